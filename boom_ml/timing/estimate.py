"""The one timing entry: the step time of a traced graph on one GPU.

The packaged GNN (``gnn_model``, loaded by ``gnn_artifact``) where cross-validation found it
better than the per-op sum for this kind of model, else the per-op sum (``per_op``).
"""

from __future__ import annotations

from boom_ml.errors import ArtifactError
from boom_ml.estimates import TimeEstimate
from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.gnn_artifact import load_model, use_gnn_for
from boom_ml.timing.gnn_features import per_op_function
from boom_ml.timing.gnn_model import predict_graph
from boom_ml.timing.per_op import estimate_per_op
from boom_ml.timing.summary import summarise
from boom_ml.trace.graph import OpGraph


def estimate_time(
    graph: OpGraph, gpu: GpuSpec, tf32: bool = False, top_n: int = 10
) -> TimeEstimate:
    """Step time from the GNN where CV says it wins, else the per-op estimate.

    ``method`` says which was used: "gnn", or the per-op estimate's own method.
    """
    packaged = load_model()
    family = str(graph.meta.get("model_family", "other"))
    amp = graph.meta.get("step", {}).get("amp")
    if packaged is None or not use_gnn_for(packaged[1], family, amp):
        return estimate_per_op(graph, gpu, tf32=tf32, top_n=top_n)
    model, manifest = packaged
    try:
        # CV compared the GNN with the per-op function it was trained on; if the
        # predictor's per-op estimate is now another one (heads packaged later), that
        # verdict is void.
        if per_op_function(None)[0] != manifest["per_op"]:
            return estimate_per_op(graph, gpu, tf32=tf32, top_n=top_n)
        pred = predict_graph(model, graph, gpu, tf32, manifest["per_op"])
    except (ImportError, ArtifactError):  # trained on per-op heads that are gone: no GNN
        return estimate_per_op(graph, gpu, tf32=tf32, top_n=top_n)
    est = summarise(graph.nodes, pred.node_ms, method="gnn", top_n=top_n)
    est.step_ms = pred.step_ms
    est.overhead_ms = round(pred.overhead_ms, 4)
    # The GNN has no quantile heads: carry the per-op interval over, scaled to its estimate.
    base = estimate_per_op(graph, gpu, tf32=tf32, top_n=top_n)
    if base.p10_ms is not None and base.p90_ms is not None and base.step_ms > 0:
        est.p10_ms = base.p10_ms * est.step_ms / base.step_ms
        est.p90_ms = base.p90_ms * est.step_ms / base.step_ms
    return est
