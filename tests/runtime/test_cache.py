"""The compile cache: memory and disk hits, atomic entries, corrupt entries rebuilt."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import kiln
from kiln import metrics
from kiln.ir.graph import GraphBuilder, In, Node, TensorType
from kiln.runtime import compiler
from kiln.runtime.cache import CacheDirError, DiskCache, cache_key


def _graph(scale: float = 2.0):
    b = GraphBuilder()
    x = b.input(TensorType((4,), torch.float32))
    y = b.add(Node("mul.Tensor", (x,), (In(0), scale), (), (TensorType((4,), torch.float32),)))
    return b.build([y])


@pytest.fixture()
def cache_dir(tmp_path):
    old = kiln.config.cache_dir
    kiln.config.update(cache_dir=str(tmp_path))
    compiler.clear_memory_cache()
    yield tmp_path
    kiln.config.update(cache_dir=old)
    compiler.clear_memory_cache()


def test_memory_then_disk_hits(cache_dir):
    metrics.reset()
    g = _graph()
    exe = compiler.compile_graph(g)
    torch.testing.assert_close(exe([torch.ones(4)])[0], torch.full((4,), 2.0))
    compiler.compile_graph(g)
    assert metrics.get("graphs_compiled") == 1 and metrics.get("cache_hits_memory") == 1
    compiler.clear_memory_cache()
    exe = compiler.compile_graph(g)
    assert metrics.get("cache_hits_disk") == 1 and metrics.get("graphs_compiled") == 1
    torch.testing.assert_close(exe([torch.ones(4)])[0], torch.full((4,), 2.0))


def test_corrupt_entry_is_reported_once_and_rebuilt(cache_dir):
    g = _graph(3.0)
    compiler.compile_graph(g)
    compiler.clear_memory_cache()
    key = cache_key(g.hash, kiln.config.backend, ",".join(sorted(kiln.config.disabled_passes)))
    path = DiskCache(cache_dir).path(key)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    metrics.reset()
    with pytest.warns(UserWarning, match=r"corrupt cache entry .*\(checksum mismatch\)"):
        exe = compiler.compile_graph(g)
    assert metrics.get("graphs_compiled") == 1
    torch.testing.assert_close(exe([torch.ones(4)])[0], torch.full((4,), 3.0))
    assert DiskCache(cache_dir).load(key) is not None  # rebuilt entry is valid


def test_no_temp_files_left(cache_dir):
    compiler.compile_graph(_graph(5.0))
    leftovers = [p for p in os.listdir(cache_dir / "graphs") if p.endswith(".tmp")]
    assert leftovers == []


def test_key_depends_on_versions_and_backend():
    assert cache_key("abc", "cpp") != cache_key("abc", "interpreter")
    assert cache_key("abc", "cpp") != cache_key("abd", "cpp")


def test_processes_share_the_cache(tmp_path):
    script = textwrap.dedent(
        """
        import json, torch, kiln
        dev = kiln.device()
        x = torch.arange(6.0).reshape(2, 3).to(dev)
        y = (x * 3).softmax(-1).sum()
        kiln.mark_step()
        print(json.dumps({"y": y.item(), **{k: kiln.metrics.get(k) for k in
              ("graphs_compiled", "cache_hits_disk")}}))
        """
    )
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path)}
    runs = []
    import json

    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", script],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["graphs_compiled"] >= 1 and runs[0]["cache_hits_disk"] == 0
    assert runs[1]["graphs_compiled"] == 0 and runs[1]["cache_hits_disk"] >= 1
    assert runs[0]["y"] == pytest.approx(runs[1]["y"])


def test_an_unusable_cache_folder_fails_at_the_first_compile_naming_the_setting(tmp_path):
    """A file where the cache folder should be raised ``NotADirectoryError`` from deep inside a
    cache read (lazy device) or AOTAutograd's wrapper (compile mode); now both name the folder
    and the setting to change, and a usable folder afterwards compiles."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    old = kiln.config.cache_dir
    compiler.clear_memory_cache()
    try:
        root = str(blocker / "kiln")
        kiln.config.update(cache_dir=root)
        message = (
            f"Kiln's compile cache folder {root} cannot be used ([Errno 20] Not a directory: "
            f"'{root}'); Kiln keeps compiled graphs and C++ kernels there: set KILN_CACHE_DIR "
            "(kiln.config.cache_dir) to a writable folder"
        )
        with pytest.raises(CacheDirError) as e:
            compiler.compile_graph(_graph(3.0))
        assert str(e.value) == message
        f = torch.compile(lambda x: torch.tanh(x) * 3.5, backend="kiln")
        with pytest.raises(Exception, match=re.escape(message)):  # inside Dynamo's wrapper
            f(torch.ones(3))
        kiln.config.update(cache_dir=str(tmp_path / "ok"))
        exe = compiler.compile_graph(_graph(3.0))
        torch.testing.assert_close(exe([torch.ones(4)])[0], torch.full((4,), 3.0))
    finally:
        kiln.config.update(cache_dir=old)
        compiler.clear_memory_cache()
        torch._dynamo.reset()
