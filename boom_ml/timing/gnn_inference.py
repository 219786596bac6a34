"""The packaged GNN's forward pass in numpy, for predictions.

A prediction from a cached trace needs no torch but for this model, and importing torch
takes about 2 s of a 5 s command; so the packaged weights are also written as numpy arrays
(``model.npz``, by ``gnn_artifact.save_model``) and run here. Training, cross-validation and
their tests run the torch model (``gnn_model.StepGNN``); ``tests/test_gnn.py`` checks that
this pass gives its node times and overhead, on the packaged weights and on an ensemble.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.gnn_features import (
    MIN_MS,
    N_CONTEXT,
    N_SPEC,
    SPEC_NAMES,
    adjacency_arrays,
    dynamic_node_features,
    edge_index,
    gpu_context,
    gpu_work_mask,
    per_op_times,
    static_node_features,
)
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.graph import OpGraph

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which StepGNN uses
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus: x itself above it


@dataclass
class GnnPrediction:  # node_ms: per graph node in graph.nodes order (0 for host nodes)
    node_ms: np.ndarray
    overhead_ms: float
    step_ms: float  # overhead_ms + node_ms.sum()
    # spec columns beyond the training GPUs' range, read at its edge (StepGNN spec_range)
    clamped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GnnWeights:
    """A saved StepGNN (or an ensemble of them): its config and each member's state dict."""

    config: dict[str, Any]
    members: tuple[dict[str, np.ndarray], ...]

    def save(self, path: Path) -> None:
        arrays = {f"{k}/{name}": a for k, m in enumerate(self.members) for name, a in m.items()}
        np.savez(path, config=np.array(json.dumps(self.config)), **arrays)

    @classmethod
    def load(cls, path: Path) -> GnnWeights:
        with np.load(path, allow_pickle=False) as blob:
            config = json.loads(str(blob["config"]))
            members: dict[int, dict[str, np.ndarray]] = {}
            for key in blob.files:
                if key != "config":
                    k, name = key.split("/", 1)
                    members.setdefault(int(k), {})[name] = blob[key]
        return cls(config, tuple(members[k] for k in sorted(members)))


def _gelu(x: np.ndarray) -> np.ndarray:
    from scipy.special import erf  # the exact GELU, as torch.nn.GELU() computes it

    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def _linear(state: dict[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
    y = x @ state[f"{name}.weight"].T
    bias = state.get(f"{name}.bias")
    return y if bias is None else y + bias


def _layer_norm(state: dict[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=1, keepdims=True)
    var = x.var(axis=1, keepdims=True)
    return (x - mean) / np.sqrt(var + LAYER_NORM_EPS) * state[f"{name}.weight"] + state[
        f"{name}.bias"
    ]


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_THRESHOLD))))


