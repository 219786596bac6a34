"""The adds gradient accumulation makes: each micro-batch after the first adds its gradients
into the kept ones (autograd's AccumulateGrad: one in-place add per gradient).

A step traced with ``zero_grad=set_to_none`` is the first micro-batch: backward hands each
parameter its new gradient and adds nothing. Micro-batches 2..N of an accumulated step each
add once per gradient (a ``zero_grad=zero`` trace has those adds in its backward already).
The adds are memory-bound elementwise kernels, timed by the per-op model from the gradients'
sizes the trace records (``graph.meta["gradients"]``: tensors and elements per dtype; each
dtype's tensors are timed at their mean size).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.features import DTYPE_BYTES
from boom_ml.timing.per_op import predict_nodes_many
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.graph import NODE_COLUMNS, OpGraph


def add_nodes(gradients: dict[str, dict[str, int]]) -> tuple[pd.DataFrame, np.ndarray]:
    """One ``add_`` node per dtype at its gradients' mean size, and how many of each."""
    rows, counts = [], []
    for k, (dtype, size) in enumerate(sorted(gradients.items())):
        tensors, numel = int(size["tensors"]), int(size["numel"])
        if tensors < 1 or numel < 1:
            continue
        mean = max(numel // tensors, 1)
        itemsize = DTYPE_BYTES.get(dtype, 4)
        rows.append({
            "id": k, "aten_op": "aten.add_.Tensor", "op": "add_", "family": "elementwise",
            "phase": "backward", "module": "", "input_shapes": json.dumps([[mean], [mean]]),
            "input_dtypes": json.dumps([dtype, dtype]), "output_shapes": json.dumps([[mean]]),
            "output_dtypes": json.dumps([dtype]), "flops": 0,  # as traced adds count
            "bytes_read": 2 * mean * itemsize, "bytes_written": mean * itemsize,
        })  # fmt: skip
        counts.append(tensors)
    frame = pd.DataFrame(rows, columns=list(NODE_COLUMNS)).astype(NODE_COLUMNS)
    return frame, np.array(counts, dtype=float)


def gradient_adds_ms(graph: OpGraph, gpus: list[GpuSpec], tf32: Tf32) -> list[float]:
    """Per GPU, the milliseconds one further micro-batch spends adding into kept gradients
    (0 where the trace recorded no gradients: no training, or a trace from before it did)."""
    return adds_ms(graph.meta.get("gradients") or {}, gpus, tf32)


def adds_ms(gradients: dict[str, dict[str, int]], gpus: list[GpuSpec], tf32: Tf32) -> list[float]:
    """``gradient_adds_ms`` of gradients given as tensors and elements per dtype."""
    nodes, counts = add_nodes(gradients)
    if nodes.empty or not gpus:
        return [0.0] * len(gpus)
    ms = predict_nodes_many(nodes, gpus, tf32=tf32, median_only=True)["ms"]
    return [float(ms[k] @ counts) for k in range(len(gpus))]


def gradients_less(
    more: dict[str, dict[str, int]], less: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """The gradients of ``more`` that ``less`` has not (tensors and elements per dtype): a
    2-layer trace's less a 1-layer one's are one layer's. Timed at their own mean size: the
    difference of two timings at mean sizes is not (the embedding's gradient, in both,
    sets both means: gpt2's layer came out at 0.14 ms for 85 MB, 600 GB/s on an L4)."""
    out = {}
    for dtype, size in more.items():
        other = less.get(dtype, {"tensors": 0, "numel": 0})
        tensors, numel = size["tensors"] - other["tensors"], size["numel"] - other["numel"]
        if tensors > 0 and numel > 0:
            out[dtype] = {"tensors": int(tensors), "numel": int(numel)}
    return out
