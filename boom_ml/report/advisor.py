"""Advisor: for a GPU where the step does not fit, the cheapest changes that make it fit.

Candidates are the usual levers, each predicted with the same memory and time models:
autocast, activation checkpointing, an optimizer with less state, and a smaller
micro-batch with gradient accumulation (same effective batch; the gradients stay alive
between micro-batches, which the memory replay models). A candidate fits when its p90
step does. Single changes come
first; if none fits, they are stacked in that order, which is roughly the order of what
they cost in speed.

When nothing tried fits on one GPU and the step trains every weight, fine-tuning recipes
are tried too (LoRA, QLoRA: peft adapters on half-precision or 4-bit frozen weights, with
activation checkpointing); they change what is trained, so they are listed apart
(``Advice.recipe``), after the closest change that keeps full training.

When nothing tried fits on one GPU, :func:`advise_layouts` asks a layout search (passed in by
``boom_ml.api``: ``report`` does not import the prediction stack) for the cheapest multi-GPU
layouts that fit, ranked by $ per step (``boom_ml/parallel/search.py``).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from boom_ml import progress
from boom_ml.errors import BoomError, InvalidInputError, interrupted
from boom_ml.estimates import GpuPrediction
from boom_ml.gpus.spec import GpuSpec
from boom_ml.specs import FINETUNE_KEYS, StepSpec

# The optimizer to suggest instead, and why it needs less memory.
LIGHTER_OPTIMIZER = {
    "adam": ("adafactor", "Adafactor keeps factored second moments, no first moment"),
    "adamw": ("adafactor", "Adafactor keeps factored second moments, no first moment"),
    "adagrad": ("adafactor", "Adafactor keeps factored second moments"),
    "rmsprop": ("sgd", "SGD keeps no optimizer state"),
    "sgd-momentum": ("sgd", "SGD without momentum keeps no optimizer state"),
}
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
    recipe: bool = False  # fine-tunes adapters instead of training every weight
    # total_bytes is a floor no single-GPU lever goes below (parameters, their gradients and
    # the terms outside the allocator): nothing was traced for this GPU
    lower_bound: bool = False
    # ``settings`` as the command line's keys (finetune.method=, not finetune_method=): what
    # to add to the command to run this advice
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# evaluate(step, gpus) -> one GpuPrediction per GPU, for that step configuration
Evaluate = Callable[[StepSpec, list[GpuSpec]], list[GpuPrediction]]
# prefetch(step, gpus): evaluate(step, gpus) will be asked for soon
Prefetch = Callable[[StepSpec, list[GpuSpec]], None]
# search(gpus) -> per GPU id: {"layouts": [proposal, ...] ranked by $ per step, "searched": n, ...}
LayoutSearch = Callable[[list[GpuSpec]], dict[str, dict[str, Any]]]


def _amp_for(gpu: GpuSpec) -> str:
    return "bf16" if gpu.bf16_tflops else "fp16"


def single_changes(step: StepSpec, gpu: GpuSpec) -> list[tuple[str, StepSpec, int]]:
    """(label, changed step, accumulation) for every lever still available."""
    out: list[tuple[str, StepSpec, int]] = []
    if step.amp == "none" and step.params_dtype == "fp32":
        # autocast halves fp32 weights' activations; 16-bit parameters already compute in 16
        # bits (and an fp16 GradScaler cannot unscale fp16 gradients)
        amp = _amp_for(gpu)
        out.append((f"amp={amp}", replace(step, amp=amp), 1))
    if halves_frozen_weights(step):
        dtype = _amp_for(gpu)
        out.append((f"params_dtype={dtype} (frozen weights in 16 bits)",
                    replace(step, params_dtype=dtype), 1))  # fmt: skip
    if step.checkpointing != "full" or step.checkpointing_every > 1:
        # from none, selective or every K-th block: every block's activations recomputed
        label = "checkpointing=full" if step.checkpointing != "full" else "checkpointing.every=1"
        if step.checkpointing != "full" and step.checkpointing_every > 1:
            label += " + checkpointing.every=1"
        out.append((label, replace(step, checkpointing="full", checkpointing_every=1), 1))
    if step.optimizer in LIGHTER_OPTIMIZER and step.finetune_method == "full":
        # (adapters' optimizer state is a few MiB: a lighter optimizer saves nothing)
        name, why = LIGHTER_OPTIMIZER[step.optimizer]
        # its own implementation (the step's was resolved for the optimizer it replaces:
        # Adafactor traced with AdamW's foreach temporaries came out 4 GB too large)
        lighter = replace(step, optimizer=name, optimizer_impl="auto")
        out.append((f"optimizer={name} ({why})", lighter, 1))
    # up to 8 micro-batches; a batch with no such split (a prime above 8) runs one at a time
    micros = halving_micros(step.batch_size)
    for micro in [m for m in micros if step.batch_size // m <= 8] or micros[-1:]:
        accumulation = step.batch_size // micro
        out.append(
            (
                _split(micro, step.grad_accum * accumulation),
                replace(step, batch_size=micro, grad_accum=step.grad_accum * accumulation),
                accumulation,
            )
        )
    return out


def _split(micro: int, steps: int) -> str:
    """A micro-batch split as the keys that run it: ``batch_size=micro grad_accum=steps``."""
    return f"batch_size={micro} x {steps} accumulation steps"


def halves_frozen_weights(step: StepSpec) -> bool:
    """Whether the advice offers a LoRA step its frozen fp32 weights in 16 bits: how LoRA is
    run (they take no update, so rounding them loses nothing), half their bytes; not under
    fp16 autocast (GradScaler cannot unscale fp16 adapter gradients)."""
    return step.finetune_method == "lora" and step.params_dtype == "fp32" and step.amp != "fp16"


def halving_micros(batch: int) -> list[int]:
    """Micro-batch sizes about halving from ``batch`` down to 1, each dividing it exactly
    (the largest divisor at or below each half): a split that does not (5 as 2 x 2) trains
    fewer samples per step and looks faster for it."""
    small = [d for d in range(1, math.isqrt(batch) + 1) if batch % d == 0]
    divisors = sorted({*small, *(batch // d for d in small)})  # trial division to the root
    out: list[int] = []
    target = batch
    while target > 1:
        target //= 2
        micro = divisors[bisect.bisect_right(divisors, target) - 1]
        if micro not in out:
            out.append(micro)
    return out


def stacked_changes(
    step: StepSpec, gpu: GpuSpec, checkpointing: bool = True
) -> list[tuple[str, StepSpec, int]]:
    """Levers applied one on top of the other, cheapest first, the micro-batch splits on top
    of them all; without ``checkpointing``, every lever but activation checkpointing."""
    out: list[tuple[str, StepSpec, int]] = []
    labels: list[str] = []
    current, accumulation = step, 1
    for label, changed, acc in single_changes(step, gpu):
        if acc > 1:  # only the smallest micro-batch still needed is stacked, below
            continue
        if not checkpointing and label.startswith("checkpointing"):
            continue
        diff = _diff(step, changed)
        if diff.get("params_dtype", "fp32") != "fp32" and current.amp != step.amp:
            # 16-bit parameters compute in 16 bits: the autocast stacked before them goes
            # (fp16 weights under fp16 autocast cannot even be unscaled)
            diff["amp"] = step.amp
            labels = [x for x in labels if not x.startswith("amp=")]
        try:
            stacked = replace(current, **diff)
        except InvalidInputError:  # levers that cannot stack
            continue
        current = stacked
        labels.append(label.split(" (")[0])
        if len(labels) > 1:
            out.append((" + ".join(labels), current, accumulation))
    for micro in halving_micros(step.batch_size):
        accumulation = step.batch_size // micro
        out.append(
            (
                " + ".join([*labels, _split(micro, step.grad_accum * accumulation)]),
                replace(current, batch_size=micro, grad_accum=step.grad_accum * accumulation),
                accumulation,
            )
        )
    return out


# Fine-tuning recipes in levels of falling memory, each tried only on the GPUs where no
# earlier level fits (every candidate is a trace per attention group: an 8B model's cost
# seconds each): LoRA; then QLoRA, or LoRA at one sample per micro-batch; then QLoRA so.
RECIPE_LEVELS = ((("lora", False),), (("qlora", False), ("lora", True)), (("qlora", True),))


def recipe_changes(
    step: StepSpec, gpu: GpuSpec, level: tuple[tuple[str, bool], ...] = RECIPE_LEVELS[0]
) -> list[tuple[str, StepSpec, int]]:
    """Fine-tuning instead of full training: LoRA on half-precision frozen weights, QLoRA on
    4-bit ones, both with activation checkpointing (what people run when nothing else fits);
    for a LoRA step, QLoRA (its frozen weights in 4 bits). ``level`` names the methods and
    whether each runs one sample per micro-batch."""
    if step.finetune_method == "qlora":
        return []
    if step.finetune_method == "lora":  # adapters already: what is left is 4-bit base weights
        level = tuple((method, micro) for method, micro in level if method == "qlora")
    # one sample per micro-batch only means something when the batch has more than one
    return [
        _recipe(step, gpu, method, micro)
        for method, micro in level
        if not (micro and step.batch_size == 1)
    ]


def _recipe(step: StepSpec, gpu: GpuSpec, method: str, micro: bool) -> tuple[str, StepSpec, int]:
    dtype = _amp_for(gpu)
    # fp16 weights under fp16 autocast: GradScaler cannot unscale their gradients; the 16-bit
    # weights compute in 16 bits without it
    amp = "none" if dtype == "fp16" and step.amp == "fp16" else step.amp
    base = replace(step, params_dtype=dtype, checkpointing="full", checkpointing_every=1,
                   amp=amp)  # fmt: skip
    accumulation = step.batch_size if micro else 1
    if micro:
        base = replace(base, batch_size=1, grad_accum=step.grad_accum * accumulation)
    extra = [f"params_dtype={dtype}"] if step.params_dtype != dtype else []
    extra += [f"amp={amp}"] if amp != step.amp else []
    extra += ["checkpointing=full"] if step.checkpointing != "full" else []
    extra += ["checkpointing.every=1"] if step.checkpointing_every > 1 else []
    extra += [_split(1, step.grad_accum * accumulation)] if micro else []
    label = " + ".join([f"finetune.method={method}", *extra])
    return label, replace(base, finetune_method=method), accumulation


def _diff(base: StepSpec, changed: StepSpec) -> dict[str, Any]:
    a, b = base.to_dict(), changed.to_dict()
    return {k: v for k, v in b.items() if a[k] != v}


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

    def try_level(
        asks: dict[StepSpec, list[tuple[GpuSpec, str, int]]], recipe: bool = False
    ) -> None:
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

    singles = {spec.id: single_changes(step, spec) for spec in pending}
    try_level(_by_step((spec, c) for spec in pending for c in singles[spec.id]))
    pending = [spec for spec in pending if not found[spec.id]]
    tried = {spec.id: {changed for _, changed, _ in singles[spec.id]} for spec in pending}
    # Two walks, each to its first fit: every lever stacked in order, and the same without
    # activation checkpointing, whose third more compute a smaller micro-batch can undercut
    # (Llama-3.2-1B on an RTX 3090 at 8 x 1024: bf16 + Adafactor + 2 x 4 fits 7 % faster than
    # with checkpointing + 4 x 2); the faster fit comes first. Without checkpointing a step
    # holds more at any micro-batch, so the second walk asks only where the first fitted, at
    # its micro-batch or below (the one above did not fit even checkpointed).
    stacks = {s.id: [c for c in stacked_changes(step, s) if c[1] not in tried[s.id]]
              for s in pending}  # fmt: skip
    fitted = _walk(stacks, pending, try_level, found)
    again = [s for s in pending if s.id in fitted]
    for s in again:
        tried[s.id] |= {changed for _, changed, _ in stacks[s.id]}
    stacks = {s.id: [c for c in stacked_changes(step, s, checkpointing=False)
                     if c[1] not in tried[s.id] and c[1].batch_size <= fitted[s.id].batch_size]
              for s in again}  # fmt: skip
    _walk(stacks, again, try_level, found)
    for recipe_level in RECIPE_LEVELS if recipes_too else ():
        bare = [
            s for s, _ in failing if s.id in found and not found[s.id] and not recipes.get(s.id)
        ]
        try_level(
            _by_step((s, c) for s in bare for c in recipe_changes(step, s, recipe_level)),
            recipe=True,
        )
    return {
        gpu: sorted(items, key=lambda a: a.step_ms)[:MAX_ADVICE]
        or ([closest[gpu]] if gpu in closest else [])
        + sorted(recipes.get(gpu, []), key=lambda a: a.step_ms)
        for gpu, items in found.items()
    }


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


def _advice(
    label: str, step: StepSpec, changed: StepSpec, accumulation: int, result: GpuPrediction
) -> Advice:
    # a candidate that does not fit has no predicted time; the time of one that does is
    # already that of the whole accumulated step (grad_accum is part of ``changed``)
    step_ms = float("nan") if result.time is None else result.time.step_ms
    settings = _diff(step, changed)
    return Advice(
        change=label,
        settings=settings,
        options=command_options(settings),
        accumulation_steps=accumulation,
        fits=result.fits,
        total_bytes=result.memory.total_bytes,
        capacity_bytes=result.memory.capacity_bytes,
        step_ms=step_ms,
        samples_per_s=step.batch_size * step.grad_accum / step_ms * 1e3
        if step_ms > 0
        else float("nan"),
    )


# StepSpec fields whose command-line key is another name
OPTION_KEYS = {**{name: f"finetune.{key}" for key, name in FINETUNE_KEYS.items()},
               "checkpointing_every": "checkpointing.every"}  # fmt: skip


def command_options(settings: dict[str, Any]) -> dict[str, Any]:
    """StepSpec field changes as ``python -m boom_ml.predict`` keys."""
    return {OPTION_KEYS.get(k, k): v for k, v in settings.items()}


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
