"""``torchvision:<name>``: torchvision image classifiers, built with ``weights=None``;
segmentation and video models through ``torchvision_tasks``."""

from __future__ import annotations

import functools
import numbers
from typing import Any

import torch
from torch import nn

from boom_ml.errors import InvalidInputError, UnknownModelError
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.zoo.base import BuiltModel
from boom_ml.zoo.checkpointing import enable_generic
from boom_ml.zoo.common import (
    build_with_options,
    classification_loss,
    closest,
    image_batch,
    refuse_weights,
)
from boom_ml.zoo.torchvision_tasks import build as build_task
from boom_ml.zoo.torchvision_tasks import has as is_task
from boom_ml.zoo.torchvision_tasks import segmentation_names, video_names

# Transformer-style classifiers; everything else in torchvision.models convolves.
_TRANSFORMER_PREFIXES = ("vit_", "swin_", "maxvit_")
# Inception-style nets have no Sequential trunk: their named stages hang off the root.
_ROOT_BLOCK_MODELS = ("googlenet", "inception_v3")


@functools.cache
def _classifiers() -> frozenset[str]:
    import torchvision

    return frozenset(torchvision.models.list_models(module=torchvision.models))


@functools.cache
def names() -> tuple[str, ...]:
    """Classification, segmentation and video models (detection and optical flow need boxes
    and flows we do not synthesise)."""
    tasks = segmentation_names() | video_names()
    return tuple(sorted(_classifiers() | tasks))


@functools.cache
def _all_names() -> frozenset[str]:
    import torchvision

    return frozenset(torchvision.models.list_models())


def has(name: str) -> bool:
    """Whether torchvision has ``name`` (a bare name resolves here, and ``build`` says what
    is supported: detection models get their one-line reason, not "unknown")."""
    return name in _all_names()


def native_image_size(name: str, module: nn.Module) -> int:
    """The resolution the model is trained at: ViT's fixed size, else its weights' crop size.

    Reading the weights *enum* costs nothing (no download); its transforms record the
    crop size (299 for inception_v3, 240..600 for efficientnet_b1..b7).
    """
    fixed = getattr(module, "image_size", None)
    if isinstance(fixed, int):  # torchvision ViT asserts this exact size in forward
        return fixed
    try:
        from torchvision.models import get_model_weights

        crop = get_model_weights(name).DEFAULT.transforms.keywords.get("crop_size")
        if crop:
            return int(crop[0] if isinstance(crop, (list, tuple)) else crop)
    except (ValueError, AttributeError, KeyError):
        pass
    return 224


def build(spec: ModelSpec, name: str, device: str | torch.device = "meta") -> BuiltModel:
    """Build ``torchvision.models.get_model(name, weights=None, **spec.options)``."""
    from torchvision.models import get_model

    if is_task(name):
        return build_task(spec, name, device)
    if name not in _classifiers():
        if name in _all_names() and name.startswith("quantized_"):
            raise InvalidInputError(
                f"torchvision:{name} is not supported: quantized models run int8 kernels that "
                f"are not trained; torchvision:{name.removeprefix('quantized_')} is the float "
                "model they come from"
            )
        if name in _all_names():
            raise InvalidInputError(
                f"torchvision:{name} is not supported: torchvision's classification, "
                "segmentation and video models are; detection and optical flow are not (their "
                "losses need boxes or flows, and their proposals have data-dependent sizes)"
            )
        hits = closest(name, list(names()))
        hint = f" (did you mean: {', '.join('torchvision:' + h for h in hits)}?)" if hits else ""
        raise UnknownModelError(f"unknown torchvision model {name!r}{hint}")

    options: dict[str, Any] = dict(spec.options)
    refuse_weights(options, f"torchvision:{name}")
    classes = options.get("num_classes", 1000)
    if not isinstance(classes, numbers.Integral) or isinstance(classes, bool) or classes < 1:
        # 0 had built with a warning and failed drawing the labels; a string in empty()
        raise InvalidInputError(
            f"model_options.num_classes={classes}: a torchvision classifier needs an integer"
            " number of classes, at least 1 (timm's num_classes=0, pooled features, has no"
            " torchvision counterpart)"
        )
    if name in _ROOT_BLOCK_MODELS:
        # Weight init is pointless on meta, and passing it silences torchvision's warning.
        # The aux heads stay on: real training of these nets uses them.
        options.setdefault("init_weights", False)
    module = build_with_options(
        f"torchvision:{name}", lambda: get_model(name, weights=None, **options), device
    )

    num_classes = int(options.get("num_classes", 1000))
    image_size = native_image_size(name, module)
    fixed_size = image_size if isinstance(getattr(module, "image_size", None), int) else None
    what = f"torchvision:{name}"
    aux_bn_1x1 = name == "inception_v3" and bool(getattr(module, "aux_logits", False))

    def make_inputs(step: StepSpec, dev: torch.device) -> dict[str, Any]:
        size = step.image_size or image_size
        if fixed_size is not None and size != fixed_size:
            # its patches must tile the image (torchvision asserts it when building)
            patch = getattr(module, "patch_size", None)
            if patch and size % patch:
                above = (size // patch + 1) * patch
                near = " or ".join(str(n) for n in (size // patch * patch, above) if n)
                raise InvalidInputError(
                    f"{what} takes image sides that are a multiple of its patch size {patch}"
                    f" ({near}), not {size}; it is built for"
                    f" {fixed_size}x{fixed_size} and takes another such side built with"
                    f" model_options={{image_size:{above}}}"
                )
            raise InvalidInputError(
                f"{what} is built for {fixed_size}x{fixed_size} images; to use {size}, "
                f"build it with model_options={{image_size:{size}}}"
            )
        if aux_bn_1x1 and step.batch_size < 2:
            # Its aux head batch-normalises a 1x1 map: one image has one value per channel,
            # which BatchNorm rejects in training, on a GPU as here.
            raise InvalidInputError(
                f"{what} trains with batch_size >= 2 (its aux head); or pass "
                "model_options={aux_logits:false}"
            )
        return image_batch(step.batch_size, size, num_classes, dev)

    def enable_checkpointing(m: nn.Module) -> None:
        blocks = None
        if name in _ROOT_BLOCK_MODELS:  # the Inception modules themselves, not their branches
            blocks = [
                c
                for n, c in m.named_children()
                if n not in ("fc", "aux1", "aux2", "AuxLogits") and next(c.children(), None)
            ]
        enable_generic(m, what, blocks)

    return BuiltModel(
        spec=spec,
        module=module,
        family="transformer" if name.startswith(_TRANSFORMER_PREFIXES) else "cnn",
        make_inputs=make_inputs,
        compute_loss=classification_loss,
        enable_checkpointing=enable_checkpointing,
        default_image_size=image_size,
        reads=frozenset({"image_size"}),
        source="torchvision",
        info={"name": name, "num_classes": num_classes},
    )
