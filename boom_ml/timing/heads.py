"""Per-op time heads: one LightGBM model per op family (+ p10/p90 quantile heads).

A head predicts ``log(latency / roofline)`` from :mod:`boom_ml.timing.features`. Optimizer
and copy kernels, never measured, are timed by the elementwise head as the streams they are
(:mod:`boom_ml.timing.bandwidth`). Other families with no measurements (attention) fall back
to a *calibrated roofline*: the roofline times the median achieved/roofline ratio of a
measured proxy family. ``method`` says which of the three each prediction is.

Stored as a directory: ``model.json`` (metadata, feature lists, fallbacks) plus one gzipped
LightGBM text model per head and quantile. Text (not pickle) so that an artifact loads with
any LightGBM version that reads the format and can be inspected.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pandas as pd

from boom_ml.errors import ArtifactError, last_line
from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.bandwidth import CURVE_HEADS
from boom_ml.timing.bandwidth import METHOD as CURVE_METHOD
from boom_ml.timing.features import (
    FEATURE_VERSION,
    GPU_FEATURES,
    HEADS,
    kernel_features,
    matrix_for,
    target,
)
from boom_ml.timing.size_floor import SizeFloor

PACKAGED_DIR = Path(__file__).resolve().parent.parent / "artifacts" / "per_op"
MODEL_ENV = "BOOM_PER_OP_MODEL"
QUANTILES = {"p10": 0.1, "p90": 0.9}
# Where a head without data borrows its achieved/roofline ratio: attention is GEMM-like
# compute, optimizer and copy kernels are streams like elementwise ops.
PROXY = {"attention": "gemm", "optimizer": "elementwise", "copy": "elementwise",
         "embedding": "elementwise", "norm": "softmax", "softmax": "norm", "conv": "gemm",
         "gemm": "conv", "elementwise": "norm"}  # fmt: skip
# Heads whose backward kernels are the same kind of kernel as their forward ones (a GEMM is
# a GEMM; an elementwise backward is an elementwise op; norm/softmax backward stream more
# bytes, which the roofline counts), so forward-only data still speaks for them.
BACKWARD_AS_FORWARD = {"gemm", "elementwise", "norm", "softmax"}
METHOD_HEAD = "per-op"
METHOD_FALLBACK = "roofline-calibrated"
DEFAULT_PARAMS: dict[str, Any] = {
    "objective": "l2",
    "learning_rate": 0.08,
    "num_leaves": 31,  # 63 leaves x 600 trees scored the same in CV at 3x the artifact size
    "min_child_samples": 200,
    "reg_lambda": 5.0,
    "subsample": 0.8,
    "subsample_freq": 1,
    "colsample_bytree": 0.8,
}


@dataclass
class Head:
    """One family's models: the median and optional quantile boosters."""

    name: str
    features: list[str]
    models: Mapping[str, lgb.Booster]  # "p50", "p10", "p90"
    n_rows: int = 0
    gpus: list[str] = field(default_factory=list)
    # Canonical families and directions seen in training: other rows get the fallback.
    families: list[str] = field(default_factory=list)
    directions: list[str] = field(default_factory=list)

    def covers(self, feats: pd.DataFrame) -> np.ndarray:
        fam = feats["family"].isin(self.families).to_numpy()
        if self.name in BACKWARD_AS_FORWARD:
            return fam
        return fam & feats["direction"].isin(self.directions).to_numpy()

    def predict(self, feats: pd.DataFrame, median_only: bool = False) -> dict[str, np.ndarray]:
        x = feats.reindex(columns=self.features).to_numpy(dtype=float)
        # One thread: the matrices are small, and OpenMP threads spin when other jobs share
        # the cores (12 ms per call on 2 busy cores).
        return {q: self.models[q].predict(x, num_threads=1) for q in self.models
                if q == "p50" or not median_only}  # fmt: skip


