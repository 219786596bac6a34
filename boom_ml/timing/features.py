"""Per-op features shared by training (canonical kernel rows) and inference (traced nodes).

One function, :func:`kernel_features`, maps rows in the canonical kernel convention (op,
family, dtype, direction and the shape columns of ``data_collection/schema.py``) plus the
GPU's spec sheet to model inputs. Training calls it on measured rows; inference calls it on
rows that ``boom_ml.timing.per_op`` derives from graph nodes. Sharing the function is what
keeps a feature identical for the same op at training and inference time.

The learned target is ``log(latency / roofline)``: the roofline already carries the
first-order effect of the GPU (peak FLOP/s for the dtype, bandwidth), so what a head learns
is an efficiency that depends on the shape relative to the GPU (waves, tiles per SM, bytes
relative to L2), which transfers to a GPU that was never measured far better than raw ms.

GEMM convention (NeuSight's): ``bmm`` multiplies (b,m,n)x(b,n,k); ``linear``/``mm`` apply a
single (n -> k) weight to b*m rows. So n is always the reduction dim and k the output width.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.roofline import LAUNCH_MS
from boom_ml.timing.spec_sheet import gpu_table
from boom_ml.trace.sdpa_select import causal_pairs

FEATURE_VERSION = 2
# LAUNCH_MS (eager launch + inter-kernel gap) is added to every roofline so that tiny ops
# have a ratio near 1 instead of 1e3; one constant, shared with the roofline fallback.

# Heads (one model each) and which canonical/trace families they cover.
HEADS = ("gemm", "conv", "attention", "norm", "softmax", "elementwise", "embedding",
         "optimizer", "copy")  # fmt: skip
FAMILY_HEAD = {
    "gemm": "gemm", "conv": "conv", "attention": "attention", "norm": "norm",
    "softmax": "softmax", "reduction": "softmax", "loss": "softmax",
    "elementwise": "elementwise", "pooling": "elementwise", "fill": "copy",
    "embedding": "embedding", "optimizer": "optimizer", "copy": "copy", "other": "elementwise",
}  # fmt: skip
BMM_OPS = {"bmm", "baddbmm"}
DTYPE_BYTES = {"float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

# Elementwise ops: (full-size tensors read, transcendental). Unknown ops use the columns
# ``arity``/``transcendental`` when a traced node supplies them, else (1, False).
ELEMENTWISE: dict[str, tuple[int, bool]] = {
    **{o: (2, False) for o in ("add", "sub", "mul", "div", "maximum", "minimum", "rsub",
                               "threshold_backward", "eq", "ne", "lt", "gt", "le", "ge")},
    **{o: (1, False) for o in ("add_scalar", "mul_scalar", "div_scalar", "sub_scalar", "relu",
                               "neg", "abs", "clamp", "fill", "copy", "masked_fill")},
    **{o: (2, True) for o in ("pow", "silu_and_mul", "gelu_backward", "tanh_backward",
                              "sigmoid_backward", "silu_backward", "atan2")},
    **{o: (1, True) for o in ("pow_scalar", "gelu", "tanh", "sigmoid", "silu", "exp", "log",
                              "sqrt", "rsqrt", "erf", "sin", "cos", "softplus", "rotary_embedding")},
    "add3": (3, False),
    "where": (3, False),
    "addcmul": (3, False),
    "addcdiv": (3, True),
}  # fmt: skip
# Rough FLOPs per output element of row-wise ops (mean, variance, scale, shift ...).
ROW_OP_FLOPS = {"layer_norm": 8, "rms_norm": 6, "batch_norm": 8, "group_norm": 8,
                "softmax": 5, "log_softmax": 6}  # fmt: skip

ALL_GPU_FEATURES = ["g_log_peak", "g_log_fp32", "g_log_bw", "g_ridge", "g_sm", "g_clock",
                    "g_l2_mb", "g_tdp", "g_lanes", "g_log_peak_per_w", "g_log_bw_per_sm"]  # fmt: skip
# What the heads see of the GPU beyond the roofline (which already carries peak and
# bandwidth): power headroom per FLOP (clock throttling), balance, cache and SM count. With
# ~8 distinct training GPUs every spec column can act as a GPU id; in a leave-one-GPU-out
# comparison over six held-out GPUs (bmm + linear) this set had the lowest mean MAPE
# (22.6 %, against 24-25 % with every column of ALL_GPU_FEATURES and 29 % with none).
GPU_FEATURES = ["g_log_peak_per_w", "g_ridge", "g_l2_mb", "g_sm"]
ROOF_FEATURES = ["log_flops", "log_bytes", "log_intensity", "log_t_compute", "log_t_memory",
                 "log_t_traffic", "boundness", "log_bytes_per_l2", "elt_bytes", "tensor_core"]  # fmt: skip
# Wave quantisation for a few CUTLASS/cuBLAS-like output tiles (rows x cols).
TILES = ((64, 64), (128, 128), (256, 128))
# Output tile of the DRAM-traffic model of a tiled GEMM: every tile streams its A row panel
# and B column panel from memory (no L2 reuse). A bound, not a kernel choice; it makes the
# roofline see that a low-bandwidth card (L4, T4) cannot feed its SMs, which raw peak misses.
TRAFFIC_TILE = 128
GEMM_FEATURES = ["log_batch", "log_rows", "log_red", "log_out", "log_aspect", "log_min_dim",
                 "pow2_rows", "pow2_red", "pow2_out", "is_bmm", "has_bias",
                 *(f"{name}_{a}x{b}" for a, b in TILES for name in ("waves", "wave_eff",
                                                                    "tiles_per_sm"))]  # fmt: skip
CONV_FEATURES = [*GEMM_FEATURES, "log_cbatch", "log_cin", "log_cout", "log_hw", "log_out_hw",
                 "kernel_area", "conv_stride", "conv_pad", "log_groups", "grad_code"]  # fmt: skip
ROW_FEATURES = ["log_numel", "log_rows_r", "log_cols", "cols_pow2", "log_rows_per_sm",
                "is_backward", "op_flops"]  # fmt: skip
ELEM_FEATURES = ["log_numel", "arity", "transcendental", "log_numel_per_sm", "numel_pow2",
                 "is_backward"]  # fmt: skip
ATTN_FEATURES = ["log_batch", "log_heads", "log_head_dim", "log_seq_q", "log_seq_kv",
                 "is_backward"]  # fmt: skip
HEAD_FEATURES: dict[str, list[str]] = {
    "gemm": GEMM_FEATURES,
    "conv": CONV_FEATURES,
    "attention": ATTN_FEATURES,
    "norm": ROW_FEATURES,
    "softmax": ROW_FEATURES,
    "elementwise": ELEM_FEATURES,
    "embedding": ROW_FEATURES,
    "optimizer": ELEM_FEATURES,
    "copy": ELEM_FEATURES,
}


# Sources whose latency is GPU kernel time only (vidur: profiler CUDA time; DeepBench: mean
# of back-to-back launches), where NeuSight times one eager call with CUDA events, launch gap
# included. A covariate for training; at inference it is 0, i.e. "an eager op's wall time",
# except for the kernels a library call issues back to back from C++ (a cuDNN RNN's per-step
# GEMMs and gate kernels: per_op marks their rows with the LIBRARY source), as DeepBench's are.
LIBRARY = "library"
KERNEL_ONLY_SOURCES = ("vidur", "deepbench", LIBRARY)
MEASUREMENT_FEATURES = ["kernel_only"]


def feature_columns(head: str, gpu_features: list[str] | None = None) -> list[str]:
    """Model input columns of ``head``, in a fixed order (the order the model was fit in)."""
    return [
        *HEAD_FEATURES[head],
        *ROOF_FEATURES,
        *MEASUREMENT_FEATURES,
        *(GPU_FEATURES if gpu_features is None else gpu_features),
    ]


def numeric(df: pd.DataFrame, col: str, default: float = np.nan) -> np.ndarray:
    """Column as float64 (NaN for null), or ``default`` everywhere when it is absent."""
    if col not in df.columns:
        return np.full(len(df), default, dtype=float)
    return pd.to_numeric(df[col], errors="coerce").astype("float64").to_numpy()


def distinct_rows(rows: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """The distinct rows of ``rows`` and, for each row, the index of its distinct row: a
    model times a kernel row from the row alone, so identical rows are featurised once."""
    if rows.empty:
        return rows, np.zeros(0, dtype=np.int64)
    # groups numbered in order of first appearance: group j's first row is distinct row j
    codes = rows.groupby(list(rows.columns), sort=False, dropna=False).ngroup().to_numpy()
    _, first = np.unique(codes, return_index=True)
    return rows.iloc[first].reset_index(drop=True), codes


def per_gpu(rows: pd.DataFrame, gpus: list[GpuSpec]) -> tuple[pd.DataFrame, dict[str, GpuSpec]]:
    """``rows`` repeated once per GPU (GPU-major), each copy's ``gpu_id`` a key of the mapping
    returned with it (``k:id``: a GPU may appear twice), as :func:`kernel_features` takes them."""
    keys = [f"{k}:{g.id}" for k, g in enumerate(gpus)]
    frame = pd.concat([rows.assign(gpu_id=key) for key in keys], ignore_index=True)
    return frame, dict(zip(keys, gpus, strict=True))


def heads_of(rows: pd.DataFrame) -> np.ndarray:
    """The head that times each kernel row, by its family (elementwise when unknown)."""
    return rows["family"].astype(str).map(FAMILY_HEAD).fillna("elementwise").to_numpy()


def row_count(rows: pd.DataFrame) -> np.ndarray:
    """Rows of a row-wise op: its ``rows`` column, else ``numel / cols``."""
    numel, cols, given = numeric(rows, "numel"), numeric(rows, "cols"), numeric(rows, "rows")
    return np.where(np.isnan(given), numel / np.maximum(cols, 1), given)


def _log2(x: np.ndarray) -> np.ndarray:
    return np.log2(np.maximum(x, 1.0))


def _pow2(x: np.ndarray) -> np.ndarray:
    """Largest power of two dividing x, as an exponent capped at 7 (128-alignment)."""
    xi = np.nan_to_num(x, nan=1.0).astype(np.int64)
    out = np.zeros(len(xi))
    for e in range(1, 8):
        out += (xi % (1 << e) == 0) & (xi > 0)
    return out


def _peak(rows: pd.DataFrame, g: pd.DataFrame, matrix: np.ndarray) -> tuple[np.ndarray, ...]:
    """Peak FLOP/s each row can reach, and whether it runs on tensor cores."""
    dtype = rows["dtype"].astype(str).to_numpy()
    fp32_math = (
        rows["math_mode"].astype(str).eq("fp32_mul_fp32_acc").to_numpy()
        if "math_mode" in rows.columns
        else np.zeros(len(rows), bool)
    )
    col = np.select(
        [dtype == "tf32", dtype == "float16", dtype == "bfloat16"], ["tf32", "fp16", "bf16"], "fp32"
    )
    col = np.where(fp32_math | ~matrix, "fp32", col)
    peak = np.zeros(len(rows))
    for name in ("fp32", "tf32", "fp16", "bf16"):
        peak = np.where(col == name, g[name].to_numpy(), peak)
    tensor = (peak > g["fp32"].to_numpy() * 1.01).astype(float)
    return peak, tensor


def _gemm_dims(df: pd.DataFrame) -> tuple[np.ndarray, ...]:
    """(batch, rows, reduction, out, weight batch) of a GEMM row in NeuSight's convention."""
    b, m, n, k = (np.nan_to_num(numeric(df, c), nan=1.0) for c in ("b", "m", "n", "k"))
    bmm = df["op"].astype(str).isin(BMM_OPS).to_numpy()
    batch = np.where(bmm, b, 1.0)
    rows = np.where(bmm, m, b * m)
    return batch, rows, n, k, np.where(bmm, b, 1.0), bmm


