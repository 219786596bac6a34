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

:class:`InPlaceAccumulation` recognises such a sum and names the block the plain run would
have written it into: the operand the engine could overwrite. The sign that the engine held
the only reference is that the operand's storage died right after the sum, before the next op
ran. It is the recorder's gradient-sum hook (``OpRecorder(sums=...)``): it only reads block
ids through :class:`Blocks`; the recorder holds back the sum's events until the hook has
answered and records the folded sum itself.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

import torch

ADD = torch.ops.aten.add.Tensor


class Blocks(Protocol):
    """What the hook reads of the recorder: block ids and the autograd node behind each."""

    def block_of(self, t: torch.Tensor) -> int: ...

    def grad_fn_of(self, block: int) -> int: ...


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


class InPlaceAccumulation:
    """Candidate sums are noted when they run and settled before the next op."""

    def __init__(self) -> None:
        self.pending: _Pending | None = None

    def note(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        out: Any,
        new_blocks: list[int],
        blocks: Blocks,
    ) -> bool:
        """Whether ``out = old + new`` looks like an engine accumulation (then it is pending)."""
        if func is not ADD or kwargs or len(args) != 2 or len(new_blocks) != 1:
            return False
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return False
        if not (isinstance(out, torch.Tensor) and _dense_like(old, out) and _dense_like(new, out)):
            return False
        old_block, new_block = blocks.block_of(old), blocks.block_of(new)
        here = current_grad_fn()
        # InputBuffer adds the buffered gradient (from an earlier node) to the one the
        # running node just produced, in that order.
        if here < 0 or blocks.grad_fn_of(new_block) != here:
            return False
        if blocks.grad_fn_of(old_block) == here:
            return False
        self.pending = _Pending(new_blocks[0], old_block, new_block)
        return True

    def settle(self, freed: Collection[int]) -> int | None:
        """The block the pending sum takes over, given the blocks freed right after it.

        None when the sum stays out of place: neither operand died, or the sum itself did.
        """
        p, self.pending = self.pending, None
        if p is None:
            return None
        keep = p.old_block if p.old_block in freed else p.new_block
        if keep not in freed or p.out_block in freed:
            return None
        return keep