@dataclass
class PerOpModel:
    """All heads plus the calibrated-roofline fallbacks; predicts ms for kernel rows."""

    heads: dict[str, Head]
    fallback: dict[str, dict[str, float | str]]  # head -> proxy and log-ratio quantiles
    meta: dict[str, Any] = field(default_factory=dict)

    def predict_rows(
        self,
        rows: pd.DataFrame,
        gpus: Mapping[str, GpuSpec] | GpuSpec,
        median_only: bool = False,
    ) -> pd.DataFrame:
        """``pred_ms``, ``p10_ms``, ``p90_ms`` and ``method`` for canonical kernel rows, each
        at least what the model gives the same op on one element (:mod:`size_floor`).
        ``median_only``: p10/p90 repeat the median."""
        pred = self.predict_features(kernel_features(rows, gpus), median_only)
        return SizeFloor.of(rows, gpus).lift(pred, self)

    def predict_features(self, feats: pd.DataFrame, median_only: bool = False) -> pd.DataFrame:
        """Predictions for featurised rows; ``median_only``: p10/p90 repeat the median."""
        n = len(feats)
        log = {q: np.zeros(n) for q in ("p50", "p10", "p90")}
        method = np.full(n, METHOD_FALLBACK, dtype=object)
        curve = np.zeros(n, dtype=bool)  # rows the elementwise head times as streams
        heads = feats["head"].to_numpy() if n else np.array([])
        for h in pd.unique(heads):
            idx = np.flatnonzero(heads == h)
            sub = feats.iloc[idx]
            fb = self.fallback.get(str(h), {"p50": 0.0, "p10": 0.0, "p90": 0.0})
            for q in log:
                log[q][idx] = float(fb[q])
            method[idx] = f"{METHOD_FALLBACK} (proxy: {fb.get('proxy', 'none')})"
            head = self.heads.get(str(h))
            ok = np.zeros(len(idx), dtype=bool)
            if head is not None and (ok := head.covers(sub)).any():
                _put(log, method, idx[ok], head.predict(sub[ok], median_only), METHOD_HEAD)
            stream = self.heads.get("elementwise") if h in CURVE_HEADS else None
            if stream is not None and not ok.all():
                # No measured rows cover these: the elementwise head, on the elementwise row
                # that moves the same bytes (bandwidth.py), is a bandwidth curve for them.
                _put(log, method, idx[~ok], stream.predict(sub[~ok], median_only), CURVE_METHOD)
                curve[idx[~ok]] = True
        roof = feats["roof_ms"].to_numpy(dtype=float) if n else np.zeros(0)
        # A stream is never faster than bytes / bandwidth (mem_ms; elementwise rows that fit
        # in L2 can be, so the head may say so for a stream of that size).
        floor = np.where(curve, feats["mem_ms"].to_numpy(dtype=float), 0.0) if n else roof
        return pd.DataFrame(
            {
                "pred_ms": np.maximum(roof * np.exp(log["p50"]), floor),
                "p10_ms": np.maximum(roof * np.exp(log["p10"]), floor),
                "p90_ms": np.maximum(roof * np.exp(log["p90"]), floor),
                "method": method,
                "head": heads,
            },
            index=feats.index,
        )

    # ---- persistence -------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        heads = {}
        for name, head in self.heads.items():
            files = {}
            for q, booster in head.models.items():
                fname = f"{name}_{q}.txt.gz"
                # mtime=0: identical models give identical bytes (clean artifact diffs).
                with gzip.GzipFile(out / fname, "wb", mtime=0) as fh:
                    fh.write(booster.model_to_string().encode())
                files[q] = fname
            heads[name] = {"features": head.features, "files": files, "n_rows": head.n_rows,
                           "gpus": head.gpus, "families": head.families,
                           "directions": head.directions}  # fmt: skip
        doc = {"feature_version": FEATURE_VERSION, "heads": heads, "fallback": self.fallback,
               "meta": self.meta}  # fmt: skip
        (out / "model.json").write_text(json.dumps(doc, indent=1, sort_keys=True, default=str))
        return out

    @classmethod
    def load(cls, folder: str | Path) -> PerOpModel:
        src = Path(folder)
        path = src / "model.json"
        if not path.exists():
            raise ArtifactError(
                f"per-op model not found: {path} (run python -m training.train_ops)"
            )
        try:
            return cls._load(src, path)
        except ArtifactError:
            raise
        except Exception as exc:  # unreadable JSON, gzip or LightGBM text: a corrupt artifact
            raise corrupt(src, exc) from exc

    @classmethod
    def _load(cls, src: Path, path: Path) -> PerOpModel:
        doc = json.loads(path.read_text())
        if doc.get("feature_version") != FEATURE_VERSION:
            raise ArtifactError(
                f"{path}: feature version {doc.get('feature_version')} != {FEATURE_VERSION}; "
                "retrain with python -m training.train_ops"
            )
        heads = {}
        for name, spec in doc["heads"].items():
            missing = [f for f in spec["files"].values() if not (src / f).is_file()]
            if missing:
                raise ArtifactError(f"per-op model in {src} is corrupt: {missing[0]} missing")
            models = BoosterFiles(src, spec["files"])
            heads[name] = Head(name, spec["features"], models, spec.get("n_rows", 0),
                               spec.get("gpus", []), spec.get("families", [name]),
                               spec.get("directions", ["forward"]))  # fmt: skip
        return cls(heads, doc["fallback"], doc.get("meta", {}))


