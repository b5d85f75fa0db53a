"""torch.save / torch.load and load_state_dict with the kiln device (issue 16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kiln

DEV = kiln.device()


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.emb(i))))


def _trained(steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = _Tied().to(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(steps):
        i = torch.randint(0, 11, (4, 5))
        torch.nn.functional.cross_entropy(
            m(i.to(DEV)).flatten(0, 1), i.flatten().to(DEV)
        ).backward()
        opt.step()
        opt.zero_grad()
    return m, opt  # the last step is still pending: save must run it


def test_save_flushes_pending_work_and_writes_an_ordinary_cpu_checkpoint(tmp_path):
    m, opt = _trained()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "p": m.body.weight}, path)
    kiln.mark_step()
    want = {k: v.cpu() for k, v in m.state_dict().items()}
    got = torch.load(path, weights_only=True)
    assert set(got["model"]) == set(want)
    for k, v in got["model"].items():
        assert v.device.type == "cpu" and torch.equal(v, want[k]), k
    assert isinstance(got["p"], torch.nn.Parameter) and torch.equal(got["p"], want["body.weight"])
    st = got["opt"]["state"][0]
    assert st["exp_avg"].device.type == "cpu" and int(st["step"]) == 2
    # a process without kiln (no autoload, no import) reads the same file as CPU tensors
    code = (
        "import torch, sys, json\n"
        f"sd = torch.load({str(path)!r}, weights_only=True)\n"
        "print(json.dumps({k: [str(v.device), float(v.double().sum())] for k, v in "
        "sd['model'].items()}))\n"
        "assert 'kiln' not in sys.modules\n"
    )
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    r = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    sums = json.loads(r.stdout)
    for k, (dev, s) in sums.items():
        assert dev == "cpu" and s == float(want[k].double().sum()), k


@pytest.mark.parametrize("where", ["kiln", "kiln:0", torch.device("kiln"), {"cpu": "kiln"}])
def test_load_with_a_kiln_map_location(tmp_path, where):
    m, _ = _trained(1)
    sd = m.state_dict()
    path = tmp_path / "sd.pt"
    torch.save({"sd": sd, "tied": [m.emb.weight, m.head.weight]}, path)
    got = torch.load(path, map_location=where)
    for k, v in got["sd"].items():
        assert v.device == torch.device("kiln", 0)
        assert torch.equal(v.cpu(), sd[k].cpu()), k
    a, b = got["tied"]
    assert isinstance(a, torch.nn.Parameter) and a is b  # shared in the file, shared after load


def test_a_kiln_device_that_does_not_exist_is_a_clear_error(tmp_path):
    path = tmp_path / "t.pt"
    torch.save(torch.ones(3), path)
    with pytest.raises(ValueError, match=r"kiln:7 does not exist.*valid: 'kiln', 'kiln:0'"):
        torch.load(path, map_location="kiln:7")
    with pytest.raises(RuntimeError, match="cannot restore a storage directly onto kiln"):
        torch.load(
            path,
            map_location=lambda s, loc: torch.serialization.default_restore_location(s, "kiln"),
        )
    assert torch.load(path, map_location="cpu").device.type == "cpu"  # other locations: PyTorch's


def test_load_state_dict_copies_in_place_like_eager():
    m, opt = _trained(1)
    params = list(m.parameters())
    new = {k: torch.randn_like(v.cpu()) for k, v in m.state_dict().items()}
    new["head.weight"] = new["emb.weight"]  # tied: one parameter under both names
    m.load_state_dict(new)
    assert all(p is q for p, q in zip(m.parameters(), params))  # same objects: optimizer refs ok
    assert m.head.weight is m.emb.weight
    for k, v in m.state_dict().items():
        assert v.device.type == "kiln" and torch.equal(v.cpu(), new[k]), k
    assert opt.param_groups[0]["params"][0] is params[0]
    # strict=False reports what is missing; strict=True raises as eager does
    partial = {k: v for k, v in new.items() if not k.startswith("body")}
    res = m.load_state_dict(partial, strict=False)
    assert sorted(res.missing_keys) == ["body.bias", "body.weight"]
    with pytest.raises(RuntimeError, match="Missing key"):
        m.load_state_dict(partial)
    # assign=True takes the given tensors themselves
    given = {k: v.to(DEV) for k, v in new.items()}
    m.load_state_dict(given, assign=True)
    assert m.body.weight is not params[1] and torch.equal(m.body.weight.cpu(), new["body.weight"])


_RESUME_LIB = textwrap.dedent(
    """
    import json, sys, torch, kiln
    dev = kiln.device()

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.1), torch.nn.GELU(),
                                torch.nn.Linear(16, 3)).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return m, opt, sched

    def steps(m, opt, sched, n):
        losses = []
        for _ in range(n):
            x = torch.randn(8, 6)
            loss = m(x.to(dev)).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad(); sched.step(); kiln.mark_step()
            losses.append(loss.item())
        return losses
    """
)
_RESUME_MAIN = textwrap.dedent(
    """
    path, n = sys.argv[1], int(sys.argv[2])
    m, opt, sched = build()
    ck = torch.load(path, map_location="kiln")
    m.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"]); torch.set_rng_state(ck["rng"].cpu())  # as with cuda
    print(json.dumps(steps(m, opt, sched, n)))
    """
)


def test_resume_in_a_new_process_is_bit_exact(tmp_path):
    path, n = str(tmp_path / "ck.pt"), 3
    lib: dict = {}
    exec(_RESUME_LIB, lib)  # noqa: S102 - the uninterrupted run, here: 2n steps, checkpoint after step n
    m, opt, sched = lib["build"]()
    full = lib["steps"](m, opt, sched, n)
    torch.save(
        {
            "model": m.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "rng": torch.get_rng_state(),
        },
        path,
    )
    full += lib["steps"](m, opt, sched, n)
    script = tmp_path / "resume.py"  # a new process: load the checkpoint, n more steps
    script.write_text(_RESUME_LIB + _RESUME_MAIN)
    r = subprocess.run(
        [sys.executable, str(script), path, str(n)], check=False, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(full) == 2 * n and resumed == full[n:]


def test_safetensors_save_file_of_a_kiln_state_dict(tmp_path):
    from safetensors.torch import load_file, save_file

    m, _ = _trained(1)  # tied weights: safetensors refuses shared tensors, as in eager
    sd = {k: v for k, v in m.state_dict().items() if k != "head.weight"}
    save_file(sd, tmp_path / "m.safetensors")
    got = load_file(tmp_path / "m.safetensors")
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v.cpu()), k
    with pytest.raises(RuntimeError, match="share memory"):
        save_file(m.state_dict(), tmp_path / "tied.safetensors")


def _views(base: torch.Tensor) -> dict:
    return {
        "x": base,
        "slice": base[2:6],
        "t": base.view(3, 4).t(),
        "again": base,
        "alone": base[:2].clone(),
    }


def _records(path) -> list:
    """A checkpoint's zip records (name below the archive folder, size): the storages it holds."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        return sorted((i.filename.split("/", 1)[1], i.file_size) for i in z.infolist())


