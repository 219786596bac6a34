"""GEMM time from output tiles and waves (NeuSight-style), for linear/mm/addmm and bmm/baddbmm.

A GEMM ``(batch x M x K) @ (K x N)`` is cut into output tiles of ``tile_m x tile_n``; each
SM runs ``TILES_PER_SM`` tiles at a time, so the kernel runs in
``waves = ceil(tiles / (SMs * TILES_PER_SM))`` waves, the last one (the tail) only partly
full. The bound is the tiled roofline: ``waves`` times the time one SM needs for its tiles at
its share of the peak, or the DRAM time of the operands if that is longer, plus the launch
cost. A learner predicts how far above that bound the kernel runs, ``log(t / bound) >= 0``
(a utilisation ``u = bound / t`` in (0, 1]), from the shape relative to the tile grid and
from GPU numbers every spec sheet gives (SMs, clocks, bandwidth, L2, TDP), so that a GPU
nobody measured is a point in that space, not an unknown id.

Rows follow the canonical kernel convention (``boom_ml.timing.features``): ``bmm`` is
(b,m,n)x(b,n,k); ``linear``/``mm`` apply one (n -> k) weight to b*m rows. Torch-free.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from boom_ml.errors import ArtifactError
from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.features import BMM_OPS, DTYPE_BYTES, KERNEL_ONLY_SOURCES, per_gpu
from boom_ml.timing.roofline import LAUNCH_MS
from boom_ml.timing.spec_sheet import gpu_table

PACKAGED_DIR = Path(__file__).resolve().parent.parent / "artifacts" / "gemm"
MODEL_ENV = "BOOM_GEMM_MODEL"  # a folder replacing the packaged model; "off": heads only
GEMM_MODEL_VERSION = 1
# Kernel-row ops this model times (per_op.node_rows names addmm "linear", 3-D GEMMs "bmm").
GEMM_ROW_OPS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm"})
BIAS_OPS = frozenset({"linear", "addmm", "baddbmm"})
METHOD = "gemm-tiles"
# Whether step times (per_op.predict_nodes_many: the GNN's inputs, the per-op sum) use this
# model. The packaged GNN, its CV verdict per cell and the step's calibrated intervals were
# fitted on these times (`python -m training.train_gnn`, each fold with a GEMM model fit
# without its GPU); turn it off only together with a retrain on the heads' GEMM times.
# predict_ops (kernel rows, where the leave-one-GPU-out table applies) always uses it.
STEP_TIMES = True
# Dtypes whose GEMM rows this model times; fp16 and bf16 GEMMs go to the gemm head. Chosen on
# the leave-one-GPU-out comparison of the two models on every GEMM row of each held-out GPU
# (`python -m training.gemm_routing`, README "GEMMs: output tiles and waves"): on fp32 rows the
# tile model is better (the table it was adopted on), on fp16 rows the head (GPU mean 19.2 %
# against 28.0; the A40, whose fp16 GEMMs the tile model times 1.55x too slow, 10.2 against
# 54.3). bf16 has no measured GEMM row and follows fp16, its tensor-core rate; TF32 none either
# and stays with fp32, as before.
TILE_DTYPES = frozenset({"float32", "tf32"})

# Output tiles cuBLAS picks from. SIMT (fp32 without TF32): the tiles named by the kernels in
# NeuSight's measured rows (``kernel_names``: ampere_sgemm_128x128_nn, volta_sgemm_128x64_nn,
# maxwell_sgemm_64x64, ..._64x32, ..._32x32). Tensor cores (fp16/bf16/TF32): CUTLASS's default
# sm80 tensor-op threadblock tiles (cutlass/python/cutlass_library/generator.py).
SIMT_TILES = ((128, 128), (128, 64), (64, 64), (64, 32), (32, 32))
TENSOR_TILES = ((256, 128), (128, 128), (128, 64), (64, 64))
# Tiles an SM works on at once. Occupancy is on no spec sheet; NeuSight counts one tile per SM
# per wave (waves = ceil(tiles / SMs)), and so do we. An assumption, not a measurement.
TILES_PER_SM = 1

SHAPE_FEATURES = ["log_batch", "log_m", "log_red", "log_out", "is_bmm", "has_bias", "elt_bytes",
                  "tensor_core", "kernel_only", "log_tile_m", "log_tile_n", "log_tiles",
                  "log_waves", "tail", "wave_eff", "boundness", "log_ai_ridge",
                  "log_bytes_per_l2", "log_traffic_ratio", "log_roof_ms"]  # fmt: skip
# Waves and tail for every SIMT candidate tile, whichever cuBLAS picks (an optional block).
MULTI_TILE_FEATURES = [f"{n}_{a}x{b}" for a, b in SIMT_TILES for n in ("log_waves", "tail")]
# GPU columns, all from the spec table (gpus.csv); sets compared in training/train_gemm.py.
GPU_FEATURE_SETS: dict[str, list[str]] = {
    "none": [],
    "neusight": ["g_log_sm", "g_log_peak", "g_log_bw", "g_log_l2"],
    "spec": ["g_log_sm", "g_log_clock", "g_log_bw", "g_log_l2", "g_ridge", "g_log_tdp",
             "g_log_peak_per_w", "g_lanes"],
    "power": ["g_log_w_per_sm_ghz"],
    "spec_power": ["g_log_sm", "g_log_clock", "g_log_bw", "g_log_l2", "g_ridge", "g_log_tdp",
                   "g_log_peak_per_w", "g_lanes", "g_log_w_per_sm_ghz"],
    "spec_base": ["g_log_sm", "g_log_clock", "g_log_bw", "g_log_l2", "g_ridge", "g_log_tdp",
                  "g_log_peak_per_w", "g_lanes", "g_base_ratio"],
}  # fmt: skip


def gemm_dims(rows: pd.DataFrame) -> tuple[np.ndarray, ...]:
    """(batch, M, K reduction, N output, has_bias, is_bmm) of canonical GEMM rows."""

    def col(c: str) -> np.ndarray:
        v = pd.to_numeric(rows[c], errors="coerce") if c in rows else pd.Series(np.nan, rows.index)
        return np.nan_to_num(v.astype("float64").to_numpy(), nan=1.0)

    op = rows["op"].astype(str)
    b, m, n, k = col("b"), col("m"), col("n"), col("k")
    bmm = op.isin(BMM_OPS).to_numpy()
    return (np.where(bmm, b, 1.0), np.where(bmm, m, b * m), n, k,
            op.isin(BIAS_OPS).to_numpy(), bmm)  # fmt: skip


def select_tile(
    batch: np.ndarray, m: np.ndarray, n: np.ndarray, sms: np.ndarray, tensor: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The output tile per row: the largest candidate whose grid fills every SM once
    (cuBLAS's heuristics shrink tiles when a grid of big tiles would leave SMs idle); the
    smallest candidate when none does."""
    tm, tn = np.zeros(len(m)), np.zeros(len(m))
    for cands, mask in ((SIMT_TILES, ~tensor), (TENSOR_TILES, tensor)):
        a, b = np.full(len(m), float(cands[-1][0])), np.full(len(m), float(cands[-1][1]))
        done = np.zeros(len(m), bool)
        for ta, tb in cands:  # largest first
            fills = batch * np.ceil(m / ta) * np.ceil(n / tb) >= sms * TILES_PER_SM
            take = fills & ~done
            a[take], b[take], done = ta, tb, done | fills
        tm[mask], tn[mask] = a[mask], b[mask]
    return tm, tn


