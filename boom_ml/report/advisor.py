"""Advisor: for a GPU where the step does not fit, the cheapest changes that make it fit.

Candidates are the levers of ``levers.py``, each predicted with the same memory and time
models; a candidate fits when its p90 step does. Single changes come first; if none fits,
the stacked ones, walked to a first fit twice: with checkpointing and without it (where the
first walk fitted, at its micro-batch or below); the faster fits are advised first.

When nothing tried fits on one GPU and the step trains every weight, recipes are tried too:
every weight in bf16 without an fp32 master copy ("bf16-true", on GPUs with bf16 tensor cores;
with the lighter optimizer where the step's does not fit), and fine-tuning (LoRA, QLoRA: peft
adapters on half-precision or 4-bit frozen weights), each with activation checkpointing; they
change the numerics or what is trained, so they are listed apart (``Advice.recipe``), after the
closest change that keeps full training.

When nothing tried fits on one GPU, :func:`advise_layouts` asks a layout search (passed in by
``boom_ml.api``: ``report`` does not import the prediction stack) for the cheapest multi-GPU
layouts that fit, ranked by $ per step (``boom_ml/parallel/search.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from boom_ml import progress
from boom_ml.errors import BoomError, interrupted
from boom_ml.estimates import GpuPrediction
from boom_ml.gpus.spec import GpuSpec
from boom_ml.report.levers import (
    BF16_TRUE_LEVELS,
    RECIPE_LEVELS,
    bf16_true_changes,
    changes_checkpointing,
    half_precision_splits,
    halves_frozen_weights,
    recipe_changes,
    single_changes,
    stacked_changes,
    step_diff,
)
from boom_ml.report.splits import (
    above_largest,
    fewer_levers,
    largest_split,
    refine_splits,
    under_kept_gradients,
)
from boom_ml.specs import FINETUNE_KEYS, StepSpec

MAX_ADVICE = 4


@dataclass
class Advice:
    change: str  # human-readable, e.g. "amp=bf16 + checkpointing=full"
    settings: dict[str, Any]  # the StepSpec fields that change
    accumulation_steps: int  # micro-batches per optimizer step
    fits: bool
    total_bytes: int  # what nvidia-smi would show at the peak
    capacity_bytes: int
    step_ms: float  # time per effective (accumulated) step; NaN when it does not fit
    samples_per_s: float
    recipe: bool = False  # changes what is trained (adapters) or its numerics (bf16-true)
    # total_bytes is a floor no single-GPU lever goes below (parameters, their gradients and
    # the terms outside the allocator): nothing was traced for this GPU
    lower_bound: bool = False
    # ``settings`` as the command line's keys (finetune.method=, not finetune_method=): what
    # to add to the command to run this advice
    options: dict[str, Any] = field(default_factory=dict)
    # ``settings`` as ``boom_ml.predict``'s keyword arguments (finetune={"method": ...}):
    # ``boom_ml.predict(**{**kwargs, **advice.arguments})`` runs this advice
    arguments: dict[str, Any] = field(default_factory=dict)
    # the p90 replay's total: the level that decides a tight fit (None: not traced)
    p90_bytes: int | None = None
    # the changed step's half-precision kernels no GPU of this one's architecture had measured
    # in fp16 (TimeEstimate.unmeasured_kernels): an amp= or bf16 advice on an RTX 4090
    unmeasured_kernels: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# evaluate(step, gpus) -> one GpuPrediction per GPU, for that step configuration
Evaluate = Callable[[StepSpec, list[GpuSpec]], list[GpuPrediction]]
# prefetch(step, gpus): evaluate(step, gpus) will be asked for soon
Prefetch = Callable[[StepSpec, list[GpuSpec]], None]
# search(gpus) -> per GPU id: {"layouts": [proposal, ...] ranked by $ per step, "searched": n, ...}
LayoutSearch = Callable[[list[GpuSpec]], dict[str, dict[str, Any]]]


def advise(
    step: StepSpec,
    failing: list[tuple[GpuSpec, GpuPrediction]],
    evaluate: Evaluate,
    recipes_too: bool = True,
    gradient_bytes: int | None = None,
    prefetch: Prefetch | None = None,
) -> dict[str, list[Advice]]:
    """For each GPU where ``step`` does not fit, the changes that make it fit.

    Every single change is tried; stacked changes only until one fits (they are ordered
    by what they cost in speed). Each candidate configuration is evaluated once for all
    GPUs that need it, since evaluating one means tracing the step again. A GPU where
    nothing fits gets the candidate that came closest, marked ``fits=False``.

    ``gradient_bytes`` (the trainable parameters' bytes): no lever here changes the
    parameters or their gradients but by their dtype (LoRA's, halved: ``lower_bound``), and
    both are alive once backward ends, so a GPU whose
    usable memory is below parameters + gradients + the terms outside the allocator gets that
    floor (``lower_bound=True``) instead of traces that cannot fit.

    ``prefetch(step, gpus)`` is told each level's candidates before the first is evaluated
    (the caller may start their traces side by side).
    """
    pending = [spec for spec, result in failing if not result.fits]
    found: dict[str, list[Advice]] = {spec.id: [] for spec in pending}
    closest: dict[str, Advice] = {}
    if gradient_bytes is not None:
        for spec, result in failing:
            floor = lower_bound(result, step, gradient_bytes) if spec.id in found else None
            if floor is not None and floor.total_bytes > floor.capacity_bytes:
                closest[spec.id] = floor
        pending = [spec for spec in pending if spec.id not in closest]

    recipes: dict[str, list[Advice]] = {}
    refused: set[StepSpec] = set()  # candidates the model cannot take
    asked: set[tuple[str, StepSpec, int, bool]] = set()  # (GPU, candidate, micro-batches, recipe)
    # each GPU's largest batch of the step, where the search found one (not a lower bound)
    largest = {spec.id: result.memory.max_batch_size for spec, result in failing
               if result.memory.max_batch_size is not None and not result.memory.max_batch_error
               and not result.memory.max_batch_lower_bound}  # fmt: skip

    def try_level(
        asks: dict[StepSpec, list[tuple[GpuSpec, str, int]]], recipe: bool = False
    ) -> None:
        # the step's own split above its largest batch does not fit (accumulation only adds
        # the kept gradients): not traced (resnet50 at 5000 had traced 2500, 1250 and 625)
        # a candidate asked of a GPU before is not asked again: two levels can reach one
        # (Llama-3-8B LoRA on an L4 had listed params_dtype=bf16 + 1 x 2 twice; a hunt)
        asks = {changed: kept for changed, group in asks.items()
                if (kept := [g for g in group
                             if not above_largest(step, changed, largest.get(g[0].id))
                             and (g[0].id, changed, g[2], recipe) not in asked])}  # fmt: skip
        asked.update((g[0].id, changed, g[2], recipe) for changed, group in asks.items()
                     for g in group)  # fmt: skip
        for changed, group in asks.items() if prefetch is not None else ():
            prefetch(changed, [spec for spec, _, _ in group])
        for changed, group in asks.items():
            label = group[0][1].split(" (")[0]
            with progress.task(
                f"advice: trying {label} on {len(group)} GPU{'s' if len(group) > 1 else ''}"
            ):
                try:
                    results = evaluate(changed, [spec for spec, _, _ in group])
                except BoomError as err:
                    if interrupted(err):
                        raise KeyboardInterrupt from err
                    # a change this model cannot take (no blocks to checkpoint, a batch its
                    # head or a BatchNorm refuses, no adapter targets for peft): not advice,
                    # and the prediction asked for stands; the API's log says which
                    logging.getLogger(__name__).warning("advice: %s not tried: %s", label, err)
                    refused.add(changed)
                    continue
            for (spec, label, accumulation), result in zip(group, results, strict=True):
                advice = _advice(label, step, changed, accumulation, result)
                if recipe:
                    if result.fits:
                        recipes.setdefault(spec.id, []).append(replace(advice, recipe=True))
                elif result.fits:
                    found[spec.id].append(advice)
                elif spec.id not in closest or advice.total_bytes < closest[spec.id].total_bytes:
                    closest[spec.id] = advice

    singles = {spec.id: single_changes(step, spec) + largest_split(step, largest.get(spec.id))
               for spec in pending}  # fmt: skip
    try_level(_by_step((spec, c) for spec in pending for c in singles[spec.id]))
    # where a split fits and autocast alone does not: autocast on the split (levers.py)
    fitted = {spec.id: max(_split_micros(found[spec.id]), default=0) for spec in pending}
    # and where no split fitted alone, autocast on the largest batch's split (splits.py)
    try_level(_by_step((spec, c) for spec in pending
                       if not any("amp" in a.settings for a in found[spec.id])
                       for c in (half_precision_splits(step, spec, fitted[spec.id]) if fitted[spec.id]
                                 else under_kept_gradients(step, spec, largest.get(spec.id)))))  # fmt: skip
    pending = [spec for spec in pending if not found[spec.id]]
    tried = {spec.id: {changed for _, changed, _ in singles[spec.id]} for spec in pending}
    # Two walks, each to its first fit: every lever stacked in order, and the same without
    # activation checkpointing, whose third more compute a smaller micro-batch can undercut
    # (Llama-3.2-1B on an RTX 3090 at 8 x 1024: bf16 + Adafactor + 2 x 4 fits 7 % faster than
    # with checkpointing + 4 x 2); the faster fit comes first. Without checkpointing a step
    # holds more at any micro-batch, so the second walk asks only where the first fitted, at
    # its micro-batch or below (the one above did not fit even checkpointed); for a model that
    # cannot be checkpointed (no blocks, an HF class without it) everywhere, unbounded.
    stacks = {s.id: [c for c in stacked_changes(step, s) if c[1] not in tried[s.id]]
              for s in pending}  # fmt: skip
    fitted = _walk(stacks, pending, try_level, found)
    uncheckpointable = any(  # the model refused checkpointing alone
        changed in refused
        for changes in singles.values()
        for _, changed, _ in changes
        if changes_checkpointing(step, changed)
    )
    again = [s for s in pending if s.id in fitted or uncheckpointable]
    for s in again:
        tried[s.id] |= {changed for _, changed, _ in stacks[s.id]}
    bound = {s.id: fitted[s.id].batch_size if s.id in fitted else step.batch_size for s in again}
    stacks = {s.id: [c for c in stacked_changes(step, s, checkpointing=False)
                     if c[1] not in tried[s.id] and c[1].batch_size <= bound[s.id]]
              for s in again}  # fmt: skip
    _walk(stacks, again, try_level, found)
    # A stacked fit's micro-batch split may fit with fewer of the levers under it (resnet50 at
    # batch 5000 on an RTX 3090: adafactor + 250 x 20 fitted, and 250 x 20 with AdamW fits
    # too; gpt2-medium at 64 x 1024 on an L4: bf16 + Adafactor + 4 x 16, and bf16 + 4 x 16;
    # a helper's hunts): the split is tried alone and under each one of those levers.
    fewer = {s.id: fewer_levers(step, s, found[s.id]) for s in pending}
    try_level(_by_step((s, c) for s in pending for c in fewer[s.id]
                       if c[1] not in tried[s.id] and c[1] not in refused))  # fmt: skip
    # the fastest split's micro-batch, grown to the largest divisor of the batch that fits
    # below the halving above it (5000 as 500 x 10 where 250 x 20 fitted: splits.py)
    leading = {s.id: _leading_split(found[s.id]) for s, _ in failing if found.get(s.id)}
    refine_splits(step, [(s, leading[s.id]) for s, _ in failing if leading.get(s.id)],
                  found, try_level, _by_step)  # fmt: skip

    def bare(kind: Callable[[Advice], bool]) -> list[GpuSpec]:
        """GPUs nothing fitted on, and no recipe of this kind yet."""
        return [s for s, _ in failing if s.id in found and not found[s.id]
                and not any(kind(a) for a in recipes.get(s.id, []))]  # fmt: skip

    for lighter in BF16_TRUE_LEVELS if recipes_too else ():
        try_level(_by_step((s, c) for s in bare(is_bf16_true)
                           for c in bf16_true_changes(step, s, lighter)), recipe=True)  # fmt: skip
    for recipe_level in RECIPE_LEVELS if recipes_too else ():
        try_level(
            _by_step(
                (s, c) for s in bare(is_adapters) for c in recipe_changes(step, s, recipe_level)
            ),
            recipe=True,
        )
    return {
        gpu: sorted(_undominated(items), key=lambda a: a.step_ms)[:MAX_ADVICE]
        or ([closest[gpu]] if gpu in closest else [])
        + sorted(recipes.get(gpu, []), key=lambda a: a.step_ms)
        for gpu, items in found.items()
    }


def is_adapters(advice: Advice) -> bool:
    """A recipe that fine-tunes adapters (LoRA, QLoRA)."""
    return "finetune_method" in advice.settings


def is_bf16_true(advice: Advice) -> bool:
    """A recipe that trains every weight in bf16 (``levers.bf16_true_changes``)."""
    return advice.recipe and not is_adapters(advice)


def _undominated(items: list[Advice]) -> list[Advice]:
    """Fits no other fit beats: one that changes a strict subset of its settings, runs no
    slower and holds no more (adafactor + 250 x 20 beside 250 x 20 alone, faster, the same
    GiB)."""

    def held(a: Advice) -> int:
        return a.p90_bytes if a.p90_bytes is not None else a.total_bytes

    def beaten(a: Advice) -> bool:
        return any(b is not a and b.fits and set(b.settings) < set(a.settings)
                   and b.step_ms <= a.step_ms and held(b) <= held(a) for b in items)  # fmt: skip

    return [a for a in items if not beaten(a)]


def _leading_split(fits: list[Advice]) -> Advice | None:
    """The split that the advice would list first among the fits that split the batch: the
    fastest undominated one, the fewest settings changed on a tie."""
    splits = [a for a in _undominated(fits) if a.accumulation_steps > 1
              and "batch_size" in a.settings]  # fmt: skip
    return min(splits, key=lambda a: (a.step_ms, len(a.settings)), default=None)


def _walk(
    stacks: dict[str, list[tuple[str, StepSpec, int]]],
    gpus: list[GpuSpec],
    try_level: Callable[[dict[StepSpec, list[tuple[GpuSpec, str, int]]]], None],
    found: dict[str, list[Advice]],
) -> dict[str, StepSpec]:
    """Level by level of each GPU's ``stacks``, every candidate evaluated once for all GPUs
    that ask for it, until each GPU has one more fit in ``found`` or no level left. Returns
    the step that fitted, per GPU that found one."""
    pending, level, fitted = list(gpus), 0, {}
    while pending:
        asks = _by_step(
            (spec, stacks[spec.id][level]) for spec in pending if level < len(stacks[spec.id])
        )
        if not asks:
            break
        before = {spec.id: len(found[spec.id]) for spec in pending}
        try_level(asks)
        for spec in pending:
            if len(found[spec.id]) > before[spec.id]:
                fitted[spec.id] = stacks[spec.id][level][1]
        pending = [spec for spec in pending if spec.id not in fitted]
        level += 1
    return fitted


def _by_step(
    candidates: Iterable[tuple[GpuSpec, tuple[str, StepSpec, int]]],
) -> dict[StepSpec, list[tuple[GpuSpec, str, int]]]:
    """(GPU, (label, changed step, accumulation)) pairs grouped by changed step: each step is
    evaluated once for every GPU that asks for it."""
    asks: dict[StepSpec, list[tuple[GpuSpec, str, int]]] = {}
    for spec, (label, changed, accumulation) in candidates:
        asks.setdefault(changed, []).append((spec, label, accumulation))
    return asks


def lower_bound(result: GpuPrediction, step: StepSpec, gradient_bytes: int) -> Advice:
    """What any candidate needs at least on this GPU: the parameters (always alive), their
    gradients (all alive when backward ends) and the terms outside the allocator."""
    m = result.memory
    outside = m.total_bytes - m.peak_reserved_bytes
    # a lever that halves the parameters (LoRA's frozen weights, and the adapters, in 16
    # bits) halves the floor's share of them
    share = 0.5 if halves_frozen_weights(step) else 1.0
    floor = int(share * (m.breakdown.get("parameter", 0) + gradient_bytes)) + outside
    nan = float("nan")
    label = "parameters and gradients alone" + (" (in 16 bits)" if share < 1 else "")
    return Advice(label, {}, 1, False, floor,
                  m.capacity_bytes, nan, nan, lower_bound=True)  # fmt: skip


def _split_micros(found: list[Advice]) -> list[int]:
    """The micro-batch sizes of the fitting advice that splits the batch and changes nothing
    else."""
    return [a.settings["batch_size"] for a in found
            if a.accumulation_steps > 1 and set(a.settings) <= {"batch_size", "grad_accum"}]  # fmt: skip


def _advice(
    label: str, step: StepSpec, changed: StepSpec, accumulation: int, result: GpuPrediction
) -> Advice:
    # a candidate that does not fit has no predicted time; the time of one that does is
    # already that of the whole accumulated step (grad_accum is part of ``changed``)
    step_ms = float("nan") if result.time is None else result.time.step_ms
    settings = step_diff(step, changed)
    return Advice(
        change=label,
        settings=settings,
        options=command_options(settings),
        arguments=predict_arguments(settings, changed),
        accumulation_steps=accumulation,
        fits=result.fits,
        total_bytes=result.memory.total_bytes,
        p90_bytes=result.memory.p90_bytes,
        capacity_bytes=result.memory.capacity_bytes,
        step_ms=step_ms,
        samples_per_s=step.batch_size * step.grad_accum / step_ms * 1e3
        if step_ms > 0
        else float("nan"),
        unmeasured_kernels=list(result.time.unmeasured_kernels) if result.time else [],
    )


# StepSpec fields whose command-line key is another name
OPTION_KEYS = {**{name: f"finetune.{key}" for key, name in FINETUNE_KEYS.items()},
               "checkpointing_every": "checkpointing.every",
               "optimizer_impl": "optimizer.impl"}  # fmt: skip


def command_options(settings: dict[str, Any]) -> dict[str, Any]:
    """StepSpec field changes as ``python -m boom_ml.predict`` keys."""
    return {OPTION_KEYS.get(k, k): v for k, v in settings.items()}


def predict_arguments(settings: dict[str, Any], changed: StepSpec) -> dict[str, Any]:
    """StepSpec field changes as ``boom_ml.predict`` keyword arguments (``options``' CLI keys
    are none), to merge over the call's own; where an adapter field changes, the ``changed``
    step's whole ``finetune`` mapping (a merge replaces the call's: LoRA r=16 keeps its r)."""
    by_field = {name: key for key, name in FINETUNE_KEYS.items()}
    out = {k: v for k, v in settings.items() if k not in by_field}
    if not any(k in by_field for k in settings):
        return out
    default = StepSpec()
    finetune = {key: getattr(changed, name) for name, key in by_field.items()
                if getattr(changed, name) != getattr(default, name) or key == "method"}  # fmt: skip
    return out | {"finetune": finetune}


def nothing_fits(items: list[Advice]) -> bool:
    """No single-GPU change that keeps full training fits (``advise`` then lists the closest,
    or nothing, and any fine-tuning recipe that fits)."""
    return not any(a.fits and not a.recipe for a in items)


def advise_layouts(
    advised: dict[str, list[Advice]],
    gpus: list[GpuSpec],
    search: LayoutSearch,
    with_checkpointing: LayoutSearch | None = None,
) -> dict[str, dict[str, Any]]:
    """For each GPU where nothing tried fits on one GPU, the cheapest layouts that fit.

    ``search`` takes those GPUs at once and returns a result per GPU id. When the layouts
    cannot be searched (a model the parallel predictor does not model) every such GPU gets
    ``layouts: []`` and the one-line ``reason``; an unexpected failure is logged and the
    GPUs left out, so the single-GPU prediction is never lost to the search. Where no
    layout of the step fits, ``with_checkpointing`` (the same search with activation
    checkpointing, when the step has none) is asked too; its layouts (or, where none fits
    either, its ``closest`` miss) then carry ``settings: {"checkpointing": "full"}``.
    """
    wanted = [s for s in gpus if s.id in advised and nothing_fits(advised[s.id])]
    return layouts_that_fit(wanted, search, with_checkpointing)


def layouts_that_fit(
    wanted: list[GpuSpec], search: LayoutSearch, with_checkpointing: LayoutSearch | None = None
) -> dict[str, dict[str, Any]]:
    """The cheapest layouts that fit on each of ``wanted`` (``advise_layouts`` for GPUs
    already chosen: a multi-GPU layout that does not fit)."""
    if not wanted:
        return {}
    found = _search_layouts(search, wanted)
    bare = [s for s in wanted if s.id in found and _no_layout(found[s.id])]
    if with_checkpointing is not None and bare:
        again = _search_layouts(with_checkpointing, bare, " with checkpointing")
        for spec in bare:
            if spec.id in again and (again[spec.id].get("layouts") or "closest" in again[spec.id]):
                # fitting layouts, or the nearest miss, now with checkpointing
                found[spec.id] = {**again[spec.id], "settings": {"checkpointing": "full"}}
    return found


def _no_layout(found: dict[str, Any]) -> bool:
    return not found.get("layouts") and "reason" not in found


def _search_layouts(
    search: LayoutSearch, wanted: list[GpuSpec], how: str = ""
) -> dict[str, dict[str, Any]]:
    n = len(wanted)
    try:
        with progress.task(f"advice: searching multi-GPU layouts{how} for {n} GPU{'s' * (n > 1)}"):
            return search(wanted)
    except BoomError as err:
        return {spec.id: {"layouts": [], "reason": str(err)} for spec in wanted}
    except Exception as err:  # noqa: BLE001 - advice is optional, the prediction is not
        logging.getLogger(__name__).warning("layout search failed: %s", err)
        return {}