def test_views_saved_from_the_device_share_their_storage_in_the_file_as_eager(tmp_path):
    """``torch.save`` of kiln tensors that share a storage wrote one CPU copy per tensor, so the
    loaded ``x[2:6]`` no longer viewed the loaded ``x``; now the file is eager's: the same bytes
    for the same tensors, and the views alias again when loaded."""
    eager = torch.arange(12.0) * 0.5
    lazy = (torch.arange(12.0).to(DEV) * 0.5).requires_grad_(False)  # pending until the save
    for name, base in (("eager", eager), ("kiln", lazy)):
        torch.save(_views(base), tmp_path / f"{name}.pt")
    assert _records(tmp_path / "kiln.pt") == _records(
        tmp_path / "eager.pt"
    )  # one storage, 2 copies
    for name in ("eager", "kiln"):
        d = torch.load(tmp_path / f"{name}.pt")
        assert d["x"] is d["again"]
        assert d["t"].stride() == (1, 4)
        d["x"][3] = 100.0
        assert d["slice"][1].item() == 100.0, name
        assert d["t"][3, 0].item() == 100.0, name  # x.view(3, 4).t()[3, 0] is x[3]
        d["alone"][0] = -1.0
        assert d["x"][0].item() == 0.0, name


def test_load_to_the_device_keeps_views_of_one_storage_aliased(tmp_path):
    """``torch.load(map_location="kiln")`` moved every tensor by itself: an in-place update of the
    loaded ``x`` did not show in the loaded ``x[2:6]``, as it does after a CPU load."""
    torch.save(_views(torch.arange(12.0) * 0.5), tmp_path / "v.pt")
    cpu = torch.load(tmp_path / "v.pt")
    dev = torch.load(tmp_path / "v.pt", map_location="kiln")
    assert dev["x"] is dev["again"]
    for d in (cpu, dev):
        d["x"].mul_(2.0)
        d["alone"].add_(7.0)
    kiln.mark_step()
    for k in cpu:
        assert dev[k].device.type == "kiln"
        assert dev[k].dtype == cpu[k].dtype and dev[k].shape == cpu[k].shape, k
        assert torch.equal(dev[k].cpu(), cpu[k]), k
    # a parameter that views a shared storage stays a parameter and trains
    w = torch.zeros(6)
    torch.save({"w": torch.nn.Parameter(w[:3]), "rest": w[3:]}, tmp_path / "p.pt")
    d = torch.load(tmp_path / "p.pt", map_location="kiln")
    assert isinstance(d["w"], torch.nn.Parameter) and d["w"].requires_grad
    (d["w"] * torch.arange(3.0).to(DEV)).sum().backward()
    assert torch.equal(d["w"].grad.cpu(), torch.arange(3.0))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return GPT2LMHeadModel, cfg


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return BertForMaskedLM, cfg


@pytest.mark.parametrize("arch", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_save_pretrained_and_from_pretrained_on_the_kiln_device(tmp_path, arch):
    cls, cfg = arch()
    torch.manual_seed(0)
    model = cls(cfg).eval().to(DEV)
    ids = torch.randint(0, 64, (2, 8))
    want = model(input_ids=ids.to(DEV)).logits.cpu()
    for safe in (True, False):
        for shard in ("1GB", "20KB"):  # one file, and sharded
            out = tmp_path / f"{safe}-{shard}"
            model.save_pretrained(out, safe_serialization=safe, max_shard_size=shard)
            weights = [p for p in out.iterdir() if p.suffix in (".safetensors", ".bin")]
            assert len(weights) == (1 if shard == "1GB" else len(weights)) and weights
            if shard == "20KB":
                assert len(weights) > 2
            loaded = cls.from_pretrained(out).eval().to(DEV)
            assert torch.equal(loaded(input_ids=ids.to(DEV)).logits.cpu(), want), (safe, shard)
