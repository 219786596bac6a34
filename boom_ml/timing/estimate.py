"""The one timing entry: the step time of a traced graph on one GPU.

The packaged GNN (``gnn_model``, loaded by ``gnn_artifact``) where cross-validation found it
better than the per-op sum for this kind of model, else the per-op sum (``per_op``). The
p10/p90 of the step come from the manifest's interval calibration (multiplicative bounds
fitted on held-out-GPU CV predictions of that method) where there is one, else from the
per-op heads' quantiles.
"""

from __future__ import annotations

import math
from typing import Any

from boom_ml.errors import ArtifactError
from boom_ml.estimates import TimeEstimate
from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.gnn_artifact import interval_for, load_model, use_gnn_for
from boom_ml.timing.gnn_features import per_op_function
from boom_ml.timing.gnn_model import predict_graph
from boom_ml.timing.per_op import estimate_per_op
from boom_ml.timing.summary import summarise
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.graph import OpGraph


def estimate_time(
    graph: OpGraph, gpu: GpuSpec, tf32: Tf32 | bool | None = None, top_n: int = 10
) -> TimeEstimate:
    """Step time from the GNN where CV says it wins, else the per-op estimate.

    ``tf32``: PyTorch's two switches (None: its defaults; a bool sets both). ``method``
    says which estimate was used: "gnn", or the per-op estimate's own method.
    """
    tf32 = Tf32.of(tf32)
    packaged = load_model()
    if packaged is None:
        return estimate_per_op(graph, gpu, tf32=tf32, top_n=top_n)
    model, manifest = packaged
    family = str(graph.meta.get("model_family", "other"))
    step = graph.meta.get("step", {})
    amp = step.get("amp")
    if amp in (None, "none") and step.get("params_dtype", "fp32") != "fp32":
        # bf16-true / fp16-true: low-precision matmuls as under AMP, which no GNN training
        # row without AMP had; the AMP cell's verdict applies (issue #15)
        amp = step["params_dtype"]
    try:
        # CV compared the GNN with the per-op function it was trained on; if the
        # predictor's per-op estimate is now another one (heads packaged later), that
        # verdict and the intervals calibrated with it are void.
        same_per_op = per_op_function(None)[0] == manifest["per_op"]
    except (ImportError, ArtifactError):  # trained on per-op heads that are gone: no GNN
        same_per_op = False
    if not same_per_op:
        return estimate_per_op(graph, gpu, tf32=tf32, top_n=top_n)
    if not use_gnn_for(manifest, family, amp):
        est = estimate_per_op(graph, gpu, tf32=tf32, top_n=top_n)
        return _calibrated(est, manifest, "per-op")
    pred = predict_graph(model, graph, gpu, tf32, manifest["per_op"])
    est = summarise(graph.nodes, pred.node_ms, method="gnn", top_n=top_n)
    est.step_ms = pred.step_ms
    est.overhead_ms = round(pred.overhead_ms, 4)
    if interval_for(manifest, "gnn") is not None:
        return _calibrated(est, manifest, "gnn")
    # No calibration packaged: carry the per-op interval over, scaled to the GNN's estimate.
    base = estimate_per_op(graph, gpu, tf32=tf32, top_n=top_n)
    if base.p10_ms is not None and base.p90_ms is not None and base.step_ms > 0:
        est.p10_ms = base.p10_ms * est.step_ms / base.step_ms
        est.p90_ms = base.p90_ms * est.step_ms / base.step_ms
    return est


def _calibrated(est: TimeEstimate, manifest: dict[str, Any], method: str) -> TimeEstimate:
    """p10/p90 = step x exp(calibrated log-ratio quantiles), when the manifest has them."""
    bounds = interval_for(manifest, method)
    if bounds is not None:
        est.p10_ms = est.step_ms * math.exp(bounds[0])
        est.p90_ms = est.step_ms * math.exp(bounds[1])
    return est