def _member_pass(
    config: dict[str, Any],
    state: dict[str, np.ndarray],
    x: np.ndarray,
    adjacency: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    dynamic: np.ndarray,
    log_per_op: np.ndarray,
    context: np.ndarray,
    gpu_mask: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """StepGNN.forward for one graph and R rows: (node_ms (R, n), overhead_ms (R,))."""
    h = _gelu(_linear(state, "embed.0", x))
    for i in range(int(config.get("layers", 3))):
        messages = []
        for src, dst, inv in adjacency:
            total = np.zeros_like(h)
            np.add.at(total, dst, h[src])
            messages.append(total * inv)
        z = np.concatenate([h, *messages], axis=1)
        h = _layer_norm(state, f"layers.{i}.norm", h + _gelu(_linear(state, f"layers.{i}.lin", z)))
    spec_range = config.get("spec_range")
    spec = context[:, :N_SPEC]
    if spec_range is not None:
        spec = np.clip(spec, np.asarray(spec_range[0]), np.asarray(spec_range[1]))
    mask = np.ones(N_CONTEXT)
    mask[:N_SPEC] = float(config.get("spec_context", True))
    ctx = np.concatenate([spec, context[:, N_SPEC:]], axis=1) * mask
    z = (
        _linear(state, "head_h", h)[None, :, :]
        + _linear(state, "head_dyn", dynamic)
        + _linear(state, "head_ctx", ctx)[:, None, :]
    )
    raw = _linear(state, "head_out", _gelu(z))[..., 0]
    max_corr = float(config.get("max_log_correction", 4.0))
    corr = max_corr * np.tanh(raw / max_corr)
    node_ms = np.exp(log_per_op + corr) * gpu_mask[None, :]
    pooled = np.broadcast_to(h.mean(axis=0), (len(ctx), h.shape[1]))
    hidden = _gelu(_linear(state, "overhead.0", np.concatenate([pooled, ctx], axis=1)))
    overhead = _softplus(_linear(state, "overhead.2", hidden))[:, 0]
    return node_ms, overhead


def beyond_range(config: dict[str, Any], context: np.ndarray) -> list[list[str]]:
    """Per row of ``context`` ((R, N_CONTEXT)): the spec columns read at the range's edge,
    as ``StepGNN.beyond_range`` names them."""
    spec_range = config.get("spec_range")
    if spec_range is None or not config.get("spec_context", True):
        return [[] for _ in range(len(context))]
    spec = context[:, :N_SPEC]
    out = (spec < np.asarray(spec_range[0], dtype=np.float32)) | (
        spec > np.asarray(spec_range[1], dtype=np.float32)
    )
    flag = SPEC_NAMES.index("no L2 figure")
    return [[SPEC_NAMES[j] for j in np.flatnonzero(row) if j != flag] for row in out]


def predict_graph_many(
    weights: GnnWeights, graph: OpGraph, gpus: list[GpuSpec], tf32: Tf32 | bool | None,
    per_op: str, channels_last: bool = False, per_op_ms: np.ndarray | None = None,
) -> list[GnnPrediction]:  # fmt: skip
    """Node times and overhead of one traced step on each of ``gpus``: message passing once
    over the graph, the per-node heads once per GPU (``gnn_model.predict_graph_many``'s
    numbers). ``per_op_ms`` ((len(gpus), n)): the per-op times of the named function, when
    the caller has them already."""
    tf32 = Tf32.of(tf32)
    if per_op_ms is None:
        per_op_ms = per_op_times(graph, gpus, tf32, per_op, channels_last)
    per_op_ms = np.asarray(per_op_ms, dtype=float)
    dynamic = np.stack(
        [dynamic_node_features(graph, g, tf32, ms) for g, ms in zip(gpus, per_op_ms, strict=True)]
    ).astype(np.float64)
    context = np.stack(
        [gpu_context(graph, g, tf32, ms, channels_last) for g, ms in zip(gpus, per_op_ms, strict=True)]
    )  # fmt: skip
    log_per_op = np.log(np.maximum(per_op_ms, MIN_MS)).astype(np.float32).astype(np.float64)
    x = static_node_features(graph.nodes).astype(np.float64)
    index, types = edge_index(graph)
    adjacency = adjacency_arrays(index, types, len(graph.nodes))
    gpu_mask = gpu_work_mask(graph).astype(np.float64)
    passes = [
        _member_pass(weights.config, state, x, adjacency, dynamic, log_per_op,
                     context.astype(np.float64), gpu_mask)
        for state in weights.members
    ]  # fmt: skip
    node_ms = np.mean([p[0] for p in passes], axis=0)
    overhead = np.mean([p[1] for p in passes], axis=0)
    clamped = beyond_range(weights.config, context)
    return [
        GnnPrediction(node_ms=node_ms[k], overhead_ms=float(overhead[k]),
                      step_ms=float(overhead[k]) + float(node_ms[k].sum()), clamped=clamped[k])
        for k in range(len(gpus))
    ]  # fmt: skip
