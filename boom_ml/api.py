"""predict(): the one place where zoo → trace → {memory, timing} → result meet."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import Any

from boom_ml.errors import InvalidInputError
from boom_ml.estimates import Prediction
from boom_ml.gpus import parse_gpu_list
from boom_ml.gpus.spec import GpuSpec
from boom_ml.hf_notices import quiet_transformers
from boom_ml.parallel.layout import (
    Cluster,
    Layout,
    as_one_gpu,
    check_checkpoint_every,
    check_cluster_keys,
    for_parallel_step,
    unread_cluster_keys,
)
from boom_ml.parallel.layout import validate as validate_layout
from boom_ml.parallel.links import intra_link
from boom_ml.parallel.search import search_layouts_many
from boom_ml.parallel.shard import config_facts
from boom_ml.plain_arguments import plain_arguments
from boom_ml.report.advisor import advise, advise_layouts, layouts_that_fit
from boom_ml.report.plot_dir import check_plot_dir, check_plot_path
from boom_ml.session import Session
from boom_ml.specs import (
    ATTENTION_CHOICES,
    MAX_BATCH_AUTO_GPUS,
    ModelSpec,
    StepSpec,
    cache_setting,
    check_bool,
    check_choice,
    check_model_options,
    check_model_syntax,
    check_number,
    finetune_fields,
    max_batch_setting,
    search_max_batch,
)
from boom_ml.stack import Stack, resolve_stack, stack_missing, step_optimizer_impl
from boom_ml.timing.conv_layout import TENSOR_CORE_SM, has_channels_last_convolutions
from boom_ml.timing.library_calls import is_rnn
from boom_ml.trace.graph import reads_dtype

__all__ = ["Session", "finetune_fields", "predict"]


# the CLI's keys that are no argument of the API: where their job is done instead
JSON_HINT = "the result is a Prediction; result.to_dict() is the JSON document"
NOT_ARGUMENTS = {
    "output": JSON_HINT,
    "format": JSON_HINT,
    "explain": "boom_ml.report.table.render_table(result, explain=True) prints it",
}


@quiet_transformers
@plain_arguments(hints=NOT_ARGUMENTS)
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
    master_weights: bool = False,
    finetune: dict[str, Any] | None = None,
    checkpointing_every: int = 1,
    max_batch: str | bool = "auto",
    model_options: dict[str, Any] | None = None,
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
    the parameters, gradients and optimizer state; ``master_weights`` (16-bit
    ``params_dtype``, ``amp="none"``): the optimizer steps fp32 copies of them (Megatron-LM,
    DeepSpeed); ``finetune`` holds ``method`` (full |
    lora | qlora), ``r``, ``alpha``, ``dropout``, ``targets``, ``double_quant`` and
    ``adapter_dtype`` (fp32, peft's default, or params: the base layer's dtype);
    ``checkpointing_every`` checkpoints every K-th block.
    ``tf32_matmul`` / ``tf32_cudnn`` are PyTorch's TF32 switches (None: on with ``tf32``,
    else PyTorch's defaults: matmuls off, cuDNN convolutions on).
    With ``cache`` (default), traced steps are reused from and stored in the on-disk
    cache (:mod:`boom_ml.trace_cache`); ``cache=False`` traces afresh and stores nothing.
    ``max_batch`` (auto | on | off, or a bool): search the largest batch that fits on each
    GPU; auto does for up to ``specs.MAX_BATCH_AUTO_GPUS`` GPUs. ``model_options`` are what
    the model is built with: torchvision / timm / file-factory keyword arguments, or hf
    config fields (``{"aux_logits": False}``, ``{"num_hidden_layers": 12}``).
    """
    check_bool("advice", advice)
    check_model_syntax(model)  # the CLI's check: a type, a typo in the scheme, a file path
    model = model.strip()
    cache = cache_setting(cache)
    for name, value in (("stack", stack), ("moe", moe), ("parallel", parallel),
                        ("cluster", cluster), ("finetune", finetune),
                        ("model_options", model_options)):  # fmt: skip
        if value is not None and not isinstance(value, Mapping):
            raise InvalidInputError(f"{name} must be a mapping of its options, got {value!r}")
    check_model_options(model_options)
    check_choice("attention", attention, ATTENTION_CHOICES)
    if plot is not None:
        check_plot_path(plot)  # a path; the directory is made and checked before the trace
    software = resolve_stack(stack)
    StepSpec(optimizer=optimizer, optimizer_impl=optimizer_impl)  # one-line errors first
    layout, nodes = _checked(Layout, parallel, "parallel"), _checked(Cluster, cluster, "cluster")
    one_gpu, grad_accum = as_one_gpu(layout, grad_accum)  # one GPU's micro-batches: grad_accum
    micro_key = one_gpu != layout  # the user's spelling, which the advice's options keep
    layout = one_gpu
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
        optimizer_impl=step_optimizer_impl(optimizer, optimizer_impl, software),
        grad_accum=grad_accum,
        zero_grad=zero_grad,
        channels_last=channels_last,
        params_dtype=params_dtype,
        master_weights=master_weights,
        checkpointing_every=checkpointing_every,
        **finetune_fields(finetune),
    )
    gpus = parse_gpu_list(gpu)  # validate before the (slower) trace
    layout = for_parallel_step(layout, grad_accum=grad_accum,
                               max_batch_on=max_batch_setting(max_batch) == "on")  # fmt: skip
    # a shipped or local HF config's heads and layers: a tp or pp it cannot take, before torch
    facts = {} if layout.is_single else config_facts(model)
    validate_layout(layout, nodes, **facts, finetune_method=step.finetune_method,
                    optimizer=step.optimizer)  # fmt: skip
    check_cluster_keys(layout, nodes, advice)
    if not layout.is_single:
        check_checkpoint_every(step.checkpointing, step.checkpointing_every)
    if not layout.is_single:  # the links each GPU needs (cluster.intra=nvlink), before a trace
        for spec in gpus:
            intra_link(nodes, spec.id, spec.name, spec.architecture,
                       min(layout.world, nodes.gpus_per_node))  # fmt: skip
    options = {**dict(model_options or {}), "attn_implementation": attention,
               "moe_imbalance": _moe_imbalance(moe)}  # fmt: skip
    if plot is not None:
        check_plot_dir(plot)
    if not layout.is_single:
        return _predict_parallel(model, gpus, step, layout, nodes, software, options,
                                 cache=cache, advice=advice, plot=plot)  # fmt: skip
    session = Session(model, cache=cache, options=options)
    search = search_max_batch(max_batch, len(gpus))
    results = session.evaluate(step, gpus, software, max_batch=search)
    graph = session.graph(replace(step, grad_accum=1))
    resolved = replace(StepSpec(**graph.meta["step"]), grad_accum=grad_accum)
    advised, layout_advice = {}, {}
    if advice:
        failing = [(s, r) for s, r in zip(gpus, results, strict=True) if not r.fits]
        # candidates timed as the models give them: the dominance bound would time every
        # GPU each one beats, for every candidate
        evaluate = partial(session.evaluate, stack=software, time_unless_oom=True, dominance=False)
        # recipes cost traces per attention group: tried for as many GPUs as max_batch=auto
        trainable = (graph.meta.get("recipe") or {}).get("bytes", {}).get("trainable_parameters")
        advised = advise(
            resolved,
            failing,
            evaluate,
            len(gpus) <= MAX_BATCH_AUTO_GPUS,
            gradient_bytes=trainable,
            prefetch=partial(session.prefetch_for, stack=software),
        )
        if micro_key:  # grad_accum= beside parallel.microbatches= is refused
            advised = {g: [replace(a, options={("parallel.microbatches" if k == "grad_accum"
                                                 else k): v for k, v in a.options.items()},
                                   arguments=_as_microbatches(a.arguments))
                           for a in items] for g, items in advised.items()}  # fmt: skip
        # where nothing fits on one GPU: the cheapest multi-GPU layouts (boom_ml/parallel/search.py)
        search = partial(search_layouts_many, model, cluster=nodes, stack=software,
                         options=options)  # fmt: skip
        checkpointed = replace(resolved, checkpointing="full")
        # cache=off stores nothing: the rank profiles in a folder for the call (a hunt: they
        # had been written to and read from the disk cache), as a layout's own prediction does
        from boom_ml.parallel.shard import scratch_cache

        with nullcontext() if cache else scratch_cache():
            layout_advice = advise_layouts(
                advised,
                gpus,
                partial(search, step=resolved),
                partial(search, step=checkpointed) if resolved.checkpointing == "none" else None,
            )
    name = _scheme_name(session.model)  # a bare name as its scheme names it (hf:gpt2)
    prediction = Prediction(
        model=name,
        batch_size=batch_size,
        max_batch=max_batch_setting(max_batch),
        step={**graph.meta["step"], "grad_accum": grad_accum},
        graph={
            "num_ops": graph.num_ops,
            "flops": graph.flops,
            "num_parameters": graph.meta["num_parameters"],
            "num_trainable_parameters": graph.meta.get("num_trainable_parameters"),
            "recipe": graph.meta.get("recipe", {}),
            "trace_seconds": graph.meta["trace_seconds"],
            "trace_from_cache": bool(graph.meta.get("from_cache", False)),
            # a deep model traced shallow, one layer repeated (trace/repeat.py); else None
            "repeated_layers": graph.meta.get("repeated_layers"),
            # settings the step never reads (seq_len for a CNN, checkpointing.every without
            # checkpointing)
            "unread": {
                k: getattr(step, k)
                for k in ("seq_len", "image_size")
                if getattr(step, k) and graph.meta["step"].get(k) is None
            }  # fmt: skip
            # channels_last lays out 2-D and 3-D convolutions' tensors: a model without one
            # ignores it
            | (
                {"channels_last": True}
                if step.channels_last and not has_channels_last_convolutions(graph.nodes)
                else {}
            )
            | (
                {"checkpointing.every": step.checkpointing_every}
                if step.checkpointing_every > 1 and step.checkpointing == "none"
                else {}
            )
            | (
                {"optimizer.impl": optimizer_impl}
                if optimizer == "none" and optimizer_impl != "auto"
                else {}
            )
            | _cudnn_unread(graph, step, software)
            # cluster.* with advice=true: read by a layout search, which no GPU needed
            | (
                unread_cluster_keys(layout, nodes)[0]
                # (the layout search takes hf: models alone: for others it never reads them)
                if advice and (all(r.fits for r in results) or not name.startswith("hf:"))
                else {}
            ),  # fmt: skip
            "unknown_ops": graph.unknown_ops,
            # what the zoo says of the model it built (hub code it did not run)
            "model_notes": graph.meta.get("model_notes", []) + _layout_notes(graph, step),
            # the attention implementation the hf model was built with (None: not an hf model)
            "attention": graph.meta.get("attention"),
        },
        gpus=results,
        advice=advised,
        layout_advice=layout_advice,
    )
    if plot is not None:
        from boom_ml.report.figures import write_plots  # matplotlib: only when asked

        prediction.plots = [
            str(p)
            for p in write_plots(
                prediction, graph, gpus, plot, stack=software, grad_accum=grad_accum
            )
        ]
    return prediction


