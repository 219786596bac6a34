"""Multi-GPU step harness: the step sweep under torchrun, one ``steps`` row per rank.

``python -m data_collection.steps launcher=torchrun nproc=8 parallel.dp=8 parallel.sharding=fsdp``

``launcher=torchrun`` spawns ``nproc`` ranks on this node through ``torch.distributed.run``'s
library API (:func:`torch.distributed.launcher.api.elastic_launch`, what the ``torchrun``
command runs: rendezvous, environment, failure propagation); a script already started by
``torchrun`` (``LOCAL_RANK`` set) runs its rank directly. Each rank builds the model of every
configuration, wraps it for the layout and measures it with the single-GPU harness's step
(:func:`data_collection.step_runner.measure_step`); rank 0 gathers the rows and writes one per rank.

Layouts (the keys of ``boom_ml.predict``'s ``parallel.*``; dp * tp * pp = world size):

* ``sharding=none``: DistributedDataParallel (25 MiB gradient buckets, PyTorch's default);
* ``zero1``: DDP plus ``torch.distributed.optim.ZeroRedundancyOptimizer`` (optimizer state
  sharded over the data-parallel ranks);
* ``zero2``: FSDP2 ``fully_shard(reshard_after_forward=False)`` per block and at the root
  (parameters stay gathered between forward and backward, as in ZeRO-2 / SHARD_GRAD_OP);
* ``zero3`` / ``fsdp``: FSDP2 ``fully_shard`` with resharding after forward (ZeRO-3);
* ``microbatches``: gradient accumulation, gradient sync on the last micro-batch only;
* tp > 1: the HF config's own ``base_model_tp_plan`` through
  ``torch.distributed.tensor.parallel`` (column/row-parallel decoder linears), on a
  (dp, tp) device mesh, tp innermost; with dp > 1 only under FSDP2 (DDP cannot synchronise
  DTensors);
* pp > 1: ``torch.distributed.pipelining`` stages of an HF decoder (Llama-like), scheduled
  by ``schedule`` (1f1b | gpipe | interleaved, ``virtual_stages`` per rank), ``microbatches``
  pipeline micro-batches; alone or with dp (DDP, ZeRO-1 or FSDP2 per stage), not with tp
  (:mod:`data_collection.pipeline_steps`). Rows carry the rank's pipeline ``stage``, and the
  last stage's notes its last micro-batch loss.

The backend is NCCL on CUDA and gloo on the CPU (a ``device=cpu dry_run=true`` run tests the
whole path in CI; every sharding mode runs on gloo with torch 2.14). Rows: ``num_gpus``
= world size, ``rank``, ``stage``, the layout columns, ``global_batch_size`` = batch_size x
microbatches x dp, the rank's own step time and peak memory. Each rank's row has its own
shard key, so a resumed sweep skips a configuration only when every rank's row is on disk. An out-of-memory
is a row like in the single-GPU harness; ranks of one data-parallel layout run the same
shapes and normally fail together, and a process-group timeout ends a sweep whose ranks
disagree instead of leaving it hanging. Pipeline stages hold different layers, so one stage
can run out of memory alone: the others then wait in their sends and receives until that
timeout (10 minutes) ends the sweep, and a resumed sweep meets that configuration again (no
row was written): leave out pipeline batch sizes that do not fit.
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import functools
import inspect
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from boom_ml.errors import InvalidInputError
from boom_ml.trace.optimizers import make_optimizer
from data_collection import environment as env
from data_collection import pipeline_steps as pipeline
from data_collection.shards import ShardWriter, config_key, my_share
from data_collection.step_runner import StepRunner, expand, measure_step, step_key, sweep_settings

log = logging.getLogger(__name__)

SHARDING = ("none", "zero1", "zero2", "zero3", "fsdp")
LAYOUT_DEFAULTS: dict[str, Any] = {"dp": 1, "tp": 1, "pp": 1, "sharding": "none",
                                   "microbatches": 1, "schedule": "1f1b",
                                   "virtual_stages": 1}  # fmt: skip
TIMEOUT = datetime.timedelta(minutes=10)  # a rank stuck in a collective fails the sweep


class LayoutError(InvalidInputError, ValueError):
    """A layout the harness cannot run (one line, raised before any process starts)."""


def layouts(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The layouts of ``cfg["parallel"]`` (``sharding`` may list several modes to sweep)."""
    par = {**LAYOUT_DEFAULTS, **dict(cfg.get("parallel") or {})}
    unknown = sorted(set(par) - set(LAYOUT_DEFAULTS))
    if unknown:
        raise LayoutError(f"unknown parallel key(s) {unknown}; known: {list(LAYOUT_DEFAULTS)}")
    modes = par["sharding"] if isinstance(par["sharding"], (list, tuple)) else [par["sharding"]]
    world = int(cfg.get("nproc", 1)) * int(cfg.get("nnodes", 1))
    out = []
    for mode in modes:
        lay = {**par, "sharding": str(mode), "schedule": str(par["schedule"])}
        for k in ("dp", "tp", "pp", "microbatches", "virtual_stages"):
            lay[k] = int(lay[k])
            if lay[k] < 1:
                raise LayoutError(f"parallel.{k} must be >= 1, got {lay[k]}")
        if lay["sharding"] not in SHARDING:
            raise LayoutError(f"parallel.sharding={mode!r}: choose one of {', '.join(SHARDING)}")
        try:
            pipeline.check_layout(lay)
        except ValueError as err:
            raise LayoutError(str(err)) from None
        if lay["tp"] > 1 and lay["dp"] == 1 and lay["sharding"] != "none":
            raise LayoutError(
                f"parallel.sharding={mode!r} shards over data-parallel ranks; with "
                "parallel.dp=1 and parallel.tp>1 use parallel.sharding=none"
            )
        if lay["tp"] > 1 and lay["dp"] > 1 and lay["sharding"] in ("none", "zero1"):
            raise LayoutError(
                f"parallel.tp>1 with parallel.dp>1 needs FSDP2 (parallel.sharding=zero2, zero3 "
                f"or fsdp): DDP cannot synchronise tensor-parallel DTensors (got {mode!r})"
            )
        if lay["dp"] * lay["tp"] * lay["pp"] != world:
            raise LayoutError(
                f"parallel.dp*tp*pp = {lay['dp'] * lay['tp'] * lay['pp']} but nproc*nnodes = "
                f"{world} ranks: they must be equal"
            )
        out.append(lay)
    return out


