"""OpRecorder: a dispatch mode that turns one step's aten calls into OpGraph records.

It sits inside a FakeTensorMode, sees every aten op after autograd, and writes down:
one node per kernel-launching op, data edges (producer of each input storage → op), and
an allocation event the first time a storage appears plus a free event when the storage
is garbage collected — the moment the CUDA caching allocator would get the block back.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from boom_ml.trace.accumulation import Blocks, InPlaceAccumulation, current_grad_fn
from boom_ml.trace.ops import entry_of, flops_of
from boom_ml.trace.recompute import recomputing


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


@dataclass
class BlockNotes:
    """Besides the graph (``OpRecorder(keep_blocks=True)``): each node's input and output
    blocks, the module path of each block no op made, and the parameter (or buffer) name of
    each block that is one, or is its gradient or optimizer state."""

    node_blocks: list[tuple[list[int], list[int]]]
    block_module: dict[int, str]
    block_param: dict[int, str] = field(default_factory=dict)


class GradientSums(Protocol):
    """The hook that recognises the autograd engine's gradient sums (``trace/accumulation.py``).

    ``note`` sees each op the engine runs in backward, once it has run, and says whether it
    is a sum a plain run does in place; the recorder then holds back that op's events. When
    the next op starts, ``settle`` gets the blocks freed since the sum's allocation and names
    the block the sum takes over (or None: it stays where it is).
    """

    def note(
        self, func: Any, args: tuple, kwargs: dict, out: Any, new_blocks: list[int], blocks: Blocks
    ) -> bool: ...

    def settle(self, freed: Collection[int]) -> int | None: ...


class OpRecorder(TorchDispatchMode):
    """Records nodes, edges and memory events while active.

    ``phase`` is set by the step driver (forward, loss, backward, optimizer, ...);
    ``module_of`` returns the current module path. An op that runs inside the autograd
    engine under checkpoint's re-run (``trace/recompute.py``) is a recomputation: the
    engine runs backward kernels with grad mode off, while ``torch.utils.checkpoint``
    re-runs the forward under ``enable_grad`` and a saved-tensor hook of its own. ``sums`` folds the engine's gradient sums as a plain run does
    (default: :class:`~boom_ml.trace.accumulation.InPlaceAccumulation`).
    """

    def __init__(
        self,
        module_of: Callable[[], str] = lambda: "",
        sums: GradientSums | None = None,
        keep_blocks: bool = False,
    ) -> None:
        super().__init__()
        self.module_of = module_of
        # keep_blocks: also note each node's input and output blocks and the module of each
        # block no op made (what trace/repeat.py needs to tell one layer's blocks from another's)
        self.keep_blocks = keep_blocks
        self.node_blocks: list[tuple[list[int], list[int]]] = []
        self.block_module: dict[int, str] = {}
        self.sums: GradientSums = sums if sums is not None else InPlaceAccumulation()
        # Events of the running backward op, and after it of a pending sum, not yet final.
        self._held: list[dict[str, Any]] | None = None
        self._sum_block: int | None = None  # output block of the pending sum
        self._phase = "setup"
        self.nodes: list[dict[str, Any]] = []
        self.edges: set[tuple[int, int]] = set()
        self.events: list[dict[str, Any]] = []
        self.block_phase: dict[int, str] = {}  # block → phase it was allocated in
        self.block_node: dict[int, int] = {}  # block → node that allocated it
        self.block_bytes: dict[int, int] = {}
        self.block_grad_fn: dict[int, int] = {}  # block → autograd node that made it
        self._blocks: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._producer: dict[int, int] = {}  # block → last node that wrote it
        self.autocast_blocks: set[int] = set()  # low-precision copies of parameters
        self._next_block = 0
        self._current_node = -1
        self._recording = True

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._settle_sum()
        self._phase = name

    @property
    def recording(self) -> bool:
        return self._recording

    @recording.setter
    def recording(self, on: bool) -> None:
        self._settle_sum()  # a sum pending when recording stops is final
        self._recording = on

    # -- storages -------------------------------------------------------------------------
    def block_of(self, t: torch.Tensor, phase: str | None = None) -> int:
        """The block id of ``t``'s storage, allocating one (and an alloc event) if new."""
        self._settle_sum()
        st = t.untyped_storage()
        block = self._blocks.get(st)
        if block is not None:
            return block
        block = self._next_block
        self._next_block += 1
        self._blocks[st] = block
        nbytes = int(st.nbytes())
        phase = phase or self.phase
        self.block_phase[block] = phase
        self.block_node[block] = self._current_node
        self.block_bytes[block] = nbytes
        if self.keep_blocks and self._current_node < 0:
            self.block_module[block] = self.module_of()
        if torch._C._current_graph_task_id() != -1:
            self.block_grad_fn[block] = current_grad_fn()
        self._event("alloc", block, nbytes, phase)
        self._refs[block] = weakref.ref(st, lambda _ref, b=block: self._freed(b))
        return block

    def adopt(self, tensors: Iterable[torch.Tensor], phase: str) -> None:
        """Register tensors that exist before recording starts (params, grads, state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.block_of(t, phase)

    def _freed(self, block: int) -> None:
        self._refs.pop(block, None)
        if self.recording:
            self._event("free", block, self.block_bytes[block], self.phase)

    def _event(self, action: str, block: int, nbytes: int, phase: str) -> None:
        event = {"seq": -1, "node_id": self._current_node, "action": action, "block": block,
                 "bytes": nbytes, "category": "", "phase": phase}  # fmt: skip
        if self._held is not None:
            self._held.append(event)
        else:
            self._commit([event])

    def _commit(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            event["seq"] = len(self.events)
            self.events.append(event)

    def grad_fn_of(self, block: int) -> int:
        """Sequence number of the autograd node whose op allocated ``block`` (-1: none)."""
        return self.block_grad_fn.get(block, -1)

    # -- the engine's gradient sums ----------------------------------------------------------
    def _settle_sum(self) -> None:
        """Ask the hook where the pending sum goes, and record its held events accordingly."""
        if self._sum_block is None:
            return
        held, out_block = self._held or [], self._sum_block
        self._held, self._sum_block = None, None
        alloc = next(
            i for i, e in enumerate(held) if e["block"] == out_block and e["action"] == "alloc"
        )
        freed = {e["block"]: i for i, e in enumerate(held) if i > alloc and e["action"] == "free"}
        keep = self.sums.settle(freed.keys())
        if keep is not None and self._take_over(out_block, keep):
            # As in a plain run: no new block for the sum, and the operand's block lives on.
            held = [e for i, e in enumerate(held) if i not in (alloc, freed[keep])]
        self._commit(held)

    def _release(self) -> None:
        """Record the held events of an op that is no sum to fold, as they happened."""
        held, self._held = self._held or [], None
        self._commit(held)

    def _take_over(self, block: int, keep: int) -> bool:
        """Make the storage of ``block`` be ``keep`` (whose storage has just died)."""
        storage_ref = self._refs.pop(block, None)  # its callback dies with it
        storage = storage_ref() if storage_ref is not None else None
        if storage is None:
            return False
        self._blocks[storage] = keep
        self._refs[keep] = weakref.ref(storage, lambda _r, b=keep: self._freed(b))
        if block in self._producer:
            self._producer[keep] = self._producer.pop(block)
        return True

    def known_block(self, t: torch.Tensor) -> int | None:
        """The block id of ``t``'s storage if it has one (no new block, no event)."""
        return self._blocks.get(t.untyped_storage())

    def live_blocks(self) -> set[int]:
        return set(self._refs)

    # -- dispatch -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self._settle_sum()
        entry = entry_of(func)
        if not self.recording or not (entry.kernel or entry.allocates):
            return func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        in_blocks = [self.block_of(t) for t in inputs]
        phase = self.phase
        in_engine = torch._C._current_graph_task_id() != -1
        if phase == "backward" and recomputing():
            phase = "recompute"
        node_id = len(self.nodes) if entry.kernel else -1
        self._current_node = node_id
        saved_phase, self.phase = self.phase, phase
        engine_backward = phase == "backward" and in_engine
        if engine_backward:  # hold its events until the hook has seen it
            self._held = []
        try:
            out = func(*args, **kwargs)
            outputs = _tensors(out)
            out_blocks = [self.block_of(t) for t in outputs]
        except BaseException:
            self._release()
            raise
        finally:
            self.phase = saved_phase
        if node_id < 0:  # a bare allocation: no kernel, but its block is now known
            self._release()
            self._current_node = -1
            return out
        mutated = self._mutated_inputs(func, args, kwargs)
        op = entry.cuda_name
        new_blocks = [b for b in out_blocks if self.block_node.get(b) == node_id]
        if engine_backward:
            if self.sums.note(func, args, kwargs, out, new_blocks, self):
                self._sum_block = new_blocks[0]  # settled when the next op starts
            else:
                self._release()
        family = entry.family
        if in_blocks and all(self.block_phase.get(b) == "host" for b in in_blocks):
            # e.g. Adam's step counters: CPU tensors in a CUDA run, no kernel, no GPU memory.
            family = "host"
            for b in new_blocks:
                self.block_phase[b] = "host"
        elif op == "_to_copy" and any(self.block_phase.get(b) == "parameter" for b in in_blocks):
            self.autocast_blocks.update(new_blocks)
        fresh = [t for t, b in zip(outputs, out_blocks, strict=True) if b not in in_blocks]
        bytes_read, bytes_written = entry.bytes(inputs, fresh, mutated)
        self.nodes.append(
            {
                "id": node_id,
                "aten_op": str(func),
                "op": op,
                "family": family,
                "phase": phase,
                "module": self.module_of(),
                "input_shapes": json.dumps([list(t.shape) for t in inputs]),
                "input_dtypes": json.dumps([str(t.dtype).removeprefix("torch.") for t in inputs]),
                "output_shapes": json.dumps([list(t.shape) for t in outputs]),
                "output_dtypes": json.dumps([str(t.dtype).removeprefix("torch.") for t in outputs]),
                "flops": flops_of(entry, args, kwargs, out),
                "bytes_read": bytes_read,
                "bytes_written": bytes_written,
            }
        )
        if self.keep_blocks:
            self.node_blocks.append((in_blocks, out_blocks))
        for b in in_blocks:
            src = self._producer.get(b)
            if src is not None and src != node_id:
                self.edges.add((src, node_id))
        for b in out_blocks:
            self._producer[b] = node_id
        for t in mutated:
            self._producer[self.block_of(t)] = node_id
        self._current_node = -1
        return out

    @staticmethod
    def _mutated_inputs(func, args, kwargs) -> list[torch.Tensor]:
        """Inputs the op writes in place (``add_``, ``_foreach_mul_``, ``out=`` arguments)."""
        schema = func._schema
        written: list[torch.Tensor] = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            written.extend(_tensors(value))
        return written
