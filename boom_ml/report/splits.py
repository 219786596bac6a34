"""The advisor's micro-batch splits: the largest micro-batch that fits (below), a stacked
fit's split under fewer levers (:func:`fewer_levers`), and which splits need no trace
(:func:`above_largest`).

The levers split a batch at about its halvings (``levers.halving_micros``), so a split that
fits at ``m`` may have a divisor of the batch between ``m`` and the next halving above it that
fits too, with fewer accumulation steps: resnet50 at batch 5000 on an RTX 3090 fitted as
250 x 20 where 500 x 10 fits (its largest batch is 540; a helper's hunt). The divisors between
are bisected, the largest first, each probe one evaluation of the changed step; a batch that is
a power of two has none between and costs nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from boom_ml.gpus.spec import GpuSpec
from boom_ml.report.levers import (
    divisors,
    half_precision_splits,
    halving_micros,
    single_changes,
    split_change,
    step_diff,
)
from boom_ml.specs import StepSpec

SPLIT_KEYS = ("batch_size", "grad_accum")
Asks = dict[StepSpec, list[tuple[GpuSpec, str, int]]]


class Advice(Protocol):
    """What this module reads of the advisor's ``Advice`` (which imports this module)."""

    change: str
    settings: dict[str, Any]
    step_ms: float


def between(batch: int, micro: int) -> list[int]:
    """The divisors of ``batch`` above ``micro`` and below the next halving micro-batch above
    it (``batch`` itself where ``micro`` is the first halving), ascending."""
    halvings = [batch, *halving_micros(batch)]
    above = halvings[halvings.index(micro) - 1] if micro in halvings[1:] else batch
    every = divisors(batch)
    return every[bisect.bisect_right(every, micro) : bisect.bisect_left(every, above)]


class _Search:
    """One GPU's bisection over the divisors between its fastest split fit and the halving
    above it: ``low`` fits (index -1 is the fit itself), ``high`` did not or was not tried."""

    def __init__(self, step: StepSpec, spec: GpuSpec, fit: Advice) -> None:
        self.spec, self.fit = spec, fit
        self.micro = fit.settings["batch_size"]
        self.levers = replace(step, **{k: v for k, v in fit.settings.items()
                                       if k not in SPLIT_KEYS})  # fmt: skip
        self.label = split_change(self.levers, self.micro)[0]
        self.sizes = between(step.batch_size, self.micro)
        self.low, self.high = -1, len(self.sizes)
        self.probes: list[Advice] = []

    @property
    def middle(self) -> int:
        """The next probe's index: the upper middle of what is left, so a fit one short of
        the halving above is found first."""
        return (self.low + self.high + 1) // 2

    def ask(self) -> tuple[str, StepSpec, int]:
        label, changed, accumulation = split_change(self.levers, self.sizes[self.middle])
        return self.fit.change.replace(self.label, label), changed, accumulation

    def done(self) -> bool:
        return self.high - self.low <= 1


def refine_splits(
    step: StepSpec,
    fits: list[tuple[GpuSpec, Advice]],
    found: dict[str, list[Advice]],
    try_level: Callable[[Asks], None],
    by_step: Callable[..., Asks],
) -> None:
    """Each (GPU, fit that splits the batch) of ``fits``: the largest micro-batch between it and
    the halving above it that fits with the same levers, added to ``found`` beside the fit
    where it is no slower. ``try_level(asks)`` evaluates candidates and appends each fit
    to ``found`` (the advisor's), ``by_step`` groups them per step."""
    searches = []
    for spec, fit in fits:
        search = _Search(step, spec, fit)
        # a fit whose settings do not rebuild (a lever this module does not know) is left
        _, rebuilt, _ = split_change(search.levers, search.micro)
        if search.sizes and step_diff(step, rebuilt) == fit.settings:
            searches.append(search)
    while active := [s for s in searches if not s.done()]:
        asks = {s.spec.id: s.ask() for s in active}
        before = {s.spec.id: len(found[s.spec.id]) for s in active}
        try_level(by_step((s.spec, asks[s.spec.id]) for s in active))
        for s in active:
            if len(found[s.spec.id]) > before[s.spec.id]:
                s.low = s.middle
                s.probes.append(found[s.spec.id][-1])
            else:
                s.high = s.middle
    for s in searches:
        if not s.probes:
            continue
        # the largest that fitted, where it is no slower; the fit it grew from stays (it has
        # more room: 250 x 20 at 12.3 GiB beside 500 x 10 at 23.5 of 23.6)
        best = s.probes[-1]
        drop = {id(p) for p in s.probes[:-1]} | (
            {id(best)} if best.step_ms > s.fit.step_ms else set()
        )
        found[s.spec.id] = [a for a in found[s.spec.id] if id(a) not in drop]


