"""Gradient accumulation in the autograd engine, as a run without a dispatch mode does it.

When two backward edges feed the same input of a node (a tensor used twice: a residual
branch, tied embedding weights), the engine's ``InputBuffer`` sums the incoming
gradients. In a plain CUDA run it sums *in place* whenever it holds the only reference:
``old.add_(new)`` (or ``new.add_(old)``), no new block. But ATen counts every tensor as
"subclass-like" while any dispatch mode is active (``isTensorSubclassLike`` returns true
under ``dispatch_mode_enabled()``), and tracing on fake tensors always has one, so the
traced engine takes the out-of-place branch: ``old + new``, one extra gradient-sized
allocation per accumulation and a different block for the sum. That changes peaks and,
through the allocator's best-fit choices, which segments get split.

:class:`InPlaceAccumulation` recognises such a sum in the recorded stream and rewrites it
to what the plain run does: the sum keeps the block of the operand the engine could
overwrite. The sign that the engine held the only reference is that the operand's storage
died right after the sum, before the next op ran.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from boom_ml.trace.recorder import OpRecorder

ADD = torch.ops.aten.add.Tensor


def current_grad_fn() -> int:
    """Sequence number of the autograd node the engine is running (-1 outside one)."""
    node = torch._C._current_autograd_node()
    return int(node._sequence_nr()) if node is not None else -1


def _dense_like(t: torch.Tensor, out: torch.Tensor) -> bool:
    return (
        t.shape == out.shape
        and t.dtype == out.dtype
        and t.stride() == out.stride()
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == out.untyped_storage().nbytes()
    )


@dataclass
class _Pending:
    out_block: int
    old_block: int
    new_block: int
    alloc_index: int  # index of the sum's alloc event in recorder.events


class InPlaceAccumulation:
    """Candidate sums are noted when they run and settled before the next op."""

    def __init__(self) -> None:
        self.pending: _Pending | None = None

    def note(
        self,
        rec: OpRecorder,
        func: Any,
        args: tuple,
        kwargs: dict,
        out: Any,
        new_blocks: list[int],
    ) -> None:
        """Remember ``out = old + new`` if it looks like an engine accumulation."""
        if func is not ADD or kwargs or len(args) != 2 or len(new_blocks) != 1:
            return
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return
        if not (isinstance(out, torch.Tensor) and _dense_like(old, out) and _dense_like(new, out)):
            return
        old_block, new_block = rec.block_of(old), rec.block_of(new)
        here = current_grad_fn()
        # InputBuffer adds the buffered gradient (from an earlier node) to the one the
        # running node just produced, in that order.
        if here < 0 or rec.block_grad_fn.get(new_block) != here:
            return
        if rec.block_grad_fn.get(old_block, -1) == here:
            return
        alloc = next(
            i
            for i in range(len(rec.events) - 1, -1, -1)
            if rec.events[i]["block"] == new_blocks[0] and rec.events[i]["action"] == "alloc"
        )
        self.pending = _Pending(new_blocks[0], old_block, new_block, alloc)

    def settle(self, rec: OpRecorder) -> None:
        """Fold the pending sum into the operand whose storage died right after it."""
        p, self.pending = self.pending, None
        if p is None:
            return
        freed = {
            e["block"]: i
            for i, e in enumerate(rec.events[p.alloc_index + 1 :], start=p.alloc_index + 1)
            if e["action"] == "free"
        }
        keep = p.old_block if p.old_block in freed else p.new_block
        if keep not in freed or p.out_block in freed:
            return
        storage_ref = rec._refs.pop(p.out_block, None)  # its callback dies with it
        storage = storage_ref() if storage_ref is not None else None
        if storage is None:
            return
        drop = {p.alloc_index, freed[keep]}
        rec.events = [e for i, e in enumerate(rec.events) if i not in drop]
        rec._blocks[storage] = keep
        rec._refs[keep] = weakref.ref(storage, lambda _r, b=keep: rec._freed(b))
        if p.out_block in rec._producer:
            rec._producer[keep] = rec._producer.pop(p.out_block)