def _as_microbatches(arguments: dict[str, Any]) -> dict[str, Any]:
    """An advice's ``grad_accum`` as ``parallel={"microbatches": n}``, for a call that names
    its micro-batches so (``predict`` refuses both)."""
    if "grad_accum" not in arguments:
        return arguments
    out = {k: v for k, v in arguments.items() if k != "grad_accum"}
    return out | {"parallel": {"microbatches": arguments["grad_accum"]}}


def _cudnn_unread(graph: Any, step: StepSpec, software: Stack) -> dict[str, Any]:
    """tf32_cudnn given, or stack.cudnn_benchmark=true, on a model with no convolution and no
    cuDNN RNN: cuDNN runs none of its ops, so neither changes a number (the header had named
    the first)."""
    nodes = graph.nodes
    if nodes["family"].eq("conv").any() or any(map(is_rnn, nodes["op"].astype(str))):
        return {}
    out: dict[str, Any] = {}
    if step.tf32_cudnn is not None:
        out["tf32_cudnn"] = step.tf32_cudnn
    if software.cudnn_benchmark:
        out["stack.cudnn_benchmark"] = True
    return out


def _layout_notes(graph: Any, step: StepSpec) -> list[str]:
    """channels_last=true on a step whose convolutions are all fp32 (TF32): the same time and
    memory as NCHW, where only fp16/bf16 tensor-core ones lose transforms (timing/conv_layout)."""
    if not step.channels_last or not has_channels_last_convolutions(graph.nodes):
        return []  # a Conv1d model is told channels_last is not used (the table's line)
    convs = graph.nodes[graph.nodes["family"].eq("conv")]
    if reads_dtype(convs, TENSOR_CORE_SM).any():
        return []
    return [
        "channels_last=true changes nothing here: the step's convolutions are fp32 (TF32),"
        " timed without layout transforms in either layout; it saves the transforms around"
        " fp16/bf16 tensor-core convolutions (amp=bf16 or fp16)"
    ]


