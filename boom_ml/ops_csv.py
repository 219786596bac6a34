"""The operator CSV of ``python -m boom_ml.predict_ops``: its vocabulary (op names, shape
columns, dtypes) and its validation into canonical kernel rows, which the predictor times."""

from __future__ import annotations

import numpy as np
import pandas as pd

from boom_ml.errors import InvalidInputError, suggest
from boom_ml.timing.features import ELEMENTWISE, conv_shape

GEMM_OPS = {"bmm": "bmm", "baddbmm": "bmm", "linear": "linear", "addmm": "linear", "mm": "mm",
            "matmul": "mm", "gemm": "mm"}  # fmt: skip
ROW_OPS = {"layer_norm": "norm", "ln": "norm", "rms_norm": "norm", "batch_norm": "norm",
           "group_norm": "norm", "softmax": "softmax", "log_softmax": "softmax",
           "embedding": "embedding"}  # fmt: skip
# NeuSight's names for an elementwise op with a Python-scalar operand (its addu.csv, ...)
SCALAR_OPS = {f"{o}u": f"{o}_scalar" for o in ("add", "mul", "div", "pow")}
FAMILY_NEEDS: dict[str, tuple[str, ...]] = {
    "gemm": ("m", "n", "k"),
    "conv": ("batch", "in_channels", "out_channels", "kernel_size", "input_h"),
    "attention": ("batch", "heads", "seq_q", "head_dim"),
    "norm": ("rows", "cols"),
    "softmax": ("rows", "cols"),
    "embedding": ("rows", "cols"),
    "elementwise": ("numel",),
}
SHAPE_COLUMNS = ("b", "m", "n", "k", "batch", "in_channels", "out_channels", "kernel_size",
                 "kernel_w", "input_h", "input_w", "stride", "stride_w", "padding", "padding_w",
                 "groups", "numel", "rows", "cols", "h", "heads", "head_dim", "seq_q", "seq_kv",
                 "causal")  # fmt: skip
