"""A library's logging call in a frame Kiln compiles is made after the graph instead of breaking
it (kiln/frontends/compile/logger_calls.py): the same records as eager, in one graph; other
backends, calls Dynamo cannot rebuild and methods the user told Dynamo to ignore keep torch's
behaviour; transformers' GPT-2 with its default config trains in two Dynamo graphs, with eager's
numbers."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from _hf_models import tiny_gpt2_lm
from torch._dynamo.utils import counters

import kiln

LOG = logging.getLogger("kiln_test.lib")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def records():
    handler = _Records()
    LOG.addHandler(handler)
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
    torch._dynamo.reset()
    counters.clear()
    yield handler
    LOG.removeHandler(handler)
    torch._dynamo.reset()


def _logging_breaks() -> int:
    """Graph breaks at this module's logging calls (not those inside ``logging`` itself, where
    Dynamo meets ``isEnabledFor`` when a call made outside the graph runs)."""
    pattern = re.compile(rf"Logger {re.escape(LOG.name)} \(\w+\)>\.(warning|info),")
    return sum(n for reason, n in counters["graph_break"].items() if pattern.search(reason))


def _layer(x: torch.Tensor, scale: float) -> torch.Tensor:
    LOG.warning("scale %s", scale)  # before any op: made before the graph
    y = (x * scale).relu()
    LOG.info("rows %d of %s", x.shape[0], "x")  # after ops: made after the graph
    return y


def _model(x: torch.Tensor) -> torch.Tensor:
    return _layer(x, 2.0).sin() + 1


def test_logging_calls_leave_one_graph_and_log_as_eager(records):
    torch.manual_seed(1)
    xs = [torch.randn(4, 8) for _ in range(3)]
    moved = kiln.metrics.get("logging_calls_moved")
    compiled = torch.compile(_model, backend="kiln")
    records.messages.clear()
    got = [compiled(x) for x in xs]
    got_log = list(records.messages)
    records.messages.clear()
    want = [_model(x) for x in xs]
    assert got_log == records.messages  # same records, same order, one per call each
    assert got_log[:2] == ["WARNING scale 2.0", "INFO rows 4 of x"] and len(got_log) == 6
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert counters["stats"]["unique_graphs"] == 1
    assert _logging_breaks() == 0
    assert kiln.metrics.get("logging_calls_moved") - moved == 2


def test_logger_state_is_read_when_the_call_is_made(records):
    compiled = torch.compile(_model, backend="kiln")
    compiled(torch.randn(4, 8))
    LOG.setLevel(logging.ERROR)
    records.messages.clear()
    compiled(torch.randn(4, 8))
    assert records.messages == []
    LOG.setLevel(logging.INFO)
    compiled(torch.randn(4, 8))
    assert [m.split()[0] for m in records.messages] == ["WARNING", "INFO"]


def test_other_backends_keep_torchs_graph_break(records):
    kiln.compile(lambda: None)  # Kiln's wrappers are installed in this process
    compiled = torch.compile(_model, backend="eager")
    x = torch.randn(4, 8)
    records.messages.clear()
    out = compiled(x)
    got_log = list(records.messages)
    records.messages.clear()
    torch.testing.assert_close(out, _model(x))
    assert got_log == records.messages
    assert _logging_breaks() > 0


def _with_kwargs(x: torch.Tensor) -> torch.Tensor:
    LOG.warning("kw %s", 1, stacklevel=1)
    return x.cos()


def _with_object(x: torch.Tensor) -> torch.Tensor:
    LOG.warning("list %s", [1, 2])
    return x.cos()


@pytest.mark.parametrize("fn", [_with_kwargs, _with_object], ids=["kwargs", "list argument"])
def test_calls_dynamo_cannot_rebuild_keep_the_graph_break(records, fn):
    compiled = torch.compile(fn, backend="kiln")
    x = torch.randn(3)
    records.messages.clear()
    torch.testing.assert_close(compiled(x), fn(x))
    assert records.messages[0] == records.messages[1]
    assert _logging_breaks() > 0


def test_method_the_user_ignores_is_dropped(records):
    with torch._dynamo.config.patch(ignore_logging_functions={logging.Logger.warning}):
        compiled = torch.compile(_model, backend="kiln")
        records.messages.clear()
        compiled(torch.randn(4, 8))
    assert records.messages == ["INFO rows 4 of x"]
    assert _logging_breaks() == 0


def _log_then_mutate(x: torch.Tensor) -> torch.Tensor:
    s = (x * 2).sum(0)
    LOG.info("s %s", s)
    s.mul_(0)  # a moved call would read the zeros
    return s


def _fstring_then_mutate(x: torch.Tensor) -> torch.Tensor:
    s = (x * 2).sum(0)
    LOG.info(f"s {s}")
    s.add_(1)
    return s


@pytest.mark.parametrize("fn", [_log_then_mutate, _fstring_then_mutate], ids=["%s", "f-string"])
def test_tensor_arguments_keep_the_graph_break(records, fn):
    """A tensor's value may change before the end of the graph: such a call is not moved."""
    x = torch.arange(6.0).reshape(2, 3)
    moved = kiln.metrics.get("logging_calls_moved")
    compiled = torch.compile(fn, backend="kiln")
    records.messages.clear()
    out = compiled(x)
    got_log = list(records.messages)
    records.messages.clear()
    torch.testing.assert_close(out, fn(x))
    assert got_log == records.messages and "6." in got_log[0]
    assert kiln.metrics.get("logging_calls_moved") == moved


def _warn_then_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    LOG.warning("loss over %d rows", logits.shape[0])
    return torch.nn.functional.cross_entropy(logits, target)


def test_call_before_the_graphs_ops_is_made_even_when_the_graph_raises(records):
    """Made before the graph runs, as in eager: a target out of range raises in the graph."""
    compiled = torch.compile(_warn_then_loss, backend="kiln")
    logits = torch.randn(4, 5)
    compiled(logits, torch.tensor([0, 1, 2, 3]))
    records.messages.clear()
    with pytest.raises(IndexError):
        compiled(logits, torch.tensor([0, 7, 2, 1]))
    assert records.messages == ["WARNING loss over 4 rows"]
    assert _logging_breaks() == 0


def test_gpt2_default_config_trains_in_two_dynamo_graphs():
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = tiny_gpt2_lm()
    ref = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref)]

    def step(m, opt, ids):
        opt.zero_grad()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    handler = _Records()
    hf_log = logging.getLogger("transformers")
    hf_log.addHandler(handler)
    hf_logging.warning_once.cache_clear()
    try:
        compiled = torch.compile(step, backend="kiln")
        for _ in range(3):
            ids = torch.randint(0, 97, (2, 16))
            got = compiled(model, opts[0], ids)
            want = step(ref, opts[1], ids)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    finally:
        hf_log.removeHandler(handler)
    for p, q in zip(model.parameters(), ref.parameters()):
        # AdamW divides by sqrt(v): a gradient near 0 moves its parameter by up to lr either way
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
    # Dynamo graphs: the forward with the loss (Kiln's forward and backward), the optimizer's;
    # the warning no longer splits the forward (it made five)
    assert counters["stats"]["unique_graphs"] == 2
    assert not [r for r in counters["graph_break"] if "logging.Logger method" in r]
    assert sum("loss_type=None" in m for m in handler.messages) == 1  # logged once, as eager
