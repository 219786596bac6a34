"""A 3-D convolution is timed by the conv head as the 2-D convolution that runs the same
implicit GEMM (output depth folded into the batch, kernel depth into the input channels),
and says so in its method."""

from __future__ import annotations

import json
import math

from boom_ml.timing.per_op import FOLDED, FOLDED_METHOD, node_rows
from boom_ml.timing.size_floor import CONV_FLOOR_NOTE

SYNTHETIC_VOLUME_MODEL = """
import torch.nn as nn

class Volume(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv3d(3, 8, (3, 5, 5), stride=(1, 2, 2), padding=(1, 2, 2))

    def forward(self, x):
        return self.c(x.unsqueeze(2).expand(-1, -1, 4, -1, -1)).mean()

def make():
    return Volume()
"""


def test_a_3d_convolution_is_timed_as_its_2d_implicit_gemm(tmp_path) -> None:
    import boom_ml

    path = tmp_path / "volume.py"
    path.write_text(SYNTHETIC_VOLUME_MODEL)
    pred = boom_ml.predict(model=f"file:{path}:make", gpu="l4", batch_size=4, image_size=16,
                           advice=False, max_batch="off", cache=False)  # fmt: skip
    time = pred.gpus[0].time
    assert math.isfinite(time.step_ms) and time.step_ms > 0
    from boom_ml.gpus import get_gpu
    from boom_ml.session import Session
    from boom_ml.specs import StepSpec
    from boom_ml.timing.per_op import predict_nodes_many

    graph = Session(f"file:{path}:make", cache=False).graph(StepSpec(batch_size=4, image_size=16))
    out = predict_nodes_many(graph.nodes, [get_gpu("l4")])
    conv = (graph.nodes["family"] == "conv").to_numpy()
    assert conv.sum() == 2  # forward and backward (the weight's gradient: x needs none)
    assert (out["ms"][0][conv] > 0).all()
    # the conv head (with the one-image floor's note where it binds), then the 3-D label
    assert all(
        m in (f"per-op ({FOLDED_METHOD})", f"per-op{CONV_FLOOR_NOTE} ({FOLDED_METHOD})")
        for m in out["method"][0][conv]
    )
    forward = graph.nodes[conv].iloc[0]
    assert json.loads(forward.input_shapes)[:2] == [[4, 3, 4, 16, 16], [8, 3, 3, 5, 5]]
    rows = node_rows(graph.nodes[conv]).query("op == 'conv2d'")
    assert rows[FOLDED].eq(True).all()
    fwd = rows[rows.direction == "forward"].iloc[0]
    # (N*Do, C*kd, H, W) x (O, C*kd, kh, kw): 4 x 4 output slices, 3 x 3 kernel slices
    assert (fwd.batch, fwd.in_channels, fwd.out_channels) == (16, 9, 8)
    assert (fwd.input_h, fwd.kernel_size, fwd.stride, fwd.padding) == (16, 5, 2, 2)
    # the implicit GEMM's FLOPs are the 3-D convolution's: 2 x (N*Do*Ho*Wo) x (C*kd*kh*kw) x O
    assert forward.flops == 2 * (4 * 4 * 8 * 8) * (3 * 3 * 5 * 5) * 8
    assert 2 * fwd.batch * 8 * 8 * fwd.in_channels * 25 * fwd.out_channels == forward.flops
