"""`python -m training.train_gemm`: the tile/wave GEMM model, leave-one-GPU-out, packaging.

    python -m training.train_gemm                        # LOGO table: every variant + old head
    python -m training.train_gemm package=true           # ... and write boom_ml/artifacts/gemm
    python -m training.train_gemm run_variants=[lgb_spec] cv.baseline=false

Each fold removes every kernel row of the held-out GPU, from any source, before anything is
fit (the learner, the NaN fill of the MLP, the interval), then scores that GPU's fp32 bmm and
linear rows: all of them (the rows of the per-op table in the README) and NeuSight's
test split alone.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from boom_ml import config_help
from boom_ml.config_help import print_help_if_asked
from boom_ml.timing.gemm import (
    GemmModel,
    gemm_features,
)
from training.gemm_learners import fit_variant

SCORED_OPS = ("bmm", "linear")  # NeuSight's two GEMM tables, fp32
MIN_TEST_ROWS = 20
MIN_TRAIN_ROWS = 200  # fewer GEMM rows: no model (train_ops' min_rows for a head)


def _baseline(kernels: pd.DataFrame, specs: dict, train: np.ndarray, o: dict) -> Any:
    """The per-op gemm head (boom_ml.timing.heads) trained on the same fold's rows."""
    from boom_ml.timing.features import kernel_features, target
    from boom_ml.timing.heads import PerOpModel, train_head

    sub = kernels.iloc[train]
    f = kernel_features(sub, specs)
    head = train_head("gemm", f, target(sub["latency_ms"].to_numpy(), f["roof_ms"].to_numpy()),
                      list(sub["gpu_id"]), n_estimators=o["cv"]["baseline_estimators"],
                      quantile_estimators=0, params={"learning_rate": 0.1}, seed=o["seed"])  # fmt: skip
    return PerOpModel({"gemm": head}, {})


def gemm_scores(rows: pd.DataFrame, pred: np.ndarray) -> list[dict[str, Any]]:
    """MAPE of fp32 bmm and linear, on all of ``rows`` and on NeuSight's test split alone."""
    true = rows["latency_ms"].to_numpy(dtype=float)
    ape = np.abs(pred - true) / true
    out = []
    for op in SCORED_OPS:
        for split, extra in (("all", True), ("test", rows["source"].eq("neusight_test"))):
            sel = (rows["op"].eq(op) & rows["dtype"].eq("float32") & extra).to_numpy()
            if sel.sum() >= MIN_TEST_ROWS:
                out.append({"op": op, "rows": split, "n": int(sel.sum()),
                            "mape": float(100 * ape[sel].mean())})  # fmt: skip
    return out


def leave_one_gpu_out(
    kernels: pd.DataFrame, specs: dict, o: dict, log: Any = print
) -> tuple[pd.DataFrame, dict]:
    """MAPE per (variant, held-out GPU, op, rows); and the held-out log residuals per variant."""
    feats = gemm_features(kernels, specs)
    y = np.log(kernels["latency_ms"].to_numpy(dtype=float) / feats["roof_ms"].to_numpy())
    gpu = kernels["gpu_id"].astype(str).to_numpy()
    scored = kernels["op"].isin(SCORED_OPS) & kernels["dtype"].eq("float32")
    counts = kernels[scored].groupby("gpu_id").size()
    held = o["cv"]["gpus"] or sorted(counts[counts >= MIN_TEST_ROWS].index)
    names = o["run_variants"] or list(o["variants"])
    rng = np.random.default_rng(o["seed"])
    out, resid = [], {n: {} for n in names}
    for g in held:
        # The split is fixed before any fit: every row of g (any source) is out.
        train, test = np.flatnonzero(gpu != g), np.flatnonzero(gpu == g)
        cap = o["cv"]["max_train_rows"]
        if cap and len(train) > cap:
            train = np.sort(rng.choice(train, cap, replace=False))
        rows = kernels.iloc[test]
        preds = {}
        for name in names:
            start = time.perf_counter()
            model = fit_variant(feats.iloc[train], y[train], o["variants"][name], o, gpu[train])
            pred = preds[name] = model.predict_ms(feats.iloc[test])
            resid[name][g] = np.log(rows["latency_ms"].to_numpy() / pred)
            for s in gemm_scores(rows, pred):
                out.append({"variant": name, "gpu": g, **s})
            log(f"fold {g} {name}: {time.perf_counter() - start:.0f} s "
                + " ".join(f"{s['op']}/{s['rows']} {s['mape']:.1f}" for s in gemm_scores(rows, pred)))  # fmt: skip
        if o["cv"]["baseline"]:
            start = time.perf_counter()
            base = _baseline(kernels, specs, train, o)
            pred = base.predict_rows(rows, specs)["pred_ms"].to_numpy()
            for s in gemm_scores(rows, pred):
                out.append({"variant": "heads", "gpu": g, **s})
            for name in o["cv"].get("blend") or []:  # geometric mean with the old head
                mix = np.sqrt(preds[name] * pred)
                out += [{"variant": f"{name}+heads", "gpu": g, **s} for s in gemm_scores(rows, mix)]
            log(f"fold {g} heads: {time.perf_counter() - start:.0f} s "
                + " ".join(f"{s['op']}/{s['rows']} {s['mape']:.1f}" for s in gemm_scores(rows, pred)))  # fmt: skip
    return pd.DataFrame(out), resid


