"""Session: one model under study, its steps traced once each and evaluated on GPUs.

The orchestration ``api.predict`` and the advisor share: traces from the on-disk cache, from
worker processes started ahead (``trace_pool``) or made here; one trace per attention group
whose SDPA kernels differ (a cuDNN-attention group's graph derived from a flash group's where
it can be, ``trace/cudnn_from_flash.py``); memory (allocator replay, the largest batch) and
time per GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from boom_ml import progress
from boom_ml.batch_scaling import scaling_pairs
from boom_ml.errors import InvalidInputError, one_value_per_channel
from boom_ml.estimates import GpuPrediction, TimeEstimate
from boom_ml.gpus import parse_gpu_list
from boom_ml.gpus.spec import GpuSpec
from boom_ml.hf_notices import quiet_transformers
from boom_ml.max_batch import MaxBatch, TraceFn, max_batch_size
from boom_ml.memory.estimate import estimate_memory
from boom_ml.specs import (
    BUILD_OPTION_DEFAULTS,
    ModelSpec,
    StepSpec,
    cache_setting,
    check_model_syntax,
    finetune_problem,
)
from boom_ml.stack import Stack, resolve_stack, stack_missing, step_optimizer_impl
from boom_ml.timing.accumulation import gradient_adds_ms
from boom_ml.timing.estimate import estimate_times
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.cudnn_from_flash import cudnn_from_flash, derivable, trace_order
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.sdpa_select import DEFAULT_GROUP, backends, same_backends, sdpa_group
from boom_ml.trace_cache import TraceCache
from boom_ml.trace_pool import shared_pool, take_or_trace


class Session:
    """One model under study: traces cached per step configuration.

    Tracing dominates the cost of a prediction, and the advisor asks about several
    variants of the same step, so each distinct StepSpec is traced once.
    """

    def __init__(
        self, model: str, cache: bool = True, options: dict[str, Any] | None = None
    ) -> None:
        check_model_syntax(model)  # Session is public: the CLI's and api.predict's check
        # the build options' defaults filled in, as predict() passes them: the same step had
        # been traced and cached apart by the two (a hunt)
        self.model = ModelSpec(model.strip(), {**BUILD_OPTION_DEFAULTS, **dict(options or {})})
        # The model is built on the first cache miss (an unknown model fails there, before
        # any trace): a graph from the on-disk cache needs no model library at all.
        # "off" / "false" as predict reads them (any non-empty string had kept it on)
        self._cache = TraceCache() if cache_setting(cache) else None
        self._pool = shared_pool(self.model)  # None: every trace runs in this process
        self._graphs: dict[StepSpec, OpGraph] = {}
        # step (sdpa_group None) -> the attention group evaluate() traced it for first, and
        # the graph of a step whose model calls no SDPA (the same for every GPU)
        self._first_group: dict[StepSpec, str] = {}
        self._no_sdpa: dict[StepSpec, OpGraph] = {}
        self._sdpa_graphs: dict[StepSpec, list[OpGraph]] = {}  # traced for other groups

    @quiet_transformers  # as boom_ml.predict is: a hub model's build warns of its config
    def graph(self, step: StepSpec) -> OpGraph:
        step = _resolved_impl(step, None)  # as evaluate() keys it
        if step.sdpa_group is None and step in self._first_group:
            step = replace(step, sdpa_group=self._first_group[step])  # evaluate()'s first GPU's
        if step not in self._graphs:
            graph = self._cached(step)
            if graph is None:
                graph = self._trace(step)
                if self._cache is not None:
                    self._cache.put(self.model, step, graph)
                    if step.sdpa_group not in (None, DEFAULT_GROUP) and _serves(
                        graph, DEFAULT_GROUP
                    ):
                        self._cache.put(self.model, replace(step, sdpa_group=DEFAULT_GROUP), graph)
            self._graphs[step] = graph
        return self._graphs[step]

    def _cached(self, step: StepSpec) -> OpGraph | None:
        """``step`` from the on-disk cache. It is keyed by group; a step cached for the
        default group serves another group where the trace would not differ (no SDPA, the
        same kernels)."""
        if self._cache is None:
            return None
        graph = self._cache.get(self.model, step)
        if graph is None and step.sdpa_group not in (None, DEFAULT_GROUP):
            graph = self._cache.get(self.model, replace(step, sdpa_group=DEFAULT_GROUP))
            if graph is not None and not _serves(graph, step.sdpa_group):
                graph = cudnn_from_flash(graph, step.sdpa_group)
        return graph

    def _trace(self, step: StepSpec) -> OpGraph:
        """A worker's trace of ``step`` if one was started (:meth:`prefetch`), else one here.
        Model libraries and the tracer (~2 s of imports) load only here, on a cache miss."""
        return take_or_trace(self.model, step)

    def prefetch(self, steps: Iterable[StepSpec]) -> None:
        """Start tracing ``steps`` (each naming its ``sdpa_group``) in worker processes, for
        :meth:`graph` to take when it asks; those already traced or cached are skipped."""
        if self._pool is None:
            return
        for step in steps:
            step = _resolved_impl(step, None)  # as graph() keys it
            if step in self._graphs or self._pool.pending(self.model, step):
                continue
            graph = self._cached(step)
            if graph is not None:
                self._graphs[step] = graph
            else:
                self._pool.submit(self.model, step)

    def prefetch_for(self, step: StepSpec, gpus: list[GpuSpec], stack: Stack) -> None:
        """Start the traces :meth:`evaluate` of ``step`` on ``gpus`` will ask for (the
        advisor's candidates), judged by the traces made so far: one per attention group
        whose kernels differ, where the model calls SDPA."""
        if self._pool is None or not gpus:
            return
        traced = replace(_resolved_impl(step, stack), grad_accum=1, sdpa_group=None)
        groups = [sdpa_group(spec.sm_version, stack) for spec in gpus]
        first = _first(groups)
        seen = next(iter(self._graphs.values()), None)  # any trace of this model
        if seen is not None and _dtypes(traced) != _dtypes(seen.meta["step"]):
            groups = []  # other dtypes pick other kernels: the first group's trace only
        self.prefetch(replace(traced, sdpa_group=g) for g in _distinct(seen, [first, *groups]))

    def graph_for(self, step: StepSpec, group: str, first: str | None = None) -> OpGraph:
        """``step`` traced for attention architecture group ``group`` (boom_ml/trace/sdpa_select).

        The ``first`` group is traced first; when its model calls no SDPA (a CNN, eager
        attention) no GPU changes the graph, and that one trace serves every group.
        """
        key = replace(step, sdpa_group=None)
        if key in self._no_sdpa:
            return self._no_sdpa[key]
        graph = self.graph(replace(step, sdpa_group=first or group))
        if not _uses_sdpa(graph):
            self._no_sdpa[key] = graph
            return graph
        # A graph traced for another group serves this one when each of its SDPA calls picks
        # the same kernel here (sm80 and sm86 both run flash for head dim 128, say), or is
        # re-expressed for it when flash calls turn cuDNN calls there (sm80 -> sm90).
        done = [graph, *self._sdpa_graphs.get(key, [])]
        own = replace(step, sdpa_group=group)
        for other in done:
            if _serves(other, group):
                return self._graphs.setdefault(own, other)
        if own not in self._graphs:
            derived = next(filter(None, (cudnn_from_flash(g, group) for g in done)), None)
            if derived is not None:
                self._graphs[own] = derived
        graph = self.graph(own)
        self._sdpa_graphs.setdefault(key, []).append(graph)
        return graph

    @quiet_transformers
    def evaluate(
        self,
        step: StepSpec,
        gpus: str | GpuSpec | Iterable[str | GpuSpec],
        stack: Stack | dict[str, Any] | None = None,
        max_batch: bool = False,
        time_unless_oom: bool = False,
        dominance: bool = True,
    ) -> list[GpuPrediction]:
        """Memory and time of ``step`` on each GPU (``gpus`` as predict's ``gpu=`` takes them);
        ``max_batch`` adds the batch search; ``stack`` a Stack or predict's ``stack=`` mapping.

        With ``time_unless_oom`` the time is only predicted where the step fits (the
        advisor's candidates that do not fit need no time); elsewhere it is ``None``.
        ``dominance=False`` leaves each GPU's time as the models give it, where it may be
        slower than on a GPU it beats on every spec number (``timing/dominance.py``).
        The trace does not depend on ``grad_accum``: accumulation is a replay option.
        """
        if not isinstance(step, StepSpec):  # dataclasses.replace's TypeError had said nothing
            raise InvalidInputError(
                f"Session.evaluate takes a StepSpec (boom_ml.StepSpec(batch_size=32, ...)),"
                f" got {type(step).__name__} {step!r}"
            )
        # a mapping of stack.* keys, as predict(stack=...) takes (it had failed on a dict)
        stack = stack if isinstance(stack, Stack) else resolve_stack(stack)
        # what predict() refuses, refused here too (a hunt: a fused Lion, finetune_method
        # "full" with lora_r=16, had been predicted)
        step = _resolved_impl(step, stack)
        if problem := finetune_problem(step):
            raise InvalidInputError(problem)
        # what predict's gpu= takes: ids, aliases, YAML paths, "all", lists of them (a hunt:
        # "all" and "l4,t4" had been unknown GPUs, a Path a TypeError); a list gives one
        # result per item, in order ("all" its every GPU)
        gpus = _gpu_items(gpus)
        traced = replace(step, grad_accum=1, sdpa_group=None)
        # One trace per attention architecture group in the list whose kernels differ (only
        # one when the model calls no SDPA); results stay in the user's order.
        groups = [sdpa_group(spec.sm_version, stack) for spec in gpus]
        first = _first(groups)  # traced first: a flash group's trace serves cuDNN groups too
        self._first_group.setdefault(traced, groups[0] if groups else first)
        # Traces known in advance run in workers beside this one: the batch search's second
        # batch, then the other attention groups (once the first trace shows SDPA calls).
        steps = [traced]
        if max_batch:
            steps.append(replace(traced, batch_size=scaling_pairs(step.batch_size)[0][1]))
            self.prefetch([replace(steps[1], sdpa_group=first)])
        others = _distinct(self.graph_for(traced, first, first), [first, *groups])[1:]
        self.prefetch(replace(s, sdpa_group=g) for g in others for s in steps)
        buckets: dict[int, tuple[OpGraph, str, list[int]]] = {}
        for k, group in enumerate(groups):
            graph = self.graph_for(traced, group, first)
            buckets.setdefault(id(graph), (graph, group, []))[2].append(k)
        graphs: dict[int, OpGraph] = {}
        memories: dict[int, Any] = {}
        times: dict[int, TimeEstimate] = {}
        tf32 = Tf32(*step.tf32_switches())
        for graph, group, members in buckets.values():
            # other batch sizes: this group's own trace where it has one, else the trace
            # that serves it or is re-expressed for it (no SDPA: the first group's)
            probe = group if _uses_sdpa(graph) and group in others else first

            def trace_at(batch: int, group: str = group, probe: str = probe) -> OpGraph:
                return self.graph_for(replace(traced, batch_size=batch), group, probe)

            for k in members:
                spec, graphs[k] = gpus[k], graph
                memory = estimate_memory(graph, spec, stack=stack, grad_accum=step.grad_accum)
                found = _largest_batch(graph, spec, trace_at, stack, step) if max_batch else None
                if isinstance(found, str):
                    memory.max_batch_error = found
                elif found is not None:
                    memory.max_batch_size = found.batch_size
                    memory.max_batch_lower_bound = found.capped
                memories[k] = memory
            # Time for the bucket's GPUs in one call (one GNN pass, one LightGBM call per head).
            timed = [k for k in members if memories[k].fits or not time_unless_oom]
            estimates = estimate_times(
                graph, [gpus[k] for k in timed], tf32=tf32, dominance=dominance
            )
            if step.grad_accum > 1 and step.zero_grad == "set_to_none":
                # micro-batches 2..N add into the gradients the first one left
                adds = gradient_adds_ms(graph, [gpus[k] for k in timed], tf32)
                estimates = [
                    replace(e, accumulate_ms=a) for e, a in zip(estimates, adds, strict=True)
                ]
            times.update(zip(timed, estimates, strict=True))
        results = []
        bf16 = "bf16" in (step.amp, step.params_dtype)
        for k, spec in enumerate(gpus):
            memory, time, graph = memories[k], times.get(k), graphs[k]
            if time is not None and bf16:
                time = replace(time, bf16_tensor_cores=spec.bf16_tensor_cores)
            if time is not None and (sdpa := graph.meta.get("sdpa") or {}).get("backends"):
                time = replace(time, attention_backends=dict(sdpa["backends"]))
            notes = graph.meta.get("method_notes") or []
            if notes:  # what is modelled analytically (QLoRA's NF4, bitsandbytes optimizers)
                memory = replace(memory, method=f"{memory.method} ({'; '.join(notes)})")
                time = (
                    None
                    if time is None
                    else replace(time, method=f"{time.method} ({'; '.join(notes)})")
                )
            results.append(
                GpuPrediction(
                    gpu=spec.id,
                    name=spec.name,
                    memory=memory,
                    time=None if time is None else accumulated(time, step.grad_accum),
                    price_usd_per_hour=spec.price_usd_per_hour,
                    stack_missing=stack_missing(stack, spec),
                    samples=step.batch_size * step.grad_accum,
                )
            )
        return results


def _resolved_impl(step: StepSpec, stack: Stack | None) -> StepSpec:
    """``step`` keyed as predict() keys it (``stack.step_optimizer_impl``): a Session had
    traced and cached the same step apart from predict (a hunt), and under another stack
    traced the installed PyTorch's choice."""
    impl = step_optimizer_impl(step.optimizer, step.optimizer_impl, stack)
    return step if impl == step.optimizer_impl else replace(step, optimizer_impl=impl)


def _gpu_items(gpus: Any) -> list[GpuSpec]:
    """The GPUs of each item of a list, duplicates kept; anything else as predict's gpu=."""
    if isinstance(gpus, (list, tuple)):
        return [spec for item in gpus for spec in parse_gpu_list(item)]
    return parse_gpu_list(gpus)


def _serves(graph: OpGraph, group: str) -> bool:
    """Whether tracing for ``group`` would give ``graph`` again: no SDPA call, or each call
    picks the same kernel there."""
    return not _uses_sdpa(graph) or same_backends(graph.meta["sdpa"], group)


def _first(groups: list[str]) -> str:
    """The group to trace first: the first GPU's, unless it runs cuDNN attention and another
    GPU does not (a flash group's trace can be re-expressed for cuDNN, not the reverse)."""
    return trace_order(groups)[0] if groups else DEFAULT_GROUP


def _distinct(graph: OpGraph | None, groups: list[str]) -> list[str]:
    """``groups`` in order, less each whose SDPA kernels for ``graph``'s calls are those of
    an earlier one (they share a trace) or whose trace an earlier one's is re-expressed as
    (``cudnn_from_flash``); only the first when the model calls no SDPA."""
    if graph is None or not _uses_sdpa(graph):
        return groups[:1]
    sdpa = graph.meta["sdpa"]
    out: list[str] = []
    for group in groups:
        kernels = backends(sdpa, group)
        if not any(
            kernels == backends(sdpa, g) or derivable({**sdpa, "group": g}, group) for g in out
        ):
            out.append(group)
    return out


def _dtypes(step: StepSpec | dict[str, Any]) -> tuple[Any, ...]:
    """What a step's SDPA kernels depend on besides the GPU: the dtypes of its tensors."""
    fields = step.to_dict() if isinstance(step, StepSpec) else step
    return fields["amp"], fields["params_dtype"], fields["finetune_method"]


def _uses_sdpa(graph: OpGraph) -> bool:
    """Whether the traced model called SDPA (graph meta "sdpa"; a graph without it: whether
    it has attention-family nodes)."""
    sdpa = graph.meta.get("sdpa")
    if sdpa:
        return int(sdpa.get("calls", 0)) > 0
    return bool((graph.nodes["family"] == "attention").any())


def _largest_batch(
    graph: OpGraph, gpu: GpuSpec, trace_at: TraceFn, stack: Stack, step: StepSpec
) -> MaxBatch | str:
    """The search's answer, or why it has none (a batch size the model refuses to trace,
    say: the estimate at the asked batch stands, and the table says why)."""
    try:
        with progress.task(f"searching the largest batch that fits on {gpu.id}"):
            return max_batch_size(graph, gpu, trace_at, stack, step.grad_accum > 1)
    except Exception as err:  # noqa: BLE001 - a failed re-trace must not lose the estimate
        logging.getLogger(__name__).warning("max batch size search failed: %s", err)
        if one_value_per_channel(err):  # the search probes batch 1 only below 2's failure
            # (a hunt: deeplabv3 at 1400 px on a T4 had been told to try a larger image)
            return (
                "no batch of 2 or more fits, and one sample leaves a BatchNorm one value per"
                " channel, which training refuses"
            )
        return (str(err).strip().splitlines() or [type(err).__name__])[0]


def accumulated(time: TimeEstimate, grad_accum: int) -> TimeEstimate:
    """One optimizer step of ``grad_accum`` micro-batches: forward and backward run once per
    micro-batch, each after the first adding into the kept gradients (``accumulate_ms``, set
    when the trace is a first micro-batch), zero_grad and the optimizer once.
    ``micro_step_ms`` keeps one micro-batch's time without them; ``by_phase`` is the step's,
    so it adds up to ``step_ms`` as without accumulation; ``by_family`` and the top lists stay
    one micro-batch and the optimizer's; p10 / p90 keep their ratio to the step."""
    once_ms = time.by_phase.get("optimizer", 0.0) + time.by_phase.get("zero_grad", 0.0)
    micro = time.step_ms - once_ms
    if grad_accum == 1:
        return replace(time, micro_step_ms=micro)
    adds = (grad_accum - 1) * time.accumulate_ms  # the later micro-batches' gradient adds
    step_ms = grad_accum * micro + adds + once_ms

    def scale(bound: float | None) -> float | None:
        # the interval is calibrated as a ratio to the step (log(measured / estimated)), so
        # it keeps that ratio: shifting it by the optimizer's median would skew it
        return None if bound is None or time.step_ms <= 0 else bound * step_ms / time.step_ms

    once = ("optimizer", "zero_grad")
    return replace(
        time,
        step_ms=step_ms,
        p10_ms=scale(time.p10_ms),
        p90_ms=scale(time.p90_ms),
        per_op_ms=scale(time.per_op_ms),
        micro_step_ms=micro,
        by_phase={
            k: v if k in once else grad_accum * v + (adds if k == "backward" else 0.0)
            for k, v in time.by_phase.items()
        },
        overhead_ms=grad_accum * time.overhead_ms,
    )
