"""checkpointing=selective / checkpointing.every=K need blocks to checkpoint one by one; a
model that has none says why (zoo/checkpoint_policy.py)."""

from __future__ import annotations

import pytest

import boom_ml
from boom_ml.errors import InvalidInputError

MLP = """
import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                                 nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)

    def example_inputs(self, batch_size, device):
        return torch.randn(batch_size, 8, device=device)

def make():
    return MLP()
"""


def test_single_layer_stages_are_said_to_be_cut_in_segments(tmp_path) -> None:
    """A hunt: an nn.Sequential of single layers asked for selective checkpointing was told
    it needed 'blocks in nn.Sequential / nn.ModuleList stages', which it is built from."""
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    kw = dict(gpu="l4", batch_size=2, advice=False, max_batch="off")
    with pytest.raises(InvalidInputError) as err:
        boom_ml.predict(f"file:{path}:make", checkpointing="selective", **kw)
    assert str(err.value).endswith(
        "needs blocks to checkpoint one by one (hf models' layers, or modules of several layers"
        " inside an nn.Sequential / nn.ModuleList); this model's nn.Sequential stages hold"
        " single layers, which checkpointing=full checkpoints in segments"
    )
    full = boom_ml.predict(f"file:{path}:make", checkpointing="full", **kw)
    assert full.gpus[0].fits