def conv_shape(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """A conv row's shape, each width field defaulting to its height one (square kernels,
    inputs, strides and padding), stride 1, padding 0, one group."""
    kh, h = numeric(df, "kernel_size"), numeric(df, "input_h")
    sh = np.nan_to_num(numeric(df, "stride"), nan=1.0)
    ph = np.nan_to_num(numeric(df, "padding"), nan=0.0)

    def width(col: str, height: np.ndarray) -> np.ndarray:
        return np.where(np.isnan(numeric(df, col)), height, numeric(df, col))

    return dict(n=numeric(df, "batch"), c=numeric(df, "in_channels"), o=numeric(df, "out_channels"),
                kh=kh, kw=width("kernel_w", kh), h=h, w=width("input_w", h), sh=sh,
                sw=width("stride_w", sh), ph=ph, pw=width("padding_w", ph),
                groups=np.nan_to_num(numeric(df, "groups", 1.0), nan=1.0))  # fmt: skip


def _conv_dims(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """Conv shape and its implicit-GEMM view for the pass the row times."""
    s = conv_shape(df)
    n, c, o, kh, kw, h, w = (s[k] for k in ("n", "c", "o", "kh", "kw", "h", "w"))
    sh, sw, ph, pw, groups = (s[k] for k in ("sh", "sw", "ph", "pw", "groups"))
    oh = np.maximum(np.floor((h + 2 * ph - kh) / sh) + 1, 1)
    ow = np.maximum(np.floor((w + 2 * pw - kw) / sw) + 1, 1)
    grad = df["grad_wrt"].astype(str).to_numpy() if "grad_wrt" in df.columns else None
    bwd = df["direction"].astype(str).eq("backward").to_numpy()
    wrt_w = bwd & (grad == "weight") if grad is not None else np.zeros(len(df), bool)
    wrt_in = bwd & ~wrt_w
    # Implicit GEMM: forward (N*OH*OW) x (C*KH*KW/g) -> O; dgrad (N*H*W) x (O*KH*KW/g) -> C;
    # wgrad O x (N*OH*OW) -> C*KH*KW/g (per group, groups as the GEMM batch).
    area = kh * kw
    rows = np.select([wrt_in, wrt_w], [n * h * w, o / groups], n * oh * ow)
    red = np.select([wrt_in, wrt_w], [o / groups * area, n * oh * ow], c / groups * area)
    out = np.select([wrt_in, wrt_w], [c / groups, c / groups * area], o / groups)
    code = np.select([wrt_in, wrt_w], [1.0, 2.0], 0.0)
    return dict(n=n, c=c, o=o, h=h, w=w, oh=oh, ow=ow, area=area, sh=sh, ph=ph, groups=groups,
                rows=rows, red=red, out=out, code=code)  # fmt: skip


def _tile_features(out: dict[str, np.ndarray], batch, rows, cols, sm) -> None:
    for a, b in TILES:
        tiles = batch * np.ceil(rows / a) * np.ceil(cols / b)
        waves = tiles / sm
        out[f"waves_{a}x{b}"] = np.log2(np.maximum(waves, 1e-3))
        with np.errstate(invalid="ignore"):  # no tiles: NaN, as trained, without numpy's
            out[f"wave_eff_{a}x{b}"] = tiles / (np.ceil(waves) * sm)  # warning on the terminal
        out[f"tiles_per_sm_{a}x{b}"] = np.ceil(waves)


def kernel_features(rows: pd.DataFrame, gpus: Mapping[str, GpuSpec] | GpuSpec) -> pd.DataFrame:
    """Features, ``head``, ``flops``, ``bytes`` and ``roof_ms`` for canonical kernel rows.

    ``gpus`` is one spec (every row runs on it) or specs by ``gpu_id`` (one per row's id).
    Rows of families without shape formulas may carry ``flops``/``bytes`` columns instead.
    Each head's rows are featurised apart, so a mixed frame gives the same features per row
    as the row alone would (what makes training and inference agree).
    """
    df = rows.reset_index(drop=True)
    if isinstance(gpus, GpuSpec):
        g = gpu_table({gpus.id: gpus}).iloc[np.zeros(len(df), dtype=int)]
    else:
        g = gpu_table(gpus).loc[df["gpu_id"].astype(str)]
    g = g.reset_index(drop=True)
    head = heads_of(df)
    parts = []
    for h in pd.unique(head):
        idx = np.flatnonzero(head == h)
        sub, gsub = df.iloc[idx].reset_index(drop=True), g.iloc[idx].reset_index(drop=True)
        part = _head_features(str(h), sub, gsub)
        part.index = idx
        parts.append(part)
    if not parts:
        return pd.DataFrame(
            columns=["head", "family", "direction", "flops", "bytes", "roof_ms", "mem_ms"]
        )
    return pd.concat(parts).sort_index()


def _head_features(head: str, df: pd.DataFrame, g: pd.DataFrame) -> pd.DataFrame:
    op = df["op"].astype(str)
    elt = df["dtype"].astype(str).map(DTYPE_BYTES).fillna(4.0).to_numpy()
    sm = g["g_sm"].to_numpy()
    bwd = df["direction"].astype(str).eq("backward").to_numpy().astype(float)
    source = df["source"].astype(str) if "source" in df.columns else pd.Series("", index=df.index)
    f: dict[str, np.ndarray] = {
        "is_backward": bwd,
        "kernel_only": source.isin(KERNEL_ONLY_SOURCES).to_numpy().astype(float),
    }
    traffic = None  # DRAM bytes of a tiled GEMM, for the matrix heads
    # Families without shape formulas (optimizer, copy, ...) bring the node's own counts.
    flops = np.nan_to_num(numeric(df, "flops"), nan=0.0)
    nbytes = np.nan_to_num(numeric(df, "bytes"), nan=0.0)
    if head == "gemm":
        batch, r, n, k, wbatch, bmm = _gemm_dims(df)
        bias = op.isin(["linear", "addmm", "baddbmm"]).to_numpy()
        flops = 2 * batch * r * n * k
        nbytes = elt * (batch * r * n + wbatch * n * k + batch * r * k + bias * k)
        traffic = _tile_traffic(elt, batch, r, n, k)
        _gemm_block(f, batch, r, n, k, sm)
        f["is_bmm"], f["has_bias"] = bmm.astype(float), bias.astype(float)
    elif head == "conv":
        c = _conv_dims(df)
        flops = 2 * c["groups"] * c["rows"] * c["red"] * c["out"]
        wts = c["o"] * c["c"] / c["groups"] * c["area"]
        nbytes = elt * (
            c["n"] * c["c"] * c["h"] * c["w"] + wts + c["n"] * c["o"] * c["oh"] * c["ow"]
        )
        traffic = _tile_traffic(elt, c["groups"], c["rows"], c["red"], c["out"])
        _gemm_block(f, c["groups"], c["rows"], c["red"], c["out"], sm)
        f.update(is_bmm=(c["groups"] > 1).astype(float), has_bias=np.zeros(len(df)),
                 log_cbatch=_log2(c["n"]), log_cin=_log2(c["c"]), log_cout=_log2(c["o"]),
                 log_hw=_log2(c["h"] * c["w"]), log_out_hw=_log2(c["oh"] * c["ow"]),
                 kernel_area=c["area"], conv_stride=c["sh"], conv_pad=c["ph"],
                 log_groups=_log2(c["groups"]), grad_code=c["code"])  # fmt: skip
    elif head == "attention":
        b, hh, d = numeric(df, "batch"), numeric(df, "heads"), numeric(df, "head_dim")
        sq = numeric(df, "seq_q")
        skv = np.where(np.isnan(numeric(df, "seq_kv")), sq, numeric(df, "seq_kv"))
        # QK^T and PV: 4*B*H*Sq*Skv*D forward; backward recomputes and does ~2.5x that
        # (torch's flop_counter formulas); a causal kernel does the kept pairs' share only,
        # which a traced row's own count carries (flash and memory-efficient kernels skip
        # the masked blocks)
        full = 4 * b * hh * sq * skv * d * np.where(bwd > 0, 2.5, 1.0)
        # a row that says causal (predict_ops) without counted FLOPs: the kept pairs' share,
        # as a traced row's count has it
        kept = causal_pairs(sq, skv)
        causal = np.nan_to_num(numeric(df, "causal")) > 0
        full_or_kept = np.where(causal, full * kept / np.maximum(sq * skv, 1), full)
        flops = np.where((flops > 0) & (flops < full), flops, full_or_kept)
        nbytes = elt * b * hh * d * (2 * sq + 2 * skv) * np.where(bwd > 0, 2.0, 1.0)
        f.update(log_batch=_log2(b), log_heads=_log2(hh), log_head_dim=_log2(d),
                 log_seq_q=_log2(sq), log_seq_kv=_log2(skv))  # fmt: skip
    elif head in ("norm", "softmax", "embedding"):
        numel, cols, rws = numeric(df, "numel"), numeric(df, "cols"), row_count(df)
        per = op.map(ROW_OP_FLOPS).fillna(5.0).to_numpy()
        # Forward reads and writes each element once; backward reads two tensors, writes one.
        nbytes = np.where(nbytes > 0, nbytes, elt * numel * (2 + bwd))
        flops = np.where(flops > 0, flops, per * numel * (1 + bwd))
        f.update(log_numel=_log2(numel), log_rows_r=_log2(rws), log_cols=_log2(cols),
                 cols_pow2=_pow2(cols), log_rows_per_sm=np.log2(np.maximum(rws / sm, 1e-3)),
                 op_flops=per)  # fmt: skip
    else:  # elementwise, optimizer, copy: memory-bound streams over numel elements
        numel = numeric(df, "numel")
        # Stream rows (optimizer, copy: timing/bandwidth.py) bring their own arity; an op
        # named like an elementwise one (copy, fill) must not take the table's.
        table = ELEMENTWISE if head == "elementwise" else {}
        known = [table.get(o, (np.nan, np.nan)) for o in op]
        arity = np.array([a for a, _ in known], dtype=float)
        trans = np.array([t for _, t in known], dtype=float)
        arity = np.nan_to_num(np.where(np.isnan(arity), numeric(df, "arity", 1.0), arity), nan=1.0)
        trans = np.nan_to_num(
            np.where(np.isnan(trans), numeric(df, "transcendental", 0.0), trans), nan=0.0
        )
        nbytes = np.where(nbytes > 0, nbytes, elt * numel * (arity + 1))
        flops = np.where(flops > 0, flops, numel * (1 + 7 * trans))
        f.update(log_numel=_log2(numel), arity=arity, transcendental=trans,
                 log_numel_per_sm=np.log2(np.maximum(numel / sm, 1e-3)), numel_pow2=_pow2(numel))  # fmt: skip
    peak, tensor = _peak(df, g, np.full(len(df), head in ("gemm", "conv", "attention")))
    bw = g["bw"].to_numpy()
    t_c, t_m = flops / peak, nbytes / bw
    t_tr = np.maximum(traffic, nbytes) / bw if traffic is not None else t_m
    f.update(
        log_flops=np.log10(np.maximum(flops, 1.0)), log_bytes=np.log10(np.maximum(nbytes, 1.0)),
        log_intensity=np.log10(np.maximum(flops, 1.0) / np.maximum(nbytes, 1.0)),
        log_t_compute=np.log10(np.maximum(t_c, 1e-12)), log_t_memory=np.log10(np.maximum(t_m, 1e-12)),
        log_t_traffic=np.log10(np.maximum(t_tr, 1e-12)),
        boundness=np.log10(np.maximum(t_c, 1e-12) / np.maximum(t_tr, 1e-12)),
        log_bytes_per_l2=np.log2(np.maximum(nbytes, 1.0) / (g["g_l2_mb"].to_numpy() * 2**20)),
        elt_bytes=elt, tensor_core=tensor,
        g_log_peak=np.log10(peak), g_log_fp32=np.log10(g["fp32"].to_numpy()),
        g_log_bw=np.log10(bw), g_ridge=np.log10(peak / bw), g_sm=sm,
        g_clock=g["g_clock"].to_numpy(), g_l2_mb=g["g_l2_mb"].to_numpy(), g_tdp=g["g_tdp"].to_numpy(),
        g_lanes=g["g_lanes"].to_numpy(), g_log_peak_per_w=np.log10(peak / g["g_tdp"].to_numpy()),
        g_log_bw_per_sm=np.log10(bw / sm),
    )  # fmt: skip
    out = pd.DataFrame({k: np.asarray(v, dtype=float) for k, v in f.items()})
    out.insert(0, "head", head)
    out.insert(1, "family", df["family"].astype(str).to_numpy())
    out.insert(2, "direction", np.where(bwd > 0, "backward", "forward"))
    out["flops"], out["bytes"] = np.asarray(flops, float), np.asarray(nbytes, float)
    # The normaliser is the plain roofline; the tiled-traffic time is only a feature, since
    # as the normaliser it raised the mean leave-one-GPU-out GEMM error (33 % vs 24 %).
    out["roof_ms"] = np.maximum(t_c, t_m) * 1e3 + LAUNCH_MS
    out["mem_ms"] = t_m * 1e3  # the bandwidth bound: no DRAM stream is faster
    return out


def _tile_traffic(elt, batch, rows, red, cols) -> np.ndarray:
    """DRAM bytes of a GEMM tiled TRAFFIC_TILE x TRAFFIC_TILE with no cache reuse."""
    t = TRAFFIC_TILE
    a = batch * rows * red * np.ceil(cols / t)  # each column of tiles re-reads A
    b = batch * red * cols * np.ceil(rows / t)  # each row of tiles re-reads B
    return elt * (a + b + batch * rows * cols)


def _gemm_block(f: dict[str, np.ndarray], batch, rows, red, cols, sm) -> None:
    """Shape features of a (batch x rows x red) @ (red x cols) GEMM."""
    f.update(log_batch=_log2(batch), log_rows=_log2(rows), log_red=_log2(red),
             log_out=_log2(cols), log_aspect=np.log2(np.maximum(rows, 1) / np.maximum(cols, 1)),
             log_min_dim=_log2(np.minimum(np.minimum(rows, cols), red)),
             pow2_rows=_pow2(rows), pow2_red=_pow2(red), pow2_out=_pow2(cols))  # fmt: skip
    _tile_features(f, batch, rows, cols, sm)


def target(latency_ms: np.ndarray, roof_ms: np.ndarray) -> np.ndarray:
    """What the heads learn: log(measured / roofline), which transfers across GPUs."""
    return np.log(np.asarray(latency_ms, float) / np.asarray(roof_ms, float))


def matrix_for(feats: pd.DataFrame, head: str, gpu_features: list[str] | None = None) -> np.ndarray:
    """The model input matrix of ``head`` (columns absent for this frame are NaN)."""
    cols = feature_columns(head, gpu_features)
    return feats.reindex(columns=cols).to_numpy(dtype=float)
