"""Helpers shared by the zoo tests: built on meta, and one fake training step."""

from __future__ import annotations

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
