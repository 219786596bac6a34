"""GNN step-time model over the traced operator graph, and its prediction for one GPU.

step_ms = overhead + sum over nodes of node_ms, with node_ms = per_op_ms * exp(correction).
The correction of a node comes from message passing over the graph (data dependencies and
program order), so it can see what the sum of isolated per-op times misses: launch gaps
behind tiny kernels, fusion and cache reuse between neighbours. Keeping the prediction a
sum of positive per-node terms is what makes every millisecond attributable to an op and
its module, exactly. Its inputs come from ``boom_ml/timing/gnn_features.py``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.gnn_features import (
    EDGE_TYPES,
    N_CONTEXT,
    N_DYNAMIC,
    N_SPEC,
    N_STATIC,
    SPEC_NAMES,
    RowBatch,
    one_graph_batch,
    per_op_times,
    row_inputs,
)
from boom_ml.timing.gnn_inference import GnnPrediction
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.graph import OpGraph


def aggregate_mean(h: torch.Tensor, adjacency: tuple) -> list[torch.Tensor]:
    """Mean of incoming neighbours' ``h`` for each edge type (zeros without neighbours)."""
    return [torch.zeros_like(h).index_add_(0, dst, h[src]) * inv for src, dst, inv in adjacency]


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

    def __init__(
        self,
        hidden: int = 64,
        layers: int = 3,
        max_log_correction: float = 4.0,
        spec_context: bool = True,
        spec_range: list[list[float]] | None = None,
    ):
        super().__init__()
        self.config = {"hidden": hidden, "layers": layers, "max_log_correction": max_log_correction}
        if not spec_context:  # older artifacts lack the key: they saw the spec columns
            self.config["spec_context"] = False
        # spec_range ([low, high], N_SPEC values each): the spec columns are clamped to the
        # range of the GPUs the model was trained on. A network extrapolates along them
        # without bound: its per-step overhead, learned from launch-bound steps of the
        # largest training GPUs, kept growing with SMs and bandwidth past them (B200 slower
        # than T4 on a small CNN). A GPU beyond the range is read as its edge.
        if spec_range is not None:
            self.config["spec_range"] = [[float(v) for v in side] for side in spec_range]
        low, high = (
            torch.tensor(spec_range, dtype=torch.float32)
            if spec_range is not None
            else torch.full((2, N_SPEC), float("inf")) * torch.tensor([[-1.0], [1.0]])
        )
        self.register_buffer("spec_low", low, persistent=False)
        self.register_buffer("spec_high", high, persistent=False)
        self.max_corr = max_log_correction
        # spec_context=False hides the spec-sheet columns of the context: the GNN then sees a
        # GPU only through its per-op times and their roofline parts, so it cannot learn an
        # offset per training GPU from a handful of spec values.
        mask = torch.ones(N_CONTEXT)
        mask[:N_SPEC] = float(spec_context)
        self.register_buffer("context_mask", mask, persistent=False)
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

    def beyond_range(self, context: torch.Tensor) -> list[list[str]]:
        """Per row of ``context`` ((R, N_CONTEXT)): the spec columns read at the range's edge
        (none when the model does not read them). The no-L2-figure flag is left out: a GPU
        without the figure is read at its architecture's median L2 (``gpu_context``)."""
        spec = context[:, :N_SPEC]
        out = ((spec < self.spec_low) | (spec > self.spec_high)) & (self.context_mask[:N_SPEC] > 0)
        flag = SPEC_NAMES.index("no L2 figure")
        return [[SPEC_NAMES[j] for j in np.flatnonzero(row) if j != flag] for row in out.numpy()]

    def node_embeddings(self, b: RowBatch) -> torch.Tensor:
        h = self.embed(b.graphs.x)
        for layer in self.layers:
            h = layer(h, b.adjacency)
        return h

    def forward(self, b: RowBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(node_ms (M,), overhead_ms (R,), step_ms (R,))."""
        h = self.node_embeddings(b)
        spec = torch.minimum(torch.maximum(b.context[:, :N_SPEC], self.spec_low), self.spec_high)
        context = torch.cat([spec, b.context[:, N_SPEC:]], 1) * self.context_mask
        z = self.head_h(h)[b.node_of] + self.head_dyn(b.dynamic) + self.head_ctx(context)[b.row_of]
        raw = self.head_out(nn.functional.gelu(z)).squeeze(1)
        corr = self.max_corr * torch.tanh(raw / self.max_corr)
        mask = b.graphs.gpu_mask[b.node_of]
        node_ms = torch.exp(b.log_per_op + corr) * mask
        # Mean node embedding of each row's graph (pooled per graph, then gathered per row).
        graph_of = b.graphs.batch
        pooled = torch.zeros(b.graphs.num_graphs, h.shape[1]).index_add_(0, graph_of, h)
        pooled = pooled / torch.bincount(graph_of, minlength=b.graphs.num_graphs)[:, None]
        pooled = pooled[graph_of[b.node_of[b.row_start]]]
        overhead = nn.functional.softplus(self.overhead(torch.cat([pooled, context], 1)))[:, 0]
        step = overhead + torch.zeros(b.num_rows).index_add_(0, b.row_of, node_ms)
        return node_ms, overhead, step


def spec_range_of(context: torch.Tensor) -> list[list[float]]:
    """[low, high] of the spec columns over the training rows' contexts ((R, N_CONTEXT))."""
    spec = context[:, :N_SPEC]
    return [spec.min(0).values.tolist(), spec.max(0).values.tolist()]


class GnnEnsemble(nn.Module):
    """Members trained alike from different seeds; node times and overhead are their means.

    One GNN trained on a few hundred rows moves by about a point of MAPE between two seeds
    (the NeuSight cell: 10.6 vs 11.4 % on unchanged rows); the mean of several cuts that
    variance. The step stays a sum of per-node terms (the mean of sums is the sum of means),
    so attributions remain exact.
    """

    def __init__(self, members: list[StepGNN]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.config = {**members[0].config, "members": len(members)}

    def forward(self, b: RowBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(node_ms (M,), overhead_ms (R,), step_ms (R,)): the members' means."""
        outs = [m(b) for m in self.members]
        return tuple(torch.stack(parts).mean(0) for parts in zip(*outs, strict=True))  # type: ignore[return-value]

    def beyond_range(self, context: torch.Tensor) -> list[list[str]]:
        return self.members[0].beyond_range(context)  # trained on the same rows: one range


def build_model(config: dict) -> StepGNN | GnnEnsemble:
    """The model a saved ``config`` describes: one StepGNN, or an ensemble of ``members``."""
    config = dict(config)
    members = int(config.pop("members", 0))
    if members:
        return GnnEnsemble([StepGNN(**config) for _ in range(members)])
    return StepGNN(**config)


def predict_graph(
    model: StepGNN | GnnEnsemble, graph: OpGraph, gpu: GpuSpec, tf32: Tf32 | bool | None, per_op: str,
    channels_last: bool = False,
) -> GnnPrediction:  # fmt: skip
    """Node times and overhead of one traced step on one GPU."""
    return predict_graph_many(model, graph, [gpu], tf32, per_op, channels_last)[0]


def predict_graph_many(
    model: StepGNN | GnnEnsemble, graph: OpGraph, gpus: list[GpuSpec], tf32: Tf32 | bool | None, per_op: str,
    channels_last: bool = False, per_op_ms: np.ndarray | None = None,
) -> list[GnnPrediction]:  # fmt: skip
    """:func:`predict_graph` on each of ``gpus`` in one forward pass: message passing runs
    once over the graph, the per-node heads once per GPU. ``per_op_ms`` ((len(gpus), n)):
    the per-op times of the named function, when the caller has them already."""
    tf32 = Tf32.of(tf32)
    if per_op_ms is None:
        per_op_ms = per_op_times(graph, gpus, tf32, per_op, channels_last)
    rows = [
        row_inputs(graph, gpu, tf32, np.asarray(base, dtype=float), channels_last)
        for gpu, base in zip(gpus, per_op_ms, strict=True)
    ]
    # One intra-op thread: the matrices are small, and with more OpenMP threads than idle
    # cores each scatter waits on spinning threads (60 ms instead of 0.1 ms on 2 busy cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            node_ms, overhead, _ = model(one_graph_batch(graph, rows))
    finally:
        torch.set_num_threads(threads)
    nodes = node_ms.double().numpy().reshape(len(gpus), len(graph.nodes))
    clamped = model.beyond_range(torch.stack([r.context for r in rows]))
    return [
        GnnPrediction(node_ms=nodes[k], overhead_ms=float(overhead[k]),
                      step_ms=float(overhead[k]) + float(nodes[k].sum()), clamped=clamped[k])
        for k in range(len(gpus))
    ]  # fmt: skip
