"""Which checkpointed blocks recompute, and what: every K-th block, full or selective.

Applied after a model's own ``enable_checkpointing`` switched on full activation
checkpointing, so every scheme keeps its way of finding blocks. The checkpointed units are
HF layers with a ``gradient_checkpointing`` flag (transformers' ``GradientCheckpointingLayer``
and older per-layer flags) and the blocks ``zoo.checkpointing.checkpoint_blocks`` wrapped.

``selective`` is PyTorch's selective activation checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with the policy of
torchtitan's "op" mode: the outputs of matmuls and attention kernels are saved in forward,
everything else (norms, activations, elementwise ops) is recomputed in backward. torchtitan
also recomputes every second ``mm`` to save more memory; here every matmul output is kept.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from boom_ml.errors import InvalidInputError
from boom_ml.zoo.checkpointing import _FLAG, CONTEXT_FN, PER_BLOCK_FALLBACK, SKIP_FLAG

aten = torch.ops.aten


def _save_list() -> set[Any]:
    """Ops whose outputs the selective policy saves (matmuls and attention, forward and CPU)."""
    names = (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    )  # fmt: skip
    ops = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return ops


SAVE_OPS = _save_list()


class SelectiveSaves:
    """Outputs the selective policy saved since ``configure`` set up the last model: none
    means its checkpointed blocks hold no matmul or attention (a CNN's convolution blocks),
    and selective checkpointing then recomputes what full checkpointing does."""

    count = 0


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save matmul and attention outputs; recompute the rest."""
    if func in SAVE_OPS:
        SelectiveSaves.count += 1
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """A fresh pair of SAC contexts for one checkpointed call (``checkpoint``'s ``context_fn``)."""
    return create_selective_checkpoint_contexts(selective_policy)


def checkpointed_units(module: nn.Module) -> list[nn.Module]:
    """Checkpointed blocks in forward order: innermost HF layers, or wrapped generic blocks.

    HF layers are transformers' ``GradientCheckpointingLayer`` where the model has them: the
    modules that run checkpoint. Other modules carry the same flag for their own use (T5's
    attention reads it to make its position bias require a gradient) and are not blocks.
    """
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52: no such class; every flagged module counts
        GradientCheckpointingLayer = ()  # noqa: N806 (isinstance(x, ()) is False)

    def flagged(m: nn.Module) -> bool:
        return getattr(m, "gradient_checkpointing", False) is True

    layers = any(isinstance(m, GradientCheckpointingLayer) and flagged(m) for m in module.modules())
    units = []
    for m in module.modules():
        # checkpoint_blocks' wrapper (functools.wraps: __wrapped__), not a segmented stage
        if getattr(m, _FLAG, False) and hasattr(m.forward, "__wrapped__"):
            units.append(m)
        elif flagged(m) and (isinstance(m, GradientCheckpointingLayer) or not layers):
            inner = any(
                (isinstance(c, GradientCheckpointingLayer) if layers else
                 getattr(c, "gradient_checkpointing", None) is not None)
                for c in m.modules()
                if c is not m
            )  # fmt: skip
            if not inner:  # a model-level flag above its layers is not a block
                units.append(m)
    return units


def configure(module: nn.Module, mode: str, every: int, what: str) -> int:
    """Keep checkpointing on every ``every``-th unit (the first of each K), ``mode`` on those.

    Returns the number of units that recompute. Raises when ``selective`` or ``every > 1``
    is asked of a model whose checkpointing this cannot reach (timm's own ``checkpoint_seq``).
    """
    units = checkpointed_units(module)
    fallback = getattr(module, PER_BLOCK_FALLBACK, None)
    if not units and (mode != "full" or every != 1) and fallback is not None:
        fallback()  # timm: its checkpoint_seq off, the blocks wrapped one by one
        units = checkpointed_units(module)
    if not units:
        if mode == "full" and every == 1:
            return 0  # the model's own switch did it (timm, segmented stages)
        segmented = any(getattr(m, _FLAG, False) for m in module.modules())
        raise InvalidInputError(
            f"{what}: checkpointing={mode} with checkpointing.every={every} needs blocks to"
            " checkpoint one by one (hf models' layers, or modules of several layers inside"
            " an nn.Sequential / nn.ModuleList)"
            # a hunt: an nn.Sequential of single layers had been told to use nn.Sequential
            + (
                "; this model's nn.Sequential stages hold single layers, which"
                " checkpointing=full checkpoints in segments"
                if segmented
                else ""
            )  # fmt: skip
        )
    if every > len(units):  # a hunt: every=100 of 16 blocks read as ckpt=full in the header
        raise InvalidInputError(
            f"{what}: checkpointing.every={every} exceeds the model's {len(units)} checkpointable"
            f" blocks (every K-th from the first: K = {len(units)} already checkpoints the first"
            " alone)"
        )
    SelectiveSaves.count = 0
    hf_func = functools.partial(checkpoint, use_reentrant=False)
    if mode == "selective":
        hf_func = functools.partial(checkpoint, use_reentrant=False, context_fn=selective_context)
    on = 0
    for index, unit in enumerate(units):
        keep = index % every == 0
        on += keep
        if getattr(unit, _FLAG, False):
            setattr(unit, SKIP_FLAG, not keep)
            if mode == "selective":
                setattr(unit, CONTEXT_FN, selective_context)
        else:
            unit.gradient_checkpointing = keep
            unit._gradient_checkpointing_func = hf_func
    return on
