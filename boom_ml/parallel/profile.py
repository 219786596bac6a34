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
    canonical_json,
    disk_get,
    disk_put,
    key_around,
    key_of,
    memory_identity,
    time_key,
)
from boom_ml.parallel.shard import module_role, param_split, rank_config, rank_model
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.cudnn_from_flash import for_group
from boom_ml.trace_pool import shared_pool, take_or_trace

PHASES_BACKWARD = ("backward", "recompute")
MATRIX_FAMILIES = ("gemm", "attention")
# Optimizer state per fp32 parameter element (bytes): what ZeRO divides. Exact for these
# optimizers (torch.optim state tensors); others (adafactor's factored rows and columns) use
# the traced optimizer_state bytes per parameter, allocator rounding included.
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0, "adagrad": 4,
                         "rmsprop": 4, "none": 0}  # fmt: skip


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


@dataclass
class MemoryProfile:
    """Memory of the 1- and 2-layer per-rank models (allocator replay) and parameter counts."""

    totals: list[int]  # nvidia-smi peak, [1 layer, 2 layers]
    p10: list[int]
    p90: list[int]
    breakdowns: list[dict[str, int]]
    capacity_bytes: int
    params: dict[str, int]  # layers (per layer), first, last, tied
    param_bytes: float  # bytes per parameter element as held (params_dtype; fp32: 4)
    optimizer_bytes: float  # optimizer state bytes per trainable parameter
    method: str
    terms: list[dict[str, Any]] = field(default_factory=list)
    # of ``params``, those with gradients and optimizer state (fewer under LoRA)
    trainable: dict[str, int] = field(default_factory=dict)
    # totals, p10, p90 and breakdowns at the peak of each part of the step (:data:`WINDOWS`),
    # extrapolated in layers apart (a model's peak moves from the backward to the optimizer
    # as it grows), with ``optimizer_transient``: the optimizer phase's own temporaries alive
    # at that peak, which ZeRO / FSDP shard with the state
    windows: dict[str, dict[str, Any]] = field(default_factory=dict)
    # bytes one micro-batch's forward leaves for its backward, [1 layer, 2 layers]
    # (memory/live.py: held_for_backward): a pipeline stage holds that per micro-batch in flight
    held: list[int] = field(default_factory=list)
    # master_weights=true: the optimizer step casts each 16-bit gradient to fp32 (its peak's
    # gradients are the fp32 ones), which ZeRO-1 does for the rank's shard alone
    master_weights: bool = False
    # ``params`` as the model stands for them: a 4-bit layer's weights counted (QLoRA holds
    # them as buffers); what ``memory.parameters`` reports
    logical: dict[str, int] = field(default_factory=dict)


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


def _graphs(raw: dict[str, Any], tp: int, step: StepSpec) -> list[tuple[Any, dict[str, int]]]:
    # the trace does not depend on grad_accum (accumulation is a replay option)
    step = replace(step, grad_accum=1)
    return [_traced(config, step) for config in _rank_configs(raw, tp)]


def prefetch(raw: dict[str, Any], tps: Iterable[int], step: StepSpec, gpu: GpuSpec) -> None:
    """Start, in worker processes (``trace_pool``), the 1- and 2-layer traces of each
    tensor-parallel degree in ``tps`` whose time profile on ``gpu`` is not cached yet, for
    :func:`_graphs` to take. A degree the model cannot be split by is left out."""
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

    return [_parts(graph, est) for est in estimate_times(graph, gpus, tf32=tf32, top_n=1_000_000)]


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
        (one_graph, _), (two_graph, _) = _graphs(raw, tp, step)
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
    )


