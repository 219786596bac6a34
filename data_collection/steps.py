"""Step harness: whole training steps of zoo models, timed and measured for memory.

``python -m data_collection.steps`` (Hydra; config ``configs/collect/steps.yaml``)::

    python -m data_collection.steps device=cpu dry_run=true out=/tmp/shards   # CI-sized
    python -m data_collection.steps out=/shared/shards                        # a GPU

A configuration is model x batch size x AMP x checkpointing x optimizer (x TF32). The step
is the one the tracer (:func:`boom_ml.trace.step.trace_step`) models: zero_grad, make the
batch, forward and loss under autocast, (scaled) backward, optimizer step. After warm-up
steps, the peak-memory counters are reset so ``peak_allocated_bytes`` is the steady-state
peak the tracer predicts; ``peak_reserved_bytes`` is what the caching allocator holds by
then, and ``peak_nvml_bytes`` what the driver sees (context and workspaces included).
An out-of-memory is a data point (``oom=True``), not a crash.

For configurations chosen by ``profile_ops`` one more step runs under ``torch.profiler``
and its aten ops are mapped onto the traced OpGraph's nodes (``op_profiles`` rows: kernel
names and device time per node; CPU time in a ``device=cpu`` dry run; see
``data_collection/op_profiles.py``). A dry run is a handful of configurations on toy sizes
that still runs every code path (see :func:`expand`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from boom_ml.errors import InvalidInputError
from data_collection import environment as env
from data_collection.shards import ShardWriter, hydra_entry, my_share, run_configs
from data_collection.step_runner import expand, measure_step, step_key, sweep_settings

log = logging.getLogger(__name__)


def run_step_sweep(cfg: Mapping[str, Any]) -> str:
    """Run the step sweep ``cfg`` (see configs/collect/steps.yaml); returns the shard root.

    ``launcher=torchrun`` runs it on ``nproc`` ranks with the ``parallel.*`` layout
    (:mod:`data_collection.distributed_steps`).
    """
    launcher = str(cfg.get("launcher", "none"))
    if launcher not in ("none", "torchrun"):  # a misspelt one ran one process, ignoring parallel.*
        raise InvalidInputError(f"launcher={launcher}: none or torchrun")
    if launcher == "torchrun":
        from data_collection.distributed_steps import run_distributed_sweep

        return run_distributed_sweep(cfg)
    dev = env.resolve_device(str(cfg.get("device", "cuda")))
    info = env.device_info(dev)
    torch.manual_seed(int(cfg.get("seed", 0)))
    warmup, iterations, shards, index = sweep_settings(cfg)
    configs = [
        (k, c) for k, c in expand(cfg, info.gpu_id, info.is_cuda) if my_share(k, shards, index)
    ]
    base = {"source": cfg["source"], **info.columns(), **env.software_versions()}
    nvml = env.NvmlMemory(dev)
    root, job = str(cfg["out"]), env.job_id(f"s{index}of{shards}")
    writers = {
        kind: ShardWriter(root, kind, job, flush_every=None) for kind in ("steps", "op_profiles")
    }
    budget = cfg.get("time_budget_min")
    with env.cpu_threads(dev, cfg.get("cpu_threads")):
        stats = run_configs(
            configs, writers, "steps",
            lambda c: measure_step(c, step_key(c), dev, base, nvml, warmup, iterations),
            flush_every=int(cfg.get("flush_every", 10)),
            time_budget_s=float(budget) * 60 if budget is not None else None,
            fail_after=cfg.get("fail_after"), desc=f"steps[{info.gpu_id}]",
        )  # fmt: skip
    log.info("steps: %s", stats)
    print(f"steps: {stats.measured} measured, {stats.already_done} already done, "
          f"{stats.skipped} skipped, budget stop={stats.stopped_by_budget} -> {root}")  # fmt: skip
    return root


def hydra_task(cfg: Any) -> None:
    """The Hydra task: resolve the config to plain containers and run the sweep."""
    from omegaconf import OmegaConf

    from boom_ml.config_help import one_line_errors

    with one_line_errors():  # a bad layout or launcher: one line, exit 2, before any process
        run_step_sweep(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]


def _hydra_main() -> None:
    hydra_entry("collect/steps", hydra_task)


if __name__ == "__main__":
    # Re-import under the package name: submitit pickles the task by reference to
    # data_collection.steps; a function of ``__main__`` would be pickled by value, torch and all.
    from data_collection.steps import _hydra_main as main

    main()
