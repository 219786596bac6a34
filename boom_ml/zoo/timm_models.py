"""``timm:<name>``: any timm model, built with ``pretrained=False``."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from boom_ml.errors import InvalidInputError, UnknownModelError
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.zoo.base import BuiltModel
from boom_ml.zoo.checkpointing import PER_BLOCK_FALLBACK, enable_generic
from boom_ml.zoo.common import (
    build_with_options,
    classification_loss,
    closest,
    generic_loss,
    guess_family,
    image_batch,
    refuse_weights,
)


@functools.cache
def names() -> tuple[str, ...]:
    import timm

    return tuple(timm.list_models())


def has(name: str) -> bool:
    """Architecture names, also with a pretrained tag ("vit_base_patch16_384.augreg_in1k")."""
    import timm

    return timm.is_model(name)


def _native_image_size(module: nn.Module, options: dict[str, Any]) -> int:
    """An explicit ``img_size`` option wins; else the pretrained config's input size."""
    size = options.get("img_size")
    if isinstance(size, int):
        return size
    if isinstance(size, (list, tuple)) and size:
        return int(size[0])
    cfg = getattr(module, "pretrained_cfg", None) or {}
    input_size = cfg.get("input_size") or (3, 224, 224)
    return int(input_size[-1])


def _strict_size(module: nn.Module) -> int | None:
    """The image size a patch-embedding model insists on, or None when any size works."""
    pe = getattr(module, "patch_embed", None)
    if pe is None or not getattr(pe, "strict_img_size", False):
        return None
    if getattr(module, "dynamic_img_size", False):
        return None
    size = getattr(pe, "img_size", None)
    return int(size[-1]) if isinstance(size, (list, tuple)) and size else None


def build(spec: ModelSpec, name: str, device: str | torch.device = "meta") -> BuiltModel:
    """Build ``timm.create_model(name, pretrained=False, **spec.options)``."""
    import timm

    if not has(name):
        hits = closest(name, list(names()))
        hint = f" (did you mean: {', '.join('timm:' + h for h in hits)}?)" if hits else ""
        raise UnknownModelError(f"unknown timm model {name!r}{hint}")
    options = dict(spec.options)
    refuse_weights(options, f"timm:{name}")
    module = build_with_options(
        f"timm:{name}", lambda: timm.create_model(name, pretrained=False, **options), device
    )

    what = f"timm:{name}"
    num_classes = int(getattr(module, "num_classes", options.get("num_classes", 1000)) or 0)
    image_size = _native_image_size(module, options)
    strict = _strict_size(module)
    in_chans = int(options.get("in_chans", 3))

    def make_inputs(step: StepSpec, dev: torch.device) -> dict[str, Any]:
        size = step.image_size or image_size
        if strict is not None and size != strict:
            raise InvalidInputError(
                f"{what} is built for {strict}x{strict} images; for {size}, build it with"
                f" model_options={{img_size:{size}}}, or leave image_size out"
            )
        batch = image_batch(step.batch_size, size, max(num_classes, 1), dev)
        if in_chans != 3:
            batch["x"] = torch.randn(step.batch_size, in_chans, size, size, device=dev)
        return batch

    def compute_loss(outputs: Any, inputs: dict[str, Any]) -> torch.Tensor:
        # num_classes=0 makes timm return pooled features: there is nothing to classify.
        if num_classes == 0:
            return generic_loss(outputs, inputs)
        return classification_loss(outputs, inputs)

    def enable_checkpointing(m: nn.Module) -> None:
        try:
            m.set_grad_checkpointing(True)  # timm's own (non-reentrant by default)
        except (AssertionError, NotImplementedError, AttributeError):
            # Some timm models (vgg, dla, hrnet, twins, ...) assert it is unsupported;
            # fall back to wrapping their blocks like any other module.
            enable_generic(m, what)
            return

        def per_block() -> None:  # selective, or every K-th block: ours, block by block
            m.set_grad_checkpointing(False)
            enable_generic(m, what)

        setattr(m, PER_BLOCK_FALLBACK, per_block)

    return BuiltModel(
        spec=spec,
        module=module,
        family=guess_family(module),
        make_inputs=make_inputs,
        compute_loss=compute_loss,
        enable_checkpointing=enable_checkpointing,
        default_image_size=image_size,
        reads=frozenset({"image_size"}),
        source="timm",
        info={"name": name, "num_classes": num_classes, "class": type(module).__name__},
    )
