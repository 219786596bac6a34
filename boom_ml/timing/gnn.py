"""GNN step-time model over the traced operator graph, and its inference.

step_ms = overhead + sum over nodes of node_ms, with node_ms = per_op_ms * exp(correction).
The correction of a node comes from message passing over the graph (data dependencies and
program order), so it can see what the sum of isolated per-op times misses: launch gaps
behind tiny kernels, fusion and cache reuse between neighbours. Keeping the prediction a
sum of positive per-node terms is what makes every millisecond attributable to an op and
its module, exactly.

Message passing runs over GPU-independent node features, once per graph; the GPU enters in
the per-node head (spec features, the node's per-op time on it), so one trace serves every
GPU for the price of the head. Training (``training/graph_dataset.py``) uses these features.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

with warnings.catch_warnings():  # torch_geometric's import warns about torch.jit.script
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import Batch, Data

from boom_ml.estimates import TimeEstimate
from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.roofline import MATRIX_FAMILIES, NO_GPU_FAMILIES, compute_dtype, roofline_ms
from boom_ml.trace.families import FAMILIES
from boom_ml.trace.graph import OpGraph

FEATURE_VERSION = 1
ARTIFACT_DIR = Path(__file__).resolve().parent.parent / "artifacts" / "gnn"
PHASES = ("zero_grad", "input", "forward", "loss", "backward", "recompute", "optimizer")
DTYPES = ("float32", "float16", "bfloat16", "float64")
N_STATIC = len(FAMILIES) + len(PHASES) + len(DTYPES) + 1 + 7
N_DYNAMIC = 5
N_CONTEXT = 17
# Edge types: data dependency (producer -> consumer), its reverse, and program order.
EDGE_TYPES = 3
# Floor of a node time in log space: host nodes (no GPU work) never reach it, they are masked.
MIN_MS = 1e-6
PerOpFn = Callable[[pd.DataFrame, GpuSpec, bool], np.ndarray]


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
            from boom_ml.timing.per_op import predict_nodes

            return "per-op", functools.partial(_heads_ms, predict_nodes, load_heads())
        except (ImportError, ArtifactError):
            if name == "per-op":
                raise
    return "roofline", roofline_ms


def _heads_ms(predict: Callable, heads: Any, nodes: pd.DataFrame, gpu: GpuSpec, tf32: bool):
    return predict(nodes, gpu, tf32=tf32, model=heads)["ms"].to_numpy()


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


def graph_data(graph: OpGraph) -> Data:
    """The GPU-independent part of a graph as a PyG ``Data``."""
    index, types = edge_index(graph)
    gpu_work = ~graph.nodes["family"].astype(str).isin(NO_GPU_FAMILIES).to_numpy()
    return Data(x=torch.from_numpy(static_node_features(graph.nodes)),
                edge_index=torch.from_numpy(index), edge_type=torch.from_numpy(types),
                gpu_mask=torch.from_numpy(gpu_work), num_nodes=len(graph.nodes))  # fmt: skip


def gpu_context(
    graph: OpGraph, gpu: GpuSpec, tf32: bool, per_op_ms: np.ndarray, channels_last: bool = False
) -> np.ndarray:
    """Graph-level features: the GPU's spec sheet and what the step does."""
    nodes = graph.nodes
    matrix = nodes["family"].isin(MATRIX_FAMILIES).to_numpy()
    dtypes = [_dtype_of(d) for d in nodes.loc[matrix, "input_dtypes"].astype(str)]
    half = float(np.mean([d in ("float16", "bfloat16") for d in dtypes])) if dtypes else 0.0
    main = max(set(dtypes), key=dtypes.count) if dtypes else "float32"
    peak = gpu.peak_flops(main, tf32=tf32)
    bw = gpu.bandwidth_bytes_per_s
    phases = set(nodes["phase"].astype(str))
    step = graph.meta.get("step", {})
    batch = float(step.get("batch_size") or 1)
    l2 = gpu.l2_cache_mb
    return np.array(
        [np.log10(gpu.fp32_tflops * 1e12) - 13, np.log10(peak) - 13, np.log10(bw) - 12,
         np.log10(peak / bw) - 1.5, gpu.sm_count / 100, (l2 or 0.0) / 40, float(l2 is None),
         (gpu.boost_clock_mhz or 1500.0) / 2000, gpu.memory_bytes / 2**30 / 80,
         half, float(step.get("amp", "none") != "none"), float("backward" in phases),
         float("optimizer" in phases), float(channels_last), np.log2(batch) / 9,
         np.log10(len(nodes) + 1) / 4, np.log10(max(float(per_op_ms.sum()), MIN_MS)) / 4],
        dtype=np.float32,
    )  # fmt: skip


