"""``torch.compile(..., backend="kiln", mode=..., options=...)``: before, Kiln ignored both, so
``options={"checks": True}`` silently did nothing and a misspelt key passed unnoticed.  Options
are Kiln config keys in force for that function's compiles (forward and backward), checked as
``kiln.config.update`` checks them; ``mode`` is Inductor's and warns (see
kiln/frontends/compile/options.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from kiln.config import ConfigError, config
from kiln.runtime import compiler


def _step_graphs(options: dict | None) -> tuple[list, list[str]]:
    """Train two steps of a small MLP through ``torch.compile`` with ``options``: the gradients
    and the ops of every Kiln graph compiled for it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    before = set(map(id, compiler._memory.values()))

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sin().mean()
        loss.backward()
        return loss

    kw = {} if options is None else {"options": options}
    f = torch.compile(loss_fn, backend="kiln", **kw)
    grads = []
    for k in range(2):
        model.zero_grad()
        f(torch.randn(4, 8, generator=torch.Generator().manual_seed(k)))
        grads.append([p.grad.clone() for p in model.parameters()])
    new = [e for e in compiler._memory.values() if id(e) not in before]
    return grads, [n.op for e in new for n in e.graph.nodes]


def test_options_apply_to_the_forward_and_backward_compiles_only():
    with config.scoped(disk_cache=False):  # compile here, not from another test's cache entry
        want, ops_default = _step_graphs(None)
        got, ops_unfused = _step_graphs({"disable_passes": "fuse"})
    assert "fused" in ops_default
    assert ops_unfused and "fused" not in ops_unfused  # both graphs compiled without fusion
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
    assert "fuse" not in config.disabled_passes  # the process's config after the compile


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bogus": 1}, "unknown Kiln compile option 'bogus'; valid: backend, checks"),
        ({"eager": True}, "configures the process, not one compile: set it with kiln.config"),
        ({"checks": "yes"}, "must be True or False"),
        ({"backend": "nope"}, "must be one of"),
    ],
)
def test_bad_options_raise_and_name_what_is_valid(options, message):
    torch._dynamo.reset()
    before = (config.checks, config.backend)
    f = torch.compile(lambda x: x.sin() * 2, backend="kiln", options=options)
    with pytest.raises(Exception, match="ConfigError") as e:
        f(torch.randn(3))
    assert message in str(e.value)
    assert (config.checks, config.backend) == before


def test_inductor_modes_warn_once_and_compile_with_kiln():
    torch._dynamo.reset()
    x = torch.randn(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.compile(lambda t: t.cos() + 1, backend="kiln", mode="max-autotune-no-cudagraphs")(
            x
        )
    torch.testing.assert_close(y, x.cos() + 1)
    texts = [str(w.message) for w in caught if "Kiln: torch.compile(mode=" in str(w.message)]
    assert len(texts) == 1 and "ignores it" in texts[0]


def test_scoped_config_restores_after_an_error():
    before = (config.checks, config.log)
    with pytest.raises(RuntimeError), config.scoped(checks=not before[0], log="graphs"):
        assert config.checks is not before[0] and config.log == "graphs"
        raise RuntimeError("inside")
    assert (config.checks, config.log) == before
    with pytest.raises(ConfigError), config.scoped(checks=not before[0], bogus=1):
        pass
    assert config.checks is before[0]  # nothing was set: every value is checked first