def tile_waves(
    batch: np.ndarray,
    m: np.ndarray,
    n: np.ndarray,
    tile_m: np.ndarray,
    tile_n: np.ndarray,
    sms: np.ndarray,
    tiles_per_sm: int = TILES_PER_SM,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tiles, waves, tail): tail is the fraction of the last wave's tile slots in use."""
    tiles = np.asarray(batch) * np.ceil(np.asarray(m) / tile_m) * np.ceil(np.asarray(n) / tile_n)
    slots = np.asarray(sms, float) * tiles_per_sm
    waves = np.ceil(tiles / slots)
    tail = (tiles - (waves - 1) * slots) / slots
    return tiles, waves, tail


def _gpu_frame(rows: pd.DataFrame, gpus: Mapping[str, GpuSpec] | GpuSpec) -> pd.DataFrame:
    if isinstance(gpus, GpuSpec):
        specs = {gpus.id: gpus}
        ids = np.full(len(rows), gpus.id, dtype=object)
    else:
        specs, ids = dict(gpus), rows["gpu_id"].astype(str).to_numpy()
    g = gpu_table(specs)
    base = {k: (s.base_clock_mhz or np.nan) for k, s in specs.items()}
    g["base"] = g.index.map(base).astype(float)
    return g.loc[ids].reset_index(drop=True)