def format_table(cv: pd.DataFrame) -> str:
    """Per rows-set: (variant, op) x held-out GPU MAPE %, with the mean over GPUs."""
    lines = []
    for split in ("all", "test"):
        part = cv[cv["rows"] == split]
        if part.empty:
            continue
        t = part.pivot_table(index=["variant", "op"], columns="gpu", values="mape")
        t["mean"] = t.mean(axis=1)
        lines += [f"LOGO MAPE % on {split} fp32 rows of the held-out GPU:",
                  t.round(1).to_string(), ""]  # fmt: skip
        both = part.groupby("variant")["mape"].mean().round(1).sort_values()
        lines += [
            "mean over GPUs and bmm+linear: " + ", ".join(f"{k} {v}" for k, v in both.items()),
            "",
        ]
    return "\n".join(lines)


def interval(resid: dict[str, np.ndarray]) -> dict[str, float]:
    """p10/p90 of held-out log(measured / predicted), each held-out GPU weighing the same."""
    vals = np.concatenate(list(resid.values()))
    w = np.concatenate([np.full(len(v), 1.0 / len(v)) for v in resid.values()])
    order = np.argsort(vals)
    cdf = np.cumsum(w[order]) / w.sum()
    return {q: float(vals[order][np.searchsorted(cdf, p)]) for q, p in (("p10", 0.1), ("p90", 0.9))}


def held_out_coverage(resid: dict[str, np.ndarray], kernels: pd.DataFrame) -> pd.DataFrame:
    """Per held-out GPU: the 80 % interval as :func:`interval` calibrates it, but on the other
    GPUs' held-out residuals only, and the share of this GPU's rows inside it (all its GEMM
    rows, and its fp32 bmm/linear rows: the MAPE table's). ``resid[g]``: log(measured /
    predicted) of GPU g's rows in ``kernels`` order, as :func:`leave_one_gpu_out` returns."""
    lines = []
    for g, r in resid.items():
        others = {h: v for h, v in resid.items() if h != g}
        if not others:
            continue
        bounds = interval(others)
        inside = (bounds["p10"] <= r) & (r <= bounds["p90"])
        mine = kernels[kernels["gpu_id"].astype(str).eq(g)]
        scored = (mine["op"].isin(SCORED_OPS) & mine["dtype"].eq("float32")).to_numpy()
        lines.append({"gpu": g, "rows": len(r), "p10": float(np.exp(bounds["p10"])),
                      "p90": float(np.exp(bounds["p90"])), "coverage %": 100 * float(inside.mean()),
                      "fp32 bmm/linear rows": int(scored.sum()),
                      "fp32 bmm/linear coverage %": 100 * float(inside[scored].mean())
                      if scored.any() else float("nan")})  # fmt: skip
    return pd.DataFrame(lines)


def load_config(**override: Any) -> dict:
    """``configs/train_gemm.yaml`` as a dict (top-level keys replaced by ``override``)."""
    from omegaconf import OmegaConf

    o = OmegaConf.to_container(OmegaConf.load(config_help.CONFIG_DIR / "train_gemm.yaml"))
    return {**o, **override}


def gemm_rows(kernels: pd.DataFrame) -> pd.DataFrame:
    """The kernel rows the GEMM model times (the gemm family's linear/mm/bmm shapes)."""
    from boom_ml.timing.gemm import is_gemm_row

    rows = kernels[(kernels["family"] == "gemm").to_numpy() & is_gemm_row(kernels)]
    return rows.reset_index(drop=True)


def fit_rows(rows: pd.DataFrame, name: str, o: dict) -> GemmModel:
    """Variant ``name`` of ``o`` (``configs/train_gemm.yaml``) fit on the GEMM ``rows``."""
    from boom_ml.gpus import get_gpu

    gpus = rows["gpu_id"].astype(str).to_numpy()
    feats = gemm_features(rows, {g: get_gpu(g) for g in sorted(set(gpus))})
    y = np.log(rows["latency_ms"].to_numpy(dtype=float) / feats["roof_ms"].to_numpy())
    return fit_variant(feats, y, o["variants"][name], o, gpus)


