"""Canonical dataset schemas (pyarrow), validation and loaders.

Four kinds of dataset live under the canonical data dir, one Parquet file per source:
``kernels/`` (one op timed in isolation), ``steps/`` (a whole training or forward step),
``memory/`` (peak memory of a training run) and ``op_profiles/`` (per-op profile of a step).

Validation is strict on purpose: a malformed row raises :class:`SchemaError` naming the file
and the first offending row and column, so bad data is fixed at the source instead of being
silently dropped or silently skewing a model.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from data_collection.paths import canonical_data_dir


class SchemaError(ValueError):
    """A dataset row or column does not match its canonical schema."""


@dataclass(frozen=True)
class Col:
    name: str
    kind: str  # "str" | "int" | "float" | "bool"
    required: bool = False
    allowed: tuple[str, ...] | None = None
    minimum: float | None = None
    exclusive: bool = False  # minimum is a strict bound (> rather than >=)
    allow_empty: bool = False  # for required strings: "" is a legitimate value


def _s(name: str, required: bool = False, allowed: Iterable[str] | None = None, **kw) -> Col:
    return Col(name, "str", required, tuple(allowed) if allowed else None, **kw)


def _i(name: str, required: bool = False, minimum: float | None = 0, **kw) -> Col:
    return Col(name, "int", required, minimum=minimum, **kw)


def _f(name: str, required: bool = False, minimum: float | None = None, **kw) -> Col:
    return Col(name, "float", required, minimum=minimum, **kw)


def _pos(name: str, required: bool = False) -> Col:
    return Col(name, "float", required, minimum=0.0, exclusive=True)


def _b(name: str, required: bool = False) -> Col:
    return Col(name, "bool", required)


FAMILIES = (
    "gemm", "conv", "attention", "norm", "softmax", "elementwise",
    "embedding", "optimizer", "copy", "reduction", "other",
)  # fmt: skip
KERNEL_DTYPES = ("float32", "float16", "bfloat16", "tf32")
STEP_PRECISIONS = ("float32", "float16", "bfloat16", "float64")
DIRECTIONS = ("forward", "backward")
DEVICE_KINDS = ("gpu", "cpu")
AMP_MODES = ("none", "fp16", "bf16")
CHECKPOINTING = ("none", "full")
OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adam", "adamw", "adagrad", "rmsprop", "adafactor")
PHASE_SCOPES = ("fwd", "fwd+bwd", "fwd+bwd+opt")
MODEL_FAMILIES = ("cnn", "transformer", "other")

_DEVICE = [_s("gpu_id", True), _s("device_name", True), _s("device_kind", True, DEVICE_KINDS)]
_VERSIONS = [_s("torch_version"), _s("cuda_version"), _s("cudnn_version"), _s("driver_version")]

KERNEL_COLUMNS: tuple[Col, ...] = (
    _s("source", True),
    _s("split", True, ("train", "test", ""), allow_empty=True),
    *_DEVICE,
    _s("op", True),
    _s("family", True, FAMILIES),
    _s("dtype", True, KERNEL_DTYPES),
    # How the arithmetic ran when it differs from dtype (DeepBench's fp16 "mixed" vs "pseudo").
    _s("math_mode", allowed=("fp16_mul_fp32_acc", "fp32_mul_fp32_acc")),
    _s("direction", True, DIRECTIONS),
    _s("grad_wrt", allowed=("input", "weight")),  # which gradient a backward row computes
    *(_i(c) for c in ("b", "m", "n", "k")),
    *(_i(c) for c in ("batch", "in_channels", "out_channels", "kernel_size", "kernel_w")),
    *(_i(c) for c in ("input_h", "input_w", "stride", "stride_w", "padding", "padding_w")),
    _i("groups", minimum=1),  # a grouped convolution's groups (null: 1, a dense one)
    *(_i(c) for c in ("numel", "rows", "cols", "heads", "head_dim", "seq_q", "seq_kv")),
    _pos("latency_ms", True),
    _s("latency_stat", True),
    _f("latency_spread_ms", minimum=0.0),
    _s("latency_spread_stat"),
    _i("n_repeats", minimum=1),
    *_VERSIONS,
    _s("kernel_names"),
    _s("context"),  # source-specific provenance: model, TP degree, transposes, algorithm
)

STEP_COLUMNS: tuple[Col, ...] = (
    _s("source", True),
    *_DEVICE,
    _i("num_gpus", True, minimum=1),
    _s("model", True),
    _s("model_family", True, MODEL_FAMILIES),
    _i("batch_size", True, minimum=1),  # per GPU
    _i("global_batch_size", True, minimum=1),
    _i("seq_len", minimum=1),
    _i("image_size", minimum=1),
    _s("precision", True, STEP_PRECISIONS),
    _s("amp", True, AMP_MODES),
    _s("checkpointing", True, CHECKPOINTING),
    _s("optimizer", True, OPTIMIZERS),
    _b("tf32"),  # null when the source does not say
    _b("channels_last", True),
    _s("phase_scope", True, PHASE_SCOPES),
    _pos("step_time_ms"),
    _s("step_time_stat"),
    _f("step_time_spread_ms", minimum=0.0),
    _s("step_time_spread_stat"),
    _i("n_iterations", minimum=1),
    _pos("fw_ms"),
    _pos("bw_ms"),
    *(_i(c) for c in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_nvml_bytes")),
    _b("oom", True),
    *_VERSIONS,
    _s("variant", True, allow_empty=True),
    _s("run_id"),
    _s("source_path"),
    _s("notes"),
    # Multi-GPU runs (data_collection/distributed_steps.py): one row per rank; num_gpus is the
    # world size. The layout as ``boom_ml.predict``'s parallel.* keys spell it.
    _i("rank"),
    _i("dp", minimum=1),
    _i("tp", minimum=1),
    _i("pp", minimum=1),
    _s("sharding", allowed=("none", "zero1", "zero2", "zero3", "fsdp")),
    _i("microbatches", minimum=1),
    # Pipeline runs (data_collection/pipeline_steps.py): the rank's pipeline stage (with
    # interleaving its first; 0 without a pipeline), the schedule and chunks per rank.
    _i("stage", minimum=0),
    _s("schedule", allowed=("1f1b", "gpipe", "interleaved")),
    _i("virtual_stages", minimum=1),
)
# Nullable columns added after datasets were written: absent in an older file, they read as
# null instead of failing validation (every other missing column is an error).
LATE_COLUMNS = {"steps": ("rank", "dp", "tp", "pp", "sharding", "microbatches", "stage",
                          "schedule", "virtual_stages"),
                "kernels": ("groups",)}  # fmt: skip

_ESTIMATORS = ("xmem", "dnnmem", "schedtune", "llmem")
MEMORY_COLUMNS: tuple[Col, ...] = (
    _s("source", True),
    *_DEVICE,
    _s("model", True),
    _s("model_family", True, MODEL_FAMILIES),
    _i("num_classes", minimum=1),
    _s("optimizer", True, OPTIMIZERS),
    _i("batch_size", True, minimum=1),
    _i("image_size", minimum=1),
    _i("seq_len", minimum=1),
    _s("seq_len_note"),
    _s("precision", True, STEP_PRECISIONS),
    _s("amp", True, AMP_MODES),
    _s("phase_scope", True, PHASE_SCOPES),
    _i("n_optimizer_steps", minimum=1),
    _i("ground_truth_peak_bytes", True, minimum=0, exclusive=True),
    _s("ground_truth_method", True),
    _b("real_oom", True),
    _i("capacity_bytes", True, minimum=0, exclusive=True),
    *(c for t in _ESTIMATORS for c in (_f(f"{t}_memory_bytes", minimum=0.0), _b(f"{t}_oom"))),
    *(_f(f"{t}_error", minimum=0.0) for t in _ESTIMATORS),
    _b("llmem_failed", True),  # LLmem reported -1 bytes; llmem_memory_bytes is then null
    _s("experiment"),
    _s("subfolder"),
    _s("run_id", True),
    _s("source_path"),
    *_VERSIONS,
    _s("notes"),
)

OP_PROFILE_COLUMNS: tuple[Col, ...] = (
    _s("source", True),
    _s("step_key", True),
    *_DEVICE,
    _s("model", True),
    _i("batch_size", True, minimum=1),
    _i("seq_len", minimum=1),
    _i("image_size", minimum=1),
    _s("phase_scope", True, PHASE_SCOPES),
    _s("variant", True, allow_empty=True),
    _s("scope", True),  # what the profiled step covers, e.g. "model_with_1_layer"
    _i("node_index", True),
    _s("node_name", True),
    _s("node_kind"),  # FX op kind: placeholder, call_module, call_function, ...
    _s("op", True),  # the op as the source names it (FX target)
    _s("input_shapes"),
    _s("output_shape"),
    _s("dtype"),
    _s("kernel_names"),
    _f("duration_ms", True, minimum=0.0),
    _f("fw_ms", minimum=0.0),
    _f("bw_ms", minimum=0.0),
    _f("acc_ms", minimum=0.0),
)

KINDS: dict[str, tuple[Col, ...]] = {
    "kernels": KERNEL_COLUMNS,
    "steps": STEP_COLUMNS,
    "memory": MEMORY_COLUMNS,
    "op_profiles": OP_PROFILE_COLUMNS,
}

# Shape columns a kernel row must fill for its family; without them a per-op model cannot
# use the row, so a missing one is a bug in the importer rather than a detail.
FAMILY_SHAPES: dict[str, tuple[str, ...]] = {
    "gemm": ("b", "m", "n", "k"),
    "conv": ("batch", "in_channels", "out_channels", "kernel_size", "input_h", "input_w",
             "stride", "padding"),
    "norm": ("numel", "rows", "cols"),
    "softmax": ("numel", "rows", "cols"),
    "elementwise": ("numel",),
    "embedding": ("numel",),
}  # fmt: skip

_ARROW = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
_TRUE = {"true": True, "1": True, "false": False, "0": False}


def columns(kind: str) -> list[str]:
    """Column names of ``kind`` in canonical order."""
    return [c.name for c in _cols(kind)]


def arrow_schema(kind: str) -> pa.Schema:
    """The pyarrow schema of ``kind``."""
    return pa.schema(
        [pa.field(c.name, _ARROW[c.kind], nullable=not c.required) for c in _cols(kind)]
    )


def _cols(kind: str) -> tuple[Col, ...]:
    if kind not in KINDS:
        raise SchemaError(f"unknown dataset kind {kind!r}; choose one of: {', '.join(KINDS)}")
    return KINDS[kind]


def _fail(origin: str, mask: pd.Series, message: str, values: pd.Series) -> None:
    """Raise for the first True position of ``mask`` (positions are 0-based data rows)."""
    hits = mask.to_numpy(dtype=bool, na_value=False).nonzero()[0]
    if len(hits):
        i = int(hits[0])
        value = values.iloc[i]
        if hasattr(value, "item"):  # numpy scalar -> Python, so the message reads "-1.0"
            value = value.item()
        raise SchemaError(f"{origin} row {i}: {message}, got {value!r}")


def _coerce(s: pd.Series, col: Col, origin: str) -> pd.Series:
    present = s.notna()
    if col.kind == "str":
        if pd.api.types.is_float_dtype(s) or pd.api.types.is_bool_dtype(s):
            _fail(origin, present, f"{col.name} must be text", s)
        return s.astype("string")
    if col.kind == "bool":
        if pd.api.types.is_bool_dtype(s):
            return s.astype("boolean")
        text = s.astype("string").str.strip().str.lower()
        mapped = text.map(_TRUE, na_action="ignore")
        _fail(origin, present & mapped.isna(), f"{col.name} must be true/false", s)
        return mapped.astype("boolean")
    if pd.api.types.is_bool_dtype(s):
        _fail(origin, present, f"{col.name} must be numeric", s)
    num = pd.to_numeric(s, errors="coerce")
    _fail(origin, present & num.isna(), f"{col.name} must be numeric", s)
    if col.kind == "int":
        frac = num.notna() & (num.astype("Float64") % 1 != 0)
        _fail(origin, frac, f"{col.name} must be an integer", s)
        return num.astype("Float64").astype("Int64")
    # Plain float64 (NaN for null): what numpy and the fitting code downstream expect.
    return num.astype("float64")


def validate(df: pd.DataFrame, kind: str, origin: str) -> pd.DataFrame:
    """Check ``df`` against ``kind``'s schema and return it with canonical dtypes and order.

    Raises :class:`SchemaError` naming ``origin`` (a file or source) and the first offending
    row (0-based, header excluded) and column. Rows are never dropped.
    """
    cols = _cols(kind)
    names = [c.name for c in cols]
    late = [n for n in LATE_COLUMNS.get(kind, ()) if n not in df.columns]
    if late:
        df = df.assign(**dict.fromkeys(late))
    missing = [n for n in names if n not in df.columns]
    if missing:
        raise SchemaError(f"{origin}: missing column(s): {', '.join(missing)}")
    extra = [n for n in df.columns if n not in names]
    if extra:
        raise SchemaError(f"{origin}: unexpected column(s): {', '.join(map(str, extra))}")
    frame = df.reset_index(drop=True)
    out: dict[str, pd.Series] = {}
    for col in cols:
        raw = frame[col.name]
        s = _coerce(raw, col, origin)
        if col.required:
            _fail(origin, s.isna(), f"{col.name} is required but null", raw)
            if col.kind == "str" and not col.allow_empty:
                _fail(origin, s.str.strip() == "", f"{col.name} is required but empty", raw)
        if col.allowed is not None:
            bad = s.notna() & ~s.isin(col.allowed)
            _fail(origin, bad, f"{col.name} must be one of {list(col.allowed)}", raw)
        if col.minimum is not None:
            low = s < col.minimum if not col.exclusive else s <= col.minimum
            sign = ">" if col.exclusive else ">="
            _fail(origin, low.fillna(False), f"{col.name} must be {sign} {col.minimum:g}", raw)
        out[col.name] = s
    result = pd.DataFrame(out)
    _check_rules(result, kind, origin)
    return result


def _check_rules(df: pd.DataFrame, kind: str, origin: str) -> None:
    """Cross-column rules: each row carries what its family or outcome needs."""
    if kind == "kernels":
        for family, needed in FAMILY_SHAPES.items():
            rows = df["family"] == family
            for name in needed:
                msg = f"{name} is required for family {family!r} but null"
                _fail(origin, rows & df[name].isna(), msg, df[name])
        backward = df["direction"] == "backward"
        _fail(origin, ~backward & df["grad_wrt"].notna(), "grad_wrt set on a forward row",
              df["grad_wrt"])  # fmt: skip
    if kind == "steps":
        ran = df["oom"] == False  # noqa: E712 (nullable boolean comparison)
        msg = "step_time_ms is required when oom is false but null"
        _fail(origin, ran & df["step_time_ms"].isna(), msg, df["step_time_ms"])
        outside = df["rank"] >= df["num_gpus"]
        _fail(origin, outside.fillna(False), "rank must be < num_gpus (the world size)",
              df["rank"])  # fmt: skip
        small = df["global_batch_size"] < df["batch_size"]
        _fail(origin, small.fillna(False), "global_batch_size must be >= batch_size",
              df["global_batch_size"])  # fmt: skip


def to_arrow(df: pd.DataFrame, kind: str, origin: str) -> pa.Table:
    """Validate ``df`` and convert it to a pyarrow Table with ``kind``'s schema."""
    valid = validate(df, kind, origin)
    return pa.Table.from_pandas(valid, schema=arrow_schema(kind), preserve_index=False)