def gemm_features(rows: pd.DataFrame, gpus: Mapping[str, GpuSpec] | GpuSpec) -> pd.DataFrame:
    """Learner inputs and ``roof_ms`` (the tiled bound + launch) for canonical GEMM rows."""
    df = rows.reset_index(drop=True)
    g = _gpu_frame(df, gpus)
    batch, m, red, out, bias, bmm = gemm_dims(df)
    dtype = df["dtype"].astype(str).to_numpy()
    elt = pd.Series(dtype).map(DTYPE_BYTES).fillna(4.0).to_numpy()
    fp32_math = (
        df["math_mode"].astype(str).eq("fp32_mul_fp32_acc").to_numpy()
        if "math_mode" in df
        else np.zeros(len(df), bool)
    )
    col = np.select([dtype == "tf32", dtype == "float16", dtype == "bfloat16"],
                    ["tf32", "fp16", "bf16"], "fp32")  # fmt: skip
    col = np.where(fp32_math, "fp32", col)
    peak = np.choose(pd.Series(col).map({"fp32": 0, "tf32": 1, "fp16": 2, "bf16": 3}).to_numpy(),
                     [g[c].to_numpy() for c in ("fp32", "tf32", "fp16", "bf16")])  # fmt: skip
    tensor = peak > g["fp32"].to_numpy() * 1.01  # the dtype has a tensor-core peak above fp32
    sms, bw = g["g_sm"].to_numpy(), g["bw"].to_numpy()
    tm, tn = select_tile(batch, m, out, sms, tensor)
    tiles, waves, tail = tile_waves(batch, m, out, tm, tn, sms)
    flops = 2 * batch * m * red * out
    nbytes = elt * (batch * m * red + np.where(bmm, batch, 1.0) * red * out + batch * m * out)
    nbytes = nbytes + elt * bias * out
    # One wave: each SM computes TILES_PER_SM full tiles at its 1/SMs share of the peak.
    t_wave = TILES_PER_SM * 2 * tm * tn * red / (peak / sms)
    t_comp = waves * t_wave
    t_mem = nbytes / bw
    # DRAM bytes if no tile reused another's operands from L2: an upper bound on traffic.
    traffic = elt * batch * (m * red * np.ceil(out / tn) + red * out * np.ceil(m / tm) + m * out)
    roof_s = np.maximum(t_comp, t_mem)
    clock = g["g_clock"].to_numpy()
    f = {
        "log_batch": np.log2(batch), "log_m": np.log2(np.maximum(m, 1)),
        "log_red": np.log2(np.maximum(red, 1)), "log_out": np.log2(np.maximum(out, 1)),
        "is_bmm": bmm.astype(float), "has_bias": bias.astype(float), "elt_bytes": elt,
        "tensor_core": tensor.astype(float),
        "kernel_only": (df["source"].astype(str).isin(KERNEL_ONLY_SOURCES).to_numpy()
                        if "source" in df else np.zeros(len(df), bool)).astype(float),
        "log_tile_m": np.log2(tm), "log_tile_n": np.log2(tn), "log_tiles": np.log2(tiles),
        "log_waves": np.log2(waves), "tail": tail, "wave_eff": tiles / (waves * sms * TILES_PER_SM),
        "boundness": np.log10(t_comp / t_mem), "log_ai_ridge": np.log10(flops / nbytes / (peak / bw)),
        "log_bytes_per_l2": np.log2(nbytes / (g["g_l2_mb"].to_numpy() * 2**20)),
        "log_traffic_ratio": np.log2(traffic / nbytes), "log_roof_ms": np.log10(roof_s * 1e3),
        "g_log_sm": np.log2(sms), "g_log_clock": np.log2(clock), "g_log_bw": np.log10(bw),
        "g_log_l2": np.log2(g["g_l2_mb"].to_numpy()), "g_log_peak": np.log10(peak),
        "g_ridge": np.log10(peak / bw), "g_log_tdp": np.log10(g["g_tdp"].to_numpy()),
        "g_log_peak_per_w": np.log10(peak / g["g_tdp"].to_numpy()), "g_lanes": g["g_lanes"].to_numpy(),
        "g_base_ratio": g["base"].to_numpy() / clock,
        # Board power per SM-GHz: low on the cards that cannot hold boost under load (T4, L4).
        "g_log_w_per_sm_ghz": np.log10(g["g_tdp"].to_numpy() / (sms * clock / 1e3)),
    }  # fmt: skip
    for a, b in SIMT_TILES:
        _, w_ab, t_ab = tile_waves(batch, m, out, a, b, sms)
        f[f"log_waves_{a}x{b}"], f[f"tail_{a}x{b}"] = np.log2(w_ab), t_ab
    feats = pd.DataFrame({k: np.asarray(v, dtype=float) for k, v in f.items()})
    feats["roof_ms"] = roof_s * 1e3 + LAUNCH_MS
    # The plain roofline (no tile padding): no kernel beats it, whatever tile it uses.
    feats["bound_ms"] = np.maximum(flops / peak, t_mem) * 1e3 + LAUNCH_MS
    feats["tiles"], feats["waves"] = tiles, waves
    return feats


