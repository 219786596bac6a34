"""predict(): the one place where zoo → trace → {memory, timing} → result meet."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from boom_ml import progress
from boom_ml.errors import InvalidInputError
from boom_ml.estimates import GpuPrediction, Prediction, TimeEstimate
from boom_ml.gpus import parse_gpu_list
from boom_ml.gpus.spec import GpuSpec
from boom_ml.max_batch import TraceFn, max_batch_size
from boom_ml.memory.estimate import estimate_memory
from boom_ml.parallel.layout import Cluster, Layout
from boom_ml.parallel.layout import validate as validate_layout
from boom_ml.parallel.search import search_layouts_many
from boom_ml.report.advisor import advise, advise_layouts
from boom_ml.report.plot_dir import check_plot_dir
from boom_ml.specs import MAX_BATCH_AUTO_GPUS, ModelSpec, StepSpec, search_max_batch
from boom_ml.stack import Stack, resolve_optimizer_impl, resolve_stack
from boom_ml.timing.estimate import estimate_times
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.sdpa_select import DEFAULT_GROUP, same_backends, sdpa_group
from boom_ml.trace_cache import TraceCache


class Session:
    """One model under study: traces cached per step configuration.

    Tracing dominates the cost of a prediction, and the advisor asks about several
    variants of the same step, so each distinct StepSpec is traced once.
    """

    def __init__(
        self, model: str, cache: bool = True, options: dict[str, Any] | None = None
    ) -> None:
        self.model = ModelSpec(model, dict(options or {}))
        # The model is built on the first cache miss (an unknown model fails there, before
        # any trace): a graph from the on-disk cache needs no model library at all.
        self._cache = TraceCache() if cache else None
        self._graphs: dict[StepSpec, OpGraph] = {}
        # step (sdpa_group None) -> the attention group evaluate() traced it for first, and
        # the graph of a step whose model calls no SDPA (the same for every GPU)
        self._first_group: dict[StepSpec, str] = {}
        self._no_sdpa: dict[StepSpec, OpGraph] = {}
        self._sdpa_graphs: dict[StepSpec, list[OpGraph]] = {}  # traced for other groups

    def graph(self, step: StepSpec) -> OpGraph:
        if step.sdpa_group is None and step in self._first_group:
            step = replace(step, sdpa_group=self._first_group[step])  # evaluate()'s first GPU's
        if step not in self._graphs:
            graph = self._cache.get(self.model, step) if self._cache is not None else None
            # The on-disk cache is keyed by group; a step cached for the default group serves
            # another group where the trace would not differ (no SDPA, the same kernels).
            default = replace(step, sdpa_group=DEFAULT_GROUP)
            other = step.sdpa_group not in (None, DEFAULT_GROUP)
            if graph is None and other and self._cache is not None:
                graph = self._cache.get(self.model, default)
                if graph is not None and not _serves(graph, step.sdpa_group):
                    graph = None
            if graph is None:
                # Model libraries and the tracer (~1 s of imports) only on a cache miss.
                from boom_ml.trace.step import trace_step
                from boom_ml.zoo import build_model

                # trace_step materialises and may checkpoint the module: a fresh build each time
                graph = trace_step(build_model(self.model), step)
                if self._cache is not None:
                    self._cache.put(self.model, step, graph)
                    if other and _serves(graph, DEFAULT_GROUP):
                        self._cache.put(self.model, default, graph)
            self._graphs[step] = graph
        return self._graphs[step]

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
        # the same kernel here (sm80 and sm86 both run flash for head dim 128, say).
        for done in [graph, *self._sdpa_graphs.get(key, [])]:
            if _serves(done, group):
                return done
        graph = self.graph(replace(step, sdpa_group=group))
        self._sdpa_graphs.setdefault(key, []).append(graph)
        return graph

    def evaluate(
        self,
        step: StepSpec,
        gpus: list[GpuSpec],
        stack: Stack | None = None,
        max_batch: bool = False,
        time_unless_oom: bool = False,
    ) -> list[GpuPrediction]:
        """Memory and time of ``step`` on each GPU; ``max_batch`` adds the batch search.

        With ``time_unless_oom`` the time is only predicted where the step fits (the
        advisor's candidates that do not fit need no time); elsewhere it is ``None``.
        The trace does not depend on ``grad_accum``: accumulation is a replay option.
        """
        stack = stack if stack is not None else resolve_stack()
        traced = replace(step, grad_accum=1, sdpa_group=None)
        # One trace per attention architecture group in the list, the first GPU's first
        # (and only that one when the model calls no SDPA); results stay in the user's order.
        groups = [sdpa_group(spec.sm_version, stack) for spec in gpus]
        first = groups[0] if groups else DEFAULT_GROUP
        self._first_group.setdefault(traced, first)
        buckets: dict[int, tuple[OpGraph, str, list[int]]] = {}
        for k, group in enumerate(groups):
            graph = self.graph_for(traced, group, first)
            buckets.setdefault(id(graph), (graph, group, []))[2].append(k)
        graphs: dict[int, OpGraph] = {}
        memories: dict[int, Any] = {}
        times: dict[int, TimeEstimate] = {}
        tf32 = Tf32(*step.tf32_switches())
        for graph, group, members in buckets.values():
            # other batch sizes: this group's own trace, unless the model calls no SDPA
            probe = group if _uses_sdpa(graph) else first

            def trace_at(batch: int, group: str = group, probe: str = probe) -> OpGraph:
                return self.graph_for(replace(traced, batch_size=batch), group, probe)

            for k in members:
                spec, graphs[k] = gpus[k], graph
                memory = estimate_memory(graph, spec, stack=stack, grad_accum=step.grad_accum)
                if max_batch:
                    memory.max_batch_size = _largest_batch(graph, spec, trace_at, stack, step)
                memories[k] = memory
            # Time for the bucket's GPUs in one call (one GNN pass, one LightGBM call per head).
            timed = [k for k in members if memories[k].fits or not time_unless_oom]
            estimates = estimate_times(graph, [gpus[k] for k in timed], tf32=tf32)
            times.update(zip(timed, estimates, strict=True))
        results = []
        for k, spec in enumerate(gpus):
            memory, time, graph = memories[k], times.get(k), graphs[k]
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
                )
            )
        return results


def _serves(graph: OpGraph, group: str) -> bool:
    """Whether tracing for ``group`` would give ``graph`` again: no SDPA call, or each call
    picks the same kernel there."""
    return not _uses_sdpa(graph) or same_backends(graph.meta["sdpa"], group)


def _uses_sdpa(graph: OpGraph) -> bool:
    """Whether the traced model called SDPA (graph meta "sdpa"; a graph without it: whether
    it has attention-family nodes)."""
    sdpa = graph.meta.get("sdpa")
    if sdpa:
        return int(sdpa.get("calls", 0)) > 0
    return bool((graph.nodes["family"] == "attention").any())


def _largest_batch(
    graph: OpGraph, gpu: GpuSpec, trace_at: TraceFn, stack: Stack, step: StepSpec
) -> int | None:
    try:
        with progress.task(f"searching the largest batch that fits on {gpu.id}"):
            return max_batch_size(graph, gpu, trace_at, stack, step.grad_accum > 1).batch_size
    except Exception as err:  # noqa: BLE001 - a failed re-trace must not lose the estimate
        logging.getLogger(__name__).warning("max batch size search failed: %s", err)
        return None


def accumulated(time: TimeEstimate, grad_accum: int) -> TimeEstimate:
    """One optimizer step of ``grad_accum`` micro-batches: forward and backward run once per
    micro-batch, zero_grad and the optimizer once (``micro_step_ms`` keeps one micro-batch's
    time without them)."""
    once_ms = time.by_phase.get("optimizer", 0.0) + time.by_phase.get("zero_grad", 0.0)
    micro = time.step_ms - once_ms
    if grad_accum == 1:
        return replace(time, micro_step_ms=micro)

    def scale(v: float | None) -> float | None:
        return None if v is None else grad_accum * (v - once_ms) + once_ms

    return replace(
        time,
        step_ms=scale(time.step_ms),
        p10_ms=scale(time.p10_ms),
        p90_ms=scale(time.p90_ms),
        micro_step_ms=micro,
    )


def predict(
    model: str,
    gpu: str | Sequence[str] = "a100-80gb-sxm",
    batch_size: int = 1,
    seq_len: int | None = None,
    image_size: int | None = None,
    optimizer: str = "adamw",
    amp: str = "none",
    checkpointing: str = "none",
    tf32: bool = False,
    tf32_matmul: bool | None = None,
    tf32_cudnn: bool | None = None,
    advice: bool = True,
    plot: str | None = None,
    cache: bool = True,
    stack: dict[str, Any] | None = None,
    optimizer_impl: str = "auto",
    grad_accum: int = 1,
    zero_grad: str = "set_to_none",
    channels_last: bool = False,
    attention: str = "sdpa",
    moe: dict[str, Any] | None = None,
    parallel: dict[str, Any] | None = None,
    cluster: dict[str, Any] | None = None,
    params_dtype: str = "fp32",
    finetune: dict[str, Any] | None = None,
    checkpointing_every: int = 1,
    max_batch: str | bool = "auto",
) -> Prediction:
    """Predict memory and step time of one training step of ``model`` on each GPU in ``gpu``.

    ``gpu`` is an id, alias, YAML path, a list of those, or ``"all"``. With ``advice``,
    every GPU where the step does not fit gets the cheapest changes that make it fit.
    With ``plot``, PNG figures are written to that directory (``Prediction.plots``).
    ``stack`` names the software stack (keys of :class:`boom_ml.stack.Stack`; default:
    the installed torch with PyTorch's defaults); ``optimizer_impl`` the optimizer's
    implementation (auto = what that stack's PyTorch picks); ``grad_accum`` the
    micro-batches per optimizer step; ``zero_grad`` how gradients are cleared before it
    (set_to_none, PyTorch 2's default, or zero: kept and zeroed in place, PyTorch 1.x's
    default). ``channels_last``: convolutions on NHWC tensors (no cuDNN layout transforms
    around tensor-core convolutions). ``attention`` is the HF attention implementation
    (sdpa or eager); ``moe`` holds ``imbalance`` (>= 1: the busiest expert's share of
    tokens relative to even routing). ``params_dtype`` (fp32 | bf16 | fp16) is the dtype of
    the parameters, gradients and optimizer state; ``finetune`` holds ``method`` (full |
    lora | qlora), ``r``, ``alpha``, ``dropout``, ``targets`` and ``double_quant``;
    ``checkpointing_every`` checkpoints every K-th block.
    ``tf32_matmul`` / ``tf32_cudnn`` are PyTorch's TF32 switches (None: on with ``tf32``,
    else PyTorch's defaults: matmuls off, cuDNN convolutions on).
    With ``cache`` (default), traced steps are reused from and stored in the on-disk
    cache (:mod:`boom_ml.trace_cache`); ``cache=False`` traces afresh and stores nothing.
    ``max_batch`` (auto | on | off, or a bool): search the largest batch that fits on each
    GPU; auto does for up to ``specs.MAX_BATCH_AUTO_GPUS`` GPUs.
    """
    software = resolve_stack(stack)
    StepSpec(optimizer=optimizer, optimizer_impl=optimizer_impl)  # one-line errors first
    step = StepSpec(
        batch_size=batch_size,
        seq_len=seq_len,
        image_size=image_size,
        optimizer=optimizer,
        amp=amp,
        checkpointing=checkpointing,
        tf32=tf32,
        tf32_matmul=tf32_matmul,
        tf32_cudnn=tf32_cudnn,
        optimizer_impl=_impl(optimizer, optimizer_impl, software),
        grad_accum=grad_accum,
        zero_grad=zero_grad,
        channels_last=channels_last,
        params_dtype=params_dtype,
        checkpointing_every=checkpointing_every,
        **finetune_fields(finetune),
    )
    gpus = parse_gpu_list(gpu)  # validate before the (slower) trace
    layout, nodes = Layout(**(parallel or {})), Cluster(**(cluster or {}))
    validate_layout(layout, nodes)
    if not layout.is_single:
        return _predict_parallel(model, gpus, step, layout, nodes, software)
    if plot is not None:
        check_plot_dir(plot)
    options = {"attn_implementation": attention, "moe_imbalance": (moe or {}).get("imbalance", 1.0)}
    session = Session(model, cache=cache, options=options)
    search = search_max_batch(max_batch, len(gpus))
    results = session.evaluate(step, gpus, software, max_batch=search)
    graph = session.graph(replace(step, grad_accum=1))
    resolved = replace(StepSpec(**graph.meta["step"]), grad_accum=grad_accum)
    advised, layout_advice = {}, {}
    if advice:
        failing = [(s, r) for s, r in zip(gpus, results, strict=True) if not r.fits]
        evaluate = partial(session.evaluate, stack=software, time_unless_oom=True)
        # recipes cost traces per attention group: tried for as many GPUs as max_batch=auto
        trainable = (graph.meta.get("recipe") or {}).get("bytes", {}).get("trainable_parameters")
        advised = advise(
            resolved, failing, evaluate, len(gpus) <= MAX_BATCH_AUTO_GPUS, gradient_bytes=trainable
        )
        # where nothing fits on one GPU: the cheapest multi-GPU layouts (boom_ml/parallel/search.py)
        search = partial(search_layouts_many, model, cluster=nodes, stack=software)
        checkpointed = replace(resolved, checkpointing="full")
        layout_advice = advise_layouts(
            advised,
            gpus,
            partial(search, step=resolved),
            partial(search, step=checkpointed) if resolved.checkpointing == "none" else None,
        )
    prediction = Prediction(
        model=session.model.text,
        batch_size=batch_size,
        step={**graph.meta["step"], "grad_accum": grad_accum},
        graph={
            "num_ops": graph.num_ops,
            "flops": graph.flops,
            "num_parameters": graph.meta["num_parameters"],
            "num_trainable_parameters": graph.meta.get("num_trainable_parameters"),
            "recipe": graph.meta.get("recipe", {}),
            "trace_seconds": graph.meta["trace_seconds"],
            "trace_from_cache": bool(graph.meta.get("from_cache", False)),
            "unknown_ops": graph.unknown_ops,
        },
        gpus=results,
        advice=advised,
        layout_advice=layout_advice,
    )
    if plot is not None:
        from boom_ml.report.figures import write_plots  # matplotlib: only when asked

        prediction.plots = [str(p) for p in write_plots(prediction, graph, gpus, plot)]
    return prediction


FINETUNE_KEYS = {
    "method": "finetune_method",
    "r": "lora_r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "targets": "lora_targets",
    "double_quant": "double_quant",
}


def finetune_fields(finetune: dict[str, Any] | None) -> dict[str, Any]:
    """StepSpec fields from the ``finetune`` mapping (None values keep the defaults)."""
    finetune = dict(finetune or {})
    unknown = sorted(set(finetune) - set(FINETUNE_KEYS))
    if unknown:
        raise InvalidInputError(
            f"unknown finetune option(s): {', '.join(unknown)}; known: {', '.join(FINETUNE_KEYS)}"
        )
    fields = {FINETUNE_KEYS[k]: v for k, v in finetune.items() if v is not None}
    if isinstance(fields.get("lora_targets"), str):  # finetune.targets=q_proj
        fields["lora_targets"] = [fields["lora_targets"]]
    return fields


def _impl(optimizer: str, impl: str, stack: Stack) -> str:
    resolved = resolve_optimizer_impl(optimizer, impl, stack)
    return "auto" if resolved == "none" else resolved


def _predict_parallel(
    model: str, gpus: list[GpuSpec], step: StepSpec, layout: Layout, nodes: Cluster, stack: Stack
) -> Prediction:
    """A multi-GPU layout: worst-rank memory and step time per GPU (``boom_ml.parallel``)."""
    from boom_ml.parallel.predict import predict_parallel

    out = predict_parallel(model, gpus, step, layout, nodes, stack=stack)
    return Prediction(
        model=model,
        batch_size=step.batch_size,
        step=step.to_dict(),
        graph={},
        gpus=[],
        parallel=out,
    )
