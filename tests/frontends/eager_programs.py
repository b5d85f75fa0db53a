"""Eager CPU programs for the do-no-harm test: run with and without ``import kiln``.

    python tests/frontends/eager_programs.py [--kiln] [program ...]

Prints one JSON line per program: its name and a SHA-256 digest of everything it computed (tensor
bytes, dtypes, shapes, object identities, flags), so that two runs can be compared bit for bit.
With ``--kiln``, kiln is imported first, before anything else runs.  No program touches the kiln
device: they are what a user's eager code does in a process that happens to import kiln.
"""

from __future__ import annotations

import hashlib
import json
import sys

if "--kiln" in sys.argv:
    import kiln  # noqa: F401

import torch
import torch.utils.checkpoint as cp
from torch import nn


class Digest:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.n = 0

    def add(self, x: object) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            self.h.update(f"T{t.dtype}{tuple(t.shape)}{t.device.type}".encode())
            if t.is_floating_point() or t.dtype in (torch.int64, torch.int32, torch.bool):
                self.h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            self.n += 1
        elif isinstance(x, (list, tuple)):
            for y in x:
                self.add(y)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                self.add(str(k))
                self.add(x[k])
        else:
            self.h.update(repr(x).encode())
            self.n += 1


def _mlp(p: float = 0.1) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(p), nn.Linear(32, 16))


def activation_checkpointing(d: Digest) -> None:
    torch.manual_seed(0)
    m = _mlp()
    for use_reentrant in (False, True):
        x = torch.randn(4, 16, requires_grad=True)
        out = cp.checkpoint(m, x, use_reentrant=use_reentrant)
        out.pow(2).sum().backward()
        d.add([out, x.grad, [p.grad for p in m.parameters()]])
        m.zero_grad()
    seq = nn.Sequential(*[_mlp() for _ in range(3)])
    x = torch.randn(4, 16, requires_grad=True)
    out = cp.checkpoint_sequential(seq, 2, x, use_reentrant=False)
    out.sum().backward()
    d.add([out, x.grad])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cp.checkpoint(m, x, use_reentrant=False)
    out.float().sum().backward()
    d.add([out, torch.get_rng_state()])


def cpu_autocast(d: Digest) -> None:
    torch.manual_seed(1)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LayerNorm(8 * 6 * 6))
    head = nn.Linear(8 * 6 * 6, 5)
    x = torch.randn(4, 3, 8, 8)
    y = torch.randint(0, 5, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = m(x)
        logits = head(h)
        loss = nn.functional.cross_entropy(logits, y)
        with torch.autocast("cpu", enabled=False):
            extra = (h.float() @ h.float().t()).softmax(-1)
    loss.backward()
    d.add([h, logits, loss, extra, [p.grad for p in [*m.parameters(), *head.parameters()]]])
    d.add([torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")])


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(8))

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(i)) * self.scale)


def module_conversion(d: Digest) -> None:
    torch.manual_seed(2)
    m = _Tied()
    params = list(m.parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.tensor([1, 2, 3])).sum().backward()
    for conv in ("double", "float", "to_cpu", "half", "bfloat16", "to_float32", "requires_grad"):
        if conv == "to_cpu":
            m.to("cpu")
        elif conv == "to_float32":
            m.to(torch.float32)
        elif conv == "requires_grad":
            m.requires_grad_(True)
        else:
            getattr(m, conv)()
        d.add(conv)
        d.add([p is q for p, q in zip(m.parameters(), params)])  # same Parameter objects?
        d.add(m.head.weight is m.emb.weight)
        d.add([p.dtype for p in m.parameters()])
        d.add([p.grad is not None for p in m.parameters()])
    d.add(torch.__future__.get_swap_module_params_on_conversion())
    opt.step()
    d.add(list(m.parameters()))
    # load_state_dict: in-place copy keeps the objects; assign=True takes the given tensors
    sd = {k: v.clone() * 2 for k, v in m.state_dict().items()}
    before = list(m.parameters())
    m.load_state_dict(sd)
    d.add([p is q for p, q in zip(m.parameters(), before)])
    d.add(list(m.parameters()))
    m2 = _Tied()
    m2.load_state_dict(sd, assign=True)
    d.add([p is sd[k] for k, p in m2.named_parameters()])
    d.add(m2.head.weight is m2.emb.weight)
    import io

    for where in (None, "cpu", torch.device("cpu"), {"cpu": "cpu"}):  # torch.save / torch.load
        buf = io.BytesIO()
        torch.save({"sd": m.state_dict(), "p": m.emb.weight, "opt": opt.state_dict()}, buf)
        buf.seek(0)
        loaded = torch.load(buf, map_location=where)
        d.add([loaded["sd"], type(loaded["p"]).__name__, loaded["opt"]["param_groups"]])
    m3 = _Tied().to_empty(device="cpu")
    d.add([p.shape for p in m3.parameters()])
    d.add(m(torch.tensor([4, 5])))