@dataclass
class GemmModel:
    """The learner of ``log(t / roof_ms)``, floored at ``log(bound_ms / roof_ms)``: a kernel
    is never predicted faster than the plain roofline (utilisation at most 1), while the tiled
    bound, which assumes the tile we picked, may be beaten by a kernel whose tiles fit better.

    ``kind`` "lgb": LightGBM text model, clipped at the floor; "mlp": a small ReLU network
    whose output goes through softplus above the floor (bounded by construction), weights in
    ``mlp`` (standardised inputs, NaN -> the training mean). ``interval``: p10/p90 of
    log(measured / predicted) on held-out GPUs.
    """

    kind: str
    features: list[str]
    boosters: list[Any] = field(default_factory=list)  # "lgb": bagged, predictions averaged
    mlp: dict[str, Any] = field(default_factory=dict)
    interval: dict[str, float] = field(default_factory=lambda: {"p10": 0.0, "p90": 0.0})
    meta: dict[str, Any] = field(default_factory=dict)
    # Optional GPU-level term added to the learner's output: intercept + coef . GPU columns
    # (a line in a few spec columns, fit on the training GPUs' mean offsets; see train_gemm).
    offset: dict[str, Any] = field(default_factory=dict)

    def gpu_offset(self, feats: pd.DataFrame) -> np.ndarray:
        if not self.offset:
            return np.zeros(len(feats))
        g = feats.reindex(columns=self.offset["features"]).to_numpy(dtype=float)
        g = np.where(np.isnan(g), np.asarray(self.offset["mean"]), g)
        return self.offset["intercept"] + g @ np.asarray(self.offset["coef"])

    def log_ratio(self, feats: pd.DataFrame) -> np.ndarray:
        x = feats.reindex(columns=self.features).to_numpy(dtype=float)
        floor = np.log(feats["bound_ms"].to_numpy() / feats["roof_ms"].to_numpy())
        if self.kind == "lgb":
            raw = np.mean([b.predict(x, num_threads=1) for b in self.boosters], axis=0)
            raw = raw + self.gpu_offset(feats)
            return np.maximum(raw, floor)
        mean, std = np.asarray(self.mlp["mean"]), np.asarray(self.mlp["std"])
        h = (np.where(np.isnan(x), mean, x) - mean) / std
        layers = self.mlp["layers"]
        for i, (w, b) in enumerate(layers):
            h = h @ np.asarray(w) + np.asarray(b)
            if i < len(layers) - 1:
                h = np.maximum(h, 0.0)
        return floor + np.logaddexp(0.0, h[:, 0])  # softplus

    def predict_ms(self, feats: pd.DataFrame) -> np.ndarray:
        return feats["roof_ms"].to_numpy() * np.exp(self.log_ratio(feats))

    def predict_rows(
        self, rows: pd.DataFrame, gpus: Mapping[str, GpuSpec] | GpuSpec
    ) -> pd.DataFrame:
        """``pred_ms``, ``p10_ms``, ``p90_ms`` for canonical GEMM rows. The p10 is floored
        at the plain roofline too, as the prediction is: no kernel runs above the peak."""
        feats = gemm_features(rows, gpus)
        ms = self.predict_ms(feats)
        p10 = np.maximum(ms * np.exp(min(self.interval["p10"], 0.0)), feats["bound_ms"].to_numpy())
        return pd.DataFrame({"pred_ms": ms, "p10_ms": p10,
                             "p90_ms": ms * np.exp(max(self.interval["p90"], 0.0))})  # fmt: skip

    def save(self, folder: str | Path) -> Path:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"version": GEMM_MODEL_VERSION, "kind": self.kind, "features": self.features,
               "mlp": self.mlp, "interval": self.interval, "meta": self.meta,
               "offset": self.offset}  # fmt: skip
        for stale in out.glob("gemm_*.txt.gz"):
            stale.unlink()
        for i, booster in enumerate(self.boosters):
            with gzip.GzipFile(out / f"gemm_{i}.txt.gz", "wb", mtime=0) as fh:
                fh.write(booster.model_to_string().encode())
        doc["boosters"] = len(self.boosters)
        (out / "model.json").write_text(json.dumps(doc, indent=1, sort_keys=True, default=str))
        return out

    @classmethod
    def load(cls, folder: str | Path) -> GemmModel:
        src = Path(folder)
        try:
            doc = json.loads((src / "model.json").read_text())
            if doc.get("version") != GEMM_MODEL_VERSION:
                raise ValueError(f"version {doc.get('version')} != {GEMM_MODEL_VERSION}")
            boosters = []
            if doc["kind"] == "lgb":
                import lightgbm as lgb

                for i in range(int(doc["boosters"])):
                    with gzip.open(src / f"gemm_{i}.txt.gz", "rb") as fh:
                        boosters.append(lgb.Booster(model_str=fh.read().decode()))
        except Exception as exc:  # missing or unreadable files: an artifact problem
            raise ArtifactError(
                f"GEMM model in {src} is missing or corrupt ({type(exc).__name__}: {exc}); "
                "rebuild it with python -m training.train_gemm package=true"
            ) from exc
        return cls(doc["kind"], doc["features"], boosters, doc.get("mlp", {}),
                   doc.get("interval", {"p10": 0.0, "p90": 0.0}), doc.get("meta", {}),
                   doc.get("offset", {}))  # fmt: skip


