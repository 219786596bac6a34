"""DeepBench training-kernel results (baidu-research/DeepBench): GEMM and convolution.

See ``deepbench/SOURCE.md``. Times are ms. ``fp16_mixed`` (V100, T4) is 16-bit inputs and
multiplication with 32-bit accumulation; ``fp16_pseudo`` (P100) is 16-bit inputs with 32-bit
multiplication and accumulation. GEMM computes C(M x N) = op(A)(M x K) op(B)(K x N); the
benchmark code averages over repeated back-to-back launches. Conv rows carry a forward
time and two backward times (wrt inputs, wrt parameters); ``N/A*`` marks a backward-input
pass the benchmark does not compute for a network's first layer.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from data_collection.importers.common import GpuResolver, ImportResult, Progress, require_file

NAME = "deepbench"
FILE_RE = re.compile(
    r"^(?P<gpu>[A-Za-z0-9]+)_(?P<prec>fp32|fp16_mixed|fp16_pseudo)_(?P<section>\w+)\.csv$"
)
# DeepBench GPU tags -> device strings for the GPU database. The V100 ran in a DGX-1 (SXM2
# modules) and the sheet does not say 16 or 32 GB; the two SXM2 parts share clocks, SMs and
# bandwidth, so the 16 GB id stands in (memory size does not change a kernel's time). The
# P100 sat in an ASUS X99-E WS workstation board, so a PCIe card; the database's "P100 PCIe"
# is the 16 GB card (the 12 GB card, with less bandwidth, is not in it; unstated here too).
GPU_NAMES = {
    "V100": "Tesla V100-SXM2-16GB",
    "T4": "Tesla T4",
    "P100": "Tesla P100-PCIE",
    "1080Ti": "GeForce GTX 1080 Ti",
    "TitanXp": "TITAN Xp",
}
PRECISION = {
    "fp32": ("float32", None),
    "fp16_mixed": ("float16", "fp16_mul_fp32_acc"),
    "fp16_pseudo": ("float16", "fp32_mul_fp32_acc"),
}
KERNEL_SECTIONS = ("gemm", "conv")
EXCLUDED_SECTIONS = {
    "rnn_vanilla": "RNN tables (no canonical RNN op yet)",
    "rnn_lstm": "RNN tables (no canonical RNN op yet)",
    "rnn_gru": "RNN tables (no canonical RNN op yet)",
    "allreduce": "all-reduce tables (multi-GPU collectives, not single-GPU kernels)",
}
NA = "N/A*"


def _specs(folder: Path, tag: str) -> dict[str, str]:
    spec = pd.read_csv(require_file(folder / f"{tag}_specs.csv"), dtype=str, keep_default_na=False)
    return dict(zip(spec["Field"].str.strip(), spec["Value"].str.strip(), strict=True))


def _common(df: pd.DataFrame, tag: str, prec: str, specs: dict[str, str], gpu: GpuResolver) -> None:
    device = GPU_NAMES[tag]
    dtype, math_mode = PRECISION[prec]
    df["source"] = NAME
    df["split"] = ""
    df["gpu_id"] = gpu(device)
    df["device_name"] = device
    df["device_kind"] = "gpu"
    df["dtype"] = dtype
    df["math_mode"] = math_mode
    df["latency_stat"] = "mean"
    df["cuda_version"] = specs.get("CUDA Version") or None
    df["cudnn_version"] = specs.get("Cudnn Version") or None
    df["driver_version"] = specs.get("Nvidia Driver") or None


def _gemm(raw: pd.DataFrame) -> pd.DataFrame:
    # DeepBench (M, N, K) is C(MxN) = A(MxK) B(KxN); NeuSight's mm is (m,n)x(n,k), so the
    # inner dimension K becomes our n and the output width N becomes our k.
    ctx = ("app=" + raw["Source"].fillna("").astype(str) + " a_t=" + raw["A Transpose"]
           + " b_t=" + raw["B Transpose"])  # fmt: skip
    note = raw["Note"].fillna("").astype(str)
    ctx = ctx + note.map(lambda s: f" note={s}" if s else "")
    return pd.DataFrame(
        {
            "op": "mm",
            "family": "gemm",
            "direction": "forward",
            "b": 1,
            "m": raw["M"],
            "n": raw["K"],
            "k": raw["N"],
            "latency_ms": pd.to_numeric(raw["Time (msec)"], errors="raise"),
            "context": ctx + " sheet_row=" + raw["sheet_row"].astype(str),
        }
    )


def _conv(raw: pd.DataFrame, result: ImportResult, origin: str) -> pd.DataFrame:
    # Header names, not positions: V100/T4 sheets order S, R, pad_w, pad_h, strides differently.
    def col(prefix: str) -> pd.Series:
        hits = [c for c in raw.columns if c == prefix or c.startswith(prefix + " (")]
        if len(hits) != 1:
            raise ValueError(f"{origin}: expected one column named {prefix!r}, found {hits}")
        return raw[hits[0]]

    shape = {
        "family": "conv",
        "op": "conv2d",
        "batch": col("N"),
        "in_channels": col("C"),
        "out_channels": col("K"),
        "kernel_size": col("R"),  # filter height
        "kernel_w": col("S"),
        "input_h": col("H"),
        "input_w": col("W"),
        "stride": col("Vertical stride"),
        "stride_w": col("Horizontal stride"),
        "padding": col("pad_h"),
        "padding_w": col("pad_w"),
    }
    ctx = ("app=" + raw["Source"].fillna("").astype(str) + " fwd_algo="
           + raw["Forward Algorithm"].fillna("").astype(str) + " sheet_row="
           + raw["sheet_row"].astype(str))  # fmt: skip
    frames = []
    for column, direction, grad in (
        ("Forward (msec)", "forward", None),
        ("wrt Inputs (msec)", "backward", "input"),
        ("wrt Parameters (msec)", "backward", "weight"),
    ):
        text = raw[column].astype(str).str.strip()
        na = text == NA
        if na.any():
            result.note(f"{NAME}: {origin}: {int(na.sum())} '{column}' cells are N/A* "
                        "(not computed for a first layer); no row made for them")  # fmt: skip
        part = pd.DataFrame(
            {k: (v[~na] if isinstance(v, pd.Series) else v) for k, v in shape.items()}
        )
        part["direction"] = direction
        part["grad_wrt"] = grad
        part["latency_ms"] = pd.to_numeric(text[~na], errors="raise")
        part["context"] = ctx[~na]
        frames.append(part)
    return pd.concat(frames, ignore_index=True)


def run(shared: Path, gpu: GpuResolver, progress: Progress) -> ImportResult:
    result = ImportResult()
    folder = shared / NAME
    files = sorted(p for p in folder.glob("*.csv") if not p.name.endswith("_specs.csv"))
    if not files:
        raise FileNotFoundError(f"no DeepBench CSVs under {folder}")
    excluded: dict[str, int] = {}
    for path in files:
        m = FILE_RE.match(path.name)
        if not m:
            raise ValueError(f"{path}: DeepBench file name does not parse")
        raw = pd.read_csv(path, dtype={"Source": str, "Note": str})
        section = m["section"]
        if section in EXCLUDED_SECTIONS:
            reason = EXCLUDED_SECTIONS[section]
            excluded[reason] = excluded.get(reason, 0) + len(raw)
        elif section == "gemm":
            df = _gemm(raw)
        elif section == "conv":
            df = _conv(raw, result, path.name)
        else:
            raise ValueError(f"{path}: unknown DeepBench section {section!r}")
        if section in KERNEL_SECTIONS:
            _common(df, m["gpu"], m["prec"], _specs(folder, m["gpu"]), gpu)
            result.add("kernels", NAME, df)
        progress()
    for reason, rows in excluded.items():
        result.note(f"{NAME}: excluded {rows} rows of {reason}")
    return result


def n_steps(shared: Path) -> int:
    folder = shared / NAME
    return sum(not p.name.endswith("_specs.csv") for p in folder.glob("*.csv"))
