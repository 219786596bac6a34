"""Kernel harness: time single ops in isolation over shapes, dtypes and directions.

``python -m data_collection.kernels`` (Hydra; config ``configs/collect/kernels.yaml``)::

    python -m data_collection.kernels device=cpu dry_run=true out=/tmp/shards   # CI-sized
    python -m data_collection.kernels out=/shared/shards                        # a GPU
    python -m data_collection.kernels -m num_shards=2 shard_index=0,1 hydra/launcher=submitit_slurm

A configuration is one op, one dtype (float32, tf32, float16, bfloat16), one direction
(forward, or backward through ``torch.autograd.grad`` on the forward's graph) and one
shape. On CUDA it is timed with CUDA events after a warm-up, as the median of N repeats,
optionally flushing the L2 cache before each repeat so small ops are timed from DRAM as
they run inside a real step; the kernel names come from one extra profiled call. On the
CPU (``device=cpu``) ``time.perf_counter`` times the same calls, and rows say
``device_kind="cpu"``: they test the pipeline and are never GPU training data.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from boom_ml.errors import InvalidInputError
from boom_ml.specs import check_bool
from data_collection import environment as env
from data_collection import schema
from data_collection.kernel_ops import DTYPES, REGISTRY, OpDef, Run
from data_collection.shards import (
    ShardWriter,
    SweepStats,
    config_key,
    hydra_entry,
    my_share,
    run_configs,
)

log = logging.getLogger(__name__)


def expand(cfg: Mapping[str, Any], gpu_id: str, on_cuda: bool) -> list[tuple[str, dict[str, Any]]]:
    """Every (key, config) of the sweep, in config order, without duplicates.

    A group is ``{ops, shapes, dtypes?, directions?}``; combinations an op cannot run
    (tf32 on a non-matmul op or a CPU, which would repeat its fp32 row; backward of a
    cast; flash attention in fp32 on CUDA) are dropped here rather than failing later.
    """
    cap = int(cfg.get("dry_run_cap", 16)) if dry_run(cfg) else None
    only = set(cfg.get("only_ops") or [])
    seen: dict[str, dict[str, Any]] = {}
    for group in cfg["groups"]:
        dtypes = list(group.get("dtypes") or cfg["dtypes"])
        directions = list(group.get("directions") or cfg["directions"])
        for op in group["ops"]:
            opdef = REGISTRY[op]  # KeyError names an unknown op in the config
            if only and op not in only:
                continue
            for shape in group["shapes"]:
                params = _params(op, opdef.params, opdef.numel_params, shape, cap)
                for dtype in dtypes:
                    if dtype == "tf32" and not (opdef.tf32 and on_cuda):
                        continue  # TF32 is a tensor-core mode: on a CPU it would be fp32
                    if opdef.half_only_cuda and on_cuda and dtype in ("float32", "tf32"):
                        continue
                    for direction in directions:
                        if direction == "backward" and not opdef.backward:
                            continue
                        # fmt: off
                        config = {"op": op, "dtype": dtype, "direction": direction,
                                  "params": params, "gpu_id": gpu_id,
                                  "l2_flush": bool(cfg.get("l2_flush")) and on_cuda}
                        # fmt: on
                        seen.setdefault(config_key(config), config)
    return list(seen.items())


# A dry run's grouped convolution: at most this many groups of at most this many channels, so
# that a depthwise shape stays depthwise and ResNeXt's 32 groups stay grouped at tiny sizes.
DRY_GROUPS = 4


def _params(
    op: str, names: tuple[str, ...], numel: tuple[str, ...], shape: Any, cap: int | None
) -> dict[str, int]:
    """One shape of ``op`` as its named params, checked; in a dry run (``cap``) cut to tiny
    sizes (``numel`` params to cap**2, a grouped convolution's structure kept)."""
    if len(shape) != len(names):
        raise InvalidInputError(f"{op}: shape {list(shape)} needs {names}")
    params = {n: int(v) for n, v in zip(names, shape, strict=True)}
    groups = params.get("groups", 1)
    if (
        groups < 1
        or params.get("in_channels", 0) % groups
        or params.get("out_channels", 0) % groups
    ):
        raise InvalidInputError(f"{op}: shape {list(shape)}: groups must divide in_channels "
                                "and out_channels")  # fmt: skip
    if cap is None:
        return params
    tiny = {n: min(v, cap**2 if n in numel else cap) for n, v in params.items()}
    if "groups" in params:
        g = min(groups, DRY_GROUPS)
        tiny.update(groups=g, in_channels=g * min(params["in_channels"] // groups, DRY_GROUPS),
                    out_channels=g * min(params["out_channels"] // groups, DRY_GROUPS))  # fmt: skip
    return tiny


class Timer:
    """Times a callable: CUDA events (median of N after warm-up) or perf_counter on CPU."""

    def __init__(self, dev: torch.device, warmup: int, repeats: int, l2_flush: bool) -> None:
        self.dev, self.warmup, self.repeats = dev, warmup, repeats
        self.flush_buf: torch.Tensor | None = None
        if l2_flush and dev.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 << 20
            # Writing twice the L2 evicts every line the previous repeat left behind.
            self.flush_buf = torch.empty(2 * l2 // 4, dtype=torch.float32, device=dev)

    def __call__(self, fn: Run) -> list[float]:
        for _ in range(self.warmup):
            fn()
        if self.dev.type != "cuda":
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return times
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.repeats)
        ]
        torch.cuda.synchronize(self.dev)
        for start, end in events:
            if self.flush_buf is not None:
                self.flush_buf.zero_()  # outside the timed region
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.dev)
        return [s.elapsed_time(e) for s, e in events]


def kernel_names(fn: Run, dev: torch.device, limit: int = 2000) -> str | None:
    """Distinct CUDA kernel names one call of ``fn`` launches, in launch order.

    A profiler failure costs the names, never the row: the timing was already taken.
    """
    if dev.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(dev)
        events = sorted(prof.events(), key=lambda e: e.time_range.start)
    except Exception as err:  # noqa: BLE001
        log.warning("kernel names unavailable: %s", err)
        return None
    names: dict[str, None] = {}
    for evt in events:  # kernels hang off the op that launched them, or stand alone
        for k in getattr(evt, "kernels", []):
            names.setdefault(k.name, None)
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            names.setdefault(evt.name, None)
    return ";".join(names)[:limit] or None


def spread(times: list[float]) -> float:
    """Interquartile range: robust to the odd slow repeat, like the median it goes with."""
    if len(times) < 4:
        return max(times) - min(times)
    q = statistics.quantiles(times, n=4)
    return q[2] - q[0]


def measure_kernel(
    config: dict[str, Any],
    dev: torch.device,
    timer: Timer,
    base: dict[str, Any],
    profile_kernels: bool,
) -> dict[str, list[dict[str, Any]]]:
    """One row for one configuration, or ``{}`` when it cannot run on this device."""
    op, params, dtype = config["op"], config["params"], config["dtype"]
    opdef = REGISTRY[op]
    env.set_tf32(dtype == "tf32")
    try:
        times, names = _time_case(opdef, config, dev, timer, profile_kernels)
    except (torch.cuda.OutOfMemoryError, RuntimeError, NotImplementedError) as err:
        # Unsupported here (a dtype without a kernel, too big): no row — nothing was measured.
        log.warning("skip %s %s %s %s: %s", op, dtype, config["direction"], params, str(err)[:200])
        return {}
    finally:
        if dev.type == "cuda":  # the case's tensors died with _time_case's frame
            torch.cuda.empty_cache()
    row: dict[str, Any] = {c: None for c in schema.columns("kernels")}
    row.update(base)
    row.update(
        op=opdef.row_op or op,
        family=opdef.family,
        dtype=dtype,
        direction=config["direction"],
        **opdef.columns(params),
        latency_ms=max(statistics.median(times), 1e-6),
        latency_stat="median",
        latency_spread_ms=spread(times),
        latency_spread_stat="iqr",
        n_repeats=len(times),
        kernel_names=names,
        # Params with no schema column (causal, num_embeddings) and how it was timed.
        context=json.dumps({"params": params, "l2_flush": config["l2_flush"]}, sort_keys=True),
    )
    return {"kernels": [row]}


def _time_case(
    opdef: OpDef, config: dict[str, Any], dev: torch.device, timer: Timer, profile: bool
) -> tuple[list[float], str | None]:
    """Build the op's inputs, time forward or backward, and name its kernels."""
    case = opdef.build(config["params"], DTYPES[config["dtype"]], dev)
    if config["direction"] == "forward":

        def fn() -> Any:
            with torch.no_grad():  # the kernels of a training forward, without the graph
                return case.run()
    else:
        out = case.run()
        outs = out if isinstance(out, tuple) else (out,)
        grads = tuple(torch.randn_like(o) for o in outs)

        def fn() -> Any:
            # retain_graph: every repeat runs the same backward kernels on the same graph.
            return torch.autograd.grad(outs, case.leaves, grads, retain_graph=True)

    times = timer(fn)
    return times, kernel_names(fn, dev) if profile else None


def dry_run(cfg: Mapping[str, Any]) -> bool:
    """``dry_run``: true or false (any other word had counted as true: ``dry_run=no``)."""
    value = cfg.get("dry_run")
    value = False if value is None else value
    check_bool("dry_run", value)
    return value


def run_kernel_sweep(cfg: Mapping[str, Any]) -> str:
    """Run the kernel sweep ``cfg`` (see configs/collect/kernels.yaml); returns the shard root."""
    dev = env.resolve_device(str(cfg.get("device", "cuda")))
    info = env.device_info(dev)
    torch.manual_seed(int(cfg.get("seed", 0)))
    dry = dry_run(cfg)
    warmup = min(int(cfg["warmup"]), 1) if dry else int(cfg["warmup"])
    repeats = min(int(cfg["repeats"]), 3) if dry else int(cfg["repeats"])
    configs = [
        (k, c)
        for k, c in expand(cfg, info.gpu_id, info.is_cuda)
        if my_share(k, int(cfg.get("num_shards", 1)), int(cfg.get("shard_index", 0)))
    ]
    base = {"source": cfg["source"], "split": "", **info.columns(), **env.software_versions()}
    timer = Timer(dev, warmup, repeats, bool(cfg.get("l2_flush")))
    root = str(cfg["out"])
    job = env.job_id(f"s{cfg.get('shard_index', 0)}of{cfg.get('num_shards', 1)}")
    writer = ShardWriter(root, "kernels", job, flush_every=None)
    budget = cfg.get("time_budget_min")
    with env.cpu_threads(dev, cfg.get("cpu_threads")):
        stats: SweepStats = run_configs(
            configs,
            {"kernels": writer},
            "kernels",
            lambda c: measure_kernel(c, dev, timer, base, bool(cfg.get("profile_kernels", True))),
            flush_every=int(cfg.get("flush_every", 50)),
            time_budget_s=float(budget) * 60 if budget is not None else None,
            fail_after=cfg.get("fail_after"),
            desc=f"kernels[{info.gpu_id}]",
        )
    log.info("kernels: %s", stats)
    print(
        f"kernels: {stats.measured} measured, {stats.already_done} already done, "
        f"{stats.skipped} skipped, budget stop={stats.stopped_by_budget} -> {root}"
    )
    return root


def hydra_task(cfg: Any) -> None:
    """The Hydra task: resolve the config to plain containers and run the sweep (a shape the
    config gets wrong is one line, exit 2)."""
    from omegaconf import OmegaConf

    from boom_ml.config_help import one_line_errors

    with one_line_errors():
        run_kernel_sweep(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]


def _hydra_main() -> None:
    hydra_entry("collect/kernels", hydra_task)


if __name__ == "__main__":
    # Re-import under the package name: submitit pickles the task by reference to
    # data_collection.kernels; a function of ``__main__`` would be pickled by value, torch and all.
    from data_collection.kernels import _hydra_main as main

    main()
