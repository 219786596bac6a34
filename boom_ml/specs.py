"""What the user asks about: which model, and what one training step does."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from boom_ml.errors import InvalidInputError

OPTIMIZERS = (
    "sgd",
    "sgd-momentum",
    "adam",
    "adamw",
    "adagrad",
    "rmsprop",
    "adafactor",
    "none",
)
AMP_MODES = ("none", "fp16", "bf16")
# auto = what the stack's PyTorch picks (boom_ml/stack.py); the rest name it
OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "loop")
CHECKPOINTING_MODES = ("none", "full")


@dataclass(frozen=True)
class ModelSpec:
    """A model named by ``scheme:name`` (torchvision, timm, hf, file) or a bare name."""

    text: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def scheme(self) -> str | None:
        head, sep, _ = self.text.partition(":")
        return head if sep and head in ("torchvision", "timm", "hf", "file") else None

    @property
    def name(self) -> str:
        return self.text.partition(":")[2] if self.scheme else self.text


@dataclass(frozen=True)
class StepSpec:
    """One training step: batch shape, optimizer, precision and recomputation choices."""

    batch_size: int = 1
    seq_len: int | None = None
    image_size: int | None = None
    optimizer: str = "adamw"
    amp: str = "none"
    checkpointing: str = "none"
    tf32: bool = False
    optimizer_impl: str = "auto"  # foreach | fused | loop, or auto
    grad_accum: int = 1  # micro-batches per optimizer step (gradients live across them)

    def __post_init__(self) -> None:
        check_positive("batch_size", self.batch_size)
        if self.seq_len is not None:
            check_positive("seq_len", self.seq_len)
        if self.image_size is not None:
            check_positive("image_size", self.image_size)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("amp", self.amp, AMP_MODES)
        check_choice("checkpointing", self.checkpointing, CHECKPOINTING_MODES)
        check_choice("optimizer.impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        check_positive("grad_accum", self.grad_accum)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{name} must be an integer >= 1, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidInputError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")
