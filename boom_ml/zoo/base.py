"""BuiltModel: what the zoo hands the tracer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from boom_ml.specs import ModelSpec, StepSpec

# make_inputs(step, device) -> the step's batch (tensors created on device). Keys are forward
# keyword arguments, except keys starting with "_" which only the loss reads (see BuiltModel).
InputsFn = Callable[[StepSpec, torch.device], dict[str, Any]]
# compute_loss(outputs, inputs) -> scalar loss tensor; ``inputs`` is the whole batch dict
LossFn = Callable[[Any, dict[str, Any]], torch.Tensor]

# Batch keys with this prefix are loss-only (e.g. "_labels" of an image classifier).
LOSS_ONLY_PREFIX = "_"


@dataclass
class BuiltModel:
    """A model on the meta device plus how to feed it, score it and checkpoint it.

    The module's parameters live on ``torch.device("meta")``: no memory, no weights
    downloaded. The tracer materialises them with ``module.to_empty`` inside a fake mode.

    One training step, as the tracer runs it::

        built.materialize("cpu")                   # inside FakeTensorMode(allow_non_fake_inputs=True)
        step = built.resolve_step(step)            # fill seq_len / image_size defaults
        batch = built.make_inputs(step, device)    # every tensor of the batch
        outputs = built.module(**built.forward_kwargs(batch))
        loss = built.compute_loss(outputs, batch)  # scalar; then loss.backward()

    Forward vs loss-only inputs: keys of ``batch`` starting with ``_`` (``LOSS_ONLY_PREFIX``)
    are never passed to ``forward``; only ``compute_loss`` reads them. Vision models get
    ``{"x": images, "_labels": classes}``. HF models compute their own loss, so their
    ``labels`` are ordinary forward kwargs and ``compute_loss`` returns ``outputs.loss``.
    Every tensor in ``batch`` (loss-only ones included) is part of the step's input memory.

    ``enable_checkpointing(module)`` switches on activation recomputation in place
    (non-reentrant) and raises ``InvalidInputError`` when the model has no blocks to
    checkpoint. ``info`` holds facts the zoo knows (num_classes, vocab_size, hf config
    class, ...) for reports and features; nothing depends on its keys.
    """

    spec: ModelSpec
    module: nn.Module
    family: str  # "cnn" | "transformer" | "other"
    make_inputs: InputsFn
    compute_loss: LossFn
    enable_checkpointing: Callable[[nn.Module], None]
    default_seq_len: int | None = None
    default_image_size: int | None = None
    # the step sizes make_inputs reads ("seq_len", "image_size"); None: not known
    reads: frozenset[str] | None = None
    source: str = ""  # "torchvision", "timm", "hf", "file"
    info: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def forward_kwargs(inputs: dict[str, Any]) -> dict[str, Any]:
        """The part of a batch that goes to ``module(**kwargs)``: keys without the ``_`` prefix."""
        return {k: v for k, v in inputs.items() if not k.startswith(LOSS_ONLY_PREFIX)}

    def materialize(self, device: str | torch.device) -> nn.Module:
        """``module.to_empty(device)`` that keeps tied parameters tied.

        Plain ``to_empty`` gives every owner of a shared parameter its own new tensor
        (GPT-2's ``lm_head.weight is wte.weight`` stops holding), so a traced step would
        count the tied embedding twice and leave one copy without a gradient; and where a
        shared *module* is reached twice (T5's ``shared`` embedding in transformers 4.x)
        its swap path fails. So each distinct tensor gets one new empty tensor, set on every
        owner. Call it inside the fake mode to get fake tensors instead of real memory.
        """
        new: dict[int, torch.Tensor] = {}

        def fresh(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in new:
                empty = torch.empty_like(t, device=device)
                if isinstance(t, nn.Parameter):
                    empty = nn.Parameter(empty, requires_grad=t.requires_grad)
                new[id(t)] = empty
            return new[id(t)]

        for mod in self.module.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in table.items():
                    if t is not None:
                        table[name] = fresh(t)
        return self.module

    def resolve_step(self, step: StepSpec) -> StepSpec:
        """Fill seq_len / image_size from the model's defaults when the user left them out;
        drop the ones its inputs never read (a sequence length given to a CNN)."""
        from dataclasses import replace

        seq = step.seq_len or self.default_seq_len
        image = step.image_size or self.default_image_size
        if self.reads is not None:
            seq = seq if "seq_len" in self.reads else None
            image = image if "image_size" in self.reads else None
        return replace(step, seq_len=seq, image_size=image)
