"""One rank role, profiled from two traces: the per-rank model with 1 and with 2 layers.

Everything per layer is the difference of the two traces; everything outside the layers
(embedding, final norm, LM head, loss, input) is what the 1-layer trace has beyond one layer.
A stage with L layers is then ``ends + L * layer`` (time and memory), which is exact for
the layers' ops (every layer is the same graph) and keeps the cost of a prediction
independent of the model's depth and of the GPU count. Results are cached per config, step
and GPU in memory and on disk (``~/.cache/boom_ml/parallel``).
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from boom_ml.errors import InvalidInputError
from boom_ml.gpus.spec import GpuSpec
from boom_ml.parallel.profile_keys import (
    disk_get,
    disk_put,
    key_of,
    time_key,
)
from boom_ml.parallel.shard import module_role, param_split, rank_config, rank_model
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.cudnn_from_flash import for_group
from boom_ml.trace_pool import shared_pool, take_or_trace

PHASES_BACKWARD = ("backward", "recompute")
MATRIX_FAMILIES = ("gemm", "attention")


@dataclass
class TimeProfile:
    """Per micro-batch times (ms) of one tensor-parallel rank on one GPU."""

    layer_ms: float  # forward + backward (+ recompute) of one layer
    first_ms: float  # embedding and input: the first pipeline stage only
    last_ms: float  # final norm, LM head, loss, top level: the last stage only
    opt_layer_ms: float  # optimizer step per layer's parameters
    opt_ends_ms: float  # optimizer step of the parameters outside the layers
    backward_fraction: float  # of layer_ms: the window DDP's all-reduce can hide behind
    method: str
    # ops the host dispatches per micro-batch (forward, backward, recompute; input on the first)
    layer_ops: float = 0.0
    first_ops: float = 0.0
    last_ops: float = 0.0
    # of layer_ms and last_ms: matrix kernels (GEMMs and attention), the rest is memory-bound
    layer_matrix_ms: float = 0.0
    last_matrix_ms: float = 0.0
    # what one further micro-batch spends adding into the kept gradients (``parallel.
    # grad_accumulation=add``; timing/accumulation.py): per layer, and of the parameters
    # outside the layers (embedding, final norm, head)
    accumulate_layer_ms: float = 0.0
    accumulate_ends_ms: float = 0.0
    # the 1-layer trace's half-precision kernels no GPU of this one's architecture had
    # measured in fp16 (TimeEstimate.unmeasured_kernels): a ViT's patch convolution too
    unmeasured_kernels: list[str] = field(default_factory=list)


@functools.lru_cache(maxsize=64)
def _traced(config_json: str, step: StepSpec) -> tuple[Any, dict[str, int]]:
    """(OpGraph, parameter split) of a per-rank config given as canonical json; the trace
    from a worker when :func:`prefetch` started one. A step traced for another attention
    group serves ``step.sdpa_group`` where no call changes kernel, or is re-expressed for it
    (``trace/cudnn_from_flash.py``)."""
    from boom_ml.trace.step import trace_step
    from boom_ml.zoo import build_model

    key = (config_json, replace(step, sdpa_group=None))
    for graph, params in _TRACED_GROUPS.get(key, []):
        served = for_group(graph, step.sdpa_group)
        if served is not None:
            return served, params
    model = rank_model(config_json)
    built = build_model(model)
    params = _recipe_split(model, built, step)
    graph = take_or_trace(model, step, lambda: trace_step(built, step))
    _TRACED.add((config_json, step))
    _TRACED_GROUPS.setdefault(key, []).append((graph, params))
    _TRACED_GROUPS.move_to_end(key)
    while len(_TRACED_GROUPS) > _traced.cache_info().maxsize:  # as many as _traced keeps
        _TRACED_GROUPS.popitem(last=False)
    return graph, params


_TRACED: set[tuple[str, StepSpec]] = set()  # what _traced has traced (it caches 64)
# (config, step without its attention group) -> (graph, parameter split) traced for some
# attention group, which serve or are re-expressed for the others; the last 64 keys
_TRACED_GROUPS: OrderedDict[tuple[str, StepSpec], list[tuple[Any, dict[str, int]]]] = OrderedDict()


def forget_traces() -> None:
    """Drop every 1- and 2-layer trace held in this process (profiles on disk stay)."""
    _traced.cache_clear()
    _TRACED.clear()
    _TRACED_GROUPS.clear()


def _recipe_split(model: ModelSpec, built: Any, step: StepSpec) -> dict[str, int]:
    """``param_split`` of the model as the step trains it: in ``params_dtype``, with what a
    recipe freezes (LoRA) not trainable. The recipe goes on a second meta build, because the
    tracer applies it to ``built`` itself (or a worker traces and ``built`` stays as built)."""
    if step.params_dtype == "fp32" and step.finetune_method == "full":
        return param_split(built.module)
    from boom_ml.zoo import build_model
    from boom_ml.zoo.finetune import apply_recipe

    fresh = build_model(model)
    apply_recipe(fresh.module, fresh.resolve_step(step))
    return param_split(fresh.module)


def _rank_configs(raw: dict[str, Any], tp: int) -> list[str]:
    return [json.dumps(rank_config(raw, tp, n), sort_keys=True) for n in (1, 2)]


def rank_graphs(raw: dict[str, Any], tp: int, step: StepSpec) -> list[tuple[Any, dict[str, int]]]:
    # the trace does not depend on grad_accum (accumulation is a replay option)
    step = replace(step, grad_accum=1)
    return [_traced(config, step) for config in _rank_configs(raw, tp)]


def prefetch(raw: dict[str, Any], tps: Iterable[int], step: StepSpec, gpu: GpuSpec) -> None:
    """Start, in worker processes (``trace_pool``), the 1- and 2-layer traces of each
    tensor-parallel degree in ``tps`` whose time profile on ``gpu`` is not cached yet, for
    :func:`rank_graphs` to take. A degree the model cannot be split by is left out."""
    step = replace(step, grad_accum=1)
    for tp in tps:
        key = time_key(raw, tp, step, gpu)
        if key in _MEMO or disk_get("time", key) is not None:
            continue
        try:
            configs = _rank_configs(raw, tp)
        except InvalidInputError:
            continue
        for config in configs:
            model = rank_model(config)
            pool = shared_pool(model)
            if pool is not None and (config, step) not in _TRACED:
                pool.submit(model, step)


def _time_parts(graph: Any, gpus: list[GpuSpec], tf32: Tf32) -> list[dict[str, Any]]:
    from boom_ml.timing.estimate import estimate_times  # the timing entry, wherever it lives

    # as the models give it (a layout search times every layout's ranks)
    timed = estimate_times(graph, gpus, tf32=tf32, top_n=1_000_000, dominance=False)
    return [_parts(graph, est) for est in timed]


def _adds(
    one_graph: Any, two_graph: Any, gpus: list[GpuSpec], tf32: Tf32
) -> list[tuple[float, float]]:
    """Per GPU, (one layer's, the ends') gradient adds of a further micro-batch: the layer's
    gradients are the 2-layer trace's less the 1-layer one's, the ends' the 1-layer trace's
    less the layer's, each timed on its own (``timing/accumulation.py``)."""
    from boom_ml.timing.accumulation import adds_ms, gradients_less

    one, two = (g.meta.get("gradients") or {} for g in (one_graph, two_graph))
    layer = gradients_less(two, one)
    ends = gradients_less(one, layer)
    return list(zip(adds_ms(layer, gpus, tf32), adds_ms(ends, gpus, tf32), strict=True))