def _put(
    log: dict[str, np.ndarray],
    method: np.ndarray,
    idx: np.ndarray,
    pred: dict[str, np.ndarray],
    name: str,
) -> None:
    """Write a head's log-ratio quantiles and its method name into rows ``idx``."""
    method[idx] = name
    log["p50"][idx] = pred["p50"]
    # A quantile head can cross the median on a row; keep the interval ordered.
    log["p10"][idx] = np.minimum(pred.get("p10", pred["p50"]), pred["p50"])
    log["p90"][idx] = np.maximum(pred.get("p90", pred["p50"]), pred["p50"])


def corrupt(src: Path, exc: Exception) -> ArtifactError:
    return ArtifactError(
        f"per-op model in {src} is corrupt ({type(exc).__name__}: {exc}); reinstall "
        "boom-ml or rebuild it with python -m training.train_ops package=true"
    )


class BoosterFiles(Mapping[str, lgb.Booster]):
    """A head's boosters, each parsed from its gzipped text file on first use.

    Parsing all 18 packaged boosters takes most of a second; a prediction needs the median
    booster of the families in its graph (the GNN path no quantiles at all).
    """

    def __init__(self, folder: Path, files: Mapping[str, str]) -> None:
        self.folder, self.files = folder, dict(files)
        self._loaded: dict[str, lgb.Booster] = {}

    def __getitem__(self, quantile: str) -> lgb.Booster:
        if quantile not in self._loaded:
            path = self.folder / self.files[quantile]
            try:
                with gzip.open(path, "rb") as fh:
                    self._loaded[quantile] = lgb.Booster(model_str=fh.read().decode())
            except Exception as exc:  # unreadable gzip or LightGBM text: a corrupt artifact
                raise corrupt(self.folder, exc) from exc
        return self._loaded[quantile]

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


# ---- training ------------------------------------------------------------------------------
def train_head(
    name: str,
    feats: pd.DataFrame,
    y: np.ndarray,
    gpus: list[str],
    params: Mapping[str, Any] | None = None,
    n_estimators: int = 400,
    quantile_estimators: int = 150,
    gpu_features: list[str] | None = None,
    n_jobs: int = 1,
    seed: int = 0,
) -> Head:
    """Fit the median head (and quantile heads unless ``quantile_estimators`` is 0)."""
    from boom_ml.timing.features import feature_columns

    cols = feature_columns(name, gpu_features)
    x = matrix_for(feats, name, gpu_features)
    base = {**DEFAULT_PARAMS, **(params or {}), "verbose": -1, "n_jobs": n_jobs, "seed": seed}
    models = {"p50": _fit(x, y, base, n_estimators)}
    if quantile_estimators > 0:
        for q, alpha in QUANTILES.items():
            # Quantile heads are coarser (fewer, shallower trees): an interval, not a point.
            qp = {**base, "objective": "quantile", "alpha": alpha, "learning_rate": 0.1,
                  "num_leaves": 15}  # fmt: skip
            models[q] = _fit(x, y, qp, quantile_estimators)
    return Head(
        name,
        cols,
        models,
        n_rows=len(y),
        gpus=sorted(set(gpus)),
        families=sorted(set(feats["family"])),
        directions=sorted(set(feats["direction"])),
    )