def fold_gemm(
    kernels: pd.DataFrame, held: Collection[str], cache: Path | None = None
) -> GemmModel | None:
    """The packaged variant fit on the GEMM rows of every GPU but those ``held`` out (a CV
    fold's GEMM model; ``cache``: a folder to reuse it from; None without GEMM rows: the heads
    time them). No interval: p10/p90 repeat the median."""
    from boom_ml.timing.gemm import GEMM_MODEL_VERSION

    o = load_config()
    tag = f"{o['use']}-v{GEMM_MODEL_VERSION}-seed{o['seed']}"
    if cache is not None and (cache / "model.json").exists():
        model = GemmModel.load(cache)
        if model.meta.get("tag") == tag:
            return model
    rows = gemm_rows(kernels)
    held = sorted(held)
    rows = rows[~rows["gpu_id"].astype(str).isin(held)].reset_index(drop=True)
    if len(rows) < MIN_TRAIN_ROWS:
        return None
    model = fit_rows(rows, o["use"], o)
    model.meta = {"tag": tag, "held_out_gpu": "+".join(held) or None, "train_rows": len(rows)}
    if cache is not None:
        model.save(cache)
    return model


def score_fold(kernels: pd.DataFrame, gpu: str, model: GemmModel | None) -> list[dict[str, Any]]:
    """A fold's GEMM model on one GPU's fp32 bmm/linear kernel rows (the GPU must be out of
    the fold's training rows; ``train_ops``' step check passes the model it used)."""
    from boom_ml.gpus import get_gpu
    from boom_ml.timing.gemm import is_gemm_row

    rows = kernels[kernels["gpu_id"].astype(str).eq(gpu).to_numpy() & is_gemm_row(kernels)]
    if model is None or rows.empty:
        return []
    rows = rows.reset_index(drop=True)
    return gemm_scores(rows, model.predict_ms(gemm_features(rows, {gpu: get_gpu(gpu)})))


def fold_line(scores: list[dict[str, Any]]) -> str:
    """:func:`score_fold`'s scores in one line: per op, all rows and NeuSight's test split."""
    by = {(sc["op"], sc["rows"]): sc for sc in scores}
    parts = []
    for op in (op for op in SCORED_OPS if (op, "all") in by):
        test = by.get((op, "test"))
        split = f"; NeuSight test split {test['mape']:.1f}" if test else ""
        parts.append(f"{op} {by[op, 'all']['mape']:.1f} ({by[op, 'all']['n']} rows{split})")
    return ", ".join(parts)


def run(o: dict, log: Any = print) -> dict[str, Any]:
    from boom_ml.gpus import get_gpu
    from boom_ml.timing.gemm import PACKAGED_DIR
    from training.kernel_rows import load_training_data

    kernels = gemm_rows(load_training_data(o["data"], log))
    specs = {g: get_gpu(g) for g in sorted(kernels["gpu_id"].unique())}
    log(f"{len(kernels)} GEMM rows, GPUs: {', '.join(specs)}")
    result: dict[str, Any] = {"cv": None}
    if o["cv"]["enabled"]:
        result["cv"], resid = leave_one_gpu_out(kernels, specs, o, log)
        log(format_table(result["cv"]))
        if o["use"] in resid:
            result["coverage"] = held_out_coverage(resid[o["use"]], kernels)
            log(
                f"held-out coverage of {o['use']}'s 80 % interval (x p10 .. x p90 of the "
                "prediction, calibrated on the other GPUs' folds):"
            )
            log(result["coverage"].round(2).to_string(index=False))
    if o["package"]:
        model = fit_rows(kernels, o["use"], o)
        if result["cv"] is not None and o["use"] in resid:
            model.interval = interval(resid[o["use"]])
        model.meta = {
            "variant": o["use"], **o["variants"][o["use"]],
            "trained_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "data_sources": {str(k): int(v) for k, v in kernels["source"].value_counts().items()},
            "rows_per_gpu": {str(k): int(v) for k, v in kernels["gpu_id"].value_counts().items()},
            "excluded_gpus": sorted(o["data"].get("exclude_gpus") or {}),
            "logo": format_table(result["cv"]).splitlines() if result["cv"] is not None else None,
            "command": "python -m training.train_gemm package=true",
        }  # fmt: skip
        folder = model.save(o["package_dir"] or PACKAGED_DIR)
        (folder / "manifest.json").write_text(json.dumps(model.meta, indent=1) + "\n")
        log(f"packaged {o['use']} in {folder}")
        result["model"] = model
    return result


def main() -> None:
    if print_help_if_asked(__doc__, "train_gemm"):
        return
    from boom_ml.predict import exit_on_bad_overrides

    exit_on_bad_overrides(sys.argv[1:], "train_gemm")  # one line, not Hydra's
    import hydra
    from omegaconf import OmegaConf

    @hydra.main(
        config_path=str(config_help.CONFIG_DIR), config_name="train_gemm", version_base="1.3"
    )
    def _entry(cfg: Any) -> None:
        with config_help.one_line_errors():
            run(OmegaConf.to_container(cfg, resolve=True), log=lambda m: print(m, flush=True))

    _entry()


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
