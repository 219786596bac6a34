"""``nn.LSTMCell`` / ``nn.GRUCell`` traced as CUDA runs them: per step two GEMMs and one fused
pointwise kernel forward, one fused kernel backward, the gate workspace alive in between.

The models are synthetic (an unrolled cell loop), not published ones.
"""

from __future__ import annotations

import json

import pytest

from boom_ml.specs import StepSpec
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model

STEPS, BATCH, IN, HIDDEN = 6, 4, 16, 32

LOOP = """
import torch
from torch import nn

class Loop(nn.Module):
    def __init__(self, kind, bias):
        super().__init__()
        self.kind = kind
        cell = nn.LSTMCell if kind == "lstm" else nn.GRUCell
        self.cell = cell({inp}, {hidden}, bias=bias)

    def example_inputs(self, batch_size, device):
        return torch.randn({steps}, batch_size, {inp}, device=device)

    def forward(self, x):
        h = torch.zeros(x.shape[1], {hidden}, device=x.device)
        c = torch.zeros_like(h)
        outs = []
        for t in range(x.shape[0]):
            if self.kind == "lstm":
                h, c = self.cell(x[t], (h, c))
            else:
                h = self.cell(x[t], h)
            outs.append(h)
        return torch.stack(outs).square().mean()

def lstm():
    return Loop("lstm", True)

def gru():
    return Loop("gru", False)
"""


@pytest.fixture(scope="module")
def loop_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cells") / "loop.py"
    path.write_text(LOOP.format(steps=STEPS, inp=IN, hidden=HIDDEN))
    return str(path)


def _trace(path: str, factory: str, **step: object):
    spec = StepSpec(batch_size=BATCH, optimizer="adamw", **step)
    return trace_step(build_model(f"file:{path}:{factory}"), spec)


def test_lstm_cell_is_two_gemms_and_one_fused_kernel_per_step(loop_file: str) -> None:
    graph = _trace(loop_file, "lstm")
    nodes = graph.nodes
    fwd = nodes[nodes.phase == "forward"]
    assert (fwd.op == "fused_lstm_cell").sum() == STEPS
    assert (fwd.op == "mm").sum() == 2 * STEPS
    assert not fwd.op.isin(["sigmoid", "tanh", "sigmoid_", "tanh_"]).any()  # CPU's cell ops
    cell = fwd[fwd.op == "fused_lstm_cell"].iloc[0]
    # gates (B, 4H) twice, the cell state, both biases -> h, c and the (B, 4H) workspace
    assert (
        json.loads(cell.input_shapes)
        == [[BATCH, 4 * HIDDEN]] * 2 + [[BATCH, HIDDEN]] + [[4 * HIDDEN]] * 2
    )
    assert json.loads(cell.output_shapes) == [[BATCH, HIDDEN]] * 2 + [[BATCH, 4 * HIDDEN]]
    bwd = nodes[nodes.phase == "backward"]
    assert (bwd.op == "fused_lstm_cell_backward").sum() == STEPS
    back = bwd[bwd.op == "fused_lstm_cell_backward"].iloc[0]
    assert json.loads(back.output_shapes) == [[BATCH, 4 * HIDDEN], [BATCH, HIDDEN]]
    # RNN.cu: the bias gradient is the gate gradient summed over the batch, a kernel a step
    sums = bwd[bwd.op == "sum"].input_shapes.map(json.loads).tolist()
    assert sums.count([[BATCH, 4 * HIDDEN]]) == STEPS
    assert not (bwd.op.isin(["zeros", "zeros_like", "fill_"])).any()  # no zero gradients made
    # each workspace (B x 4H fp32) is allocated in forward and freed in backward
    events = graph.mem_events
    work = events[(events.bytes == BATCH * 4 * HIDDEN * 4) & (events.phase == "forward")]
    cells = set(fwd[fwd.op == "fused_lstm_cell"].id)
    blocks = set(work[work.node_id.isin(cells) & (work.action == "alloc")].block)
    assert len(blocks) == STEPS
    freed = events[events.block.isin(blocks) & (events.action == "free")]
    assert set(freed.phase) == {"backward"} and len(freed) == STEPS


def test_gru_cell_without_bias(loop_file: str) -> None:
    nodes = _trace(loop_file, "gru").nodes
    fwd = nodes[nodes.op == "fused_gru_cell"]
    assert len(fwd) == STEPS
    assert json.loads(fwd.iloc[0].input_shapes) == [[BATCH, 3 * HIDDEN]] * 2 + [[BATCH, HIDDEN]]
    # h and the (B, 5H) workspace
    assert json.loads(fwd.iloc[0].output_shapes) == [[BATCH, HIDDEN], [BATCH, 5 * HIDDEN]]
    bwd = nodes[nodes.op == "fused_gru_cell_backward"]
    assert len(bwd) == STEPS
    assert json.loads(bwd.iloc[0].output_shapes) == [[BATCH, 3 * HIDDEN]] * 2 + [[BATCH, HIDDEN]]
    assert not (nodes.op == "sum").any()  # no biases: no bias-gradient reductions


def test_autocast_casts_each_weight_once(loop_file: str) -> None:
    nodes = _trace(loop_file, "lstm", amp="bf16").nodes
    fwd = nodes[nodes.phase == "forward"]
    casts = fwd[fwd.op == "_to_copy"].input_shapes.map(json.loads)
    weights = [s for s in casts if s[0] in ([4 * HIDDEN, IN], [4 * HIDDEN, HIDDEN])]
    assert len(weights) == 2  # cached for the autocast region, as CUDA's autocast does
    cells = fwd[fwd.op == "fused_lstm_cell"]
    assert set(cells.output_dtypes) == {json.dumps(["bfloat16"] * 3)}
