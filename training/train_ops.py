"""`python -m training.train_ops`: train the per-op time heads, cross-validate, log to MLflow.

    python -m training.train_ops                       # train, CV, log + register in MLflow
    python -m training.train_ops package=true          # ... and refresh boom_ml/artifacts/per_op
    python -m training.train_ops cv.enabled=false steps.evaluate=true   # whole-model labels
    python -m training.train_ops mlflow.tracking_uri=http://host:5000

Reads the canonical kernel Parquet (``python -m data_collection.import_public`` builds it).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from boom_ml.config_help import print_help_if_asked
from training.kernel_rows import CONFIG_DIR, load_training_data

REPO = Path(__file__).resolve().parent.parent
FOLDS = ("gpu", "newer")  # steps.fold: what a label GPU's fold holds out (held_out_for)


def _opts(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)


def _train_kw(model: dict[str, Any], **override: Any) -> dict[str, Any]:
    kw = {
        "params": dict(model.get("params") or {}),
        "n_estimators": model["n_estimators"],
        "quantile_estimators": model["quantile_estimators"],
        "gpu_features": model.get("gpu_features"),
        "n_jobs": model.get("n_jobs", 1),
    }
    for key, value in override.items():
        if key == "learning_rate":
            kw["params"]["learning_rate"] = value
        else:
            kw[key] = value
    return kw


def importances(model: Any) -> pd.DataFrame:
    """Gain importance per head and feature (normalised to sum 1 within a head)."""
    rows = []
    for name, head in model.heads.items():
        gain = head.models["p50"].feature_importance("gain")
        total = float(gain.sum()) or 1.0
        rows += [{"head": name, "feature": f, "gain": float(v) / total}
                 for f, v in zip(head.features, gain, strict=True)]  # fmt: skip
    return pd.DataFrame(rows).sort_values(["head", "gain"], ascending=[True, False])


def run(cfg: Any, log: Any = print) -> dict[str, Any]:
    """Plain function behind the CLI; returns the model, CV table and timings."""
    from boom_ml.gpus import get_gpu
    from boom_ml.timing.heads import fit_model
    from training import cv as cvmod

    o = _opts(cfg)
    if o["steps"].get("fold", "gpu") not in FOLDS:  # before anything trains
        from boom_ml.errors import InvalidInputError

        raise InvalidInputError(
            f"steps.fold={o['steps']['fold']!r}: expected one of {', '.join(FOLDS)}"
        )
    kernels = load_training_data(o["data"], log)
    specs = {g: get_gpu(g) for g in sorted(kernels["gpu_id"].unique())}
    log(f"{len(kernels)} kernel rows, {len(specs)} GPUs: {', '.join(specs)}")
    mo = o["model"]
    start = time.perf_counter()
    model = fit_model(kernels, specs, heads=mo.get("heads"), min_rows=mo["min_rows"], log=log,
                      seed=o["seed"], **_train_kw(mo))  # fmt: skip
    train_s = time.perf_counter() - start
    log(f"trained {len(model.heads)} heads in {train_s:.0f} s")
    result: dict[str, Any] = {"model": model, "train_seconds": train_s, "cv": None, "steps": None}
    c = o["cv"]
    if c["enabled"]:
        kw = _train_kw(mo, n_estimators=c["n_estimators"], learning_rate=c["learning_rate"],
                       quantile_estimators=c["quantile_estimators"])  # fmt: skip
        result["cv"] = cvmod.leave_one_gpu_out(
            kernels, specs, heads=c.get("heads") or mo.get("heads"), gpus=c.get("gpus"),
            min_rows=mo["min_rows"],
            max_train_rows=c["max_train_rows"], seed=o["seed"], log=log, **kw,
        )  # fmt: skip
        log(cvmod.format_tables(result["cv"]))
    s = o["steps"]
    if s["evaluate"]:
        result["steps"] = _evaluate_steps(kernels, specs, o, log)
        held = {"gpu": "each GPU", "newer": "each GPU and every GPU as new or newer"}
        log(f"whole-model step time, {held[s.get('fold', 'gpu')]} held out of training:")
        log(cvmod.step_summary(result["steps"]).to_string())
    model.meta.update(_meta(o, kernels, result))
    if o["mlflow"]["enabled"]:
        result["model_uri"] = _log_mlflow(o, model, result, log)
    if o["package"]:
        folder = package(model, o.get("package_dir"), result)
        log(f"packaged model in {folder}")
    return result


def _evaluate_steps(kernels: pd.DataFrame, specs: dict, o: dict, log: Any) -> pd.DataFrame:
    from boom_ml.gpus import get_gpu
    from data_collection.schema import load_steps
    from training.cv import evaluate_steps
    from training.fold_heads import FoldHeads, fold_settings
    from training.step_traces import SOURCE_ATTENTION
    from training.train_gemm import fold_line, score_fold

    s = o["steps"]
    steps = load_steps(o["data"].get("dir"), [s["source"]])
    labels = steps[(steps["phase_scope"] == "fwd+bwd") & (steps["num_gpus"] == 1)
                   & (steps["precision"] == "float32") & (steps["optimizer"] == "none")]  # fmt: skip
    # The same cached leave-one-GPU-out heads as train_gnn's CV folds.
    folds = FoldHeads(kernels, fold_settings(o), log=log)
    all_specs = {**specs, **{g: get_gpu(g) for g in labels["gpu_id"].unique()}}

    used: dict[str, Any] = {}

    def model_for(gpu_id: str) -> Any:
        held = held_out_for(gpu_id, s.get("fold", "gpu"), all_specs)
        log(f"steps: heads without {gpu_id} (fold {folds.key(held)})")
        used[gpu_id] = folds.without(held)
        return used[gpu_id]

    attention = SOURCE_ATTENTION.get(s["source"], "sdpa")  # NeuSight: eager (its SOURCE.md)
    steps = evaluate_steps(labels, model_for, all_specs, log, attention=attention)
    # The same folds' GEMM models on the label GPU's own fp32 bmm/linear kernels (per-op
    # MAPE %, the per-op target), where it has such rows.
    for gpu_id, model in used.items():
        line = fold_line(score_fold(kernels, gpu_id, getattr(model, "gemm", None)))
        if line:
            log(f"steps fold {gpu_id}: its fp32 kernels by the fold's GEMM model, MAPE %: {line}")
    return steps


def held_out_for(gpu_id: str, fold: str, specs: dict) -> list[str]:
    """The GPUs whose kernel rows a label GPU's fold leaves out: ``gpu``, the GPU itself;
    ``newer``, every GPU of its compute capability or newer (A100 labels then come from
    Pascal, Volta and Turing kernels only: what predicting a generation nobody measured is)."""
    if fold == "gpu":
        return [gpu_id]
    if fold != "newer":
        raise ValueError(f"steps.fold={fold!r}: expected one of {', '.join(FOLDS)}")
    floor = specs[gpu_id].sm_version
    return sorted(g for g, spec in specs.items() if spec.sm_version >= floor)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def rows_per_head_dtype(kernels: pd.DataFrame) -> dict[str, dict[str, dict[str, int]]]:
    """Training rows per head, dtype and GPU: which architectures each head measured in each
    dtype (``boom_ml/timing/basis.py`` names the half-precision kernels a step runs without)."""
    from boom_ml.timing.features import FAMILY_HEAD

    heads = kernels["family"].astype(str).map(FAMILY_HEAD).fillna("elementwise")
    counts = kernels.groupby([heads.rename("head"), kernels["dtype"].astype(str),
                              kernels["gpu_id"].astype(str)]).size()  # fmt: skip
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (head, dtype, gpu), n in counts.items():
        out.setdefault(str(head), {}).setdefault(str(dtype), {})[str(gpu)] = int(n)
    return out


def _meta(o: dict, kernels: pd.DataFrame, result: dict) -> dict[str, Any]:
    from training.cv import gemm_table, mape_table

    meta: dict[str, Any] = {
        "trained_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "data_sources": {str(k): int(v) for k, v in kernels["source"].value_counts().items()},
        "rows_per_gpu": {str(k): int(v) for k, v in kernels["gpu_id"].value_counts().items()},
        "rows_per_head_dtype": rows_per_head_dtype(kernels),
        "excluded_gpus": {k: " ".join(str(v).split()) for k, v in (o["data"].get("exclude_gpus") or {}).items()},
        "train_seconds_total": round(result["train_seconds"], 1),
    }  # fmt: skip
    if result["cv"] is not None:
        meta["cv_mape"] = json.loads(mape_table(result["cv"]).to_json(orient="index"))
        meta["cv_gemm_mape"] = json.loads(gemm_table(result["cv"]).to_json(orient="index"))
    return meta


def _log_mlflow(o: dict, model: Any, result: dict, log: Any) -> str:
    import mlflow

    from training import registry
    from training.cv import format_tables, step_summary

    m = o["mlflow"]
    exp = registry.setup(m.get("tracking_uri"), m["experiment"])
    with mlflow.start_run(experiment_id=exp, run_name=m.get("run_name")) as run:
        flat = pd.json_normalize({k: v for k, v in o.items() if k != "mlflow"}, sep=".")
        mlflow.log_params({k: str(v)[:500] for k, v in flat.iloc[0].items()})
        mlflow.log_metric("train_seconds", result["train_seconds"])
        mlflow.log_dict(model.meta, "meta.json")
        mlflow.log_text(importances(model).to_csv(index=False), "feature_importance.csv")
        if result["cv"] is not None:
            cv = result["cv"]
            mlflow.log_text(cv.to_csv(index=False), "cv/logo.csv")
            mlflow.log_text(format_tables(cv), "cv/tables.txt")
            for r in cv.itertuples(index=False):
                key = f"mape.{r.head}.{r.op if r.op != '*' else 'all'}.{r.gpu}"
                mlflow.log_metric(key.replace("*", "all"), r.mape)
        if result["steps"] is not None:
            mlflow.log_text(result["steps"].to_csv(index=False), "steps/labels.csv")
            for gpu, r in step_summary(result["steps"]).iterrows():
                mlflow.log_metric(f"step_mae_ms.{gpu}", r["mae_ms"])
        uri, registered = registry.log_model(model, m.get("registered_model"))
        log(f"mlflow run {run.info.run_id}: model {uri}, registered {registered} "
            f"(tracking {mlflow.get_tracking_uri()})")  # fmt: skip
    return registered or uri


def package(model: Any, folder: str | Path | None, result: dict[str, Any]) -> Path:
    """Write ``model`` and ``manifest.json`` (version, sources, date, CV) for boom_ml.predict."""
    from boom_ml.timing.heads import PACKAGED_DIR
    from training.cv import format_tables, step_summary

    out = Path(folder) if folder else PACKAGED_DIR
    old = out / "manifest.json"
    version = json.loads(old.read_text()).get("version", 0) + 1 if old.exists() else 1
    for stale in out.glob("*.txt.gz"):  # heads dropped since the last package
        stale.unlink()
    model.save(out)
    manifest = {"version": version, **model.meta, "model_uri": result.get("model_uri"),
                "heads": sorted(model.heads), "fallback_heads": sorted(set(model.fallback) - set(model.heads))}  # fmt: skip
    if result.get("cv") is not None:
        manifest["cv_tables"] = format_tables(result["cv"]).splitlines()
    if result.get("steps") is not None:
        manifest["step_labels"] = json.loads(step_summary(result["steps"]).to_json(orient="index"))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    return out


def main() -> None:
    if print_help_if_asked(__doc__, "train_ops"):
        return
    from boom_ml.predict import exit_on_bad_overrides

    exit_on_bad_overrides(sys.argv[1:], "train_ops")  # one line, not Hydra's
    import hydra

    @hydra.main(config_path=CONFIG_DIR, config_name="train_ops", version_base="1.3")
    def _entry(cfg: Any) -> None:
        from boom_ml.errors import BoomError

        try:
            run(cfg, log=lambda msg: print(msg, flush=True))
        except (BoomError, FileNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    _entry()


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
