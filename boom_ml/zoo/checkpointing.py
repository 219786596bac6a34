"""Activation checkpointing for models without a built-in switch (torchvision, file, some timm).

Blocks are checkpointed with non-reentrant ``torch.utils.checkpoint`` by replacing their
``forward`` on the instance, never by wrapping them in a new module: module paths (and
the tracer's per-module attribution) stay the same, the block's hooks fire once per
call, and its children's hooks fire again during recomputation (the recompute phase).
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from boom_ml.errors import InvalidInputError

# Children of these are the "blocks" a user would wrap in torch.utils.checkpoint.
_CONTAINERS = (nn.Sequential, nn.ModuleList)
# Containers named like a classifier head are not part of the trunk one checkpoints.
_HEAD_NAMES = {"classifier", "head", "heads", "fc", "pre_logits", "head_drop", "aux_logits"}
_POOLS = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.MaxPool1d)
_FLAG = "_boom_checkpointed"
SKIP_FLAG = "_boom_checkpoint_skip"  # set by checkpoint_policy: run this block plainly
CONTEXT_FN = "_boom_checkpoint_context_fn"  # set by checkpoint_policy: checkpoint's context_fn
# A model whose own checkpointing switch (timm's checkpoint_seq) cannot be told which blocks
# or how: a callable that turns it off and wraps the blocks one by one instead, for
# checkpointing=selective and checkpointing.every > 1 (checkpoint_policy.configure).
PER_BLOCK_FALLBACK = "_boom_per_block_fallback"


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _is_leaf(m: nn.Module) -> bool:
    return next(m.children(), None) is None


def _is_stage(m: nn.Module, allow_leaves: bool) -> bool:
    """A Sequential/ModuleList with >= 2 parameterised children (composite unless allowed)."""
    if not isinstance(m, _CONTAINERS):
        return False
    kids = [c for c in m.children() if _has_params(c) and (allow_leaves or not _is_leaf(c))]
    return len(kids) >= 2


def _collect_stages(m: nn.Module, allow_leaves: bool, out: list[nn.Module]) -> None:
    for name, child in m.named_children():
        if name in _HEAD_NAMES:
            continue
        if _is_stage(child, allow_leaves):
            out.append(child)
        else:
            _collect_stages(child, allow_leaves, out)


def _stage_blocks(stage: nn.Module) -> list[nn.Module]:
    """Children of a stage, descending into nested stages (efficientnet, convnext, regnet)."""
    blocks: list[nn.Module] = []
    for child in stage.children():
        if _is_stage(child, allow_leaves=False):
            blocks.extend(_stage_blocks(child))
        elif _has_params(child):
            blocks.append(child)
    return blocks


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The composite modules a user would checkpoint one by one.

    Rule: the top-most Sequential/ModuleList stages of the trunk (not the classifier
    head); their parameterised children are the blocks (resnet layer1..4 children,
    mobilenet/efficientnet ``features`` blocks, ViT encoder layers). Models without such
    containers (Inception, hand-written nets) fall back to the root's composite children.
    """
    stages: list[nn.Module] = []
    _collect_stages(module, False, stages)
    blocks = [b for s in stages for b in _stage_blocks(s)]
    if len(blocks) >= 2:
        return blocks
    # a ModuleList / ModuleDict is never called (its owner loops over it): a forward
    # replaced on it would never run, and the step would be traced without checkpointing
    roots = [
        c
        for name, c in module.named_children()
        if name not in _HEAD_NAMES
        and _has_params(c)
        and not _is_leaf(c)
        and not isinstance(c, nn.ModuleList | nn.ModuleDict)
    ]
    return roots if len(roots) >= 2 else []


def find_leaf_stages(module: nn.Module) -> list[nn.Sequential]:
    """Sequentials of plain layers (VGG/AlexNet ``features``): checkpointed in segments.

    Checkpointing one conv at a time frees nothing (its input is kept either way), so
    such stages are cut into segments that end at each pooling layer, like a user's
    ``checkpoint_sequential`` call.
    """
    stages: list[nn.Module] = []
    _collect_stages(module, True, stages)
    return [s for s in stages if isinstance(s, nn.Sequential)]


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Recompute each block's forward in backward."""
    for block in blocks:
        if getattr(block, _FLAG, False):
            continue  # idempotent: enabling twice must not nest checkpoints
        inner = block.forward

        def forward(self: nn.Module, *args: Any, _inner: Callable = inner, **kwargs: Any) -> Any:
            # checkpoint_policy may turn a block off (every K-th) or give it a selective policy
            if getattr(self, SKIP_FLAG, False):
                return _inner(*args, **kwargs)
            context = getattr(self, CONTEXT_FN, noop_context_fn)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=context, **kwargs)

        block.forward = types.MethodType(functools.wraps(inner)(forward), block)  # type: ignore[method-assign]
        setattr(block, _FLAG, True)


def _segments(stage: nn.Sequential) -> list[list[nn.Module]]:
    layers = list(stage)
    cuts = [i + 1 for i, m in enumerate(layers) if isinstance(m, _POOLS)]
    if not cuts or cuts == [len(layers)]:  # no pooling: ~sqrt(n) equal segments
        size = max(1, math.ceil(len(layers) / max(1, round(math.sqrt(len(layers))))))
        cuts = list(range(size, len(layers), size))
    bounds = [0, *[c for c in cuts if c < len(layers)], len(layers)]
    return [layers[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def checkpoint_segments(stage: nn.Sequential) -> None:
    """Run a Sequential of plain layers as checkpointed segments."""
    if getattr(stage, _FLAG, False):
        return
    segments = _segments(stage)

    def run(x: Any, layers: list[nn.Module]) -> Any:
        for layer in layers:
            x = layer(x)
        return x

    def forward(self: nn.Sequential, x: Any) -> Any:
        for seg in segments:
            # A segment without parameters (a lone pool) has nothing worth recomputing.
            if any(_has_params(m) for m in seg):
                x = checkpoint(run, x, seg, use_reentrant=False)
            else:
                x = run(x, seg)
        return x

    stage.forward = types.MethodType(forward, stage)  # type: ignore[method-assign]
    setattr(stage, _FLAG, True)


def enable_generic(module: nn.Module, what: str, blocks: list[nn.Module] | None = None) -> None:
    """Checkpoint ``blocks`` (default: :func:`find_blocks`), else segmented leaf stages."""
    blocks = find_blocks(module) if blocks is None else blocks
    if blocks:
        checkpoint_blocks(blocks)
        return
    stages = find_leaf_stages(module)
    if not stages:
        raise InvalidInputError(
            f"{what}: no blocks (nn.Sequential / nn.ModuleList stages) found to checkpoint; "
            "use checkpointing='none' or build the model from such containers"
        )
    for stage in stages:
        checkpoint_segments(stage)


def checkpoint_generic(what: str) -> Callable[[nn.Module], None]:
    """An ``enable_checkpointing`` callable applying :func:`enable_generic`."""
    return functools.partial(enable_generic, what=what)