def run_distributed_sweep(cfg: Mapping[str, Any]) -> str:
    """Spawn ``nproc`` ranks (or be one, under ``torchrun``); returns the shard root."""
    lays = layouts(cfg)  # fail in one line before anything starts
    piped = [lay for lay in lays if lay["pp"] > 1]
    if piped:  # meta builds: a model the pipeline cannot cut fails here, not in every rank
        models = [(c["model"], c["options"]) for _, c in expand(cfg, "check", on_cuda=False)]
        lay = piped[0]  # the sweep's layouts differ in sharding only
        try:
            pipeline.check_models(models, lay["pp"] * lay["virtual_stages"],
                                  equal=lay["schedule"] == "interleaved")  # fmt: skip
        except ValueError as err:
            raise LayoutError(str(err)) from None
    if "LOCAL_RANK" in os.environ:  # started by the torchrun command: this is one rank
        return rank_main(dict(cfg))
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc = int(cfg.get("nproc", 1))
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"boom-steps-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # torchrun --standalone's choice
        max_restarts=0, start_method="spawn",
    )  # fmt: skip
    results = elastic_launch(launch, rank_main)(dict(cfg))
    return str(results[0])


def _device(cfg: Mapping[str, Any]) -> torch.device:
    if str(cfg.get("device", "cuda")).startswith("cuda"):
        return env.resolve_device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    return env.resolve_device("cpu")


@record  # a failing rank's traceback reaches the launcher's error summary
def rank_main(cfg: dict[str, Any]) -> str:
    """One rank: join the process group, measure every configuration, rank 0 writes."""
    dev = _device(cfg)
    backend = str(cfg.get("backend", "auto"))
    backend = ("nccl" if dev.type == "cuda" else "gloo") if backend == "auto" else backend
    dist.init_process_group(backend, timeout=TIMEOUT,
                            device_id=dev if dev.type == "cuda" else None)  # fmt: skip
    try:
        with env.cpu_threads(dev, cfg.get("cpu_threads")):
            return _sweep(cfg, dev)
    finally:
        dist.destroy_process_group()