def memory_profile(
    raw: dict[str, Any], tp: int, step: StepSpec, gpu: GpuSpec, stack: Any = None
) -> MemoryProfile:
    from boom_ml.memory.estimate import estimate_memory, window_peaks
    from boom_ml.memory.live import held_for_backward

    # = key_of("memory-2", raw, tp, step.to_dict(), asdict(gpu), str(stack), memory_identity())
    key = key_around(
        ("memory-2",), canonical_json(raw), (tp, step, gpu, str(stack), memory_identity())
    )
    if key in _MEMO:  # a layout search asks once per layout
        return _MEMO[key]
    hit = disk_get("memory", key)
    if hit is not None:
        _MEMO[key] = MemoryProfile(**hit)
        return _MEMO[key]
    ests, peaks, splits, held, heads = [], [], [], [], []
    for graph, params in _graphs(raw, tp, step):
        heads.append(head_modules(graph))
        held.append(held_for_backward(graph.mem_events))
        ests.append(estimate_memory(graph, gpu, stack=stack, grad_accum=step.grad_accum))
        peaks.append(window_peaks(graph, gpu, WINDOWS, stack=stack, grad_accum=step.grad_accum,
                                  top_n=EVERY_MODULE))  # fmt: skip
        splits.append(params)
    one, two = splits
    trainable = _roles(one, two, "trainable_")
    bd = ests[0].breakdown
    prof = MemoryProfile(
        totals=[e.total_bytes for e in ests],
        p10=[e.p10_bytes for e in ests],
        p90=[e.p90_bytes for e in ests],
        breakdowns=[dict(e.breakdown) for e in ests],
        capacity_bytes=ests[0].capacity_bytes,
        params=_roles(one, two),
        param_bytes=float(one["bytes"]),
        optimizer_bytes=_optimizer_bytes(step, one, bd),
        method=ests[0].method,
        terms=list(ests[0].terms),
        trainable=trainable,
        windows=_windows(ests, peaks, heads),
        held=held,
        master_weights=bool(step.master_weights),
        logical=_roles(one, two, "logical_"),
    )  # fmt: skip
    disk_put("memory", key, asdict(prof))
    _MEMO[key] = prof
    return prof


# The parts of a step whose peaks are extrapolated in layers apart (the phases each spans;
# "other": the replay's own events outside the step's phases): a 1- and a 2-layer model
# reach a part's peak at the same moment of it (the backward's as the head's gradient is
# cast), where their overall peaks can fall in different parts (the loss for one, the
# backward for the other). A line through two different moments gave categories below zero,
# and missed what grows fastest with depth: autocast's cached weight copies, all alive at
# the loss (Llama-3-8B: 14.0 GiB in its whole trace, as the loss window's line gives).
WINDOWS: dict[str, tuple[str, ...]] = {
    "zero_grad": ("zero_grad",),  # the last step's gradients still alive
    "forward": ("input", "forward"),
    "loss": ("loss",),
    "backward": ("backward", "recompute"),
    "optimizer": ("optimizer",),
    "other": (),
}


# window_peaks(top_n=): every module's bytes, so that the head's can be summed
EVERY_MODULE = 1 << 30
# What a stage without the LM head does not hold of the head's share at a peak: the tensors
# its modules made (logits, the loss's temporaries, autocast's copy of its weight); its
# parameters, gradients and optimizer state are the parameter split's (memory.py)
HEAD_CATEGORIES = ("activation", "temporary", "autocast_copy")


def head_modules(graph: Any) -> set[str]:
    """The modules that run after the last layer in the forward pass (final norm, LM head,
    the model's root computing the loss): what only the last pipeline stage runs. Modules
    outside the layers that run before them (rotary tables, the mask) are every stage's."""
    fwd = graph.nodes[graph.nodes["phase"].eq("forward")]
    modules = fwd["module"].astype(str).tolist()
    layer_at = [i for i, m in enumerate(modules) if module_role(m) == "layer"]
    after = modules[layer_at[-1] + 1 :] if layer_at else []
    return {m for m in after if module_role(m) == "last"}


def head_bytes(by_module: list[dict[str, Any]], heads: set[str]) -> dict[str, int]:
    """Of a peak's bytes by module, those the head's modules (``heads``: head_modules) hold,
    by category. Bytes made outside every module ("(top level)": the optimizer's temporaries,
    the training loop's) and the synthetic entries (workspaces, parameter state) are every
    stage's."""
    out = dict.fromkeys(HEAD_CATEGORIES, 0)
    for entry in by_module:
        if str(entry["module"]) not in heads:
            continue
        for cat in HEAD_CATEGORIES:
            out[cat] += int(entry["by_category"].get(cat, 0))
    return out


