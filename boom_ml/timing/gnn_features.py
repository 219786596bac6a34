"""The GNN's inputs: node and graph features of a traced step, and their batching.

Message passing runs over GPU-independent node features (:func:`graph_data`), once per
graph; the GPU enters through per-node GPU features and a graph context (:func:`row_inputs`),
so one trace serves every GPU. Training (``training/graph_dataset.py``) and inference
(``boom_ml/timing/gnn_model.py``; ``gnn_inference.py``, its numpy pass) build their inputs
with these same functions. torch is imported where tensors are made: a prediction builds
none.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.roofline import (
    MATRIX_FAMILIES,
    NO_GPU_FAMILIES,
    compute_dtype,
    matrix_peaks,
    node_dtypes_families,
    roofline_ms,
)
from boom_ml.timing.spec_sheet import filled
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.families import FAMILIES
from boom_ml.trace.graph import OpGraph

if TYPE_CHECKING:
    import torch
    from torch_geometric.data import Batch, Data

# 2: the GPU's memory size left the spec columns (a step that fits takes the same time
# whatever the card's capacity; as a column it let the GNN tell training GPUs apart by it)
FEATURE_VERSION = 2
PHASES = ("zero_grad", "input", "forward", "loss", "backward", "recompute", "optimizer")
DTYPES = ("float32", "float16", "bfloat16", "float64")
N_STATIC = len(FAMILIES) + len(PHASES) + len(DTYPES) + 1 + 7
N_DYNAMIC = 5
N_CONTEXT = 16
# The first N_SPEC context columns are the GPU's spec sheet (gpu_context); the rest describe the step.
N_SPEC = 8
SPEC_NAMES = ("FP32 TFLOPS", "matrix peak", "memory bandwidth", "peak / bandwidth", "SMs",
              "L2 cache", "no L2 figure", "boost clock")  # fmt: skip
# Edge types: data dependency (producer -> consumer), its reverse, and program order.
EDGE_TYPES = 3
# Floor of a node time in log space: host nodes (no GPU work) never reach it, they are masked.
MIN_MS = 1e-6
PerOpFn = Callable[[pd.DataFrame, GpuSpec, Tf32], np.ndarray]


def per_op_function(name: str | None = None) -> tuple[str, PerOpFn]:
    """The per-node time function the GNN builds on, and its name for the manifest.

    ``None`` prefers the learned per-op heads (``boom_ml.timing.per_op.predict_nodes``)
    when a packaged model loads, else the roofline; a name picks one exactly, because a
    trained GNN must see the per-op times it was trained on.
    """
    if name in (None, "per-op"):
        from boom_ml.errors import ArtifactError

        try:
            from boom_ml.timing.heads import load_model as load_heads

            return "per-op", HeadsTimes(load_heads())
        except (ImportError, ArtifactError):
            if name == "per-op":
                raise
    return "roofline", roofline_ms


def per_op_times(
    graph: OpGraph, gpus: list[GpuSpec], tf32: Tf32, per_op: str, channels_last: bool = False
) -> np.ndarray:
    """((len(gpus), n)) the per-node ms of the named per-op function, all GPUs in one call
    where it can (the heads' ``many``)."""
    _, fn = per_op_function(per_op)
    many = getattr(fn, "many", None)
    if many is not None:
        return many(graph.nodes, gpus, tf32, channels_last)
    return np.stack([np.asarray(fn(graph.nodes, g, tf32), dtype=float) for g in gpus])


def heads_function(heads: Any) -> PerOpFn:
    """The per-op time function of a given PerOpModel (a CV fold's heads, say)."""
    return HeadsTimes(heads)


class HeadsTimes:
    """Per-node median ms from a PerOpModel; ``many`` does several GPUs in one call."""

    def __init__(self, heads: Any) -> None:
        self.heads = heads

    def __call__(self, nodes: pd.DataFrame, gpu: GpuSpec, tf32: Tf32) -> np.ndarray:
        return self.many(nodes, [gpu], tf32)[0]

    def many(
        self, nodes: pd.DataFrame, gpus: list[GpuSpec], tf32: Tf32, channels_last: bool = False
    ) -> np.ndarray:
        from boom_ml.timing.per_op import node_ms_many

        return node_ms_many(nodes, gpus, tf32=tf32, model=self.heads, channels_last=channels_last)


def _dtype_of(row_dtypes: str) -> str:
    return compute_dtype(row_dtypes) if row_dtypes else "float32"  # compute dtype of a node


def static_node_features(nodes: pd.DataFrame) -> np.ndarray:
    """GPU-independent node features: op family, phase, dtype, log FLOPs/bytes, position."""
    n = len(nodes)
    fam = nodes["family"].astype(str).to_numpy()
    fam = np.where(np.isin(fam, FAMILIES), fam, "other")
    phase = nodes["phase"].astype(str).to_numpy()
    dtype = np.array([_dtype_of(d) for d in nodes["input_dtypes"].astype(str)])
    has_float = np.array(["float" in d for d in nodes["input_dtypes"].astype(str)])
    flops = nodes["flops"].to_numpy(dtype=float)
    read = nodes["bytes_read"].to_numpy(dtype=float)
    written = nodes["bytes_written"].to_numpy(dtype=float)
    n_inputs = np.array([len(json.loads(s)) if s else 0 for s in nodes["input_shapes"].astype(str)])
    op = nodes["op"].astype(str)
    parts = [
        (fam[:, None] == np.array(FAMILIES)[None, :]),
        (phase[:, None] == np.array(PHASES)[None, :]),
        (dtype[:, None] == np.array(DTYPES)[None, :]) & has_float[:, None],
        ~has_float[:, None],
        # Scaled to roughly [0, 1.5] so that no input dominates the first layer.
        np.log10(1 + flops)[:, None] / 10,
        np.log10(1 + read)[:, None] / 10,
        np.log10(1 + written)[:, None] / 10,
        (np.log10((1 + flops) / (1 + read + written)) / 3)[:, None],
        np.log2(1 + n_inputs)[:, None] / 8,  # foreach kernels take hundreds of tensors
        op.str.endswith("_").to_numpy()[:, None],  # in-place ops
        (np.arange(n) / max(n - 1, 1))[:, None],  # where in the step the op runs
    ]
    return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts], axis=1)


