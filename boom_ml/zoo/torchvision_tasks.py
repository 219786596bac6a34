"""``torchvision:<name>`` beyond classifiers: semantic segmentation and video classification.

Segmentation models (``deeplabv3_*``, ``fcn_*``, ``lraspp_*``) take images and return a dict of
per-pixel logits (``out``, and ``aux`` when built with ``aux_loss=True``); they train on
per-pixel classes with cross-entropy, ``out + 0.5 * aux`` and class 255 ignored, as
torchvision's reference script (``references/segmentation/train.py: criterion``) does. Video
classifiers (``r3d_18``, ``mvit_v2_s``, ``swin3d_t``, ...) take clips of shape
(B, 3, frames, H, W). Sizes default to what the model's weights record: the segmentation
weights' resize size, the video weights' crop size and clip length (``clip_len`` in their
documentation). Detection and optical-flow models are not supported: their losses need
boxes and flows, and their proposals (NMS) have data-dependent sizes a fake tensor lacks.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from boom_ml.errors import InvalidInputError
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.zoo.base import BuiltModel
from boom_ml.zoo.checkpointing import enable_generic
from boom_ml.zoo.common import build_with_options, classification_loss, refuse_weights

IGNORE_INDEX = 255  # the reference script's "void" class (Pascal VOC's border pixels)
AUX_WEIGHT = 0.5  # references/segmentation/train.py: losses["out"] + 0.5 * losses["aux"]
_TRANSFORMER_VIDEO = ("mvit_", "swin3d_")
DEFAULT_SIZE = 224  # as for classifiers: the size when the weights record none


@functools.cache
def segmentation_names() -> frozenset[str]:
    import torchvision

    return frozenset(torchvision.models.list_models(module=torchvision.models.segmentation))


@functools.cache
def video_names() -> frozenset[str]:
    import torchvision

    return frozenset(torchvision.models.list_models(module=torchvision.models.video))


def has(name: str) -> bool:
    return name in segmentation_names() or name in video_names()


def _weights_meta(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, transform keywords) of the model's default weights: no download, the enum only."""
    from torchvision.models import get_model_weights

    weights = get_model_weights(name).DEFAULT
    return weights.meta, dict(weights.transforms.keywords)


def _size(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def clip_length(name: str) -> int:
    """Frames per clip the weights were evaluated with (``clip_len=16`` in their docs)."""
    meta, _ = _weights_meta(name)
    found = re.search(r"clip_len=(\d+)", meta.get("_docs", ""))
    if found is None:  # a release whose docs do not say: the weights' minimum
        return int(meta.get("min_temporal_size", 1))
    return int(found.group(1))


def segmentation_loss(outputs: dict[str, torch.Tensor], inputs: dict[str, Any]) -> torch.Tensor:
    """Per-pixel cross-entropy of ``out``, plus half that of ``aux`` when the model has it."""
    target = inputs["_target"]
    loss = F.cross_entropy(outputs["out"], target, ignore_index=IGNORE_INDEX)
    if "aux" in outputs:
        aux = F.cross_entropy(outputs["aux"], target, ignore_index=IGNORE_INDEX)
        loss = loss + AUX_WEIGHT * aux
    return loss


def build(spec: ModelSpec, name: str, device: str | torch.device = "meta") -> BuiltModel:
    """Build a segmentation or video model with ``weights=None`` (and no backbone weights)."""
    from torchvision.models import get_model

    options: dict[str, Any] = dict(spec.options)
    refuse_weights(options, f"torchvision:{name}")
    segmentation = name in segmentation_names()
    if segmentation:
        options.setdefault("weights_backbone", None)  # the default would download ImageNet's
    module = build_with_options(
        f"torchvision:{name}", lambda: get_model(name, weights=None, **options), device
    )
    what = f"torchvision:{name}"
    meta, keywords = _weights_meta(name)
    num_classes = int(options.get("num_classes", len(meta.get("categories") or ()) or 1))
    if segmentation:
        size = _size(keywords.get("resize_size", DEFAULT_SIZE))
        return _segmentation(spec, module, what, size, num_classes, name)
    size = _size(keywords.get("crop_size", DEFAULT_SIZE))
    return _video(spec, module, what, size, clip_length(name), num_classes, name)


def _input_name(module: nn.Module) -> str:
    """The forward's first argument (``x``; LRASPP calls it ``input``)."""
    return next(iter(inspect.signature(module.forward).parameters))


def _segmentation(
    spec: ModelSpec, module: nn.Module, what: str, size: int, num_classes: int, name: str
) -> BuiltModel:
    key = _input_name(module)

    def make_inputs(step: StepSpec, dev: torch.device) -> dict[str, Any]:
        side = step.image_size or size
        return {
            key: torch.randn(step.batch_size, 3, side, side, device=dev),
            "_target": torch.randint(0, num_classes, (step.batch_size, side, side), device=dev),
        }

    return BuiltModel(
        spec=spec,
        module=module,
        family="cnn",
        make_inputs=make_inputs,
        compute_loss=segmentation_loss,
        enable_checkpointing=lambda m: enable_generic(m, what),
        default_image_size=size,
        reads=frozenset({"image_size"}),
        source="torchvision",
        info={"name": name, "num_classes": num_classes, "task": "segmentation"},
    )


def _fixed_clip(module: nn.Module) -> tuple[int, int] | None:
    """(frames, side) a model with positional encodings per clip position is built for (MViT:
    the encoding's grid times the patch embedding's stride), None for other models."""
    encoding, proj = getattr(module, "pos_encoding", None), getattr(module, "conv_proj", None)
    if encoding is None or proj is None or not hasattr(encoding, "temporal_size"):
        return None
    stride = proj.stride
    return encoding.temporal_size * stride[0], encoding.spatial_size[0] * stride[1]


def _video(
    spec: ModelSpec,
    module: nn.Module,
    what: str,
    size: int,
    frames: int,
    num_classes: int,
    name: str,
) -> BuiltModel:
    key = _input_name(module)
    fixed = _fixed_clip(module)  # MViT: positional encodings for one clip shape
    frames = fixed[0] if fixed else frames
    size = fixed[1] if fixed else size
    least = int(_weights_meta(name)[0].get("min_temporal_size", 1))

    def make_inputs(step: StepSpec, dev: torch.device) -> dict[str, Any]:
        side, clip = step.image_size or size, step.seq_len or frames
        if fixed and (clip, side) != fixed:
            # torchvision's builder passes its own temporal_size and spatial_size to MViT
            raise InvalidInputError(
                f"{what} is built for clips of {fixed[0]} frames of {fixed[1]}x{fixed[1]} "
                f"(torchvision's builder fixes both); asked for {clip} of {side}x{side}: leave "
                "seq_len and image_size out"
            )
        if clip < least:
            raise InvalidInputError(f"{what} needs clips of at least {least} frames (seq_len)")
        return {
            key: torch.randn(step.batch_size, 3, clip, side, side, device=dev),
            "_labels": torch.randint(0, num_classes, (step.batch_size,), device=dev),
        }

    return BuiltModel(
        spec=spec,
        module=module,
        family="transformer" if name.startswith(_TRANSFORMER_VIDEO) else "cnn",
        make_inputs=make_inputs,
        compute_loss=classification_loss,
        enable_checkpointing=lambda m: enable_generic(m, what),
        default_seq_len=frames,
        default_image_size=size,
        reads=frozenset({"image_size", "seq_len"}),
        source="torchvision",
        info={"name": name, "num_classes": num_classes, "task": "video", "frames": frames},
    )
