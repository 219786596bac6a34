"""The spec-sheet numbers of a GPU that the learned models read (per-op heads, GEMM model, GNN).

A sheet silent on a field (``SPARSE_FIELDS``) is read at its architecture's median, so that no
model meets a blank it never saw in training.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec

# Spec-sheet fields some sheets leave blank (GH200: its power covers the CPU too; H20, A30:
# no clock or L2 published): gpu_table fills them from the GPUs of the same architecture.
SPARSE_FIELDS = ("boost_clock_mhz", "l2_cache_mb", "tdp_w")


@functools.cache  # the packaged table does not change within a process
def spec_medians(architecture: str) -> dict[str, float]:
    """Median of each sparse field over the packaged GPUs of ``architecture`` that give it
    (over every packaged GPU where none does). No GPU with kernel or step measurements lacks
    one, so the learned models never saw a blank: one reached a tree's missing-value branch
    (the GH200 ran 12 % slower than the H100 it contains, for lack of a TDP)."""
    from boom_ml.gpus import all_gpus

    table = all_gpus()
    out = {}
    for field in SPARSE_FIELDS:
        same = [getattr(g, field) for g in table if g.architecture == architecture]
        known = [float(v) for v in same if v] or [float(getattr(g, field)) for g in table
                                                  if getattr(g, field)]  # fmt: skip
        out[field] = float(np.median(known))
    return out


def filled(spec: GpuSpec) -> GpuSpec:
    """``spec`` with each sparse field its sheet is silent on at its architecture's median
    (``spec_medians``): what the learned models read for it, per-op heads and GNN alike."""
    if all(getattr(spec, f) for f in SPARSE_FIELDS):
        return spec
    fill = spec_medians(spec.architecture)
    return replace(spec, **{f: getattr(spec, f) or fill[f] for f in SPARSE_FIELDS})


def gpu_table(specs: Mapping[str, GpuSpec]) -> pd.DataFrame:
    """Spec-sheet numbers per GPU id that the features need (a field the sheet is silent on
    takes its architecture's median: ``filled``)."""
    rows = []
    for gid, s in specs.items():
        s = filled(s)
        clock = float(s.boost_clock_mhz)  # every sparse field is filled by now
        rows.append(
            {
                "gpu_id": gid,
                "fp32": s.fp32_tflops * 1e12,
                "tf32": (s.tf32_tflops or s.fp32_tflops) * 1e12,
                "fp16": (s.fp16_tflops or s.fp32_tflops) * 1e12,
                "bf16": s.bf16_peak_tflops * 1e12,
                "bw": s.bandwidth_bytes_per_s,
                "g_sm": float(s.sm_count),
                "g_clock": clock,
                "g_l2_mb": float(s.l2_cache_mb),
                "g_tdp": float(s.tdp_w),
                # FP32 FLOPs per SM per clock: 128 (64 lanes) or 256 (128 lanes per SM).
                "g_lanes": s.fp32_tflops * 1e6 / (s.sm_count * clock),
            }
        )
    return pd.DataFrame(rows).set_index("gpu_id")
