"""BuiltModel: what the zoo hands the tracer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from boom_ml.specs import ModelSpec, StepSpec

# make_inputs(step, device) -> keyword arguments for module.forward (tensors created on device)
InputsFn = Callable[[StepSpec, torch.device], dict[str, Any]]
# compute_loss(outputs, inputs) -> scalar loss tensor
LossFn = Callable[[Any, dict[str, Any]], torch.Tensor]


@dataclass
class BuiltModel:
    """A model on the meta device plus how to feed it, score it and checkpoint it.

    The module's parameters live on ``torch.device("meta")``: no memory, no weights
    downloaded. The tracer materialises them with ``module.to_empty`` inside a fake mode.
    """

    spec: ModelSpec
    module: nn.Module
    family: str  # "cnn" | "transformer" | "other"
    make_inputs: InputsFn
    compute_loss: LossFn
    enable_checkpointing: Callable[[nn.Module], None]
    default_seq_len: int | None = None
    default_image_size: int | None = None
    source: str = ""  # "torchvision", "timm", "hf", "file"

    def resolve_step(self, step: StepSpec) -> StepSpec:
        """Fill seq_len / image_size from the model's defaults when the user left them out."""
        from dataclasses import replace

        return replace(
            step,
            seq_len=step.seq_len or self.default_seq_len,
            image_size=step.image_size or self.default_image_size,
        )
