"""Leave-one-GPU-out cross-validation of the per-op heads, and whole-model step checks.

Each fold trains a head on every GPU but one and scores it on the held-out GPU's rows, so
the numbers say how well a head transfers to a GPU it never saw (the product's use case),
not how well it interpolates between shapes of a GPU it was trained on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.features import kernel_features, target
from boom_ml.timing.heads import PerOpModel, calibrate_fallbacks, train_head

GEMM_OPS = ("bmm", "linear")


def _scores(pred: pd.DataFrame, true: np.ndarray) -> dict[str, float]:
    """MAPE (mean |pred-true|/true, in %), median APE, median log bias, interval coverage."""
    p = pred["pred_ms"].to_numpy()
    ape = np.abs(p - true) / true
    inside = (pred["p10_ms"].to_numpy() <= true) & (true <= pred["p90_ms"].to_numpy())
    return {
        "n": len(true),
        "mape": float(100 * ape.mean()),
        "median_ape": float(100 * np.median(ape)),
        "bias": float(np.median(np.log(p / true))),  # >0: predictions too slow
        "coverage": float(inside.mean()),
    }


def leave_one_gpu_out(
    kernels: pd.DataFrame,
    specs: Mapping[str, GpuSpec],
    heads: Iterable[str] | None = None,
    gpus: Iterable[str] | None = None,
    min_rows: int = 200,
    min_test_rows: int = 20,
    max_train_rows: int | None = None,
    seed: int = 0,
    log: Callable[[str], Any] = print,
    **train_kw: Any,
) -> pd.DataFrame:
    """One row per (head, held-out GPU, op) with MAPE and friends; op '*' is the whole head.

    For the gemm head the bmm and linear float32 rows are also scored on their own: that is
    the comparison with NeuSight's unseen-GPU errors.
    """
    feats = kernel_features(kernels, specs)
    y = target(kernels["latency_ms"].to_numpy(), feats["roof_ms"].to_numpy())
    gpu = kernels["gpu_id"].astype(str).to_numpy()
    op = kernels["op"].astype(str).to_numpy()
    fp32 = kernels["dtype"].astype(str).eq("float32").to_numpy()
    latency = kernels["latency_ms"].to_numpy(dtype=float)
    head_of = feats["head"].to_numpy()
    rng = np.random.default_rng(seed)
    wanted = set(gpus) if gpus is not None else None
    out: list[dict[str, Any]] = []
    for h in heads or pd.unique(head_of):
        rows = head_of == h
        for g in sorted(set(gpu[rows])):
            test = rows & (gpu == g)
            train = np.flatnonzero(rows & (gpu != g))
            if (wanted is not None and g not in wanted) or test.sum() < min_test_rows:
                continue
            start = time.perf_counter()
            if len(train) < min_rows:  # no head possible: score the calibrated fallback
                model = PerOpModel({}, calibrate_fallbacks(feats.iloc[train], y[train]))
            else:
                if max_train_rows and len(train) > max_train_rows:
                    train = rng.choice(train, max_train_rows, replace=False)
                head = train_head(h, feats.iloc[train], y[train], list(gpu[train]), **train_kw)
                model = PerOpModel({h: head}, calibrate_fallbacks(feats.iloc[train], y[train]))
            idx = np.flatnonzero(test)
            pred = model.predict_features(feats.iloc[idx])
            method = str(pred["method"].iloc[0])
            whole = {"head": h, "gpu": g, "op": "*", "method": method,
                     **_scores(pred, latency[idx])}  # fmt: skip
            out.append(whole)
            if h == "gemm":
                for name in GEMM_OPS:
                    sel = (op[idx] == name) & fp32[idx]
                    if sel.sum() >= min_test_rows:
                        out.append({"head": h, "gpu": g, "op": name, "method": method,
                                    **_scores(pred[sel], latency[idx][sel])})  # fmt: skip
            log(f"cv {h} held-out {g}: MAPE {whole['mape']:.1f}% ({method}, "
                f"{time.perf_counter() - start:.0f} s)")  # fmt: skip
    return pd.DataFrame(out)


def mape_table(cv: pd.DataFrame) -> pd.DataFrame:
    """Head x held-out GPU MAPE (%) over each head's rows."""
    whole = cv[cv["op"] == "*"]
    return whole.pivot(index="head", columns="gpu", values="mape").round(1)


def gemm_table(cv: pd.DataFrame) -> pd.DataFrame:
    """bmm / linear (fp32) x held-out GPU MAPE (%): the NeuSight comparison."""
    part = cv[(cv["head"] == "gemm") & cv["op"].isin(GEMM_OPS)]
    return part.pivot(index="op", columns="gpu", values="mape").round(1)


