"""A 3-D convolution (no 2-D geometry for the conv head) is timed on the roofline of an
unmodelled op from its counted FLOPs and bytes, never as NaN."""

from __future__ import annotations

import math

SYNTHETIC_VOLUME_MODEL = """
import torch.nn as nn

class Volume(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv3d(3, 8, 3, padding=1)

    def forward(self, x):
        return self.c(x.unsqueeze(2).expand(-1, -1, 4, -1, -1)).mean()

def make():
    return Volume()
"""


def test_a_3d_convolution_gets_a_finite_time(tmp_path) -> None:
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
    assert conv.sum() == 2  # forward and backward
    assert (out["ms"][0][conv] > 0).all() and all("proxy" in m for m in out["method"][0][conv])
