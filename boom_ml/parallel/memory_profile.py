"""The memory of one rank role, from the allocator replays of its 1- and 2-layer traces
(``profile.py`` traces them): the step's peak and the peak of each part of the step, with
what a stage without the LM head does not hold, which ``memory.py`` scales to a stage of L
layers. Cached like the time profiles (``profile_keys.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from boom_ml.gpus.spec import GpuSpec
from boom_ml.parallel.profile import rank_graphs, roles
from boom_ml.parallel.profile_keys import (
    canonical_json,
    disk_get,
    disk_put,
    key_around,
    memory_identity,
)
from boom_ml.parallel.shard import module_role
from boom_ml.specs import StepSpec

# Optimizer state per fp32 parameter element (bytes): what ZeRO divides. Exact for these
# optimizers (torch.optim state tensors); others (adafactor's factored rows and columns) use
# the traced optimizer_state bytes per parameter, allocator rounding included.
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0, "adagrad": 4,
                         "rmsprop": 4, "none": 0}  # fmt: skip


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
    # bytes per trainable parameter element, their gradients' width (LoRA's fp32 adapters
    # beside bf16 weights: 4); None: ``param_bytes``
    grad_bytes: float | None = None
    # the largest trainable tensor of each role (layers: one layer's), elements
    # (shard.param_split's largest_*): what a rank's gradient holds whole at a backward's peak
    largest: dict[str, int] = field(default_factory=dict)
    # trainable tensors of each role (layers: per layer): the allocator rounds each gradient
    tensors: dict[str, int] = field(default_factory=dict)

    @property
    def trainable_bytes(self) -> float:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes


_MEMO: dict[str, MemoryProfile] = {}  # a layout search asks once per layout


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
    for graph, params in rank_graphs(raw, tp, step):
        heads.append(head_modules(graph))
        held.append(held_for_backward(graph.mem_events))
        ests.append(estimate_memory(graph, gpu, stack=stack, grad_accum=step.grad_accum))
        peaks.append(window_peaks(graph, gpu, WINDOWS, stack=stack, grad_accum=step.grad_accum,
                                  top_n=EVERY_MODULE))  # fmt: skip
        splits.append(params)
    one, two = splits
    trainable = roles(one, two, "trainable_")
    bd = ests[0].breakdown
    prof = MemoryProfile(
        totals=[e.total_bytes for e in ests],
        p10=[e.p10_bytes for e in ests],
        p90=[e.p90_bytes for e in ests],
        breakdowns=[dict(e.breakdown) for e in ests],
        capacity_bytes=ests[0].capacity_bytes,
        params=roles(one, two),
        param_bytes=float(one["bytes"]),
        optimizer_bytes=_optimizer_bytes(step, one, bd),
        method=ests[0].method,
        terms=list(ests[0].terms),
        trainable=trainable,
        windows=_windows(ests, peaks, heads),
        held=held,
        master_weights=bool(step.master_weights),
        logical=roles(one, two, "logical_"),
        grad_bytes=float(one["trainable_bytes"]),
        largest={k: two.get(f"largest_{k}", 0) for k in ("layers", "first", "last")},
        tensors={"layers": two["tensors_layers"] - one["tensors_layers"],
                 "first": one["tensors_first"], "last": one["tensors_last"]},
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
