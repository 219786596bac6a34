"""The largest batch size that fits: a search over batch sizes, run by the orchestration
layer (``session.py``: ``Session.evaluate``), which owns tracing and passes a tracer in.

The search is on the safe side: a batch fits when its step does at every level, the
estimate's "yes" (``estimate.py``). Tracing is the slow part (seconds per batch size),
replaying is fast: ``batch_scaling.py`` writes the event list of any batch size from traces
at two; where its check fails (data-dependent shapes, batch-dependent kernel choices), every
probe is traced instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from boom_ml.batch_scaling import BatchScaling, scaling_pairs
from boom_ml.gpus.spec import GpuSpec
from boom_ml.identity_cache import IdentityCache
from boom_ml.memory.allocator import AllocatorConfig
from boom_ml.memory.estimate import DEFAULT_STEPS, simulate_step, step_fits
from boom_ml.memory.overheads import OverheadTable, load_overheads
from boom_ml.memory.replay import Replay
from boom_ml.stack import Stack, resolve_stack
from boom_ml.trace.graph import OpGraph

LEVEL = "p90"  # the search answers "fits" where the upper bound fits, and the levels below,
# as the estimate's "yes" asks (a p90 replay that drops cuDNN workspaces can fit where the p50
# one runs out: resnet18 at 1029 on an L4 had been the max batch, and tight)
OTHER_LEVELS = ("p50", "p10")
MAX_BATCH = 1 << 16
# Strides of the top-down scan past the bisection's first failure (_past_failures)
SCAN = 8
# A search below the traced batches checks the affine model with one trace this many times
# below the batch asked (BatchSearch._check_below): a structure change (HF decoders' mask path
# at batch 1) shows as a mismatch there, and the probes above it need no trace.
CHECK_BELOW = 8

TraceFn = Callable[[int], OpGraph]


@dataclass
class MaxBatch:
    batch_size: int  # largest batch that fits (0: not even batch size 1)
    scaled: bool  # whether probes used affine scaling instead of traces
    probes: dict[int, bool] = field(default_factory=dict)  # batch size → fits
    capped: bool = False  # True when the search stopped at its upper limit


@dataclass
class BatchSearch:
    """Traces, scaling and replays of one model/step over batch sizes, shared by GPUs."""

    graph: OpGraph  # traced at ``batch``
    batch: int
    trace_at: TraceFn | None
    allocator_config: AllocatorConfig | None = None
    table: OverheadTable | None = None
    hold_outputs: bool = True
    steps: int = DEFAULT_STEPS
    stack: Stack | None = None
    accumulate: bool = False
    traced: dict[int, OpGraph] = field(default_factory=dict)
    _scaling: BatchScaling | None = None
    _scaling_tried: bool = False
    _unbounded: dict[tuple, tuple[int, int]] = field(default_factory=dict)
    _optional: set[tuple] = field(default_factory=set)  # replays with cuDNN workspaces
    _floors: dict[tuple, int] = field(default_factory=dict)  # _allocated_floor's
    _templates: dict[int, Replay] = field(default_factory=dict)  # arch major → replay

    def __post_init__(self) -> None:
        self.traced[self.batch] = self.graph
        self.table = self.table if self.table is not None else load_overheads()
        self.stack = self.stack if self.stack is not None else resolve_stack()

    def _replay_options(self) -> dict:
        return dict(
            stack=self.stack, level=LEVEL, allocator_config=self.allocator_config,
            steps=self.steps, hold_outputs=self.hold_outputs, table=self.table,
            accumulate=self.accumulate,
        )  # fmt: skip

    def scaling(self) -> BatchScaling | None:
        """The affine model, from one more trace (at half the batch, or twice a small one)."""
        if not self._scaling_tried and self.trace_at is not None:
            self._scaling_tried = True
            for b1, b2 in scaling_pairs(self.batch):
                try:
                    self._scaling = BatchScaling(self._traced(b1), b1, self._traced(b2), b2)
                    break
                except ValueError:
                    continue
        return self._scaling

    def _traced(self, batch: int) -> OpGraph:
        if batch not in self.traced:
            if self.trace_at is None:
                raise ValueError("no tracer to trace another batch size")
            self.traced[batch] = self.trace_at(batch)
        return self.traced[batch]

    def graph_at(self, batch: int) -> OpGraph:
        if batch in self.traced:
            return self.traced[batch]
        scaling = self.scaling()
        if scaling is not None and batch < scaling.low:
            self._check_below(scaling, batch)
        if scaling is not None and batch >= scaling.low:
            try:
                return scaling.graph_at(batch)
            except ValueError:
                # a size that shrinks with the batch (a MoE's routing, say) is not affine:
                # the model does not hold this far, so trace from here on
                self._scaling = None
        return self._traced(batch)

    def _check_below(self, scaling: BatchScaling, batch: int) -> None:
        """Extends the affine model below the batches it came from, where one more trace
        matches it exactly: at ``batch / CHECK_BELOW`` (the probes between then come from
        the model), else at ``batch`` itself. resnet50 traced at 5000, whose largest batch
        is 540, had traced every probe below 2500 (24 traces, 72 s)."""
        for below in dict.fromkeys((max(2, batch // CHECK_BELOW), batch)):
            try:
                graph = self._traced(below) if below < scaling.low else None
            except Exception:  # noqa: BLE001 - a batch the model refuses: the asked one decides
                continue
            if graph is not None and scaling.matches(graph, below):
                scaling.low = below
                return

    def _unbounded_peaks(self, batch: int, gpu: GpuSpec) -> tuple[int, int, int]:
        """(reserved, allocated, outside) of an unbounded replay; the replay is shared by
        GPUs of one architecture major (same workspaces), the outside terms are per GPU."""
        assert self.table is not None
        graph = self.graph_at(batch)
        key = (batch, gpu.sm_version // 10)
        if key not in self._unbounded:
            sm = simulate_step(graph, gpu, capacity=False, **self._replay_options())
            self._unbounded[key] = (sm.result.peak_reserved, sm.result.peak_allocated)
            if sm.replay.optional:
                self._optional.add(key)
        outside = sum(self.table.outside_allocator(gpu, graph, self.stack, LEVEL).values())
        return (*self._unbounded[key], outside)

    def _allocated_floor(self, batch: int, gpu: GpuSpec) -> int:
        """The allocated peak without the cuDNN workspaces a capped replay drops, the p10
        level's (it has none); a CNN fitting at 64 had been searched no higher than 63."""
        key = (batch, gpu.sm_version // 10)
        if key in self._optional and key not in self._floors:
            options = {**self._replay_options(), "level": "p10"}
            sm = simulate_step(self.graph_at(batch), gpu, capacity=False, **options)
            self._floors[key] = sm.result.peak_allocated
        return self._floors.get(key, self._unbounded[key][1])

    def need(self, batch: int, gpu: GpuSpec) -> int:
        """What ``batch`` needs on ``gpu`` with an unbounded allocator (nvidia-smi bytes)."""
        reserved, _, outside = self._unbounded_peaks(batch, gpu)
        return reserved + outside

    def fits(self, batch: int, gpu: GpuSpec, every_level: bool = False) -> bool:
        """Whether ``batch`` runs on ``gpu`` without OOM: the p90 verdict from its capped replay
        alone (the search probes only batches whose need exceeds the GPU); ``every_level``:
        the lower levels' too, from ``estimate.step_fits`` (the estimate's yes)."""
        graph, options = self.graph_at(batch), self._replay_options()
        sm = simulate_step(graph, gpu, capacity=True, **options)
        if sm.result.oom or sm.total > gpu.capacity_bytes:
            return False
        return not every_level or all(
            step_fits(graph, gpu, **{**options, "level": lv})[0] for lv in OTHER_LEVELS
        )

    def max_batch(self, gpu: GpuSpec, limit: int = MAX_BATCH) -> MaxBatch:
        """Largest batch size that fits on ``gpu``.

        1. The last batch whose unbounded need fits (bracket by doubling or halving from
           the traced batch, then interpolation: memory is close to affine in the batch).
           These replays are shared by all GPUs of the same architecture.
        2. The first batch whose *allocated* peak alone does not fit: past it nothing can.
        3. Bisection in between with the capped replay, where the allocator frees its
           cache and retries before giving up (it can fit a little more).
        Probes are replays of scaled events when scaling holds.
        """
        cap = gpu.capacity_bytes
        scaled = lambda: self._scaling is not None  # noqa: E731 - read after tracing

        def need_ok(b: int) -> bool:
            return self.need(b, gpu) <= cap

        def alloc_ok(b: int) -> bool:
            _, allocated, outside = self._unbounded_peaks(b, gpu)
            if allocated + outside <= cap:
                return True
            return self._allocated_floor(b, gpu) + outside <= cap

        b0 = min(self.batch, limit)
        if need_ok(b0):
            if self.scaling() is not None and not self._scaling.batch_dependent:  # type: ignore[union-attr]
                return MaxBatch(limit, True, {b0: True}, capped=True)
            lo, hi = b0, min(b0 * 2, limit)
            bound = self._allocated_bound(gpu)
            if bound is not None and b0 < bound < limit:
                hi = bound + 1  # need >= allocated: the bracket's upper end, without doubling
            while hi > lo and need_ok(hi):
                lo, hi = hi, min(hi * 2, limit)
            if hi == lo:
                return MaxBatch(lo, scaled(), {lo: True}, capped=True)
            lo = self._narrow(lo, hi, gpu)
        else:
            hi = b0
            while hi > 1 and not need_ok(hi // 2):
                hi //= 2
            lo = hi // 2
            lo = self._narrow(lo, hi, gpu) if lo > 0 else 0
        probes = {lo: lo > 0}
        step, hi = 1, lo + 1
        bound = self._allocated_bound(gpu)
        if bound is not None and lo < bound < limit and not alloc_ok(bound + 1):
            step, hi = bound + 1 - lo, bound + 1  # skip the stepping: past it nothing fits
        while hi < limit and alloc_ok(hi):
            step *= 2
            hi = min(lo + step, limit)
        if hi >= limit and alloc_ok(limit) and self.fits(limit, gpu):
            return MaxBatch(limit, scaled(), probes | {limit: True}, capped=True)
        lo, hi = self._bisect(lo, hi, gpu, probes)
        if scaled() and bound:  # probes are replays, not traces, and the bound is known
            lo = self._past_failures(lo, hi, min(limit, bound + 1), gpu, probes)
        if lo < b0 and probes.get(b0, True) and self.fits(b0, gpu):
            # fit is not monotone in the batch near the limit (the allocator's segments): the
            # searched batch fits, so the answer is never below it (it was 22372 for a
            # resnet18 traced at 22500 that fits)
            probes[b0] = True
            lo = b0
        return MaxBatch(self._confirmed(lo, gpu, probes), scaled(), probes)

    def _confirmed(self, lo: int, gpu: GpuSpec, probes: dict[int, bool]) -> int:
        """``lo`` (the search's, on the p90 replay) where every level fits there, else the
        largest batch below it where they do: a look down in doubling steps, then a bisection
        of the last one. Checked at the answer alone: each probe of the search at every level
        had cost the first command a fifth more time."""
        if lo <= 0 or self.fits(lo, gpu, every_level=True):
            return lo
        probes[lo], step = False, 1
        while lo - step > 0 and not self.fits(lo - step, gpu, every_level=True):
            probes[lo - step], step = False, step * 2
        if lo - step <= 0:
            return 0
        return self._bisect(lo - step, lo - step // 2, gpu, probes, every_level=True)[0]

    def _bisect(
        self, lo: int, hi: int, gpu: GpuSpec, probes: dict[int, bool], every_level: bool = False
    ) -> tuple[int, int]:
        """From ``lo`` that fits and ``hi`` that does not: two neighbours, one of each."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            probes[mid] = self.fits(mid, gpu, every_level)
            lo, hi = (mid, hi) if probes[mid] else (lo, mid)
        probes[hi] = False
        return lo, hi

    def _past_failures(
        self, lo: int, hi: int, end: int, gpu: GpuSpec, probes: dict[int, bool]
    ) -> int:
        """A fitting batch above the first failure ``hi`` and below ``end``, the highest the
        scan finds (else ``lo``): the highest fit on the stride grid, then the boundary a
        bisection finds in the stride above it (batches between grid points can fit and be
        missed: A100-80GB resnet50, 962 fits, the answer is 950).

        Fit is not monotone in the batch near the limit (the allocator's segments and the
        p90 terms: vgg16, Adam, eager loading, A100-40GB: 396 tight, the bisection said 395).
        Past the allocated-peak bound (``end``) nothing fits: the batches below it are probed
        from the top down in at most ``SCAN`` strides, the stride above the first that fits
        bisected (a probe is one capped replay of scaled events, 15-60 ms).
        """

        def fits(b: int) -> bool:
            if b not in probes:
                probes[b] = self.fits(b, gpu)
            return probes[b]

        stride = max(1, -(-(end - 1 - hi) // SCAN))  # ceil: at most SCAN probes
        for top in range(end - 1, hi, -stride):
            if fits(top):
                if top + stride >= end:
                    return top
                return self._bisect(top, top + stride, gpu, probes)[0]
        return lo

    def _allocated_bound(self, gpu: GpuSpec) -> int | None:
        """The largest batch whose *allocated* peak (plus the outside terms) fits, from the
        affine event sizes in one vectorised pass: the running sum of live bytes at event
        i is c_i + d_i * batch, so the bound is min over d_i > 0 of (cap - c_i) / d_i.
        An estimate (512-byte rounding and workspaces sized at the traced batch are left
        out): callers check it with a replay. None without affine scaling."""
        scaling = self.scaling()
        if scaling is None or not scaling.batch_dependent:
            return None
        replay = self._template_replay(gpu)
        src = replay.src
        sign = np.where(replay.is_alloc, 1, -1)
        traced = src >= 0
        slope = np.where(traced, scaling.slope[np.maximum(src, 0)], 0) * sign
        # without the optional blocks (cuDNN workspaces), which a capped replay drops
        kept = np.where(np.isin(replay.block, list(replay.optional)), 0, replay.nbytes)
        base = np.where(traced, scaling.intercept[np.maximum(src, 0)], kept) * sign
        c, d = np.cumsum(base), np.cumsum(slope)
        _, _, outside = self._unbounded_peaks(self.batch, gpu)
        room = gpu.capacity_bytes - outside
        if np.any(c[d <= 0] > room):
            return 0
        grows = d > 0
        return int(np.floor(np.min((room - c[grows]) / d[grows]))) if grows.any() else None

    def _template_replay(self, gpu: GpuSpec) -> Replay:
        major = gpu.sm_version // 10
        if major not in self._templates:
            # the scaling's own template: its event indices are the ones slopes refer to
            template = self._scaling.template if self._scaling is not None else self.graph
            sm = simulate_step(template, gpu, capacity=False, **self._replay_options())
            self._templates[major] = sm.replay
        return self._templates[major]

    def _narrow(self, lo: int, hi: int, gpu: GpuSpec) -> int:
        """The last batch in [lo, hi) whose unbounded need fits (need(lo) fits, need(hi)
        does not): interpolation, falling back to bisection when it does not halve."""
        cap = gpu.capacity_bytes
        interpolate = True
        while hi - lo > 1:
            width = hi - lo
            guess = (lo + hi) // 2
            if interpolate:
                n_lo, n_hi = self.need(lo, gpu), self.need(hi, gpu)
                if n_hi > n_lo:
                    guess = lo + int((cap - n_lo) / (n_hi - n_lo) * width)
                    guess = min(max(guess, lo + 1), hi - 1)
            if self.need(guess, gpu) <= cap:
                lo = guess
                if guess + 1 < hi and self.need(guess + 1, gpu) > cap:
                    hi = guess + 1
            else:
                hi = guess
            interpolate = hi - lo <= width // 2
        return lo


# The last few searches, which the GPUs of one prediction share (a search holds its graphs)
_SEARCHES: IdentityCache[BatchSearch] = IdentityCache(8)


def search_for(
    graph: OpGraph,
    trace_at: TraceFn | None,
    allocator_config: AllocatorConfig | None = None,
    table: OverheadTable | None = None,
    hold_outputs: bool = True,
    steps: int = DEFAULT_STEPS,
    stack: Stack | None = None,
    accumulate: bool = False,
) -> BatchSearch:
    """The (cached) :class:`BatchSearch` of ``graph``; ``trace_at(b)`` traces batch ``b``
    (None: only the traced batch and affine scaling are available)."""
    key = (id(trace_at), allocator_config, id(table), hold_outputs, steps, stack, accumulate)
    batch = int(graph.meta.get("step", {}).get("batch_size", 1))
    return _SEARCHES.get(
        graph,
        key,
        lambda: BatchSearch(
            graph, batch, trace_at, allocator_config, table, hold_outputs, steps, stack, accumulate
        ),
    )


def max_batch_size(
    graph: OpGraph,
    gpu: GpuSpec,
    trace_at: TraceFn | None,
    stack: Stack | None = None,
    accumulate: bool = False,
    limit: int = MAX_BATCH,
) -> MaxBatch:
    """Largest batch of ``graph``'s model and step that fits on ``gpu`` at every level."""
    search = search_for(graph, trace_at, stack=stack, accumulate=accumulate)
    return search.max_batch(gpu, limit)