def is_gemm_row(rows: pd.DataFrame) -> np.ndarray:
    """Rows this model times: GEMM ops with their m/n/k shape columns present."""
    ok = np.array(rows["op"].astype(str).isin(GEMM_ROW_OPS))
    for c in ("m", "n", "k"):
        ok &= np.array(pd.to_numeric(rows[c], errors="coerce").notna()) if c in rows else False
    return ok


def is_tiled_row(rows: pd.DataFrame) -> np.ndarray:
    """GEMM rows this model times in predictions: :func:`is_gemm_row` in a dtype of
    :data:`TILE_DTYPES` (it is fit on every GEMM row, any dtype)."""
    dtype = rows["dtype"].astype(str) if "dtype" in rows else pd.Series("float32", index=rows.index)
    return is_gemm_row(rows) & dtype.isin(TILE_DTYPES).to_numpy()


def override_gemm(
    rows: pd.DataFrame,
    gpus: Mapping[str, GpuSpec] | GpuSpec,
    pred: pd.DataFrame,
    model: GemmModel | None,
) -> pd.DataFrame:
    """``pred`` (the heads' predictions for ``rows``, same order) with GEMM rows of
    :data:`TILE_DTYPES` re-timed by ``model``; ``method`` says ``gemm-tiles`` there. No model:
    ``pred`` unchanged."""
    if model is None or rows.empty:
        return pred
    sel = is_tiled_row(rows)
    if not sel.any():
        return pred
    sub = rows.iloc[np.flatnonzero(sel)]
    new = model.predict_rows(sub, gpus)
    pred = pred.copy()
    for col in ("pred_ms", "p10_ms", "p90_ms"):
        if col in pred:
            pred.loc[pred.index[sel], col] = new[col].to_numpy()
    if "method" in pred:
        pred.loc[pred.index[sel], "method"] = METHOD
    return pred


