"""Run the prepared GPU sweep (kernels, then steps) end to end, without Hydra.

    python data_collection/sweeps/run_gpu_sweep.py OUTDIR [--budget-min 7.5] [--device cuda]
        [--sweep steps=h200_neusight_steps.yaml --sweep kernels=h200_kernels.yaml ...]

The GPU machine's image has torch, pyarrow, pandas, tqdm, fsspec, PyYAML and nvidia-ml-py
but no hydra-core, so the sweep YAMLs are read with PyYAML: a ``defaults`` list names base
configs under ``configs/`` (merged first, this file's keys on top; lists replace), and
``${...}`` interpolations are not needed because ``out`` comes from the command line.
The sweeps (``--sweep KIND=FILE``, in priority order; by default the kernel sweep, then
the step sweep) run in one process (one torch import, one CUDA context) under one overall
time budget: each keeps its own ``time_budget_min``, capped by what is left minus a margin
for the configuration that is running when the budget ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge dicts like OmegaConf does for a defaults list (lists are replaced)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: Path) -> dict[str, Any]:
    """A sweep YAML with its ``defaults`` (``collect/steps``, ``_self_``) resolved."""
    doc = yaml.safe_load(path.read_text()) or {}
    result: dict[str, Any] = {}
    for item in doc.pop("defaults", []) or []:
        if item == "_self_":
            continue
        name = str(item).split("@")[0].lstrip("/")
        result = merge(result, load_config(REPO / "configs" / f"{name}.yaml"))
    result = merge(result, doc)
    result.pop("hydra", None)  # Hydra's own settings (run dirs) mean nothing here
    return result


DEFAULT_PLAN = ("kernels=h200_kernels.yaml", "steps=h200_steps.yaml")


def parse_plan(items: list[str]) -> list[tuple[str, Path]]:
    """``KIND=FILE`` entries (KIND kernels or steps; FILE relative to this folder or not)."""
    plan = []
    for item in items:
        kind, sep, name = item.partition("=")
        if not sep or kind not in ("kernels", "steps"):
            raise SystemExit(f"--sweep {item!r}: expected kernels=FILE or steps=FILE")
        path = Path(name) if Path(name).is_file() else HERE / name
        if not path.is_file():
            raise SystemExit(f"--sweep {item!r}: no file {name} (here or in {HERE})")
        plan.append((kind, path))
    return plan


def missing_inputs(plan: list[tuple[str, Path]]) -> list[str]:
    """Model files a step sweep names under the repository (``hf:.sweep_inputs/...``) that
    are not there: they travel only when carried, and a sweep without them would skip
    every configuration and still end well."""
    missing = []
    for kind, path in plan:
        if kind != "steps":
            continue
        for model in load_config(path).get("models") or []:
            name = str(model.get("name", "")) if isinstance(model, dict) else str(model)
            local = name.removeprefix("hf:")
            if name.startswith("hf:.") and not (REPO / local).is_file():
                missing.append(f"{path.name}: {local}")
    return missing


def write_environment(outdir: str, record: dict[str, Any]) -> None:
    """``environment.json`` beside the shards (a local folder or an fsspec URL)."""
    import fsspec

    with fsspec.open(f"{outdir.rstrip('/')}/environment.json", "w") as fh:
        fh.write(json.dumps(record, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", help="folder (or fsspec URL) for the shards")
    parser.add_argument("--budget-min", type=float, default=7.5, help="whole run, minutes")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (with --device cpu)")
    parser.add_argument("--sweep", action="append", metavar="KIND=FILE",
                        help="a sweep to run, in priority order (repeatable); default: "
                        + " ".join(DEFAULT_PLAN))  # fmt: skip
    parser.add_argument("--margin-min", type=float, default=1.0,
                        help="left for the config running when the budget ends")  # fmt: skip
    args = parser.parse_args(argv)
    plan = parse_plan(args.sweep or list(DEFAULT_PLAN))
    missing = missing_inputs(plan)
    if missing:  # before the GPU's minutes are spent on a plan that would measure nothing
        raise SystemExit(
            f"missing sweep inputs ({len(missing)}), e.g. {missing[0]}: copy them here first"
            " (data_collection/sweeps/README.md: .sweep_inputs) and carry the folder"
        )

    from data_collection.environment import nvml_baseline, run_record

    nvml_baseline()  # device memory before this process touches CUDA (NvmlMemory's baseline)
    import torch

    from data_collection.kernels import run_kernel_sweep
    from data_collection.shards import read_shards
    from data_collection.steps import run_step_sweep

    runners = {"kernels": run_kernel_sweep, "steps": run_step_sweep}
    started = time.monotonic()
    common = {"out": args.outdir, "device": args.device, "dry_run": args.dry_run}
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, "
          f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")  # fmt: skip
    record = run_record(args.device)
    print("ENVIRONMENT " + json.dumps(record, default=str), flush=True)
    if "://" not in args.outdir:  # a local folder (an fsspec URL makes its own)
        Path(args.outdir).mkdir(parents=True, exist_ok=True)
    write_environment(args.outdir, record)
    failed = []
    # rows already in the folder (a resumed run): what this run measured is the difference
    before = sum(len(read_shards(args.outdir, kind)) for kind in ("kernels", "steps"))
    for kind, path in plan:
        cfg = merge(load_config(path), common)
        # Each sweep keeps its own budget, capped by what the whole run has left.
        left = args.budget_min - (time.monotonic() - started) / 60 - args.margin_min
        own = cfg.get("time_budget_min")
        cfg["time_budget_min"] = max(0.0, min(left, float(own)) if own is not None else left)
        print(f"{kind} sweep {path.name}: budget {cfg['time_budget_min']:.1f} min", flush=True)
        try:
            runners[kind](cfg)
        except Exception as err:  # noqa: BLE001 - one broken sweep must not cost the others
            print(f"{kind} sweep {path.name} failed: {type(err).__name__}: {err}", flush=True)
            failed.append(f"{kind}={path.name}")

    summary: dict[str, Any] = {
        kind: len(read_shards(args.outdir, kind)) for kind in ("kernels", "steps", "op_profiles")
    }
    summary["measured_now"] = summary["kernels"] + summary["steps"] - before
    steps_df = read_shards(args.outdir, "steps")
    if len(steps_df):
        cols = ["source", "model", "batch_size", "amp", "checkpointing", "tf32", "oom",
                "step_time_ms", "peak_allocated_bytes", "peak_reserved_bytes"]  # fmt: skip
        print(steps_df[cols].to_string(index=False))
    summary["minutes"] = round((time.monotonic() - started) / 60, 2)
    summary["failed"] = failed
    print("SUMMARY " + json.dumps(summary))
    # a run that measured nothing (a resumed one included), or lost a sweep, is not a
    # success: the lease reports this exit status
    return 1 if failed or summary["measured_now"] <= 0 else 0


if __name__ == "__main__":
    sys.exit(main())