def _moe_imbalance(moe: dict[str, Any] | None) -> float:
    """``moe={"imbalance": x}`` (the only key), checked as the CLI's ``moe.imbalance``."""
    moe = dict(moe or {})
    unknown = sorted(set(moe) - {"imbalance"})
    if unknown:
        raise InvalidInputError(f"unknown moe option(s): {', '.join(unknown)}; known: imbalance")
    value = moe.get("imbalance", 1.0)
    check_number("moe.imbalance", value, 1.0, None)
    return float(value)


def _checked(kind: type, fields: dict[str, Any] | None, prefix: str) -> Any:
    """``Layout`` / ``Cluster`` from the API's mapping, unknown keys as one line."""
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(fields or {}) - known)
    if unknown:
        raise InvalidInputError(
            f"unknown {prefix} option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return kind(**(fields or {}))


def _scheme_name(spec: ModelSpec) -> str:
    """``scheme:name`` of a model spec; the zoo (torch, torchvision: seconds where the trace
    came from the cache) is imported only to look up a bare name."""
    if spec.scheme is not None:
        return spec.text
    from boom_ml.zoo import resolve_name

    return resolve_name(spec.text)


def _predict_parallel(
    model: str, gpus: list[GpuSpec], step: StepSpec, layout: Layout, nodes: Cluster,
    stack: Stack, options: dict[str, Any], cache: bool = True, advice: bool = True,
    plot: str | None = None,
) -> Prediction:  # fmt: skip
    """A multi-GPU layout: worst-rank memory and step time per GPU (``boom_ml.parallel``);
    with ``advice``, for each GPU where it does not fit, the cheapest layouts that do (the
    same search as a single-GPU step's, at the layout's micro-batch and micro-batch count);
    with ``plot``, the layout's pipeline timeline and stage memory as a PNG."""
    from boom_ml.parallel.predict import predict_parallel
    from boom_ml.parallel.shard import scratch_cache
    from boom_ml.zoo import resolve_name

    model = resolve_name(model)  # a bare name, as one GPU's trace reads it (hf:gpt2 for gpt2)
    with nullcontext() if cache else scratch_cache():
        out = predict_parallel(model, gpus, step, layout, nodes, stack=stack, options=options)
        for spec, entry in zip(gpus, out, strict=True):
            entry["stack_missing"] = stack_missing(stack, spec)
        layout_advice = {}
        failing = [g for g, entry in zip(gpus, out, strict=True) if not entry.get("fits", True)]
        if advice and failing:
            searched = replace(step, grad_accum=max(step.grad_accum, layout.microbatches))
            # priced per step of the layout's global batch: its data-parallel replicas' too
            search = partial(search_layouts_many, model, cluster=nodes, stack=stack,
                             options=options,
                             requested=searched.batch_size * searched.grad_accum * layout.dp)  # fmt: skip
            again = None
            if step.checkpointing == "none":
                again = partial(search, step=replace(searched, checkpointing="full"))
            layout_advice = layouts_that_fit(failing, partial(search, step=searched), again)
        keys, why = unread_cluster_keys(layout, nodes)
        if advice and not failing and keys:  # advice's layout search reads it; none ran
            for entry in out:
                entry.setdefault("notes", []).append(
                    f"cluster.inter={keys['cluster.inter']} not used: {why}, and advice=true"
                    " searches layouts, which read it, only where the layout does not fit"
                )
    resolved = step.to_dict()
    # the tokens the layout took, as a one-GPU step says the default it took: a vision
    # transformer's patches whatever seq_len says (its header had shown seq=512 and sent 197)
    if out and out[0].get("parallel", {}).get("seq_len"):
        resolved["seq_len"] = out[0]["parallel"]["seq_len"]
    prediction = Prediction(
        model=model,
        batch_size=step.batch_size,
        step=resolved,
        graph={},
        gpus=[],
        parallel=out,
        layout_advice=layout_advice,
    )
    if plot is not None:
        from boom_ml.report.advice_text import layout_name
        from boom_ml.report.figures import write_layout_plots  # matplotlib: only when asked

        title = f"{model}, batch {step.batch_size}, {layout_name(out[0]['parallel'])}"
        prediction.plots = [str(p) for p in write_layout_plots(prediction, plot, title)]
    return prediction