def write_dataset(df: pd.DataFrame, kind: str, path: str | Path) -> int:
    """Validate and write ``df`` to ``path`` atomically (temp file + ``os.replace``).

    The bytes depend only on the rows, so re-running an import rewrites identical files.
    Returns the number of rows written.
    """
    path = Path(path)
    table = to_arrow(df, kind, origin=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return table.num_rows


def load(
    kind: str, data_dir: str | Path | None = None, sources: Iterable[str] | None = None
) -> pd.DataFrame:
    """Read, validate and concatenate ``<data_dir>/<kind>/<source>.parquet`` files."""
    _cols(kind)
    folder = Path(data_dir) if data_dir is not None else canonical_data_dir()
    folder = folder / kind
    files = sorted(folder.glob("*.parquet"))
    if sources is not None:
        wanted = set(sources)
        unknown = wanted - {f.stem for f in files}
        if unknown:
            raise FileNotFoundError(
                f"no {kind} dataset for source(s) {sorted(unknown)} in {folder}; "
                "run `python -m data_collection.import_public`"
            )
        files = [f for f in files if f.stem in wanted]
    if not files:
        raise FileNotFoundError(
            f"no {kind} datasets in {folder}; run `python -m data_collection.import_public`"
        )
    frames = [validate(pq.read_table(f).to_pandas(), kind, origin=str(f)) for f in files]
    return pd.concat(frames, ignore_index=True)


def load_kernels(
    data_dir: str | Path | None = None, sources: Iterable[str] | None = None
) -> pd.DataFrame:
    """All kernel measurements (validated), optionally only some sources."""
    return load("kernels", data_dir, sources)


def load_steps(
    data_dir: str | Path | None = None, sources: Iterable[str] | None = None
) -> pd.DataFrame:
    """All step measurements (validated), optionally only some sources."""
    return load("steps", data_dir, sources)


def load_memory(
    data_dir: str | Path | None = None, sources: Iterable[str] | None = None
) -> pd.DataFrame:
    """All peak-memory runs (validated), optionally only some sources."""
    return load("memory", data_dir, sources)


def load_op_profiles(
    data_dir: str | Path | None = None, sources: Iterable[str] | None = None
) -> pd.DataFrame:
    """All per-op step profiles (validated), optionally only some sources."""
    return load("op_profiles", data_dir, sources)
