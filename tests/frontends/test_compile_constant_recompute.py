"""constant_recompute: values a joint graph computes from no input are recomputed (never saved),
so Kiln folds them in the forward and the backward; the step's numbers stay eager's."""

from __future__ import annotations

import glob
import json

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import kiln
from kiln.frontends.compile.constant_recompute import mark_constant_values
from kiln.passes.constant_fold import MAX_BYTES


def _joint(x: torch.Tensor) -> torch.Tensor:
    aten = torch.ops.aten
    ones = aten.ones.default([4, 8], dtype=torch.int64)
    pos = aten.cumsum.default(ones, -1)  # from no input
    mask = aten.le.Tensor(aten.unsqueeze.default(pos, 1), aten.unsqueeze.default(pos, 2))
    noise = aten.rand.default([4, 8])  # random: never
    scratch = aten.empty.memory_format([4, 8])  # uninitialised: never
    big = aten.ones.default([MAX_BYTES // 4 + 1], dtype=torch.float32)  # over the limit: never
    y = aten.mul.Tensor(x, aten.sum.dim_IntList(mask, [1]))  # reads the input: never
    return y, noise, scratch, big


def test_marks_only_values_from_no_input():
    # an ATen graph with meta["val"] on its nodes, as AOTAutograd's joint graph has
    gm = make_fx(_joint, tracing_mode="fake")(torch.randn(4, 8))
    nodes = {n.name: n for n in gm.graph.nodes}
    nodes["le"].meta["recompute"] = CheckpointPolicy.MUST_SAVE  # a user's policy stays
    marked = mark_constant_values(gm.graph)
    policy = {name: n.meta.get("recompute") for name, n in nodes.items()}
    want = {"ones", "cumsum", "unsqueeze", "unsqueeze_1", "sum_1"}
    assert {k for k, v in policy.items() if v is CheckpointPolicy.MUST_RECOMPUTE} == want
    assert marked == len(want)
    assert policy["le"] is CheckpointPolicy.MUST_SAVE
    for name in ("x_1", "rand", "empty", "ones_1", "mul"):
        assert policy[name] is None, name


def _step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    b, s = x.shape[0], x.shape[1]
    pos = torch.ones(b, s, dtype=torch.long).cumsum(-1)  # positions from shapes alone
    causal = pos[:, None, :] <= pos[:, :, None]  # (b, s, s), like transformers' mask
    scores = model(x) @ x.transpose(1, 2)
    scores = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    loss = (scores @ x).square().mean()
    loss.backward()
    return loss


def test_mask_from_shapes_folds_in_both_graphs(tmp_path):
    torch._dynamo.reset()
    kiln.config.update(explain_dir=str(tmp_path))
    try:
        torch.manual_seed(0)
        x = torch.randn(2, 16, 8)
        want_model = torch.nn.Linear(8, 8)
        got_model = torch.nn.Linear(8, 8)
        got_model.load_state_dict(want_model.state_dict())
        want = _step(want_model, x)
        got = torch.compile(_step, backend="kiln")(got_model, x)
    finally:
        kiln.config.update(explain_dir="")
    torch.testing.assert_close(got, want)
    for p, q in zip(got_model.parameters(), want_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    texts = [json.load(open(f))["graph_text"] for f in glob.glob(str(tmp_path / "*.json"))]
    assert len(texts) >= 2  # forward and backward
    for text in texts:
        assert "cumsum" not in text and "le.Tensor" not in text, text