def dynamic_node_features(
    graph: OpGraph, gpu: GpuSpec, tf32: bool, per_op_ms: np.ndarray
) -> np.ndarray:
    """GPU-dependent node features: per-op time, its roofline parts, neighbours' times."""
    nodes = graph.nodes
    log_ms = np.log10(np.maximum(per_op_ms, MIN_MS))
    matrix = nodes["family"].isin(MATRIX_FAMILIES).to_numpy()
    peaks = np.array(
        [gpu.peak_flops(_dtype_of(d), tf32) if m else gpu.fp32_tflops * 1e12
         for d, m in zip(nodes["input_dtypes"].astype(str), matrix, strict=True)]
    )  # fmt: skip
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
    graph: OpGraph, gpu: GpuSpec, tf32: bool, per_op_ms: np.ndarray, channels_last: bool = False
) -> RowInputs:
    return RowInputs(
        dynamic=torch.from_numpy(dynamic_node_features(graph, gpu, tf32, per_op_ms)),
        log_per_op=torch.from_numpy(np.log(np.maximum(per_op_ms, MIN_MS)).astype(np.float32)),
        context=torch.from_numpy(gpu_context(graph, gpu, tf32, per_op_ms, channels_last)),
    )


@dataclass
class RowBatch:
    """Rows that share a batch of unique graphs; ``node_of`` maps row nodes to batch nodes."""

    graphs: Batch
    node_of: torch.Tensor  # (M,) index into graphs' nodes, rows' nodes concatenated
    row_of: torch.Tensor  # (M,) row of each row-node
    dynamic: torch.Tensor  # (M, N_DYNAMIC)
    log_per_op: torch.Tensor  # (M,)
    context: torch.Tensor  # (R, N_CONTEXT)
    num_rows: int
    row_start: torch.Tensor  # (R,) first row-node of each row
    adjacency: tuple  # per edge type: (src, dst, inverse in-degree), see mean_adjacency


def mean_adjacency(edge_index: torch.Tensor, edge_type: torch.Tensor, n: int) -> tuple:
    """Per edge type (src, dst, 1 / in-degree of each node): what a mean aggregation needs.

    Gather + ``index_add_`` instead of PyG's scatter path: without the compiled
    torch-scatter extension that path (and torch.sparse CSR matmuls) are several times
    slower on CPU, and training time is budgeted.
    """
    out = []
    for t in range(EDGE_TYPES):
        src, dst = edge_index[:, edge_type == t]
        inv = 1.0 / torch.bincount(dst, minlength=n).clamp(min=1).float()
        out.append((src, dst, inv[:, None]))
    return tuple(out)


def aggregate_mean(h: torch.Tensor, adjacency: tuple) -> list[torch.Tensor]:
    """Mean of incoming neighbours' ``h`` for each edge type (zeros without neighbours)."""
    return [torch.zeros_like(h).index_add_(0, dst, h[src]) * inv for src, dst, inv in adjacency]


def collate(graphs: list[Data], graph_of_row: list[int], rows: list[RowInputs]) -> RowBatch:
    """Batch unique graphs once and point each row's nodes at its graph's nodes."""
    batch = Batch.from_data_list(graphs)
    ptr = batch.ptr
    node_of = torch.cat([torch.arange(ptr[g], ptr[g + 1]) for g in graph_of_row])
    sizes = torch.tensor([len(r.log_per_op) for r in rows])
    return RowBatch(
        graphs=batch, node_of=node_of,
        row_of=torch.repeat_interleave(torch.arange(len(rows)), sizes),
        dynamic=torch.cat([r.dynamic for r in rows]),
        log_per_op=torch.cat([r.log_per_op for r in rows]),
        context=torch.stack([r.context for r in rows]), num_rows=len(rows),
        row_start=torch.cumsum(sizes, 0) - sizes,
        adjacency=mean_adjacency(batch.edge_index, batch.edge_type, batch.num_nodes),
    )  # fmt: skip