def fewer_levers(
    step: StepSpec, gpu: GpuSpec, fits: list[Advice]
) -> list[tuple[str, StepSpec, int]]:
    """For each fit that stacks levers under a micro-batch split: the split alone, and under
    each single lever among them (one candidate per step)."""
    levers = [(label.split(" (")[0], changed) for label, changed, acc in single_changes(step, gpu)
              if acc == 1]  # fmt: skip
    out: dict[StepSpec, tuple[str, StepSpec, int]] = {}
    for a in fits:
        stacked = set(a.settings) - {"batch_size", "grad_accum"}
        if "batch_size" not in a.settings or not stacked:
            continue
        micro = a.settings["batch_size"]
        split = split_change(step, micro)
        out.setdefault(split[1], split)
        for label, changed in levers:
            keys = set(step_diff(step, changed))
            if (
                keys
                and keys < stacked | {"optimizer_impl"}
                and keys <= set(a.settings) | {"optimizer_impl"}
            ):
                name, under, acc = split_change(changed, micro)
                out.setdefault(under, (f"{label} + {name}", under, acc))
    return list(out.values())


def above_largest(step: StepSpec, changed: StepSpec, largest: int | None) -> bool:
    """Whether ``changed`` only splits ``step``'s batch, into micro-batches above the largest
    batch of ``step`` that fits (None: not searched)."""
    return (
        largest is not None
        and changed.batch_size > largest
        and set(step_diff(step, changed)) <= {"batch_size", "grad_accum"}
    )


def largest_split(step: StepSpec, largest: int | None) -> list[tuple[str, StepSpec, int]]:
    """The step's own split at the largest divisor of its batch that its largest batch holds,
    where that takes more than the 8 micro-batches the single levers try (resnet152 at 1024
    on a T4, largest batch 78: 64 x 16, which had never been asked; a hunt); [] otherwise."""
    if not largest or largest >= step.batch_size:
        return []
    micro = max(d for d in divisors(step.batch_size) if d <= largest)
    return [split_change(step, micro)] if step.batch_size // micro > 8 else []


def under_kept_gradients(
    step: StepSpec, gpu: GpuSpec, largest: int | None
) -> list[tuple[str, StepSpec, int]]:
    """Where no split of the step fitted alone though its largest batch is known: the gradients
    kept between micro-batches took the room (vit_l_16 at 256 on a T4, largest batch 33: 32 x 8
    did not fit, and it was told checkpointing alone, 32.9 s, where fp16 autocast on 32 x 8
    takes a sixth of that; a hunt). Autocast on the largest halving micro-batch the largest
    batch holds and on the next larger one (``levers.half_precision_splits``), and the split at the
    halving below it alone; [] where no halving is at or below the largest batch."""
    micros = [m for m in halving_micros(step.batch_size) if m <= (largest or 0)]
    if not micros:
        return []
    below = [split_change(step, micros[1])] if len(micros) > 1 else []
    return half_precision_splits(step, gpu, micros[0]) + below
