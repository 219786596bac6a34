"""The one timing entry: the step time of a traced graph on one GPU.

The packaged GNN (``gnn_model``, run by ``gnn_inference`` from the weights ``gnn_artifact``
loads) where cross-validation found it
better than the per-op sum for this kind of model, else the per-op sum (``per_op``). The
p10/p90 of the step come from the manifest's interval calibration (multiplicative bounds
fitted on held-out-GPU CV predictions of that method) where there is one, else from the
per-op heads' quantiles.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from boom_ml.errors import ArtifactError
from boom_ml.estimates import TimeEstimate
from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing import conv_layout
from boom_ml.timing.basis import (
    basis,
    half_coverage,
    half_kinds,
    measured_gpus,
    unmeasured_half,
)
from boom_ml.timing.dominance import dominated_extra, no_slower_than_dominated
from boom_ml.timing.gnn_artifact import interval_for, load_weights, use_gnn_for
from boom_ml.timing.gnn_features import per_op_function
from boom_ml.timing.gnn_inference import predict_graph_many
from boom_ml.timing.per_op import predict_nodes_many
from boom_ml.timing.summary import summarise
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.graph import OpGraph, reads_dtype

# a top op's method where the GNN timed the step: its node times, read off the per-op model's
GNN_OVER = "gnn over "


def estimate_time(
    graph: OpGraph,
    gpu: GpuSpec,
    tf32: Tf32 | bool | None = None,
    top_n: int = 10,
    dominance: bool = True,
) -> TimeEstimate:
    """Step time from the GNN where CV says it wins, else the per-op estimate.

    ``tf32``: PyTorch's two switches (None: its defaults; a bool sets both). ``method``
    says which estimate was used: "gnn", or the per-op estimate's own method.
    """
    return estimate_times(graph, [gpu], tf32=tf32, top_n=top_n, dominance=dominance)[0]


def estimate_times(
    graph: OpGraph,
    gpus: list[GpuSpec],
    tf32: Tf32 | bool | None = None,
    top_n: int = 10,
    dominance: bool = True,
) -> list[TimeEstimate]:
    """:func:`estimate_time` on each of ``gpus``: the per-op heads predict every GPU's rows
    in one call and the GNN passes messages over the graph once. Each estimate's ``basis``
    says whether that GPU, or its architecture, was among the measured ones. ``dominance``:
    none is slower than a packaged GPU it beats on every spec number (``dominance.py``;
    False: as the models give it, for the advisor's candidates, which it would cost a
    timing of every such GPU each: an H100's are 29)."""
    flags = Tf32.of(tf32)
    estimates = _timed(graph, gpus, flags, top_n)
    if dominance:
        estimates = _no_slower_than_dominated(graph, gpus, flags, top_n, estimates)
    measured = measured_gpus() if estimates else []
    kinds = half_kinds(graph.nodes) if estimates else []
    coverage = half_coverage() if kinds else {}
    for gpu, est in zip(gpus, estimates, strict=True):
        est.basis = basis(gpu, measured) if measured else None
        est.unmeasured_kernels = unmeasured_half(gpu, kinds, coverage)
    return estimates


def _no_slower_than_dominated(
    graph: OpGraph, gpus: list[GpuSpec], flags: Tf32, top_n: int, estimates: list[TimeEstimate]
) -> list[TimeEstimate]:
    """``dominance.no_slower_than_dominated`` over ``gpus`` and the packaged GPUs they beat:
    those are timed in totals alone, and one whose estimate a GPU takes, again in full."""
    extra = dominated_extra(gpus)
    every = [*gpus, *extra]
    totals = [*estimates, *(_timed(graph, extra, flags, 0) if extra else [])]

    def in_full(k: int) -> TimeEstimate:
        return totals[k] if k < len(gpus) else _timed(graph, [every[k]], flags, top_n)[0]

    return no_slower_than_dominated(every, totals, asked=len(gpus), in_full=in_full)


def _timed(graph: OpGraph, gpus: list[GpuSpec], flags: Tf32, top_n: int) -> list[TimeEstimate]:
    """Each GPU's estimate, TF32 never slower than strict fp32 (``top_n`` 0: totals alone)."""
    estimates = _estimate_times(graph, gpus, flags, top_n)
    return _no_slower_than_fp32(graph, gpus, flags, top_n, estimates)


def _no_slower_than_fp32(
    graph: OpGraph, gpus: list[GpuSpec], flags: Tf32, top_n: int, estimates: list[TimeEstimate]
) -> list[TimeEstimate]:
    """A step whose fp32 matrix kernels may use TF32 is never timed slower than the same step
    in strict fp32: TF32 tensor cores run at least the fp32 rate on every GPU that has them,
    on the same bytes, and cuDNN still has its fp32 algorithms to pick. The learned models had
    put it above on GPUs whose TF32 no row measured (resnet50 batch 32 on an L4: 163.2 ms
    with cuDNN's TF32, 151.4 without). Where they do, the strict-fp32 estimate is the step's
    (``tf32_capped``); GPUs without TF32 and steps without fp32 matrix work keep theirs."""
    families = {family for family in ("conv", "gemm", "attention") if flags.for_family(family)}
    nodes = graph.nodes
    fp32 = nodes["family"].isin(families) & reads_dtype(nodes, ["float32"])
    with_tf32 = [k for k, gpu in enumerate(gpus) if gpu.tf32_tflops]
    if not fp32.any() or not with_tf32:
        return estimates
    strict = _estimate_times(graph, [gpus[k] for k in with_tf32], Tf32(False, False), top_n)
    out = list(estimates)
    for k, est in zip(with_tf32, strict, strict=True):
        if est.step_ms < out[k].step_ms:
            out[k] = replace(est, tf32_capped=True)
    return out


def _estimate_times(
    graph: OpGraph, gpus: list[GpuSpec], tf32: Tf32, top_n: int
) -> list[TimeEstimate]:
    packaged = load_weights()
    if not gpus:
        return []
    if packaged is None:
        return _per_op(graph, gpus, tf32, top_n)
    model, manifest = packaged
    method = _method(graph, manifest)
    channels_last = _channels_last(graph)
    if method == "uncalibrated":
        return _per_op(graph, gpus, tf32, top_n)
    fp32 = _fp32_method(graph, manifest, method)
    if method == "per-op":
        return [
            replace(_calibrated(e, manifest, "per-op", graph), fp32_method=fp32)
            for e in _per_op(graph, gpus, tf32, top_n)
        ]
    # The GNN: per-op medians only (its interval is calibrated, or scaled from the per-op one).
    calibrated = interval_for(manifest, "gnn") is not None
    on_heads = manifest["per_op"] == "per-op"  # else the roofline: predict_graph_many's own
    per_op = (
        predict_nodes_many(
            graph.nodes, gpus, tf32=tf32, median_only=calibrated, channels_last=channels_last
        )
        if on_heads or not calibrated
        else None
    )
    preds = predict_graph_many(
        model, graph, gpus, tf32, manifest["per_op"], channels_last=channels_last,
        per_op_ms=per_op["ms"] if on_heads and per_op is not None else None,
    )  # fmt: skip
    out = []
    for k, pred in enumerate(preds):
        methods = per_op["method"][k] if per_op is not None else None
        est = summarise(graph.nodes, pred.node_ms, method="gnn", top_n=top_n, methods=methods)
        for op in est.top_ops:  # the GNN's node times, on features of the per-op model's
            if "method" in op:
                op["method"] = f"{GNN_OVER}{op['method']}"
        est.per_op_ms = float(per_op["ms"][k].sum()) if per_op is not None else None
        est.step_ms = pred.step_ms
        est.overhead_ms = round(pred.overhead_ms, 4)
        est.gnn_clamped = pred.clamped
        est.fp32_method = fp32
        if calibrated:
            out.append(_calibrated(est, manifest, "gnn", graph))
            continue
        # No calibration packaged: carry the per-op interval over, scaled to the GNN's estimate.
        assert per_op is not None  # computed whenever there is no calibration
        base = float(per_op["ms"][k].sum())
        if base > 0:
            est.p10_ms = float(per_op["p10"][k].sum()) * est.step_ms / base
            est.p90_ms = float(per_op["p90"][k].sum()) * est.step_ms / base
        out.append(est)
    return out


def _method(graph: OpGraph, manifest: dict[str, Any]) -> str:
    """The method: "gnn", "per-op" (calibrated by the manifest) or "uncalibrated" (per-op heads the GNN
    was not trained on: the manifest's verdict and intervals are void)."""
    try:
        # CV compared the GNN with the per-op function it was trained on; if the
        # predictor's per-op estimate is now another one (heads packaged later), that
        # verdict and the intervals calibrated with it are void.
        same_per_op = per_op_function(None)[0] == manifest["per_op"]
    except (ImportError, ArtifactError):  # trained on per-op heads that are gone: no GNN
        same_per_op = False
    if not same_per_op:
        return "uncalibrated"
    family = str(graph.meta.get("model_family", "other"))
    step = graph.meta.get("step", {})
    amp = step.get("amp")
    if amp in (None, "none") and step.get("params_dtype", "fp32") != "fp32":
        # bf16-true / fp16-true: low-precision matmuls as under AMP, which no GNN training
        # row without AMP had; the AMP cell's verdict applies (issue #15)
        amp = step["params_dtype"]
    return "gnn" if use_gnn_for(manifest, family, amp) else "per-op"


def _fp32_method(graph: OpGraph, manifest: dict[str, Any], method: str) -> str:
    """The method an fp32 step of ``graph``'s model family gets, where a 16-bit step's
    ``method`` is another ("" otherwise, and for fp32 steps)."""
    step = graph.meta.get("step", {})
    if step.get("amp") in (None, "none") and step.get("params_dtype", "fp32") == "fp32":
        return ""
    family = str(graph.meta.get("model_family", "other"))
    fp32 = "gnn" if use_gnn_for(manifest, family, "none") else "per-op"
    return fp32 if fp32 != method else ""


def _channels_last(graph: OpGraph) -> bool:
    """Whether the traced step ran its convolutions on NHWC tensors (StepSpec.channels_last,
    on a model with a 2-D or 3-D convolution: ``conv_layout.has_channels_last_convolutions``)."""
    asked = bool(graph.meta.get("step", {}).get("channels_last", False))
    return asked and conv_layout.has_channels_last_convolutions(graph.nodes)


def _per_op(graph: OpGraph, gpus: list[GpuSpec], tf32: Tf32, top_n: int) -> list[TimeEstimate]:
    """The per-op sum on each GPU (``estimate_per_op``), predicted in one call."""
    pred = predict_nodes_many(graph.nodes, gpus, tf32=tf32, channels_last=_channels_last(graph))
    out = [
        summarise(graph.nodes, pred["ms"][k], method="per-op", top_n=top_n,
                  p10=pred["p10"][k], p90=pred["p90"][k], methods=pred["method"][k])
        for k in range(len(gpus))
    ]  # fmt: skip
    for est in out:
        est.per_op_ms = est.step_ms
    return out


def _calibrated(
    est: TimeEstimate, manifest: dict[str, Any], method: str, graph: OpGraph
) -> TimeEstimate:
    """p10/p90 = step x exp(calibrated log-ratio quantiles of the graph's model family, else
    of the method), when the manifest has them."""
    family = str(graph.meta.get("model_family", "other"))  # as _method reads it
    bounds = interval_for(manifest, method, family)
    if bounds is not None:
        est.p10_ms = est.step_ms * math.exp(bounds[0])
        est.p90_ms = est.step_ms * math.exp(bounds[1])
    return est