def _parts(graph: Any, est: Any) -> dict[str, Any]:
    opt = float(est.by_phase.get("optimizer", 0.0))
    first = float(est.by_phase.get("input", 0.0))
    roles = {"layer": 0.0, "first": 0.0, "last": 0.0}
    for row in est.top_modules:
        module = "" if row["module"] == "(top level)" else row["module"]
        roles[module_role(module)] += float(row["ms"])
    # top-level ops hold the optimizer and input phases: what is left of "last" is the loss
    last = max(roles["last"] - opt - first, 0.0) + float(est.overhead_ms or 0.0)
    bwd = sum(float(est.by_phase.get(p, 0.0)) for p in PHASES_BACKWARD)
    nodes = graph.nodes
    ops = {"layer": 0, "first": 0, "last": 0}
    stepping = nodes[nodes["phase"].isin(("forward", "backward", "recompute", "input"))]
    for module, count in stepping.groupby("module").size().items():
        ops[module_role(str(module))] += int(count)
    nonopt = est.step_ms - opt
    return {
        "nonopt": nonopt,
        "opt": opt,
        "first": roles["first"] + first,
        "last": last,
        "bwd_fraction": bwd / nonopt if nonopt > 0 else 0.5,
        "method": est.method,
        "ops": ops,
        "matrix": sum(float(est.by_family.get(f, 0.0)) for f in MATRIX_FAMILIES),
        "unmeasured": list(est.unmeasured_kernels),
    }


_MEMO: dict[str, Any] = {}