def rank_key(key: str, rank: int, world: int) -> str:
    return config_key({"config": key, "rank": rank, "world": world})


def _sweep(cfg: dict[str, Any], dev: torch.device) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    info = env.device_info(dev)
    torch.manual_seed(int(cfg.get("seed", 0)))
    warmup, iterations, shards, index = sweep_settings(cfg)
    configs = []
    for lay in layouts(cfg):
        for _, config in expand(cfg, info.gpu_id, info.is_cuda):
            config = {**config, "parallel": lay, "profile": False}  # no op profiles per rank
            # without a pipeline the schedule keys stay out: keys of older sweeps still match
            keyed = lay if lay["pp"] > 1 else {
                k: v for k, v in lay.items() if k not in pipeline.PIPELINE_KEYS}  # fmt: skip
            key = step_key({**config, "parallel": keyed})
            if my_share(key, shards, index):
                configs.append((key, config))
    root = str(cfg["out"])
    writer, todo = None, []
    if rank == 0:
        writer = ShardWriter(root, "steps", env.job_id(f"s{index}of{shards}-w{world}"), None)
        todo = [(k, c) for k, c in configs
                if not all(writer.is_done(rank_key(k, r, world)) for r in range(world))]  # fmt: skip
    box = [todo if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # every rank runs the same configurations
    todo = box[0]
    base = {"source": cfg["source"], **info.columns(), **env.software_versions()}
    nvml = env.NvmlMemory(dev)
    flush_every, measured = int(cfg.get("flush_every", 10)), 0
    for key, config in todo:
        report: dict[str, Any] = {}  # a pipeline rank's stage, and the last stage's last loss
        runner = (functools.partial(pipeline.PipelineStepRunner, report=report)
                  if config["parallel"]["pp"] > 1 else DistributedStepRunner)  # fmt: skip
        rows = measure_step(config, key, dev, base, nvml, warmup, iterations,
                            runner=runner).get("steps", [])  # fmt: skip
        row = _rank_row(rows[0], config["parallel"], rank, world, report) if rows else None
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(row, gathered if rank == 0 else None, dst=0)
        if writer is not None and all(r is not None for r in gathered):
            for r in gathered:
                writer.add(rank_key(key, r["rank"], world), [r])
            measured += 1
            if writer.pending >= flush_every * world:
                writer.flush()
        elif writer is not None:
            log.warning("%s: a rank could not run it; no rows written", config["model"])
    if writer is not None:
        writer.flush()
        print(f"steps[torchrun x{world}]: {measured} measured, "
              f"{len(configs) - len(todo)} already done -> {root}")  # fmt: skip
    return root


def _rank_row(
    row: dict[str, Any], lay: dict[str, Any], rank: int, world: int, report: dict[str, Any]
) -> dict[str, Any]:
    notes = row["notes"]
    if "loss" in report:  # the pipeline's last stage: the loss it trained to, as a sanity check
        loss = f"last-stage loss {float(report['loss']):.6g}"
        notes = f"{notes}; {loss}" if notes else loss
    return {
        **row,
        **{k: lay[k] for k in LAYOUT_DEFAULTS},
        "rank": rank,
        "stage": report.get("stage", 0),  # the pipeline rank; 0 without a pipeline
        "num_gpus": world,
        "global_batch_size": row["batch_size"] * lay["microbatches"] * lay["dp"],
        "notes": notes,
    }


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (entries of every ModuleList): FSDP2's units, as torchtitan wraps."""
    return [m for lst in module.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]


def tensor_parallel(module: torch.nn.Module, mesh: Any) -> None:
    """Shard ``module``'s decoder linears over ``mesh`` with its HF config's own TP plan.

    transformers ships ``base_model_tp_plan`` per architecture (Llama: q/k/v and gate/up
    column-parallel, o and down row-parallel); its ``colwise`` / ``rowwise`` entries map onto
    ``torch.distributed.tensor.parallel``'s ColwiseParallel / RowwiseParallel, local outputs
    (Megatron-style: attention runs on the rank's heads). Embedding and LM head stay
    replicated. A model without such a plan is one error naming it.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    base = getattr(module, "base_model", module)
    plan_spec = getattr(getattr(module, "config", None), "base_model_tp_plan", None) or {}
    unknown = sorted({v for v in plan_spec.values() if v not in styles})
    if not plan_spec or unknown:
        raise ValueError(
            f"parallel.tp>1 needs an HF model whose config has a base_model_tp_plan of "
            f"colwise/rowwise entries; {type(module).__name__} has "
            f"{'none' if not plan_spec else 'unsupported styles ' + ', '.join(unknown)}"
        )
    plan = {
        name: styles[style]()
        for name, _ in base.named_modules()
        for pattern, style in plan_spec.items()
        if fnmatch.fnmatchcase(name, pattern.replace("*", "[0-9]*"))
    }
    parallelize_module(base, mesh, plan)


class DistributedStepRunner(StepRunner):
    """The single-GPU step, wrapped for a data-parallel layout, with gradient accumulation."""

    def __init__(self, config: Mapping[str, Any], dev: torch.device) -> None:
        super().__init__(config, dev)  # builds, checkpoints, casts: the unwrapped module
        lay = config["parallel"]
        self.microbatches = int(lay["microbatches"])
        inner, sharding, dp, tp = self.module, lay["sharding"], int(lay["dp"]), int(lay["tp"])
        from torch.distributed.device_mesh import init_device_mesh

        # ranks tp-innermost (Megatron's order, as boom_ml.parallel assumes)
        mesh = init_device_mesh(dev.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        if tp > 1:
            tensor_parallel(inner, mesh["tp"])
        self.fsdp = sharding in ("zero2", "zero3", "fsdp") and (dp > 1 or tp == 1)
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            reshard = sharding != "zero2"  # ZeRO-2 keeps parameters gathered until backward
            for block in _blocks(inner):
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
            self.module = fully_shard(inner, mesh=mesh["dp"], reshard_after_forward=reshard)
        elif tp == 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [dev.index] if dev.type == "cuda" else None
            self.module = DistributedDataParallel(inner, device_ids=ids)
        # else: tensor parallel alone (dp = 1): no data-parallel wrapper to add
        # The optimizer holds the parameters as wrapped (FSDP2 turns them into DTensors).
        if self.optimizer is not None:
            params: list[Any] = list(self.module.parameters())
            if tp > 1 and not self.fsdp:
                # foreach kernels cannot mix DTensors (sharded linears) with the replicated
                # plain tensors (embedding, norms, head): one param group of each
                from torch.distributed.tensor import DTensor

                split = [[p for p in params if isinstance(p, DTensor) == d] for d in (True, False)]
                params = [{"params": group} for group in split if group]
            self.optimizer = make_optimizer(config["optimizer"], params)
            if sharding == "zero1":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                # the same class and settings; defaults may hold derived keys the
                # constructor does not take (AdamW's decoupled_weight_decay)
                cls = type(self.optimizer)
                takes = inspect.signature(cls.__init__).parameters
                kwargs = {k: v for k, v in self.optimizer.defaults.items() if k in takes}
                self.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP: gradient sync on the last micro-batch only (``no_sync``). FSDP2 (ZeRO-2/3)
        reduce-scatters every micro-batch's gradients and adds them into the rank's shards
        (its default), as ``boom_ml.parallel`` predicts it: skipping the sync would keep
        whole unsharded gradients between micro-batches."""
        if self.fsdp:
            return contextlib.nullcontext()
        no_sync = getattr(self.module, "no_sync", None)  # DDP; tensor parallel alone has none
        return contextlib.nullcontext() if last or no_sync is None else no_sync()

    def __call__(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.module.zero_grad(set_to_none=True)
        autocast_dtype = self.amp_dtype
        for i in range(self.microbatches):
            batch = self.built.make_inputs(self.step, self.dev)
            with self._sync(i == self.microbatches - 1):
                autocast = (torch.autocast(self.dev.type, dtype=autocast_dtype)
                            if autocast_dtype else contextlib.nullcontext())  # fmt: skip
                with autocast:
                    outputs = self.module(**self.built.forward_kwargs(batch))
                    loss = self.built.compute_loss(outputs, batch) / self.microbatches
                del outputs
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            del loss, batch
        pipeline.optimizer_step(self.optimizer, self.scaler)
