"""Parts of bench/workloads.py's Llama step alone, forward + backward: eager vs
``torch.compile(backend="kiln")``, median process CPU us per call, 1 thread.

    python bench/llama_regions.py --region rope     # one layer's rotary embedding of q and k
    python bench/llama_regions.py --region mlp      # two residual SiLU-gated MLP blocks
    python bench/llama_regions.py --region loss     # the causal-LM cross-entropy loss
    python bench/llama_regions.py --region rmsnorm  # transformers' LlamaRMSNorm

rope: q (4x4x64x32) and k (4x2x64x32, grouped-query) come out of their projections' outputs
through ``view`` + ``transpose`` as in transformers' Llama, cos/sin are 64x32; ``rotate_half`` is
transformers' own.  mlp: ``x + down(silu(gate(x)) * up(x))`` twice, 256 tokens of width 128,
hidden 512.  loss: transformers' ``ForCausalLMLoss`` on logits 4x64x1000 (shift, ``view``,
cross-entropy with ignore_index -100, a quarter of the labels -100).  rmsnorm: ``LlamaRMSNorm``
over 4x64x128.  Each mode runs ``--calls`` calls per round, rounds interleaved, the first dropped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kiln  # noqa: E402


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(xq, xk, cos, sin):
    q = xq.view(4, 64, 4, 32).transpose(1, 2)
    k = xk.view(4, 64, 2, 32).transpose(1, 2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class MLP(torch.nn.Module):
    def __init__(self, layers: int = 2, d: int = 128, hidden: int = 512) -> None:
        super().__init__()
        lin = torch.nn.Linear
        self.gate = torch.nn.ModuleList(lin(d, hidden, bias=False) for _ in range(layers))
        self.up = torch.nn.ModuleList(lin(d, hidden, bias=False) for _ in range(layers))
        self.down = torch.nn.ModuleList(lin(hidden, d, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for g, u, dn in zip(self.gate, self.up, self.down):
            x = x + dn(torch.nn.functional.silu(g(x)) * u(x))
        return x


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--region", choices=("rope", "mlp", "loss", "rmsnorm"), default="rope")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    kiln.config.update(cache_dir=tempfile.mkdtemp(prefix="kiln-regions-"))
    if a.region == "rope":
        xq = torch.randn(4, 64, 128, requires_grad=True)
        xk = torch.randn(4, 64, 64, requires_grad=True)
        cos, sin = torch.randn(1, 1, 64, 32), torch.randn(1, 1, 64, 32)
        args = (xq, xk, cos, sin)
        grads = (torch.randn(4, 4, 64, 32), torch.randn(4, 2, 64, 32))
        fn = rope
    elif a.region == "loss":
        g = torch.Generator().manual_seed(0)
        labels = torch.randint(0, 1000, (4, 64), generator=g)
        labels[torch.rand(4, 64, generator=g) < 0.25] = -100
        args = (torch.randn(4, 64, 1000, generator=g, requires_grad=True), labels)
        grads = (torch.tensor(1.0),)
        fn = causal_lm_loss
    elif a.region == "rmsnorm":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        fn = LlamaRMSNorm(128)
        with torch.no_grad():
            fn.weight.normal_()
        args = (torch.randn(4, 64, 128, requires_grad=True),)
        grads = (torch.randn(4, 64, 128),)
    else:
        fn = MLP()
        args = (torch.randn(4, 64, 128, requires_grad=True),)
        grads = (torch.randn(4, 64, 128),)
    modes = {"eager": fn, "kiln": torch.compile(fn, backend="kiln")}
    res: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for m, f in modes.items():
            c0 = time.process_time()
            for _ in range(a.calls):
                out = f(*args)
                out = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(out, grads)
            if r:
                res[m].append((time.process_time() - c0) / a.calls * 1e6)
    med = {m: round(statistics.median(v), 1) for m, v in res.items()}
    print(f"RESULT {ROOT} {a.region}: us/call {med}, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
