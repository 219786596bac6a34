"""Which module an op belongs to, in forward and in backward.

Forward: the deepest module whose forward is running (ModTracker). Backward: the module
whose forward created the autograd node being executed. ModTracker alone cannot say that
in backward: a module leaves its "active" set only once the gradients of all its inputs
are complete, so a residual block's shortcut stays active while the whole main branch
runs backward. Autograd nodes are matched to modules by sequence number, recorded by a
node-creation hook during forward.

torch.utils.module_tracker.ModuleTracker would import faster (torch.distributed._tools'
``__init__`` loads the FSDP memory tracker: ~0.3 s of every call that traces) but changes what the
trace records: with it, Llama-3-8B under full checkpointing (dp8 FSDP) came out at 86.8 GiB
per rank instead of 48.4. Tried and reverted (2026-12-04).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch.distributed._tools.mod_tracker import ModTracker

_REENTRY_WARNING = "The module hierarchy tracking maybe be messed up"
_ACCUMULATE_GRAD = 2**64 - 1  # sequence number autograd gives every AccumulateGrad node


def _deepest(parents: set[str]) -> str:
    names = [p for p in parents if p != "Global"]
    return max(names, key=lambda n: (n.count("."), len(n), n)) if names else ""


class ModuleOf:
    """Callable returning the module path of the op being dispatched now."""

    def __init__(self) -> None:
        self.tracker = ModTracker()
        self.node_module: dict[int, str] = {}

    def _on_node(self, node: torch.autograd.graph.Node) -> None:
        self.node_module[node._sequence_nr()] = _deepest(self.tracker.parents)

    def __call__(self) -> str:
        if torch._C._current_graph_task_id() != -1 and not torch.is_grad_enabled():
            node = torch._C._current_autograd_node()
            if node is not None and node._sequence_nr() != _ACCUMULATE_GRAD:
                found = self.node_module.get(node._sequence_nr())
                if found is not None:
                    return found
        return _deepest(self.tracker.parents)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        torch._C._autograd._push_node_creation_hook(self._on_node)
        # ModTracker warns "hierarchy tracking maybe be messed up" whenever a checkpointed
        # block's forward is re-run inside backward (the block is still among its parents),
        # and replaces warnings.formatwarning for the rest of the process as it does. Backward
        # ops take their module from the autograd node above, not from those parents, so the
        # warning says nothing about this trace: it is silenced and the formatter restored.
        formatwarning = warnings.formatwarning
        try:
            with warnings.catch_warnings(), self.tracker:
                warnings.filterwarnings("ignore", message=_REENTRY_WARNING, category=UserWarning)
                yield
        finally:
            warnings.formatwarning = formatwarning
            torch._C._autograd._pop_node_creation_hook()
