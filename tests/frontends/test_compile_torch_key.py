"""torch's source key (part of AOTAutograd's cache key) remembered in Kiln's cache
(``kiln/frontends/compile/torch_key.py``): the fingerprint follows torch's files, a matching memo
gives torch its key without hashing torch's sources, anything else recomputes and rewrites it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._inductor import codecache

import kiln
from kiln.config import config
from kiln.frontends.compile import torch_key


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Path]:
    """A process state in which torch has no key yet and Kiln has not primed it, with the cache
    in ``tmp_path``; torch's own key again after the test."""
    codecache.torch_key.clear()
    torch_key.reset()
    kiln.metrics.reset()
    with config.scoped(cache_dir=str(tmp_path), disk_cache=True):
        yield tmp_path
    codecache.torch_key.clear()  # a key a test planted must not outlive it
    torch_key.reset()


def _count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times torch hashes its source tree (``build_code_hash`` at the top level)."""
    calls = [0]
    original = codecache.build_code_hash

    def counted(roots, prefix, hasher):  # type: ignore[no-untyped-def]
        if prefix == "":
            calls[0] += 1
        return original(roots, prefix, hasher)

    monkeypatch.setattr(codecache, "build_code_hash", counted)
    return calls


def _tree(root: Path) -> None:
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "pkg" / "b.py").write_text("y = 2\n")
    (root / "pkg" / "_ext.so").write_bytes(b"\x7fELF")
    (root / "pkg" / "notes.txt").write_text("not read by torch's key\n")
    (root / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"cache")


def test_fingerprint_follows_sizes_times_and_names(tmp_path: Path) -> None:
    _tree(tmp_path)
    fp = torch_key.fingerprint(tmp_path)
    assert torch_key.fingerprint(tmp_path) == fp
    # files torch's key does not read leave it alone
    (tmp_path / "pkg" / "notes.txt").write_text("changed\n")
    (tmp_path / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"other bytes")
    assert torch_key.fingerprint(tmp_path) == fp
    # an edit of the same size, with a new modification time
    b = tmp_path / "pkg" / "b.py"
    st = b.stat()
    b.write_text("y = 3\n")
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    fp2 = torch_key.fingerprint(tmp_path)
    assert fp2 != fp
    # a size change, a new module, a renamed module, an extension module rebuilt
    (tmp_path / "a.py").write_text("x = 10\n")
    fp3 = torch_key.fingerprint(tmp_path)
    assert fp3 != fp2
    (tmp_path / "pkg" / "c.py").write_text("")
    fp4 = torch_key.fingerprint(tmp_path)
    assert fp4 != fp3
    (tmp_path / "pkg" / "c.py").rename(tmp_path / "pkg" / "d.py")
    fp5 = torch_key.fingerprint(tmp_path)
    assert fp5 != fp4
    (tmp_path / "pkg" / "_ext.so").write_bytes(b"\x7fELF2")
    assert torch_key.fingerprint(tmp_path) != fp5


def test_first_process_computes_and_stores_the_key(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed = _count_hashing(monkeypatch)
    torch_key.prime()
    assert hashed[0] == 1
    assert kiln.metrics.get("torch_key_memo_misses") == 1
    memo = json.loads((fresh / "torch_key.json").read_text())
    assert bytes.fromhex(memo["key"]) == codecache.torch_key()
    assert memo["fingerprint"] == torch_key.fingerprint(os.path.dirname(torch.__file__))
    # once per process
    torch_key.prime()
    assert hashed[0] == 1 and kiln.metrics.get("torch_key_memo_misses") == 1


def test_a_matching_memo_gives_torch_its_key_without_hashing(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_key.prime()
    real = codecache.torch_key()
    codecache.torch_key.clear()  # as in a new process
    torch_key.reset()
    hashed = _count_hashing(monkeypatch)
    torch_key.prime()
    assert codecache.torch_key() == real
    assert hashed[0] == 0
    assert kiln.metrics.get("torch_key_memo_hits") == 1


def test_the_key_torch_uses_is_the_memos(fresh: Path) -> None:
    """The mechanism itself: with the fingerprint matching, torch takes the stored value."""
    planted = bytes(range(32))
    fp = torch_key.fingerprint(os.path.dirname(torch.__file__))
    (fresh / "torch_key.json").write_text(json.dumps({"fingerprint": fp, "key": planted.hex()}))
    torch_key.prime()
    assert codecache.torch_key() == planted


@pytest.mark.parametrize(
    "memo",
    [
        '{"fingerprint": "0000", "key": "%s"}' % ("ab" * 32),  # torch changed since
        "{not json",  # damaged
        '["a list"]',  # foreign
        '{"fingerprint": "%(fp)s", "key": "zz"}',  # a key that is not hex
        '{"fingerprint": "%(fp)s", "key": "abcd"}',  # a key of the wrong length
    ],
    ids=["stale", "damaged", "foreign", "not-hex", "short"],
)
def test_any_other_memo_is_recomputed_and_rewritten(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, memo: str
) -> None:
    fp = torch_key.fingerprint(os.path.dirname(torch.__file__))
    path = fresh / "torch_key.json"
    path.write_text(memo % {"fp": fp} if "%(fp)s" in memo else memo)
    hashed = _count_hashing(monkeypatch)
    torch_key.prime()
    assert hashed[0] == 1
    key = codecache.torch_key()
    assert json.loads(path.read_text()) == {"fingerprint": fp, "key": key.hex()}
    assert kiln.metrics.get("torch_key_memo_misses") == 1


def test_a_key_torch_already_has_is_kept(fresh: Path) -> None:
    real = codecache.torch_key()  # torch computed it before Kiln's first compile
    fp = torch_key.fingerprint(os.path.dirname(torch.__file__))
    (fresh / "torch_key.json").write_text(json.dumps({"fingerprint": fp, "key": bytes(32).hex()}))
    torch_key.prime()
    assert codecache.torch_key() == real


def test_nothing_happens_without_the_disk_cache(fresh: Path) -> None:
    with config.scoped(disk_cache=False):
        torch_key.prime()
    assert not (fresh / "torch_key.json").exists()
    assert kiln.metrics.get("torch_key_memo_misses") == 0


def test_a_compile_with_the_cache_primes_the_key(fresh: Path) -> None:
    torch._dynamo.reset()
    model = torch.nn.Linear(5, 3)

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).relu().sum()

    x = torch.randn(4, 5)
    loss = torch.compile(step, backend="kiln")(x)
    loss.backward()
    ref = model(x).relu().sum()
    torch.testing.assert_close(loss, ref)
    memo = json.loads((fresh / "torch_key.json").read_text())
    assert bytes.fromhex(memo["key"]) == codecache.torch_key()
    torch._dynamo.reset()