def time_profiles(
    raw: dict[str, Any], tp: int, step: StepSpec, gpus: list[GpuSpec]
) -> list[TimeProfile]:
    """The time profile on each GPU; the GPUs not cached yet share one timing call per trace."""
    keys = [time_key(raw, tp, step, gpu) for gpu in gpus]
    missing = []
    for key, gpu in zip(keys, gpus, strict=True):
        if key not in _MEMO:
            hit = disk_get("time", key)
            if hit is not None:
                _MEMO[key] = TimeProfile(**hit)
            elif key not in (k for k, _ in missing):
                missing.append((key, gpu))
    if missing:
        (one_graph, _), (two_graph, _) = rank_graphs(raw, tp, step)
        todo = [gpu for _, gpu in missing]
        # the step's TF32 switches, as one GPU's prediction reads them (session.py)
        tf32 = Tf32(*step.tf32_switches())
        for (key, _), one, two, (layer_adds, ends_adds) in zip(
            missing, _time_parts(one_graph, todo, tf32), _time_parts(two_graph, todo, tf32),
            _adds(one_graph, two_graph, todo, tf32), strict=True,
        ):  # fmt: skip
            prof = replace(_profile(one, two), accumulate_layer_ms=layer_adds,
                           accumulate_ends_ms=ends_adds)  # fmt: skip
            disk_put("time", key, asdict(prof))
            _MEMO[key] = prof
    return [_MEMO[key] for key in keys]


def _profile(one: dict[str, Any], two: dict[str, Any]) -> TimeProfile:
    """A layer's time from the 2-layer trace minus the 1-layer one; the rest is the ends."""
    layer = two["nonopt"] - one["nonopt"]
    ends = one["nonopt"] - layer
    # the 1-layer trace's module split of what lies outside the layer, scaled to sum to ends
    split = one["first"] + one["last"]
    first = ends * one["first"] / split if split > 0 else 0.0
    return TimeProfile(
        layer_ms=layer,
        first_ms=first,
        last_ms=ends - first,
        # a LoRA layer's few small optimizer kernels can time a hair faster in the 2-layer
        # trace than in the 1-layer one: no negative time per layer (-0.03 ms at tp=2)
        opt_layer_ms=max(two["opt"] - one["opt"], 0.0),
        opt_ends_ms=max(one["opt"] - max(two["opt"] - one["opt"], 0.0), 0.0),
        backward_fraction=two["bwd_fraction"],
        method=one["method"],
        layer_ops=two["ops"]["layer"] - one["ops"]["layer"],
        first_ops=one["ops"]["first"],
        last_ops=one["ops"]["last"],
        # the embedding runs no matrix kernel: the ends' GEMMs are the LM head's (last stage)
        layer_matrix_ms=two["matrix"] - one["matrix"],
        last_matrix_ms=max(2 * one["matrix"] - two["matrix"], 0.0),
        unmeasured_kernels=one["unmeasured"],
    )


def roles(one: dict[str, int], two: dict[str, int], prefix: str = "") -> dict[str, int]:
    """Per layer (the 2-layer split less the 1-layer one), embedding, rest, tied head."""
    return {"layers": two[f"{prefix}layers"] - one[f"{prefix}layers"],
            "first": one[f"{prefix}first"], "last": one[f"{prefix}last"],
            "tied": one[f"{prefix}tied"]}  # fmt: skip


def _recipe_key(step: StepSpec) -> list[Any]:
    """The step's fields that change the parameters (dtype, what LoRA adds and freezes)."""
    return [step.params_dtype, step.finetune_method, step.lora_r, step.lora_targets,
            step.double_quant, step.master_weights, step.adapter_dtype]  # fmt: skip


def param_counts(raw: dict[str, Any], tp: int, step: StepSpec) -> dict[str, Any]:
    """Parameters per layer, of the embedding (first stage) and of the rest (last stage), the
    same prefixed ``trainable_`` and ``logical_`` (``shard.param_split``), bytes per element
    of each, and under LoRA / QLoRA ``recipe``: the adapters' targets and dtypes as traced."""
    key = key_of("params", raw, tp, _recipe_key(step))  # batch and sequence change nothing
    if key in _MEMO:
        return _MEMO[key]
    hit = disk_get("params", key)
    if hit is None:
        (graph, one), (_, two) = rank_graphs(raw, tp, step)
        trainable, logical = roles(one, two, "trainable_"), roles(one, two, "logical_")
        hit = {**roles(one, two), **{f"trainable_{k}": v for k, v in trainable.items()},
               **{f"logical_{k}": v for k, v in logical.items()},
               "bytes": one["bytes"], "trainable_bytes": one["trainable_bytes"]}  # fmt: skip
        if step.finetune_method != "full":
            recipe = graph.meta.get("recipe") or {}
            hit["recipe"] = {k: recipe[k] for k in ("lora_targets", "adapter_dtypes")
                             if recipe.get(k)}  # fmt: skip
        disk_put("params", key, hit)
    _MEMO[key] = hit
    return hit