class RelationalLayer(nn.Module):
    """Mean messages per edge type plus self, mixed by one linear map (R-GCN / SAGE style)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden * (1 + EDGE_TYPES), hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h: torch.Tensor, adjacency: tuple) -> torch.Tensor:
        z = torch.cat([h, *aggregate_mean(h, adjacency)], dim=1)
        return self.norm(h + nn.functional.gelu(self.lin(z)))


class StepGNN(nn.Module):
    """Message passing per graph, then a GPU-conditioned positive time per node + overhead."""

    def __init__(self, hidden: int = 64, layers: int = 3, max_log_correction: float = 4.0):
        super().__init__()
        self.config = {"hidden": hidden, "layers": layers, "max_log_correction": max_log_correction}
        self.max_corr = max_log_correction
        self.embed = nn.Sequential(nn.Linear(N_STATIC, hidden), nn.GELU())
        self.layers = nn.ModuleList(RelationalLayer(hidden) for _ in range(layers))
        # Per-node head, one hidden layer over [embedding, GPU node features, context]. It runs
        # over every node of every row (the hot loop), so its first layer is split: embedding
        # projected per graph node, context per row, only GPU node features per row-node.
        self.head_h = nn.Linear(hidden, hidden)  # per graph node, before the gather
        self.head_dyn = nn.Linear(N_DYNAMIC, hidden, bias=False)
        self.head_ctx = nn.Linear(N_CONTEXT, hidden, bias=False)
        self.head_out = nn.Linear(hidden, 1)
        self.overhead = nn.Sequential(
            nn.Linear(hidden + N_CONTEXT, hidden), nn.GELU(), nn.Linear(hidden, 1)
        )
        # Start exactly at the per-op sum (zero correction) with a small overhead, so the
        # model only has to learn where the per-op sum is wrong.
        nn.init.zeros_(self.head_out.weight)
        nn.init.zeros_(self.head_out.bias)
        nn.init.zeros_(self.overhead[-1].weight)
        nn.init.constant_(self.overhead[-1].bias, -2.0)

    def node_embeddings(self, b: RowBatch) -> torch.Tensor:
        h = self.embed(b.graphs.x)
        for layer in self.layers:
            h = layer(h, b.adjacency)
        return h

    def forward(self, b: RowBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(node_ms (M,), overhead_ms (R,), step_ms (R,))."""
        h = self.node_embeddings(b)
        z = (
            self.head_h(h)[b.node_of]
            + self.head_dyn(b.dynamic)
            + self.head_ctx(b.context)[b.row_of]
        )
        raw = self.head_out(nn.functional.gelu(z)).squeeze(1)
        corr = self.max_corr * torch.tanh(raw / self.max_corr)
        mask = b.graphs.gpu_mask[b.node_of]
        node_ms = torch.exp(b.log_per_op + corr) * mask
        # Mean node embedding of each row's graph (pooled per graph, then gathered per row).
        graph_of = b.graphs.batch
        pooled = torch.zeros(b.graphs.num_graphs, h.shape[1]).index_add_(0, graph_of, h)
        pooled = pooled / torch.bincount(graph_of, minlength=b.graphs.num_graphs)[:, None]
        pooled = pooled[graph_of[b.node_of[b.row_start]]]
        overhead = nn.functional.softplus(self.overhead(torch.cat([pooled, b.context], 1)))[:, 0]
        step = overhead + torch.zeros(b.num_rows).index_add_(0, b.row_of, node_ms)
        return node_ms, overhead, step


@dataclass
class GnnPrediction:  # node_ms: per graph node in graph.nodes order (0 for host nodes)
    node_ms: np.ndarray
    overhead_ms: float
    step_ms: float  # overhead_ms + node_ms.sum()


