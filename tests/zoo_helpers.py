"""Helpers shared by the zoo tests: built on meta, and one fake training step."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from boom_ml.specs import StepSpec
from boom_ml.zoo.base import BuiltModel

CPU = torch.device("cpu")


def all_on_meta(built: BuiltModel) -> bool:
    tensors = [*built.module.parameters(), *built.module.buffers()]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


def fake_step(built: BuiltModel, step: StepSpec, checkpointing: bool = False) -> dict:
    """Forward + backward on fake tensors, as the tracer runs it; returns the batch."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        built.materialize("cpu")
        built.module.train()
        if checkpointing:
            built.enable_checkpointing(built.module)
        batch = built.make_inputs(built.resolve_step(step), CPU)
        outputs = built.module(**built.forward_kwargs(batch))
        loss = built.compute_loss(outputs, batch)
        assert loss.dim() == 0
        loss.backward()
        # every trainable parameter (Whisper's sinusoidal encoder positions are frozen)
        assert all(p.grad is not None for p in built.module.parameters() if p.requires_grad)
    return batch


def linear_factory(directory: Path, forward: str, init: str = "") -> str:
    """``file:<path>:make`` of a synthetic model: a Linear(8, 8) ``fc`` (plus ``init`` lines
    in ``__init__``), batches of (batch, 8), and ``forward`` as the body of forward(x)."""
    indent = "\n        "
    path = directory / "factory.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n\nclass Model(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n"
        + "".join(f"        {line}\n" for line in init.splitlines())
        + "\n    def example_inputs(self, batch_size, device):\n"
        "        return {'x': torch.randn(batch_size, 8, device=device)}\n\n"
        "    def forward(self, x):" + indent + indent.join(forward.splitlines()) + "\n\n\n"
        "def make():\n    return Model()\n"
    )
    return f"file:{path}:make"


def tiny_config(tmp_path: Path, model_type: str, arch: str, **fields: object) -> str:
    """An hf: spec of a config.json written under ``tmp_path``: the model_type's defaults with
    ``fields``, its class ``arch`` (synthetic configs, sized small by the caller)."""
    from transformers import AutoConfig

    raw = AutoConfig.for_model(model_type, **fields).to_dict()
    raw["architectures"] = [arch]
    path = tmp_path / model_type / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(raw))
    return f"hf:{path}"