def gemm_coverage_table(cv: pd.DataFrame) -> pd.DataFrame:
    """bmm / linear (fp32) x held-out GPU: % of rows inside the p10-p90 quantile heads."""
    part = cv[(cv["head"] == "gemm") & cv["op"].isin(GEMM_OPS)]
    return (100 * part.pivot(index="op", columns="gpu", values="coverage")).round(1)


def format_tables(cv: pd.DataFrame) -> str:
    """Plain-text tables for logs, the README and the manifest."""
    lines = ["MAPE % per head x held-out GPU (leave-one-GPU-out):",
             mape_table(cv).fillna("").to_string()]  # fmt: skip
    g = gemm_table(cv)
    if not g.empty:
        lines += ["", "GEMM MAPE % (fp32 rows) x held-out GPU:", g.fillna("").to_string()]
        lines += ["", "GEMM p10-p90 coverage % (fp32 rows; target 80) x held-out GPU:",
                  gemm_coverage_table(cv).fillna("").to_string()]  # fmt: skip
    return "\n".join(lines)


# ---- whole-model labels ------------------------------------------------------------------
def evaluate_steps(
    labels: pd.DataFrame,
    model_for_gpu: Callable[[str], PerOpModel],
    specs: Mapping[str, GpuSpec],
    log: Callable[[str], Any] = print,
    attention: str = "sdpa",
) -> pd.DataFrame:
    """Predicted vs measured step time for each label row (one GPU at a time).

    ``attention``: the HF ``attn_implementation`` the labels were measured with.

    ``model_for_gpu(gpu_id)`` returns a model trained without that GPU, so each label is
    predicted for a GPU its model never saw. Graphs are traced once per (model, batch, seq).
    """
    from boom_ml.specs import ModelSpec, StepSpec
    from boom_ml.timing.per_op import predict_nodes
    from boom_ml.trace.step import trace_step
    from boom_ml.zoo import build_model
    from data_collection.paths import shared_data_dir

    def resolve(spec: str) -> str:
        # Label models without a Hub id name a config shipped with the data, relative to
        # the shared data dir (e.g. hf:neusight/model_configs/gpt3_xl.json).
        path = shared_data_dir() / spec.removeprefix("hf:")
        return f"hf:{path}" if spec.startswith("hf:") and path.is_file() else spec

    graphs: dict[tuple[str, int, int], Any] = {}
    out: list[dict[str, Any]] = []
    for gpu_id, group in labels.groupby("gpu_id", sort=True):
        model = model_for_gpu(str(gpu_id))
        for row in group.itertuples(index=False):
            key = (str(row.model), int(row.batch_size), int(row.seq_len))
            if key not in graphs:
                try:
                    opts = {"attn_implementation": attention} if key[0].startswith("hf:") else {}
                    built = build_model(ModelSpec(resolve(key[0]), opts))
                    step = StepSpec(batch_size=key[1], seq_len=key[2], optimizer="none")
                    graphs[key] = trace_step(built, step)
                except Exception as exc:  # a model the zoo cannot build is reported, not fatal
                    log(f"steps: skip {key}: {type(exc).__name__}: {exc}")
                    graphs[key] = None
            graph = graphs[key]
            if graph is None:
                continue
            # PyTorch 2.1 defaults, as NeuSight measured (matmul TF32 off; no convolutions here)
            pred = predict_nodes(graph.nodes, specs[str(gpu_id)], tf32=None, model=model)
            ms = float(pred["ms"].sum())
            out.append({"gpu": gpu_id, "model": key[0], "batch_size": key[1], "seq_len": key[2],
                        "measured_ms": float(row.step_time_ms), "pred_ms": ms,
                        "p10_ms": float(pred["p10"].sum()), "p90_ms": float(pred["p90"].sum()),
                        "abs_err_ms": abs(ms - float(row.step_time_ms)),
                        "ape": abs(ms - float(row.step_time_ms)) / float(row.step_time_ms) * 100})  # fmt: skip
            log(f"steps {gpu_id} {key}: measured {row.step_time_ms:.1f} ms, predicted {ms:.1f} ms")
    return pd.DataFrame(out)


def step_summary(steps: pd.DataFrame) -> pd.DataFrame:
    """Per GPU: labels, mean absolute error (ms) and mean absolute percentage error."""
    if steps.empty:
        return pd.DataFrame(columns=["labels", "mae_ms", "mape"])
    return (
        steps.groupby("gpu")
        .agg(labels=("ape", "size"), mae_ms=("abs_err_ms", "mean"), mape=("ape", "mean"))
        .round(1)
    )