def edge_index(graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """(2, E) edges and their types: dependency, reversed dependency, program order."""
    src = graph.edges["src"].to_numpy(dtype=np.int64)
    dst = graph.edges["dst"].to_numpy(dtype=np.int64)
    ids = graph.nodes["id"].to_numpy(dtype=np.int64)
    if len(ids) and not np.array_equal(ids, np.arange(len(ids))):
        pos = {int(i): k for k, i in enumerate(ids)}  # sub-graphs keep their original ids
        keep = np.array([s in pos and d in pos for s, d in zip(src, dst, strict=True)], bool)
        src = np.array([pos[int(s)] for s in src[keep]], dtype=np.int64)
        dst = np.array([pos[int(d)] for d in dst[keep]], dtype=np.int64)
    order = np.arange(len(ids) - 1, dtype=np.int64)
    index = np.concatenate(
        [np.stack([src, dst]), np.stack([dst, src]), np.stack([order, order + 1]),
         np.stack([order + 1, order])], axis=1)  # fmt: skip
    types = np.concatenate([np.zeros(len(src)), np.ones(len(src)), np.full(2 * len(order), 2)])
    return index, types.astype(np.int64)


def pyg_types() -> tuple[type, type]:
    """PyG's ``Batch`` and ``Data``, imported on first use: importing torch_geometric takes
    about 2 s (it imports torch._dynamo), and a prediction batches one graph without it."""
    with warnings.catch_warnings():  # torch_geometric's import warns about torch.jit.script
        warnings.simplefilter("ignore", FutureWarning)
        from torch_geometric.data import Batch, Data
    return Batch, Data


def gpu_work_mask(graph: OpGraph) -> np.ndarray:
    """Which nodes run GPU work (host nodes take no time of their own)."""
    return ~graph.nodes["family"].astype(str).isin(NO_GPU_FAMILIES).to_numpy()


def graph_tensors(graph: OpGraph) -> dict[str, Any]:
    """The GPU-independent part of a graph: node features, typed edges, GPU-work mask."""
    import torch

    index, types = edge_index(graph)
    gpu_work = gpu_work_mask(graph)
    return {"x": torch.from_numpy(static_node_features(graph.nodes)),
            "edge_index": torch.from_numpy(index), "edge_type": torch.from_numpy(types),
            "gpu_mask": torch.from_numpy(gpu_work), "num_nodes": len(graph.nodes)}  # fmt: skip


def graph_data(graph: OpGraph) -> Data:
    """:func:`graph_tensors` as a PyG ``Data`` (training batches many graphs)."""
    return pyg_types()[1](**graph_tensors(graph))


def gpu_context(
    graph: OpGraph,
    gpu: GpuSpec,
    tf32: Tf32 | bool | None,
    per_op_ms: np.ndarray,
    channels_last: bool = False,
) -> np.ndarray:
    """Graph-level features: the GPU's spec sheet and what the step does. A field the sheet
    is silent on takes its architecture's median, as the per-op features do
    (``spec_sheet.filled``; every GPU with measurements has them all): read as 0, a
    missing L2 made an L40 9 % faster than itself with its 96 MB."""
    l2_missing = gpu.l2_cache_mb is None
    gpu = filled(gpu)
    nodes = graph.nodes
    all_dtypes, all_fams = node_dtypes_families(nodes)
    matrix = np.isin(all_fams, list(MATRIX_FAMILIES))
    dtypes = list(all_dtypes[matrix])
    half = float(np.mean([d in ("float16", "bfloat16") for d in dtypes])) if dtypes else 0.0
    main = max(set(dtypes), key=dtypes.count) if dtypes else "float32"
    # The TF32 switch of the family doing most of the matrix work (conv: cuDNN's).
    fams = list(all_fams[matrix])
    main_family = max(set(fams), key=fams.count) if fams else "gemm"
    peak = gpu.peak_flops(main, tf32=Tf32.of(tf32).for_family(main_family))
    bw = gpu.bandwidth_bytes_per_s
    phases = set(nodes["phase"].astype(str))
    step = graph.meta.get("step", {})
    batch = float(step.get("batch_size") or 1)
    l2 = gpu.l2_cache_mb
    # NHWC matters where the step's matrix work (its convolutions among it) runs in half
    # precision (cuDNN's layout transforms around tensor-core convolutions, conv_layout.py);
    # every channels_last row the GNN trained on is an AMP one, so an fp32 step in NHWC is
    # read as the NCHW step it times alike
    channels_last = bool(channels_last) and half > 0
    return np.array(
        [np.log10(gpu.fp32_tflops * 1e12) - 13, np.log10(peak) - 13, np.log10(bw) - 12,
         np.log10(peak / bw) - 1.5, gpu.sm_count / 100, l2 / 40, float(l2_missing),
         gpu.boost_clock_mhz / 2000, half, float(step.get("amp", "none") != "none"), float("backward" in phases),
         float("optimizer" in phases), float(channels_last), np.log2(batch) / 9,
         np.log10(len(nodes) + 1) / 4, np.log10(max(float(per_op_ms.sum()), MIN_MS)) / 4],
        dtype=np.float32,
    )  # fmt: skip


def dynamic_node_features(
    graph: OpGraph, gpu: GpuSpec, tf32: Tf32 | bool | None, per_op_ms: np.ndarray
) -> np.ndarray:
    """GPU-dependent node features: per-op time, its roofline parts, neighbours' times."""
    nodes = graph.nodes
    log_ms = np.log10(np.maximum(per_op_ms, MIN_MS))
    peaks = matrix_peaks(nodes, gpu, tf32)
    moved = (nodes["bytes_read"] + nodes["bytes_written"]).to_numpy(dtype=float)
    t_compute = nodes["flops"].to_numpy(dtype=float) / peaks * 1e3
    t_memory = moved / gpu.bandwidth_bytes_per_s * 1e3
    index, types = edge_index(graph)
    dep = index[:, types == 0]
    # Mean log time of producers and of consumers: is this op sandwiched between tiny ones?
    neigh = []
    for a, b in ((dep[0], dep[1]), (dep[1], dep[0])):
        total, count = np.zeros(len(nodes)), np.zeros(len(nodes))
        np.add.at(total, b, log_ms[a])
        np.add.at(count, b, 1.0)
        neigh.append(np.where(count > 0, total / np.maximum(count, 1), log_ms))
    cols = [log_ms, np.log10(np.maximum(t_compute, MIN_MS)), np.log10(np.maximum(t_memory, MIN_MS)),
            *neigh]  # fmt: skip
    # log10(ms) spans about -3 (launch-bound) to 3; centre and scale it near [-1, 1].
    return ((np.stack(cols, axis=1) + 1.5) / 2).astype(np.float32)


@dataclass
class RowInputs:
    """One (graph, GPU) pair as model input: per-node GPU features and the graph context."""

    dynamic: torch.Tensor  # (n, N_DYNAMIC)
    log_per_op: torch.Tensor  # (n,) natural log of per-op ms
    context: torch.Tensor  # (N_CONTEXT,)


def row_inputs(
    graph: OpGraph,
    gpu: GpuSpec,
    tf32: Tf32 | bool | None,
    per_op_ms: np.ndarray,
    channels_last: bool = False,
) -> RowInputs:
    import torch

    return RowInputs(
        dynamic=torch.from_numpy(dynamic_node_features(graph, gpu, tf32, per_op_ms)),
        log_per_op=torch.from_numpy(np.log(np.maximum(per_op_ms, MIN_MS)).astype(np.float32)),
        context=torch.from_numpy(gpu_context(graph, gpu, tf32, per_op_ms, channels_last)),
    )


@dataclass
class RowBatch:
    """Rows that share a batch of unique graphs; ``node_of`` maps row nodes to batch nodes."""

    graphs: Batch | OneGraph
    node_of: torch.Tensor  # (M,) index into graphs' nodes, rows' nodes concatenated
    row_of: torch.Tensor  # (M,) row of each row-node
    dynamic: torch.Tensor  # (M, N_DYNAMIC)
    log_per_op: torch.Tensor  # (M,)
    context: torch.Tensor  # (R, N_CONTEXT)
    num_rows: int
    row_start: torch.Tensor  # (R,) first row-node of each row
    adjacency: tuple  # per edge type: (src, dst, inverse in-degree), see mean_adjacency


def adjacency_arrays(
    index: np.ndarray, types: np.ndarray, n: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per edge type (src, dst, 1 / in-degree of each node, as a column): what a mean
    aggregation needs, in numpy (the packaged model's forward pass runs on these)."""
    out = []
    for t in range(EDGE_TYPES):
        src, dst = index[:, types == t]
        inv = 1.0 / np.maximum(np.bincount(dst, minlength=n), 1)
        out.append((src, dst, inv[:, None]))
    return out


def mean_adjacency(edge_index: torch.Tensor, edge_type: torch.Tensor, n: int) -> tuple:
    """:func:`adjacency_arrays` as tensors (the inverse in-degrees float32, as the model's).

    Gather + ``index_add_`` instead of PyG's scatter path: without the compiled
    torch-scatter extension that path (and torch.sparse CSR matmuls) are several times
    slower on CPU, and training time is budgeted.
    """
    import torch

    arrays = adjacency_arrays(edge_index.numpy(), edge_type.numpy(), n)
    return tuple(
        (torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(inv.astype(np.float32)))
        for src, dst, inv in arrays
    )


@dataclass
class OneGraph:
    """What the model reads of a PyG ``Batch``, for a batch of one graph (no PyG import)."""

    x: torch.Tensor
    gpu_mask: torch.Tensor
    batch: torch.Tensor  # (n,) zeros: every node belongs to graph 0
    num_graphs: int = 1


def collate(graphs: list[Data], graph_of_row: list[int], rows: list[RowInputs]) -> RowBatch:
    """Batch unique graphs once and point each row's nodes at its graph's nodes."""
    import torch

    batch = pyg_types()[0].from_data_list(graphs)
    ptr = batch.ptr
    node_of = torch.cat([torch.arange(ptr[g], ptr[g + 1]) for g in graph_of_row])
    adjacency = mean_adjacency(batch.edge_index, batch.edge_type, batch.num_nodes)
    return _row_batch(batch, node_of, rows, adjacency)


def one_graph_batch(graph: OpGraph, rows: list[RowInputs]) -> RowBatch:
    """Rows (one per GPU, say) over one graph: the same batch as ``collate([graph_data(graph)],
    [0] * len(rows), rows)``, built without PyG."""
    import torch

    t = graph_tensors(graph)
    n = t["num_nodes"]
    one = OneGraph(x=t["x"], gpu_mask=t["gpu_mask"], batch=torch.zeros(n, dtype=torch.long))
    node_of = torch.arange(n).repeat(len(rows))
    return _row_batch(one, node_of, rows, mean_adjacency(t["edge_index"], t["edge_type"], n))


def _row_batch(
    graphs: Batch | OneGraph, node_of: torch.Tensor, rows: list[RowInputs], adjacency: tuple
) -> RowBatch:
    import torch

    sizes = torch.tensor([len(r.log_per_op) for r in rows])
    return RowBatch(
        graphs=graphs, node_of=node_of,
        row_of=torch.repeat_interleave(torch.arange(len(rows)), sizes),
        dynamic=torch.cat([r.dynamic for r in rows]),
        log_per_op=torch.cat([r.log_per_op for r in rows]),
        context=torch.stack([r.context for r in rows]), num_rows=len(rows),
        row_start=torch.cumsum(sizes, 0) - sizes, adjacency=adjacency,
    )  # fmt: skip
