"""`python -m boom_ml.predict_ops`: latency of individual operators on one GPU.

    python -m boom_ml.predict_ops input=ops.csv gpu=l4 output=pred.csv

The input CSV has a column ``op`` and the shape columns its op needs (names are
case-insensitive); optional ``dtype`` (fp32 default; fp16, bf16, tf32) and ``direction``
(forward default; backward, with ``grad_wrt`` input|weight, required for conv). Shape conventions:

- GEMM (bmm, linear, mm, matmul, addmm): NeuSight's ``B,M,N,K``. ``bmm`` multiplies
  (B,M,N) x (B,N,K); ``linear``/``mm`` apply one N->K weight to B*M rows (B defaults to 1).
- conv2d: ``batch, in_channels, out_channels, kernel_size, input_h`` (+ optional
  ``input_w, stride, padding, kernel_w, stride_w, padding_w, groups``); conv1d: the same
  without the width columns (``input_h`` is its length).
- row-wise and elementwise ops (layer_norm, rms_norm, softmax, add, mul, gelu, ... and the
  ``*_scalar`` forms): ``rows, cols`` (NeuSight's ``B, H``) or ``numel``.
- embedding: ``rows`` (lookups) and ``cols`` (embedding dim).
- attention (sdpa): ``batch, heads, seq_q, head_dim`` (+ ``seq_kv``; ``causal`` 1 for a causal
  mask, whose fused kernels do the kept pairs' share of the work, as in a traced step).

The rows come back with ``pred_ms``, ``p10_ms``, ``p90_ms``, ``method`` and ``basis``.
``method``: ``per-op`` (a learned head; fp16/bf16 GEMMs too), ``gemm-tiles`` (the tile/wave
GEMM model, fp32 and TF32 GEMMs),
``elementwise-head (bandwidth curve)`` (a ``fill``: a stream that writes and reads nothing,
timed as a step times it), ``roofline-calibrated (proxy: X)`` (no head covers the op, e.g.
``sdpa``: its roofline scaled by head X's calibration) or ``empty`` (the output has no
elements, so nothing runs and the time is 0). ``basis``: ``measured``, ``architecture
measured`` or ``architecture not measured`` (whether the GPU, or its architecture, has kernel
rows in the model's training data; for an fp16/bf16 GEMM or convolution row, fp16 rows of that
kind: an L4 has fp32 GEMMs measured, and no Ada GPU fp16 ones; empty for a model that does not
record them).

A GEMM row is one GEMM kernel, forward or backward alike: a linear layer's backward is two
GEMMs (input and weight gradients), each a row of its own shape. A GEMM with ``N`` 0 (nothing
to sum over) only zero-fills its output, so it is timed as a ``fill`` of ``B*M*K`` elements.
Norms, softmax and elementwise ops are ``empty`` either way (their gradient is shaped as
their input); convolution, attention and embedding rows only forward (a backward can fill a
gradient that has elements, a weight's). No backward kernel of a norm, softmax or elementwise
op was measured: a backward row of one is timed as the forward kernel of its shape, and a note
on stderr says so (``gelu_backward`` and the like are ops of their own).
``numel`` given with ``rows`` and ``cols`` must be their product. A ``latency_ms`` column, if
given, is passed through (handy to score the predictions). bf16 matrix rows on a GPU without
bf16 tensor cores (before Ampere) are timed at its fp32 rate, and a note on stderr says so.

Intervals are the heads' own quantiles, clipped to the prediction, so a side can have zero
width (``p90_ms`` = ``pred_ms``). Tiny elementwise kernels: the fp32 rows the head learned
from are NeuSight's (CUDA events around the op: the launch gap is in them), the fp16/bf16
rows Vidur's (profiled kernel time alone), so a 4,096-element fp16 ``add`` comes out about
9x faster than the fp32 one (`../shared/data/*/SOURCE.md`). An elementwise, norm or softmax
row is never timed faster than the same op on one element (one row) on the same GPU
(``boom_ml/timing/size_floor.py``): on a GPU faster than any measured one, the heads alone
timed an fp32 ``add`` of 2^20 elements below one of a single element; a convolution is never
timed faster than the same convolution on one image (the conv head had a batch-1 3x3 conv on a
B200 at twice its batch-4 time). A row so raised says so in ``method`` (``per-op (one-element
floor)``, ``per-op (one-image floor)``). No row is timed slower than on a measured GPU that this
one beats on every spec-sheet number (``boom_ml/timing/anchors.py``; ``... (capped at <gpu>)``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from boom_ml.errors import BoomError, InvalidInputError
from boom_ml.ops_csv import canonical_rows

OUTPUT_COLUMNS = ("pred_ms", "p10_ms", "p90_ms", "method")
TIME_COLUMNS = ("pred_ms", "p10_ms", "p90_ms")
# A zero in any of these leaves the op's output without elements: no kernel is launched
# (PyTorch returns before cuBLAS for an empty GEMM). GEMMs: (B,M,N) x (B,N,K) -> (B,M,K).
EMPTY_IF_ZERO = {"gemm": ("b", "m", "k"), "conv": ("batch", "out_channels"),
                 "attention": ("batch", "heads", "seq_q", "head_dim"), "norm": ("numel",),
                 "softmax": ("numel",), "embedding": ("numel",), "elementwise": ("numel",)}  # fmt: skip
EMPTY = "empty"


def predict_canonical(rows: pd.DataFrame, gpu: str, model: str | None = None) -> pd.DataFrame:
    """pred_ms, p10_ms, p90_ms and method for canonical kernel rows on ``gpu``."""
    from boom_ml.gpus import get_gpu
    from boom_ml.timing.anchors import time_kernel_rows
    from boom_ml.timing.gemm import gemm_model_for
    from boom_ml.timing.heads import load_model

    per_op = load_model(model)
    # GEMM rows: the tile/wave model (packaged one with the packaged heads; boom_ml/timing/gemm.py)
    return time_kernel_rows(rows, get_gpu(gpu), per_op, gemm_model_for(per_op))


# Families whose backward writes a gradient of its input's shape: no elements in, none out.
SHAPED_GRADIENT = ("norm", "softmax", "elementwise")
# Families no kernel row measured backward (NeuSight's and DeepBench's are forward kernels):
# their heads time a backward row as the forward kernel of the shape (an embedding's backward,
# a scatter-add, goes to the calibrated roofline instead).
FORWARD_ONLY = ("norm", "softmax", "elementwise")


def empty_rows(rows: pd.DataFrame) -> np.ndarray:
    """Canonical rows whose output has no elements (backward ones only for GEMMs, which time
    one GEMM kernel either way, for the families whose gradient is shaped as their input, and
    for a convolution's gradient of no elements: another op's backward can fill a gradient
    with elements, a conv's or embedding's weight's)."""
    forward = (rows["direction"] == "forward").to_numpy() | rows["family"].isin(
        SHAPED_GRADIENT
    ).to_numpy()
    out = np.zeros(len(rows), dtype=bool)
    for family, columns in EMPTY_IF_ZERO.items():
        zero = np.zeros(len(rows), dtype=bool)
        for col in columns:
            if col in rows.columns:
                zero |= (rows[col] == 0).to_numpy()
        out |= (rows["family"] == family).to_numpy() & zero & (forward | (family == "gemm"))
    if "grad_wrt" in rows.columns:
        # a convolution's gradient is shaped as what it is taken with respect to: the input
        # (batch, in_channels, ...) or the weight (out_channels, in_channels / groups, ...);
        # with in_channels 0 either is empty (both had been timed above the full-size kernel)
        grad, zero = rows["grad_wrt"], lambda col: rows[col] == 0  # noqa: E731
        gradient_empty = (
            zero("in_channels")
            | ((grad == "input") & zero("batch"))
            | ((grad == "weight") & zero("out_channels"))
        )
        backward = (rows["family"] == "conv") & (rows["direction"] == "backward")
        out |= (backward & gradient_empty).to_numpy()
    return out


def as_fill(rows: pd.DataFrame, empty: np.ndarray) -> tuple[pd.DataFrame, np.ndarray]:
    """``rows`` with each GEMM whose N is 0 (a sum over nothing; not in ``empty``) turned into
    the ``fill`` of its B*M*K output elements, all PyTorch launches for it; and those rows."""
    sel = np.zeros(len(rows), dtype=bool)
    if "n" in rows.columns:
        sel = ((rows["family"] == "gemm") & (rows["n"] == 0)).to_numpy() & ~empty
    if not sel.any():
        return rows, sel
    rows = rows.copy()
    for col in ("numel", "rows", "cols"):
        if col not in rows.columns:
            rows[col] = np.nan
    numel = (rows["b"] * rows["m"] * rows["k"])[sel]
    rows.loc[sel, ["family", "op"]] = ["elementwise", "fill"]
    rows.loc[sel, "numel"] = rows.loc[sel, "cols"] = numel
    rows.loc[sel, "rows"] = 1.0
    return rows, sel


def fills_as_streams(rows: pd.DataFrame) -> pd.DataFrame:
    """``fill`` rows as the step path times a fill (timing/bandwidth.py): a stream of the
    ``fill`` family that writes its elements and reads nothing, as the elementwise row moving
    the same bytes, so the per-op model times (and names) it as it does a traced fill. The
    table's arity (one tensor read) had timed a fill as a copy of the same size."""
    sel = (rows["op"] == "fill").to_numpy()
    if not sel.any():
        return rows
    from boom_ml.timing.bandwidth import Stream, width

    rows = rows.copy()
    if "bytes" not in rows.columns:
        rows["bytes"] = np.nan
    for i in np.flatnonzero(sel):
        n, dtype = int(rows["numel"].iat[i]), str(rows["dtype"].iat[i])
        row = Stream("fill", 0.0, float(n * width(dtype)), n, dtype, False).row()
        for col in ("numel", "cols", "bytes"):
            rows.iloc[i, rows.columns.get_loc(col)] = float(row[col])
        rows.iloc[i, rows.columns.get_loc("rows")] = 1.0
    rows.loc[sel, "family"] = "fill"
    return rows


def predict_ops(
    table: pd.DataFrame, gpu: str, model: str | None = None, where: str = "input"
) -> pd.DataFrame:
    """``table`` (the user's rows) with pred_ms, p10_ms, p90_ms, method and basis appended."""
    from boom_ml.gpus import get_gpu
    from boom_ml.timing.basis import basis, half_coverage, measured_gpus

    # the rows as plain numpy values (NaN where missing), whatever dtypes the table carries
    rows = canonical_rows(table.astype(object).where(table.notna(), np.nan), where)
    empty = empty_rows(rows)
    rows, fill = as_fill(rows, empty)
    rows = fills_as_streams(rows)
    pred = pd.DataFrame({c: 0.0 for c in TIME_COLUMNS} | {"method": EMPTY}, index=rows.index)
    if not empty.all():
        timed = predict_canonical(rows[~empty], gpu, model)
        for col in OUTPUT_COLUMNS:
            pred.loc[~empty, col] = timed[col].to_numpy()
        pred.loc[fill, "method"] += " (fill: N is 0)"
    out = table.copy()
    for col in OUTPUT_COLUMNS:
        out[col] = pred[col].to_numpy()
    for col in TIME_COLUMNS:
        out[col] = out[col].astype(float).round(6)
    measured = measured_gpus(model)
    out["basis"] = basis(get_gpu(gpu), measured) if measured else ""
    # an fp16/bf16 GEMM or convolution row: whether the GPU or its architecture had that kind
    # measured in fp16 (an L4's fp16 bmm had said "measured" beside the note that no Ada GPU
    # had fp16 GEMMs measured: its fp32 rows are the L4's); a row scaled by such a head's
    # calibration (sdpa's roofline, proxy: gemm) follows that head (a hunt)
    half = rows["dtype"].isin(["float16", "bfloat16"]).to_numpy()
    proxy = pred["method"].str.extract(r"\(proxy: (\w+)\)", expand=False).to_numpy()
    for kind, gpus in half_coverage(model).items() if measured else ():
        sel = half & ((rows["family"] == kind).to_numpy() | (proxy == kind))
        if sel.any():
            out.loc[sel, "basis"] = basis(get_gpu(gpu), gpus)
    return out


def notes(table: pd.DataFrame, gpu: str) -> list[str]:
    """What to tell the user of ``table``'s rows on ``gpu`` (stderr: the CSV stays a CSV):
    bf16 matrix rows on a GPU without bf16 tensor cores, backward rows of families no kernel row
    measured backward. Empty rows run nothing and need no note."""
    rows = canonical_rows(table.astype(object).where(table.notna(), np.nan))
    timed = ~empty_rows(rows)
    found = (_bf16_note(rows, timed, gpu), _backward_note(rows, timed), _grouped_note(rows, timed),
             _half_note(rows, timed, gpu))  # fmt: skip
    return [n for n in found if n]


def _grouped_note(rows: pd.DataFrame, timed: np.ndarray) -> str | None:
    """No kernel table has a grouped convolution: the conv head extrapolates on each."""
    if "groups" not in rows:
        return None
    groups = pd.to_numeric(rows["groups"], errors="coerce").fillna(1)
    sel = (rows["family"] == "conv") & (groups > 1) & timed
    if not sel.any():
        return None
    return (
        f"note: {int(sel.sum())} grouped or depthwise convolution row(s): no kernel table measured"
        " one (NeuSight's and DeepBench's convolutions are dense), so the conv head extrapolates"
        " on them; their times are likely too high (depthwise networks' were, where checked)"
    )


def _half_note(rows: pd.DataFrame, timed: np.ndarray, gpu: str) -> str | None:
    """fp16/bf16 GEMM and convolution rows on a GPU of an architecture that no fp16 kernel
    of theirs was measured on, as ``predict``'s table says (``timing/basis.py``)."""
    from boom_ml.gpus import get_gpu
    from boom_ml.timing.basis import HALF_KINDS, half_coverage, half_text, unmeasured_half

    half = rows["family"].isin(list(HALF_KINDS)) & rows["dtype"].isin(["float16", "bfloat16"])
    kinds = [k for k in HALF_KINDS if (half & timed & (rows["family"] == k)).any()]
    gaps = unmeasured_half(get_gpu(gpu), kinds, half_coverage()) if kinds else []
    if not gaps:
        return None
    return (
        f"note: no GPU of {gpu}'s architecture had {half_text(gaps, 'or')} measured: those rows are"
        " timed from other GPUs' kernels, and their times are likely too high (README,"
        " 'Forward passes on GPUs nobody measured a kernel on')"
    )


def _backward_note(rows: pd.DataFrame, timed: np.ndarray) -> str | None:
    sel = (rows["direction"] == "backward") & rows["family"].isin(FORWARD_ONLY) & timed
    if not sel.any():
        return None
    ops = ", ".join(sorted(set(rows.loc[sel, "op"].astype(str))))
    return (
        f"note: {int(sel.sum())} backward row(s) of {ops}: no backward kernel of these ops was"
        " measured (NeuSight's and DeepBench's rows are forward kernels), so each is timed as"
        " the forward kernel of its shape; a backward op of its own (gelu_backward,"
        " silu_backward, ...) may be given as a forward row"
    )


def _bf16_note(rows: pd.DataFrame, timed: np.ndarray, gpu: str) -> str | None:
    """bf16 matrix rows on a GPU without bf16 tensor cores run at its fp32 rate, as
    ``predict``'s table also says."""
    from boom_ml.gpus import get_gpu

    spec = get_gpu(gpu)
    if spec.bf16_tensor_cores:
        return None
    matrix = rows["family"].isin(["gemm", "conv", "attention"]) & (rows["dtype"] == "bfloat16")
    matrix &= timed
    if not matrix.any():
        return None
    return (
        f"note: {spec.id} has no bf16 tensor cores (before Ampere): {int(matrix.sum())} bf16 "
        "matrix row(s) are timed at its fp32 rate; "
        + ("fp16 runs on its tensor cores" if spec.sm_version >= 70
           else "it has no tensor cores (Pascal): fp16 runs at its fp16 rate on CUDA cores")
    )  # fmt: skip


def run(cfg: Any) -> str | None:
    """Plain function behind the CLI: writes ``output`` (or returns the CSV text)."""
    from omegaconf import OmegaConf

    o = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    missing = [key for key in ("input", "gpu") if not o.get(key)]
    if missing:
        raise InvalidInputError(
            f"{' and '.join(missing)} not given; usage: python -m boom_ml.predict_ops"
            " input=<csv> gpu=<id> [output=<csv>]"
        )
    if isinstance(o["gpu"], (list, tuple)):
        raise InvalidInputError(
            f"predict_ops times the ops on one GPU per call: gpu=<id>, got {o['gpu']!r}"
        )
    path = Path(str(o["input"])).expanduser()
    if not path.exists():
        raise InvalidInputError(f"input file not found: {path}")
    if not path.is_file():
        raise InvalidInputError(f"input {path}: not a file (a CSV with an op column)")
    try:
        # nullable dtypes: an integer column with empty cells stays integer in the output;
        # index_col=False: a row with more fields than the header is not read as an index
        # (pandas then warns that it drops the extra fields: refused instead)
        with warnings.catch_warnings():
            warnings.simplefilter("error", pd.errors.ParserWarning)
            table = pd.read_csv(path, dtype_backend="numpy_nullable", index_col=False)
    except pd.errors.ParserWarning as exc:
        raise InvalidInputError(f"{path}: a row has more fields than the header") from exc
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{path}: not a readable CSV ({str(exc).splitlines()[0]})") from exc
    target = Path(str(o["output"])).expanduser() if o.get("output") else None
    if target is not None and (not target.parent.is_dir() or target.is_dir()):
        raise InvalidInputError(f"output {target}: not a file in an existing directory")
    from boom_ml.cli_imports import lightgbm_alone

    lightgbm_alone()  # scikit-learn, which lightgbm would import, costs ~1 s
    result = predict_ops(table, str(o["gpu"]), o.get("model"), where=str(path))
    # the input's columns as written: a column holding 1e9 is read as floats, and its 1000
    # had come back as 1000.0
    as_written = pd.read_csv(path, dtype=str, keep_default_na=False, index_col=False)
    result[list(table.columns)] = as_written[list(table.columns)].to_numpy()
    for note in notes(table, str(o["gpu"])):
        print(note, file=sys.stderr)  # stderr: the CSV on stdout stays a CSV
    if target is not None:
        try:
            result.to_csv(target, index=False)
        except OSError as exc:
            raise InvalidInputError(f"output {target}: cannot write ({exc.strerror})") from exc
        return None
    return result.to_csv(index=False)


def main() -> None:
    from boom_ml.config_help import print_help_if_asked, require_configs

    try:
        config_dir = require_configs()
    except BoomError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if print_help_if_asked(__doc__, "predict_ops"):
        return
    from boom_ml.predict import exit_on_bad_overrides, rewrite_aliases

    exit_on_bad_overrides(sys.argv[1:], "predict_ops")  # one line, not Hydra's three
    # predict's rewrite: gpu=l4,t4 as the list it means (Hydra stops a bare comma list with
    # lines of "Ambiguous value"), so run() says in one line that one GPU is timed
    sys.argv[1:] = rewrite_aliases(sys.argv[1:])
    import hydra

    @hydra.main(config_path=config_dir, config_name="predict_ops", version_base="1.3")
    def _entry(cfg: Any) -> None:
        try:
            text = run(cfg)
        except BoomError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)
        if text is not None:
            print(text, end="")

    _entry()


if __name__ == "__main__":
    main()