def foreach_optimizers(d: Digest) -> None:
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.testing._internal.common_optimizers import optim_db

    torch.manual_seed(3)
    params = [nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(4))]
    d.add(_default_to_fused_or_foreach(params, differentiable=False))
    results = []
    for info in optim_db:  # PyTorch's own optimizer configurations for CPU
        try:
            inputs = info.optim_inputs_func(device="cpu")
        except Exception as e:  # noqa: BLE001 - recorded: must be the same in both runs
            results.append((info.optim_cls.__name__, "inputs", type(e).__name__))
            continue
        for inp in inputs:
            for foreach in (False, True):
                torch.manual_seed(4)
                ps = [nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(4))]
                kwargs = dict(inp.kwargs)
                if "fused" not in kwargs:
                    kwargs["foreach"] = foreach
                try:
                    opt = info.optim_cls(ps, **kwargs)
                    for _ in range(2):
                        for p in ps:
                            p.grad = torch.randn_like(p)

                        def closure() -> torch.Tensor:
                            return sum(p.sum() for p in ps)

                        opt.step(closure) if info.step_requires_closure else opt.step()
                    results.append((info.optim_cls.__name__, inp.desc, foreach, ps))
                except Exception as e:  # noqa: BLE001 - recorded: must be the same in both runs
                    results.append((info.optim_cls.__name__, inp.desc, foreach, type(e).__name__))
    d.add(results)
    ps = [nn.Parameter(torch.randn(6)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn(6) * 10
    for foreach in (None, True, False):
        d.add(nn.utils.clip_grad_norm_(ps, 1.0, foreach=foreach))
        d.add([p.grad for p in ps])


def transformers_gradient_checkpointing(d: Digest) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = GPT2LMHeadModel(cfg)  # library defaults: sdpa attention, dropout 0.1
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 16))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        d.add([out.loss, [p.grad for p in model.parameters()]])
        opt.step()
        opt.zero_grad()
    d.add(list(model.parameters()))


def transformers_trainer(d: Digest) -> None:
    """The transformers Trainer with its defaults (it asks accelerate, which asks
    ``torch.accelerator``, where to train): a process that imports kiln but never uses the kiln
    device trains on the CPU, as it would without kiln.  (Before: accelerate saw the kiln device
    as the accelerator and ``Trainer.train()`` failed in ``torch.accelerator.empty_cache()``.)"""
    import contextlib
    import io
    import tempfile

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(7)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(8)
    data = [{"input_ids": torch.randint(0, 64, (16,), generator=g)} for _ in range(16)]
    for row in data:
        row["labels"] = row["input_ids"].clone()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=4,
            num_train_epochs=1,
            learning_rate=1e-3,
            warmup_steps=2,
            weight_decay=0.01,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        with contextlib.redirect_stdout(io.StringIO()):  # its logs: stdout is the digests'
            trainer.train()
    d.add([str(args.device), torch.accelerator.is_available()])
    d.add([h["loss"] for h in trainer.state.log_history if "loss" in h])
    d.add(list(model.parameters()))


class _Noisy(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3,), float(i)) + torch.rand(3), i


def dataloader_workers(d: Digest) -> None:
    for workers, pin in ((0, False), (2, False), (2, True), (0, True)):
        g = torch.Generator().manual_seed(6)
        dl = torch.utils.data.DataLoader(
            _Noisy(), batch_size=4, shuffle=True, num_workers=workers, pin_memory=pin, generator=g
        )
        d.add([(x, y) for x, y in dl])


PROGRAMS = {
    f.__name__: f
    for f in (
        activation_checkpointing,
        cpu_autocast,
        module_conversion,
        foreach_optimizers,
        transformers_gradient_checkpointing,
        transformers_trainer,
        dataloader_workers,
    )
}


def main() -> None:
    import gc
    import warnings

    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(PROGRAMS)
    warnings.simplefilter("ignore")  # warnings may differ (kiln's own); results may not
    for name in names:
        d = Digest()
        PROGRAMS[name](d)
        print(json.dumps({"program": name, "digest": d.h.hexdigest(), "items": d.n}), flush=True)
    print(json.dumps({"program": "gc_freeze_count", "digest": str(gc.get_freeze_count())}))


if __name__ == "__main__":
    main()
