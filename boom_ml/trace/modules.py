"""Which module an op belongs to, in forward and in backward.

Forward: the deepest module whose forward is running (ModTracker). Backward: the module
whose forward created the autograd node being executed. ModTracker alone cannot say that
in backward: a module leaves its "active" set only once the gradients of all its inputs
are complete, so a residual block's shortcut stays active while the whole main branch
runs backward. Autograd nodes are matched to modules by sequence number, recorded by a
node-creation hook during forward. A checkpointed block's forward re-run inside backward
takes the deepest module re-entered by that re-run, as forward would; between its modules
(a residual add), their common parent. ModTracker's set would also hold modules still
active in backward and those a re-run stopped early left behind (the next layer's
attention, as deep), which claimed the re-run's ops.

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

from boom_ml.trace.recompute import recompute_key

_REENTRY_WARNING = "The module hierarchy tracking maybe be messed up"
_ACCUMULATE_GRAD = 2**64 - 1  # sequence number autograd gives every AccumulateGrad node


def _common_parent(names: list[str], called: set[str]) -> str:
    """The innermost module that holds all of ``names`` and whose forward runs: a
    ModuleList holding them is looped over by its owner, never called."""
    paths = [n.split(".") for n in names if "." in n]  # "Func": a module called, not owned
    if not paths:
        return ""
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == paths[0][shared] for p in paths):
        shared += 1
    while shared > 0 and ".".join(paths[0][:shared]) not in called:
        shared -= 1
    return ".".join(paths[0][:shared])


def _deepest(parents: set[str]) -> str:
    names = [p for p in parents if p != "Global"]
    return max(names, key=lambda n: (n.count("."), len(n), n)) if names else ""


class ModuleOf:
    """Callable returning the module path of the op being dispatched now."""

    def __init__(self) -> None:
        self.tracker = ModTracker()
        self.node_module: dict[int, str] = {}
        # modules whose forward runs now, outermost first, each with the re-run it is in
        # (None: forward); and the modules the newest re-run has entered so far
        self.running: list[tuple[str, tuple[int, int] | None]] = []
        self.reentered: tuple[tuple[int, int] | None, list[str]] = (None, [])
        self.called: set[str] = set()  # modules whose forward has run

    def _enter(self, module: torch.nn.Module, args: object) -> None:
        key = recompute_key()
        name = self.tracker._get_mod_name(module)
        # a re-run stopped early left its modules here: they belong to no other run
        self.running = [entry for entry in self.running if entry[1] == key]
        self.running.append((name, key))
        self.called.add(name)
        if key is not None:
            if self.reentered[0] != key:
                self.reentered = (key, [])
            self.reentered[1].append(name)

    def _leave(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self.running and self.running[-1][1] == recompute_key():
            self.running.pop()

    def _recomputed(self, key: tuple[int, int]) -> str:
        names = {name for name, run in self.running if run == key}
        if names:
            return _deepest(names)
        if self.reentered[0] != key:
            return ""
        return _common_parent(self.reentered[1], self.called)

    def _on_node(self, node: torch.autograd.graph.Node) -> None:
        self.node_module[node._sequence_nr()] = _deepest(self.tracker.parents)

    def __call__(self) -> str:
        key = recompute_key()
        if key is not None:
            found = self._recomputed(key)
            if found:
                return found
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
        hooks = torch.nn.modules.module
        enter = hooks.register_module_forward_pre_hook(self._enter)
        leave = hooks.register_module_forward_hook(self._leave, always_call=True)
        try:
            with warnings.catch_warnings(), self.tracker:
                warnings.filterwarnings("ignore", message=_REENTRY_WARNING, category=UserWarning)
                yield
        finally:
            warnings.formatwarning = formatwarning
            enter.remove()
            leave.remove()
            torch._C._autograd._pop_node_creation_hook()