def retime_gemm_many(
    rows: pd.DataFrame, gpus: list[GpuSpec], pred: pd.DataFrame, model: GemmModel | None
) -> pd.DataFrame:
    """``pred`` for ``rows`` repeated once per GPU (GPU-major, as ``per_op`` builds it) with
    the GEMM rows re-timed by ``model``; unchanged when there is no model or no GEMM."""
    sel = is_tiled_row(rows) if model is not None and not rows.empty else np.zeros(0, bool)
    if not sel.any():
        return pred
    sub = rows.iloc[np.flatnonzero(sel)]
    new = model.predict_rows(*per_gpu(sub, gpus))
    at = (np.arange(len(gpus))[:, None] * len(rows) + np.flatnonzero(sel)[None, :]).ravel()
    pred = pred.copy()
    for col in ("pred_ms", "p10_ms", "p90_ms"):
        pred.iloc[at, pred.columns.get_loc(col)] = new[col].to_numpy()
    if "method" in pred:
        pred.iloc[at, pred.columns.get_loc("method")] = METHOD
    return pred


def gemm_model_for(per_op_model: Any) -> GemmModel | None:
    """The GEMM model that goes with a per-op model: the one it carries as ``.gemm`` (a CV
    fold's, fit without the fold's GPU); with the packaged heads (``None`` or the loaded
    packaged object) the packaged one; with any other model none, so that a model passed in
    never gets a GEMM model fit on GPUs it was meant not to see."""
    if per_op_model is not None and hasattr(per_op_model, "gemm"):
        return per_op_model.gemm
    if per_op_model is None:
        return load_gemm_model()
    from boom_ml.timing.heads import load_model

    try:
        packaged = load_model()
    except ArtifactError:
        return None
    return load_gemm_model() if per_op_model is packaged else None


def load_gemm_model(uri: str | None = None) -> GemmModel | None:
    """The packaged model (``uri`` None), a folder, or None when ``$BOOM_GEMM_MODEL=off`` or
    no model is packaged (the per-op heads then time GEMMs)."""
    uri = uri if uri is not None else os.environ.get(MODEL_ENV) or None
    return _load_cached(uri)


@functools.lru_cache(maxsize=4)
def _load_cached(uri: str | None) -> GemmModel | None:
    if uri == "off":
        return None
    folder = PACKAGED_DIR if uri in (None, "", "packaged", "default") else Path(uri).expanduser()
    if uri in (None, "", "packaged", "default") and not (folder / "model.json").exists():
        return None
    return GemmModel.load(folder)