OTHER_COLUMNS = ("op", "dtype", "direction", "grad_wrt", "latency_ms")
DTYPES = {"fp32": "float32", "float32": "float32", "float": "float32", "fp16": "float16",
          "float16": "float16", "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "tf32": "tf32"}  # fmt: skip


def _family(op: str) -> str | None:
    if op in GEMM_OPS:
        return "gemm"
    if op in ("conv2d", "conv", "conv1d"):
        return "conv"
    if op in ("sdpa", "attention", "scaled_dot_product_attention"):
        return "attention"
    if op in ROW_OPS:
        return ROW_OPS[op]
    if op in ELEMENTWISE:
        return "elementwise"
    return None


def known_ops() -> list[str]:
    return sorted({*GEMM_OPS, "conv2d", "conv1d", "sdpa", *ROW_OPS, *ELEMENTWISE, *SCALAR_OPS})


def canonical_rows(raw: pd.DataFrame, where: str = "input") -> pd.DataFrame:
    """Validate a user CSV and convert it to canonical kernel rows (raises on the first issue)."""
    df = raw.rename(columns=lambda c: str(c).strip().lower())
    unknown = [c for c in df.columns if c not in SHAPE_COLUMNS + OTHER_COLUMNS]
    if unknown:
        raise InvalidInputError(
            f"{where}: unknown column(s): {', '.join(unknown)}; allowed: "
            f"{', '.join(OTHER_COLUMNS + SHAPE_COLUMNS)}"
        )
    if "op" not in df.columns:
        raise InvalidInputError(f"{where}: missing column: op")
    blank = (df["op"].isna() | (df["op"].astype(str).str.strip() == "")).to_numpy()
    if blank.any():
        raise InvalidInputError(f"{where}: row {int(np.flatnonzero(blank)[0]) + 1} has no op")
    df["op"] = df["op"].astype(str).str.strip().str.lower().replace(SCALAR_OPS)
    fam = df["op"].map(_family)
    if fam.isna().any():
        k = int(np.flatnonzero(fam.isna().to_numpy())[0])
        bad = df["op"].iat[k]
        near = suggest(bad, known_ops())
        raise InvalidInputError(
            f"{where}: unknown op {bad!r} (row {k + 1})"
            + (near if near else f"; known: {', '.join(known_ops())}")
        )
    for col in SHAPE_COLUMNS:
        if col in df.columns:
            num = pd.to_numeric(df[col], errors="coerce").astype(float)
            whole = np.isfinite(num) & (num >= 0) & (num % 1 == 0)
            bad = (df[col].notna() & ~whole).to_numpy()
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                raise InvalidInputError(
                    f"{where}: column {col} must hold non-negative whole numbers (row {k + 1}: "
                    f"{df[col].iat[k]!r})"
                )
            if (num >= 2.0**63).any():  # torch sizes are int64
                raise InvalidInputError(
                    f"{where}: column {col} holds {num.max():g}: no tensor dimension exceeds "
                    "2^63 - 1 (torch sizes are int64)"
                )
            df[col] = num
    if "causal" in df.columns:
        flag = df["causal"]
        if (bad := flag.notna() & ~flag.isin([0, 1])).any():
            raise InvalidInputError(
                f"{where}: column causal must be 0 or 1 ({_row(df, bad, 'causal')})"
            )
        if (bad := flag.fillna(0).astype(bool) & (fam != "attention")).any():
            raise InvalidInputError(
                f"{where}: causal applies to attention (sdpa) rows only ({_row(df, bad, 'op')})"
            )
    rowlike = fam.isin(["norm", "softmax", "embedding", "elementwise"])
    if "b" in df.columns and "h" in df.columns:  # NeuSight's vector ops: a (B, H) tensor
        for dst, src in (("rows", "b"), ("cols", "h")):
            cur = df[dst] if dst in df.columns else pd.Series(np.nan, index=df.index)
            df[dst] = cur.where(~rowlike | cur.notna(), df[src])
    if {"rows", "cols"} <= set(df.columns):
        numel = df["numel"] if "numel" in df.columns else pd.Series(np.nan, index=df.index)
        product = df["rows"] * df["cols"]
        clash = (numel.notna() & product.notna() & (numel != product)).to_numpy()
        if clash.any():
            k = int(np.flatnonzero(clash)[0])
            raise InvalidInputError(
                f"{where}: row {k + 1} gives numel {numel.iat[k]:g} but rows x cols "
                f"{product.iat[k]:g}; give one of them"
            )
        df["numel"] = numel.fillna(product)
    if "numel" in df.columns and rowlike.any():
        for col in ("rows", "cols"):
            if col not in df.columns:
                df[col] = np.nan
        # numel with one side: the other is their quotient (a hunt: rows=4096 with numel
        # 4194304 had been read as one row of 4194304 beside four rows of nothing)
        for side, other in (("rows", "cols"), ("cols", "rows")):
            one = df[side].notna() & df[other].isna() & df["numel"].notna()
            uneven = one & (df["numel"] % df[side].where(one, 1) != 0)
            if uneven.any():
                k = int(np.flatnonzero(uneven.to_numpy())[0])
                raise InvalidInputError(
                    f"{where}: row {k + 1} gives numel {df['numel'].iat[k]:g} and {side} "
                    f"{df[side].iat[k]:g}, which does not divide it"
                )
            df[other] = df[other].where(~one, df["numel"] / df[side])
        df["cols"] = df["cols"].fillna(df["numel"])
        df["rows"] = df["rows"].fillna(1)
    gemm = fam == "gemm"
    if gemm.any():
        df["b"] = (df["b"] if "b" in df.columns else pd.Series(np.nan, index=df.index)).fillna(1)
    for family, needed in FAMILY_NEEDS.items():
        rows = fam == family
        if not rows.any():
            continue
        absent = [c for c in needed if c not in df.columns]
        if absent:
            first = int(rows.idxmax()) + 1
            raise InvalidInputError(
                f"{where}: missing column(s) for {family} ops ({df.loc[rows, 'op'].iloc[0]}, row {first}): {', '.join(absent)}"
            )
        for c in needed:
            empty = (rows & df[c].isna()).to_numpy()
            if empty.any():
                k = int(np.flatnonzero(empty)[0])
                raise InvalidInputError(
                    f"{where}: row {k + 1} ({df['op'].iat[k]}) leaves column {c} empty; "
                    f"{family} ops need {', '.join(needed)}"
                )
    one_d = (df["op"] == "conv1d").to_numpy()
    if one_d.any():  # PyTorch runs conv1d as a 2-D convolution one pixel wide
        for col, value in (("input_w", 1), ("kernel_w", 1), ("stride_w", 1), ("padding_w", 0)):
            given = df[col] if col in df.columns else pd.Series(np.nan, index=df.index)
            if (one_d & given.notna().to_numpy() & (given != value).to_numpy()).any():
                raise InvalidInputError(f"{where}: conv1d has no width; leave {col} out")
            df[col] = given.where(~one_d, value)
    if (fam == "conv").any():
        _check_convolutions(df[fam == "conv"], where)
    dtype = df["dtype"] if "dtype" in df.columns else pd.Series("fp32", index=df.index)
    dtype = dtype.fillna("fp32").astype(str).str.strip().str.lower()
    if not dtype.isin(DTYPES).all():
        bad = dtype[~dtype.isin(DTYPES)].iloc[0]
        raise InvalidInputError(
            f"{where}: unknown dtype {bad!r}; choose one of: fp32, fp16, bf16, tf32"
        )
    direction = (
        df["direction"] if "direction" in df.columns else pd.Series("forward", index=df.index)
    )
    direction = direction.fillna("forward").astype(str).str.strip().str.lower()
    if (bad := ~direction.isin(["forward", "backward"])).any():
        raise InvalidInputError(
            f"{where}: direction must be forward or backward ({_row(df, bad, 'direction')})"
        )
    conv_backward = (fam == "conv") & (direction == "backward")
    grad = pd.Series(None, index=df.index, dtype=object)
    if "grad_wrt" in df.columns:  # which gradient a backward convolution computes
        grad = df["grad_wrt"].astype(object).where(df["grad_wrt"].notna(), None)
        grad = grad.map(lambda v: None if v is None else str(v).strip().lower())
        set_ = grad.notna()
        if (bad := set_ & ~grad.isin(["input", "weight"])).any():
            raise InvalidInputError(
                f"{where}: grad_wrt must be input or weight ({_row(df, bad, 'grad_wrt')})"
            )
        if (bad := set_ & ~conv_backward).any():
            raise InvalidInputError(
                f"{where}: grad_wrt applies to backward conv rows only ({_row(df, bad, 'op')})"
            )
        df["grad_wrt"] = grad
    if (bad := conv_backward & grad.isna()).any():  # a layer's backward runs both kernels
        raise InvalidInputError(
            f"{where}: a backward conv row needs grad_wrt=input or weight (its two kernels;"
            f" a layer's backward runs both: give one row each; {_row(df, bad, 'op')})"
        )
    out = df.drop(columns=[c for c in ("h", "latency_ms") if c in df.columns])
    out["family"] = fam
    out["op"] = [
        GEMM_OPS.get(o, "conv2d" if f == "conv" else o) for o, f in zip(df["op"], fam, strict=True)
    ]
    out["op"] = out["op"].replace({"ln": "layer_norm"})
    out["dtype"] = dtype.map(DTYPES)
    out["direction"] = direction
    return out


def _check_convolutions(conv: pd.DataFrame, where: str) -> None:
    """Convolutions PyTorch would refuse: a kernel or stride below 1, channels
    that the groups do not divide, or a kernel larger than the padded input (no output)."""
    s = conv_shape(conv)
    groups = s["groups"]
    # a stride of 0 was timed as inf ms, a kernel of 0 as three times a 3x3 one (a hunt); a
    # zero batch or size is an empty tensor, which launches nothing (timed 0)
    zero = (np.vstack([s[k] for k in ("kh", "kw", "sh", "sw")]) < 1).any(axis=0)
    none = groups < 1
    some = np.where(none, 1, groups)  # no remainder by 0 (numpy warns on the terminal)
    split = ~none & ((s["c"] % some != 0) | (s["o"] % some != 0))
    empty = (s["h"] + 2 * s["ph"] < s["kh"]) | (s["w"] + 2 * s["pw"] < s["kw"])
    for bad, why in ((zero, "kernel size and stride must be at least 1"),
                     (none, "groups must be at least 1"),
                     (split, "groups must divide in_channels and out_channels"),
                     (empty, "kernel larger than the padded input")):  # fmt: skip
        if bad.any():
            raise InvalidInputError(
                f"{where}: convolution row {int(conv.index[np.argmax(bad)]) + 1}: {why}"
            )


def _row(df: pd.DataFrame, bad: pd.Series, col: str) -> str:
    """The first row ``bad`` marks, counted from 1 as the CSV's data rows, and its ``col``."""
    k = int(np.flatnonzero(bad.to_numpy())[0])
    value = df[col].iat[k]
    number = isinstance(value, int | float | np.number) and not isinstance(value, bool)
    return f"row {k + 1}: {value:g}" if number else f"row {k + 1}: {value!r}"