def _fit(x: np.ndarray, y: np.ndarray, params: dict[str, Any], rounds: int) -> lgb.Booster:
    data = lgb.Dataset(x, label=y, free_raw_data=True)
    return lgb.train(params, data, num_boost_round=rounds)


def calibrate_fallbacks(feats: pd.DataFrame, y: np.ndarray) -> dict[str, dict[str, float | str]]:
    """Log-ratio quantiles of each head's proxy family (its own rows when it has data)."""
    heads = feats["head"].to_numpy()
    out: dict[str, dict[str, float | str]] = {}
    for h in HEADS:
        source = h if (heads == h).any() else PROXY.get(h, "elementwise")
        vals = y[heads == source]
        if len(vals) == 0:  # nothing to calibrate on: the bare roofline
            out[h] = {"proxy": "none", "p50": 0.0, "p10": 0.0, "p90": 0.0}
            continue
        p10, p50, p90 = np.quantile(vals, [0.1, 0.5, 0.9])
        out[h] = {"proxy": source, "p50": float(p50), "p10": float(p10), "p90": float(p90)}
    return out


def fit_model(
    kernels: pd.DataFrame,
    specs: Mapping[str, GpuSpec],
    heads: list[str] | None = None,
    min_rows: int = 200,
    log: Any = print,
    **train_kw: Any,
) -> PerOpModel:
    """Train every head that has at least ``min_rows`` measured rows; calibrate the rest."""
    feats = kernel_features(kernels, specs)
    y = target(kernels["latency_ms"].to_numpy(), feats["roof_ms"].to_numpy())
    gpu_ids = kernels["gpu_id"].astype(str).to_numpy()
    trained: dict[str, Head] = {}
    timings: dict[str, float] = {}
    for h in heads or list(HEADS):
        idx = np.flatnonzero(feats["head"].to_numpy() == h)
        if len(idx) < min_rows:
            log(f"head {h}: {len(idx)} rows < {min_rows}: calibrated roofline fallback")
            continue
        start = time.perf_counter()
        trained[h] = train_head(h, feats.iloc[idx], y[idx], list(gpu_ids[idx]), **train_kw)
        timings[h] = round(time.perf_counter() - start, 1)
        log(f"head {h}: {len(idx)} rows, {len(set(gpu_ids[idx]))} GPUs, {timings[h]} s")
    meta = {"train_seconds": timings, "gpu_features": train_kw.get("gpu_features") or GPU_FEATURES}
    return PerOpModel(trained, calibrate_fallbacks(feats, y), meta)


# ---- loading ---------------------------------------------------------------------------
def load_model(uri: str | None = None) -> PerOpModel:
    """The packaged default (``uri`` None), a local model folder, or an MLflow model URI.

    ``$BOOM_PER_OP_MODEL`` (a folder or MLflow URI) replaces the packaged default, so that
    ``python -m boom_ml.predict`` can use a model from the registry without code changes.
    """
    if uri is None:
        uri = os.environ.get(MODEL_ENV) or None
    return _load_cached(uri)


@functools.lru_cache(maxsize=4)
def _load_cached(uri: str | None) -> PerOpModel:
    if uri is None or uri in ("", "packaged", "default"):
        return PerOpModel.load(PACKAGED_DIR)
    if Path(uri).expanduser().is_dir():
        return PerOpModel.load(Path(uri).expanduser())
    try:
        import mlflow.pyfunc

        model = mlflow.pyfunc.load_model(uri).unwrap_python_model().model
    except Exception as exc:  # any MLflow failure is an artifact problem for the user (a
        # registered model of another kind, the GNN, failed in the unwrap: a traceback)
        raise ArtifactError(f"cannot load per-op model from {uri!r}: {last_line(exc)}") from exc
    if not isinstance(model, PerOpModel):
        raise ArtifactError(f"{uri!r} holds a {type(model).__name__}, not a per-op model")
    return model
