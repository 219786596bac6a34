"""Collectives of one rank's training step, traced through the real PyTorch wrappers.

``torch.distributed`` is initialised with PyTorch's ``fake`` backend (``FakeStore``; every
collective returns at once without moving data, as torchtitan's memory estimator uses it), the
model is wrapped as a job would wrap it (DDP, FSDP2 ``fully_shard``, tensor parallel through
``parallelize_module``) and one optimizer step of rank 0 runs under a dispatch mode that records
every c10d collective: its op, process group, bytes and the phase of the step it ran in. The
analytic model (``collectives.py``, ``time.py``) is checked against this record in
``tests/test_parallel_traced.py``.

What runs where (torch 2.14, CPU):

* FSDP2 and tensor parallel (also FSDP2 over tp) trace on fake tensors (``FakeTensorMode``).
  FSDP2 over tp-sharded DTensors concatenates device meshes, whose coordinate tensors must be
  real ("DynamicOutputShapeException: aten.nonzero"), so ``fully_shard`` runs with the fake
  mode unset (fake parameters stay fake).
* DDP needs real tensors: its C++ ``Reducer`` reads tensor data, at construction
  (``_verify_params_across_processes``: "The tensor has a non-zero number of elements, but its
  data is not allocated yet") and when it rebuilds its buckets at the second step
  (``Reducer._rebuild_buckets``, the same error). Even on real tensors its default all-reduce
  hook fails on the fake group (comm.cpp: "expected the hook result is either a Tensor or a
  TensorList found None": the fake group's work future holds no tensor), so we register a hook
  that does what the default does (divide the bucket by the group size, all-reduce it) and
  returns the bucket. Buckets are rebuilt in gradient-ready order after the first step, so
  ``warmup_steps`` run before the recorded one.
* Not traced (analytic only): DDP over tp (its parameter sync fails on DTensors), ZeRO-1/2
  (torch has no ZeRO-2; its ZeroRedundancyOptimizer broadcasts, unlike Megatron/DeepSpeed's
  reduce-scatter + all-gather that ``time.py`` models) and pipeline stages (FSDP2 under
  torch's pipeline schedules is run in the test itself, one stage, against ``fsdp.py``).

Bytes: all-reduce, the buffer; all-gather, the gathered output; reduce-scatter, the unscattered
input (the sizes ``collectives.py``'s formulas take). ``torch.distributed`` is imported inside
the functions only: ``boom_ml.predict`` validates without torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from boom_ml.parallel.layout import Layout

# c10d ops (ProcessGroup calls) and functional collectives (DTensor's) -> our op names
OP_NAMES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "send",
    "recv_": "recv",
    "barrier": "barrier",
}
NAMESPACES = ("c10d", "_c10d_functional")
DECODER_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DECODER_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TracedCollective:
    op: str  # all_reduce | all_gather | reduce_scatter | broadcast | ...
    group: str  # dp | tp
    group_size: int
    bytes: int  # see the module doc
    dtype: str
    phase: str  # forward | backward | optimizer

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _tensors(x: Any) -> list[Any]:
    import torch

    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def collective_bytes(op: str, args: tuple[Any, ...], group_size: int) -> tuple[int, str]:
    """(bytes in ``collectives.py``'s convention, dtype) of one collective call's arguments."""
    name = op.split(".")[1]
    first = _tensors(args[0])
    if name in ("_allgather_base_", "_reduce_scatter_base_"):
        # (output, input, ...): the gathered output / the unscattered input
        t = first if name == "_allgather_base_" else _tensors(args[1])
        return sum(map(_nbytes, t)), str(t[0].dtype)
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        return group_size * sum(map(_nbytes, first)), str(first[0].dtype)
    if name in ("allgather_", "allgather_into_tensor_coalesced_"):
        return sum(map(_nbytes, first)), str(first[0].dtype)  # outputs
    if name in ("reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        t = _tensors(args[1])
        return sum(map(_nbytes, t)), str(t[0].dtype)
    return sum(map(_nbytes, first)), str(first[0].dtype) if first else ""


def _process_group(args: tuple[Any, ...]) -> Any:
    """The ProcessGroup of a c10d op (a boxed ScriptObject) or functional one (its name)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    names = [a for a in args if isinstance(a, str)]
    for a in args:
        if isinstance(a, torch.ScriptObject):
            with contextlib.suppress(Exception):  # other script objects (Work, ReduceOp)
                return dist.ProcessGroup.unbox(a)
    # functional collectives end with the group's name (all_reduce has the reduce op before it)
    return _resolve_process_group(names[-1]) if names else None


def _recorder(groups: dict[str, str]) -> Any:
    """A TorchDispatchMode appending TracedCollectives to ``.calls`` while ``.phase`` is set."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveRecorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[TracedCollective] = []
            self.phase: str | None = None  # None: not recording (warm-up steps)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):
                # modes run before subclasses, and a mode is off while its handler runs: let
                # DTensor desugar the op first, so its collectives come back here (as
                # CommDebugMode does); without this, redistributions inside ops (the
                # vocabulary-parallel cross-entropy's) would go unrecorded
                return NotImplemented
            name = func.name().split("::")[-1].split(".")[0]
            if self.phase and func.namespace in NAMESPACES and name in OP_NAMES:
                pg = _process_group(tuple(args) + tuple(kwargs.values()))
                size = pg.size() if pg is not None else 1
                nbytes, dtype = collective_bytes(f"{func.namespace}.{name}", tuple(args), size)
                group = groups.get(pg.group_name, "world") if pg is not None else "?"
                self.calls.append(
                    TracedCollective(OP_NAMES[name], group, size, nbytes, dtype, self.phase)
                )
            return func(*args, **kwargs)

    return CollectiveRecorder()


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """torch.distributed on the ``fake`` backend for the block; destroyed and env restored after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; trace in a fresh process")
    # torch.distributed and what the wrappers import may set variables (RANK..., inductor's
    # cache dir): the whole environment is put back as it was
    saved = dict(os.environ)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def decoder_tp_plan(module: Any, mesh: Any) -> None:
    """Megatron-style plan for HF decoder layers (Llama naming): q/k/v, gate/up column-parallel,
    o and down row-parallel. The attention and MLP inputs become replicated DTensors once
    (``PrepareModuleInput``), so their gradient is all-reduced once per block in backward, as
    Megatron's fused QKV / gate-up does; plain per-linear ColwiseParallel all-reduces it after
    each of q, k, v (and gate, up): 5 backward all-reduces per layer instead of 2.

    An untied ``embed_tokens`` / ``lm_head`` pair is vocabulary-parallel (Megatron's): the
    embedding row-parallel (its output all-reduced), the head column-parallel with logits left
    sharded for ``loss_parallel``'s cross-entropy. Tied ones stay replicated.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    for sub in list(module.modules()):
        kids = dict(sub.named_children())
        plan: dict[str, Any] = {}
        prepare = None
        if all(k in kids for k in DECODER_ATTENTION):
            # HF decoder layers call self_attn(hidden_states=...): a keyword input
            prepare = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Replicate()},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
            plan.update({k: ColwiseParallel() for k in DECODER_ATTENTION[:3]})
            plan["o_proj"] = RowwiseParallel()
        elif all(k in kids for k in DECODER_MLP):
            prepare = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
            )
            plan.update({k: ColwiseParallel() for k in DECODER_MLP[:2]})
            plan["down_proj"] = RowwiseParallel()
        if plan:
            parallelize_module(sub, mesh, prepare)
            parallelize_module(sub, mesh, plan)
    embeds = [m for name, m in module.named_modules() if name.endswith("embed_tokens")]
    head = getattr(module, "lm_head", None)
    if len(embeds) == 1 and head is not None and head.weight is not embeds[0].weight:
        parallelize_module(embeds[0], mesh, RowwiseParallel(input_layouts=Replicate()))
        head_plan = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(head, mesh, head_plan)


def default_fsdp_units(module: Any) -> list[Any]:
    """Every child of an ``nn.ModuleList`` (a transformer's layers), as torchtitan wraps them."""
    import torch.nn as nn

    return [m for ml in module.modules() if isinstance(ml, nn.ModuleList) for m in ml]


def _ddp_hook(dist: Any) -> Callable[..., Any]:
    import torch

    # no annotations: DDP checks them against dist.GradBucket (this module's are strings)
    def hook(group, bucket):  # noqa: ANN001, ANN202
        # the default hook's collective (the bucket averaged over the group); the fake
        # group's own future holds no tensor, which DDP's C++ side rejects
        buf = bucket.buffer()
        buf.div_(dist.get_world_size(group))
        dist.all_reduce(buf, group=group)
        fut: Any = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook


def trace_collectives(
    build: Callable[[], Any],
    loss_fn: Callable[[Any], Any],
    layout: Layout,
    *,
    tp_plan: Callable[[Any, Any], None] | None = decoder_tp_plan,
    fsdp_units: Callable[[Any], list[Any]] = default_fsdp_units,
    fake: bool | None = None,
    warmup_steps: int = 2,
) -> list[TracedCollective]:
    """The collectives of rank 0 in one optimizer step of ``build()`` under ``layout``.

    ``loss_fn(model)`` runs one micro-batch's forward and returns the loss (autocast, if any,
    inside it); the step is ``layout.microbatches`` forward/backward passes and an AdamW step,
    after ``warmup_steps`` unrecorded steps. dp ranks use DDP (``sharding=none``; micro-batches
    before the last under ``no_sync``) or FSDP2 (``zero3``/``fsdp``: each of ``fsdp_units`` and
    then the root); tp ranks get ``tp_plan(model, tp_mesh)``. ``fake`` (default: all but DDP)
    builds and runs on FakeTensorMode. ZeRO-1/2 and pipeline stages are not traced (analytic).
    """
    import torch

    if layout.pp > 1 or layout.zero_stage in (1, 2):
        raise NotImplementedError("pipeline stages and ZeRO-1/2 are modelled analytically only")
    ddp = layout.dp > 1 and layout.zero_stage == 0
    if ddp and layout.tp > 1:
        # DDP's construction broadcasts its parameters flattened: on DTensors that fails
        # (_sync_module_states: "aten.cat.default got mixed torch.Tensor and DTensor")
        raise NotImplementedError(
            "DDP over tensor-parallel DTensor parameters fails in DDP's parameter sync; "
            "dp x tp is traced with FSDP2 (sharding=fsdp) and modelled analytically otherwise"
        )
    if fake is None:
        fake = not ddp
    if fake and ddp:
        raise ValueError("DDP's Reducer reads tensor data: trace it on real tensors (fake=False)")
    with fake_process_group(layout.dp * layout.tp):
        import torch.distributed as dist
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed.device_mesh import init_device_mesh

        dims = [(n, s) for n, s in (("dp", layout.dp), ("tp", layout.tp)) if s > 1] or [("dp", 1)]
        mesh = init_device_mesh(
            "cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims)
        )
        groups = {mesh.get_group(n).group_name: n for n, _ in dims}
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            model = build()
            if layout.tp > 1 and tp_plan is not None:
                tp_plan(model, mesh["tp"])
            if ddp:
                from torch.nn.parallel import DistributedDataParallel

                model = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
                model.register_comm_hook(mesh.get_group("dp"), _ddp_hook(dist))
            elif layout.dp > 1:
                from torch._subclasses.fake_tensor import unset_fake_temporarily
                from torch.distributed.fsdp import fully_shard

                # FSDP over tp-sharded DTensors concatenates device meshes, whose coordinate
                # tensors must be real (under FakeTensorMode: "DynamicOutputShapeException:
                # aten.nonzero"); fake parameters stay fake outside the mode
                with unset_fake_temporarily():
                    for unit in fsdp_units(model):
                        fully_shard(unit, mesh=mesh["dp"])
                    fully_shard(model, mesh=mesh["dp"])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            rec = _recorder(groups)
            # a vocabulary-parallel head's logits are sharded DTensors: cross-entropy on them
            # (forward and backward) needs DTensor's loss_parallel; plain logits ignore it
            vocab_parallel_loss = contextlib.nullcontext
            if layout.tp > 1:
                from torch.distributed.tensor.parallel import loss_parallel as vocab_parallel_loss
            with rec:
                for step in range(warmup_steps + 1):
                    record = step == warmup_steps
                    for micro in range(layout.microbatches):
                        last = micro == layout.microbatches - 1
                        sync = model.no_sync() if ddp and not last else contextlib.nullcontext()
                        with sync, vocab_parallel_loss():
                            rec.phase = "forward" if record else None
                            loss = loss_fn(model)
                            rec.phase = "backward" if record else None
                            loss.backward()
                    rec.phase = "optimizer" if record else None
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    rec.phase = None
    return rec.calls


def summarize(calls: list[TracedCollective]) -> dict[tuple[str, str, str], dict[str, int]]:
    """(group, op, phase) -> {"calls", "bytes"} totals."""
    out: dict[tuple[str, str, str], dict[str, int]] = {}
    for c in calls:
        row = out.setdefault((c.group, c.op, c.phase), {"calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += c.bytes
    return out