def _windows(ests: list[Any], peaks: list[Any], heads: list[set[str]]) -> dict[str, dict[str, Any]]:
    """Each window's peak of the 1- and 2-layer replays as the estimate reports a peak:
    nvidia-smi's total less the allocated bytes the window lacks against the step's peak,
    the window's own breakdown, the terms outside the allocator and the head's share."""
    from boom_ml.memory.attribution import CATEGORIES

    out: dict[str, dict[str, Any]] = {}
    for name in WINDOWS:
        found = [p[name] for p in peaks]
        if any(att is None for _, att in found):
            continue  # no such window (no optimizer step)
        view: dict[str, Any] = {"totals": [], "p10": [], "p90": [], "breakdowns": [],
                                "optimizer_transient": [], "head": []}  # fmt: skip
        for est, (allocated, att), head in zip(ests, found, heads, strict=True):
            short = est.peak_allocated_bytes - allocated
            view["totals"].append(est.total_bytes - short)
            view["p10"].append(est.p10_bytes - short)
            view["p90"].append(est.p90_bytes - short)
            outside = {k: v for k, v in est.breakdown.items() if k not in CATEGORIES}
            view["breakdowns"].append({**att.by_category, **outside})
            view["optimizer_transient"].append(att.temporary_by_phase.get("optimizer", 0))
            view["head"].append(head_bytes(att.by_module, head))
        out[name] = view
    return out


def _roles(one: dict[str, int], two: dict[str, int], prefix: str = "") -> dict[str, int]:
    """Per layer (the 2-layer split less the 1-layer one), embedding, rest, tied head."""
    return {"layers": two[f"{prefix}layers"] - one[f"{prefix}layers"],
            "first": one[f"{prefix}first"], "last": one[f"{prefix}last"],
            "tied": one[f"{prefix}tied"]}  # fmt: skip


def _optimizer_bytes(step: StepSpec, split: dict[str, int], breakdown: dict[str, int]) -> float:
    """Optimizer state bytes per trainable parameter element: exact for torch.optim's
    optimizers (their state tensors take the parameters' dtype; with master weights, fp32
    state and the fp32 copy itself), else the traced state of the 1-layer model per
    trainable element of it."""
    per_fp32 = OPTIMIZER_STATE_BYTES.get(step.optimizer)
    if per_fp32 is not None and step.master_weights:  # the fp32 copy and fp32 state
        return 4 + per_fp32
    if per_fp32 is not None:
        return per_fp32 * split["trainable_bytes"] / 4
    count = split["trainable_layers"] + split["trainable_first"] + split["trainable_last"]
    return breakdown.get("optimizer_state", 0) / max(count, 1)


def _recipe_key(step: StepSpec) -> list[Any]:
    """The step's fields that change the parameters (dtype, what LoRA adds and freezes)."""
    return [step.params_dtype, step.finetune_method, step.lora_r, step.lora_targets,
            step.double_quant, step.master_weights]  # fmt: skip


def param_counts(raw: dict[str, Any], tp: int, step: StepSpec) -> dict[str, int]:
    """Parameters per layer, of the embedding (first stage) and of the rest (last stage), the
    same prefixed ``trainable_``, and bytes per element of each (``param_split``)."""
    key = key_of("params", raw, tp, _recipe_key(step))  # batch and sequence change nothing
    if key in _MEMO:
        return _MEMO[key]
    hit = disk_get("params", key)
    if hit is None:
        (_, one), (_, two) = _graphs(raw, tp, step)
        trainable = _roles(one, two, "trainable_")
        hit = {**_roles(one, two), **{f"trainable_{k}": v for k, v in trainable.items()},
               "bytes": one["bytes"], "trainable_bytes": one["trainable_bytes"]}  # fmt: skip
        disk_put("params", key, hit)
    _MEMO[key] = hit
    return hit
