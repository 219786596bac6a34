"""Roofline time per op: max(FLOPs / peak, bytes / bandwidth) + a kernel launch cost.

The first-order model and the fallback for op families without a learned head.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec
from boom_ml.identity_cache import IdentityCache
from boom_ml.timing.tf32 import Tf32

# Per-kernel cost of a launch plus the gap before the next kernel, in eager PyTorch.
# An assumption (a few µs is the usual order of magnitude), replaced by learned models.
LAUNCH_MS = 0.005
MATRIX_FAMILIES = {"gemm", "conv", "attention"}
NO_GPU_FAMILIES = {"host"}


def compute_dtype(row_dtypes: str) -> str:
    """The dtype a matrix op computes in: its first floating input's dtype."""
    for dtype in json.loads(row_dtypes):
        if dtype in ("float16", "bfloat16", "float32", "float64"):
            return dtype
    return "float32"


# Per graph: each node's compute dtype and family (parsed once, reused for every GPU).
_STATIC: IdentityCache[tuple[np.ndarray, np.ndarray]] = IdentityCache(32)


def node_dtypes_families(nodes: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Compute dtype (first floating input; float32 when none) and family of every node."""

    def parse() -> tuple[np.ndarray, np.ndarray]:
        dtypes = [compute_dtype(d) if d else "float32" for d in nodes["input_dtypes"].astype(str)]
        return np.array(dtypes, dtype=object), nodes["family"].astype(str).to_numpy(dtype=object)

    return _STATIC.get(nodes, (), parse)


def matrix_peaks(nodes: pd.DataFrame, gpu: GpuSpec, tf32: Tf32 | bool | None) -> np.ndarray:
    """Peak FLOP/s per node: the dtype's (TF32 per the node's family switch) for matrix
    families, the fp32 vector peak for the rest."""
    flags = Tf32.of(tf32)
    dtypes, families = node_dtypes_families(nodes)
    peaks = np.full(len(nodes), gpu.fp32_tflops * 1e12)
    matrix = np.isin(families, list(MATRIX_FAMILIES))
    for d, f in set(zip(dtypes[matrix], families[matrix], strict=True)):
        peaks[matrix & (dtypes == d) & (families == f)] = gpu.peak_flops(d, flags.for_family(f))
    return peaks


def roofline_ms(nodes: pd.DataFrame, gpu: GpuSpec, tf32: Tf32 | bool | None = None) -> np.ndarray:
    """Predicted milliseconds for each node of an OpGraph on ``gpu``."""
    flops = nodes["flops"].to_numpy(dtype=float)
    moved = (nodes["bytes_read"] + nodes["bytes_written"]).to_numpy(dtype=float)
    peaks = matrix_peaks(nodes, gpu, tf32)
    seconds = np.maximum(flops / peaks, moved / gpu.bandwidth_bytes_per_s)
    ms = seconds * 1e3 + LAUNCH_MS
    ms[nodes["family"].isin(NO_GPU_FAMILIES).to_numpy()] = 0.0
    return ms