def save_model(model: StepGNN, manifest: dict[str, Any], directory: Path = ARTIFACT_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"config": model.config, "state": model.state_dict()}, directory / "model.pt")
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    load_model.cache_clear()


@functools.cache
def load_model(directory: Path = ARTIFACT_DIR) -> tuple[StepGNN, dict[str, Any]] | None:
    """The packaged model and its manifest, or None when none is packaged."""
    if not (directory / "model.pt").exists():
        return None
    blob = torch.load(directory / "model.pt", weights_only=True)
    model = StepGNN(**blob["config"])
    model.load_state_dict(blob["state"])
    return model.eval(), json.loads((directory / "manifest.json").read_text())


def predict_graph(
    model: StepGNN, graph: OpGraph, gpu: GpuSpec, tf32: bool, per_op: str,
    channels_last: bool = False,
) -> GnnPrediction:  # fmt: skip
    """Node times and overhead of one traced step on one GPU."""
    _, fn = per_op_function(per_op)
    base = np.asarray(fn(graph.nodes, gpu, tf32), dtype=float)
    row = row_inputs(graph, gpu, tf32, base, channels_last)
    with torch.no_grad():
        node_ms, overhead, _ = model(collate([graph_data(graph)], [0], [row]))
    nodes, over = node_ms.double().numpy(), float(overhead[0])
    return GnnPrediction(node_ms=nodes, overhead_ms=over, step_ms=over + float(nodes.sum()))


def regime(family: str, amp: str | None) -> str:
    """The cell a CV verdict is kept per: model family x AMP or not ("cnn/amp", ...)."""
    return f"{family}/{'no-amp' if amp in (None, 'none') else 'amp'}"


def use_gnn_for(manifest: dict[str, Any], family: str, amp: str | None) -> bool:
    """Whether CV said the GNN beats the per-op sum in this cell ("other/*": unseen family)."""
    rule = manifest.get("use_gnn", {})
    return bool(rule.get(regime(family, amp), rule.get(regime("other", amp), False)))


def estimate_time(
    graph: OpGraph, gpu: GpuSpec, tf32: bool = False, top_n: int = 10
) -> TimeEstimate:
    """Step time from the GNN where CV says it wins, else the per-op estimate.

    ``method`` says which was used: "gnn", or the per-op estimate's own method.
    """
    from boom_ml.errors import ArtifactError
    from boom_ml.timing import estimate as per_op_estimate

    packaged = load_model()
    family = str(graph.meta.get("model_family", "other"))
    # CV compared the GNN with the per-op function it was trained on; if the predictor's
    # per-op estimate is now another one (heads packaged later), that verdict is void.
    amp = graph.meta.get("step", {}).get("amp")
    if packaged is None or not use_gnn_for(packaged[1], family, amp):
        return per_op_estimate.estimate_time(graph, gpu, tf32=tf32, top_n=top_n)
    model, manifest = packaged
    try:
        if per_op_function(None)[0] != manifest["per_op"]:
            return per_op_estimate.estimate_time(graph, gpu, tf32=tf32, top_n=top_n)
        pred = predict_graph(model, graph, gpu, tf32, manifest["per_op"])
    except (ImportError, ArtifactError):  # trained on per-op heads that are gone: no GNN
        return per_op_estimate.estimate_time(graph, gpu, tf32=tf32, top_n=top_n)
    est = per_op_estimate.summarise(graph.nodes, pred.node_ms, method="gnn", top_n=top_n)
    est.step_ms = pred.step_ms
    est.overhead_ms = round(pred.overhead_ms, 4)
    # The GNN has no quantile heads: carry the per-op interval over, scaled to its estimate.
    base = per_op_estimate.estimate_time(graph, gpu, tf32=tf32, top_n=top_n)
    if base.p10_ms is not None and base.p90_ms is not None and base.step_ms > 0:
        est.p10_ms = base.p10_ms * est.step_ms / base.step_ms
        est.p90_ms = base.p90_ms * est.step_ms / base.step_ms
    return est
