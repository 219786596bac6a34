"""Terminal rendering of a Prediction: the GPU table, advice, and (with explain) attributions."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from boom_ml.estimates import MemoryEstimate, Prediction, rate_text, usd_text
from boom_ml.report.advice_text import advice_lines, layout_lines, layout_name
from boom_ml.report.explain import GIB, explain_lines
from boom_ml.report.explain_layout import layout_explain_lines
from boom_ml.report.layout_text import collective_lines, layout_recipe_line
from boom_ml.report.table_notes import (
    basis_line,
    bf16_line,
    count_text,
    half_line,
    methods_line,
    price_line,
    recipe_line,
    stack_label,
    stack_missing_lines,
    timed_as_line,
    unlike_line,
    zero_grad_line,
)
from boom_ml.specs import MAX_BATCH_AUTO_GPUS, tf32_switches

FIT_STYLE = {"yes": "yes", "tight": "[yellow]tight[/yellow]", "no": "[red]no[/red]"}
# a step that does not fit runs no samples and costs nothing: its rate and price had been
# printed beside "no" as if it ran (JSON keeps them, for the step's time as if it fit)
NO_RATE_LINE = (
    "samples/s and $ / 1k steps: - where the step does not fit (step ms: its time if the"
    " memory were there)"
)


def _title(prediction: Prediction) -> str:
    step = prediction.step
    return (
        f"{prediction.model}  batch={prediction.batch_size}"
        + (f"  seq={step['seq_len']}" if step.get("seq_len") else "")
        + (f"  image={step['image_size']}" if step.get("image_size") else "")
        + f"  opt={step['optimizer']}  amp={step['amp']}  ckpt={step['checkpointing']}"
        + (
            f"/every={step['checkpointing_every']}"
            if step.get("checkpointing_every", 1) > 1 and step["checkpointing"] != "none"
            else ""
        )
        + (
            f"  attn={attn}"
            if (attn := prediction.graph.get("attention")) not in (None, "sdpa")
            else ""
        )
        + (f"  ft={ft}" if (ft := step.get("finetune_method", "full")) != "full" else "")
        + (f"  params={step['params_dtype']}" if step.get("params_dtype", "fp32") != "fp32" else "")
        + ("+fp32 master" if step.get("master_weights") else "")
        + _tf32_label(step)
        + (f"  accum={step['grad_accum']}" if step.get("grad_accum", 1) > 1 else "")
    )


def _tf32_label(step: dict) -> str:
    """The TF32 switches where they differ from PyTorch's defaults (matmuls off, cuDNN on)."""
    matmul, cudnn = tf32_switches(step.get("tf32"), step.get("tf32_matmul"), step.get("tf32_cudnn"))
    if matmul and cudnn:
        return "  tf32"
    return ("  tf32-matmul" if matmul else "") + ("" if cudnn else "  no-tf32-cudnn")


def _peak(m: MemoryEstimate) -> str:
    """``total (p10–p90) / capacity`` in GiB; the range only where the bounds differ."""
    text = f"{m.total_bytes / GIB:.1f}"
    lo, hi = m.p10_bytes, m.p90_bytes
    if hi and f"{lo / GIB:.1f}" != f"{hi / GIB:.1f}":
        text += f" ({lo / GIB:.1f}–{hi / GIB:.1f})"
    return f"{text} / {m.capacity_bytes / GIB:.1f}"


def _max_batch(m: MemoryEstimate) -> str:
    if m.max_batch_size is None:
        return "-"
    if m.max_batch_size == 0:
        return "none"  # not even batch 1 fits
    return f"≥ {m.max_batch_size}" if m.max_batch_lower_bound else str(m.max_batch_size)


def gpu_table(prediction: Prediction) -> Table:
    """One row per GPU, fastest first; GPUs where the step does not fit come last."""
    table = Table(title=_title(prediction))
    columns = ("GPU", "fits", "peak (p10–p90) / usable GiB", "step ms (p10–p90)", "samples/s",
               "$ / 1k steps", "max batch")  # fmt: skip
    # the ids are what gpu= takes: never cut (other cells wrap when the terminal is narrow)
    longest = max((len(g.gpu) for g in prediction.gpus), default=3)
    table.add_column(columns[0], justify="left", no_wrap=True, min_width=longest)
    for col in columns[1:]:
        table.add_column(col, justify="right")
    for g in sorted(prediction.gpus, key=lambda g: (not g.fits, g.time.step_ms)):
        m, t = g.memory, g.time
        interval = f" ({t.p10_ms:.1f}–{t.p90_ms:.1f})" if t.p10_ms and t.p90_ms else ""
        cost = None if m.fit == "no" else g.usd_per_1000_steps
        rate = None if m.fit == "no" else prediction.samples_per_s(g)
        table.add_row(
            g.gpu,
            FIT_STYLE.get(m.fit, "yes" if g.fits else "[red]no[/red]"),
            _peak(m),
            f"{t.step_ms:.1f}{interval}",
            rate_text(rate) if rate is not None else "-",
            usd_text(cost) if cost is not None else "-",
            _max_batch(m),
        )
    return table


def parallel_table(prediction: Prediction) -> Table:
    """One row per GPU of a multi-GPU layout: worst rank's memory, step time and its terms;
    fastest first, the GPUs where the worst rank does not fit last (as ``gpu_table``)."""
    first = prediction.parallel[0]["parallel"]
    schedule = ""
    if first["pp"] > 1:  # the pipeline schedule, and its chunks per rank when interleaved
        name = first.get("schedule", "1f1b")
        chunks = first.get("virtual_stages", 1)
        schedule = f" {name}" + (f" (v={chunks})" if chunks > 1 else "")
    title = (
        f"{_title(prediction)}  dp={first['dp']} tp={first['tp']} pp={first['pp']}{schedule} "
        f"{first['sharding']} x{first['microbatches']} micro-batches ({first['world']} GPUs)"
    )
    if first["microbatches"] > 1:
        fused = first.get("grad_accumulation") == "fused"
        title += ", gradients " + ("accumulated in the GEMMs" if fused else "added")
    table = Table(title=title)
    for col in ("GPU", "fits", "worst rank (p10–p90) / usable GiB", "step ms", "compute ms",
                "exposed comm ms", "bubble ms", "samples/s", "$ / 1k steps"):  # fmt: skip
        table.add_column(col, justify="left" if col == "GPU" else "right")
    for g in sorted(prediction.parallel, key=_layout_order):
        m, t = g.get("memory", {}), g["time"]
        runs = m.get("fit") != "no"
        table.add_row(
            g["gpu"],
            FIT_STYLE.get(m.get("fit", ""), "-"),
            f"{m['total_bytes'] / GIB:.1f} ({m['p10_bytes'] / GIB:.1f}–{m['p90_bytes'] / GIB:.1f})"
            f" / {m['capacity_bytes'] / GIB:.1f}"
            if m
            else "-",
            f"{t['step_ms']:.1f}",
            f"{t['compute_ms']:.1f}",
            f"{t['exposed_comm_ms']:.1f}",
            f"{t['bubble_ms']:.1f}",
            rate_text(t["samples_per_s"]) if runs else "-",
            "-" if (usd := g.get("usd_per_1000_steps")) is None or not runs else usd_text(usd),
        )
    return table


def _layout_order(g: dict) -> tuple[bool, float]:
    return g.get("memory", {}).get("fit") == "no", g["time"]["step_ms"]


def render_table(prediction: Prediction, explain: bool = False) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=130, force_terminal=False)
    if prediction.parallel:
        console.print(parallel_table(prediction))
        lines = collective_lines(prediction)
        if any(g.get("memory", {}).get("fit") == "no" for g in prediction.parallel):
            lines.insert(0, NO_RATE_LINE)
        lines.append(basis_line([(g["gpu"], g["time"].get("basis")) for g in prediction.parallel]))
        lines.append(
            half_line(
                [
                    (g["gpu"], g["time"].get("unmeasured_kernels"), g["time"].get("basis"))
                    for g in prediction.parallel
                ]
            )
        )
        lines.append(
            bf16_line(
                [
                    g["gpu"]
                    for g in prediction.parallel
                    if g["time"].get("bf16_tensor_cores") is False
                ]
            )
        )
        unpriced = [g["gpu"] for g in prediction.parallel if g.get("price_usd_per_hour") is None]
        lines.append(price_line(unpriced, len(prediction.parallel)) if unpriced else "")
        notes = dict.fromkeys(n for g in prediction.parallel for n in g.get("notes") or [])
        lines += [f"Note: {note}." for note in notes]
        lines += stack_missing_lines(
            [(g["gpu"], g.get("stack_missing")) for g in prediction.parallel]
        )
        lines.append(layout_recipe_line(prediction))
        asked = layout_name(prediction.parallel[0]["parallel"])
        for gpu, found in prediction.layout_advice.items():
            lines += [f"{gpu}: {asked} does not fit", *layout_lines(found)]
        if explain:
            for entry in prediction.parallel:
                lines += layout_explain_lines(entry)
        for line in filter(None, lines):
            console.print(line, highlight=False, soft_wrap=True)
        return buf.getvalue().rstrip()
    console.print(gpu_table(prediction))
    gpus = prediction.gpus
    if any(g.memory.fit == "no" for g in gpus):
        console.print(NO_RATE_LINE, highlight=False, soft_wrap=True)
    skipped = prediction.max_batch == "auto" and len(gpus) > MAX_BATCH_AUTO_GPUS
    if skipped and all(g.memory.max_batch_size is None for g in gpus):
        console.print(
            f"max batch: not searched for {len(gpus)} GPUs (max_batch=on searches each GPU, "
            "about 0.4 s per GPU)",
            highlight=False,
        )
    failed: dict[str, list[str]] = {}  # one line per reason, naming its GPUs
    for g in gpus:
        if g.memory.max_batch_error:
            failed.setdefault(g.memory.max_batch_error, []).append(g.gpu)
    for reason, ids in failed.items():
        console.print(
            f"max batch on {', '.join(ids)}: not found ({reason})", highlight=False, soft_wrap=True
        )
    graph = prediction.graph
    traced = (
        "trace from the cache"
        if graph.get("trace_from_cache")
        else f"traced in {graph['trace_seconds']:.1f} s"
    )
    repeated = graph.get("repeated_layers")
    if repeated:
        traced += (
            f" ({repeated['traced']} and {repeated['checked']} of its {repeated['layers']} "
            "layers, one repeated)"
        )
    # the traced graph is one micro-batch (and one optimizer step)
    per = "micro-batch" if prediction.step.get("grad_accum", 1) > 1 else "step"
    # a small model's work in GFLOP (0.002 TFLOP printed as 0.00)
    work = (f"{graph['flops'] / 1e12:.2f} TFLOP" if graph["flops"] >= 1e10
            else f"{graph['flops'] / 1e9:.2f} GFLOP")  # fmt: skip
    console.print(
        f"{graph['num_ops']} ops, {work} per {per}, "
        f"{count_text(graph['num_parameters'])} parameters, {traced}. "
        f"{methods_line(prediction.gpus[0].memory.method, prediction.gpus[0].time.method)}."
    )
    unread = dict(graph.get("unread") or {})
    channels_last = unread.pop("channels_last", None)
    every = unread.pop("checkpointing.every", None)
    if every:
        console.print(
            f"Not used: checkpointing.every={every} (checkpointing=none checkpoints no block)",
            highlight=False,
        )
    impl = unread.pop("optimizer.impl", None)
    if impl:
        console.print(
            f"Not used: optimizer.impl={impl} (optimizer=none runs no optimizer)", highlight=False
        )
    cudnn = [f"{k}={str(unread.pop(k)).lower()}" for k in ("tf32_cudnn", "stack.cudnn_benchmark")
             if k in unread]  # fmt: skip
    if cudnn:
        console.print(
            f"Not used: {', '.join(cudnn)} (cuDNN runs none of this model's ops)",
            highlight=False,
        )
    cluster = [f"{k}={unread.pop(k)}" for k in list(unread) if k.startswith("cluster.")]
    if cluster:
        console.print(
            f"Not used: {', '.join(cluster)} (one GPU's step does not read "
            f"{'them' if len(cluster) > 1 else 'it'}, and advice=true searches layouts, which"
            " do, only for an hf: model a GPU does not fit)",
            highlight=False,
            soft_wrap=True,
        )
    if unread:
        given = ", ".join(f"{k}={v}" for k, v in unread.items())
        console.print(f"Not used: {given} (this model's inputs do not read it)", highlight=False)
    if channels_last:
        console.print(
            "Not used: channels_last=true (this model has no 2-D or 3-D convolutions)",
            highlight=False,
        )
    for note in graph.get("model_notes") or []:
        console.print(f"Note: {note}.", highlight=False, soft_wrap=True)
    unpriced = [g.gpu for g in prediction.gpus if g.price_usd_per_hour is None and g.time]
    if unpriced:
        console.print(price_line(unpriced, len(prediction.gpus)), highlight=False, soft_wrap=True)
    for line in stack_missing_lines([(g.gpu, g.stack_missing) for g in prediction.gpus]):
        console.print(line, highlight=False, soft_wrap=True)
    basis = basis_line([(g.gpu, g.time.basis if g.time else None) for g in prediction.gpus])
    half = half_line(
        [
            (g.gpu, g.time.unmeasured_kernels, g.time.basis) if g.time else (g.gpu, None, None)
            for g in prediction.gpus
        ]
    )
    for line in (basis, half):
        if line:
            console.print(line, highlight=False, soft_wrap=True)
    bare = [g for g in prediction.gpus if g.time and g.time.bf16_tensor_cores is False]
    slow = bf16_line(
        [g.gpu for g in bare], [g.gpu for g in bare if g.time.attention_backends.get("math")]
    )
    if slow:
        console.print(slow, highlight=False, soft_wrap=True)
    unlike = unlike_line([(g.gpu, g.time.fp32_method, g.time.per_op_ms)
                          for g in prediction.gpus if g.time and g.time.fp32_method])  # fmt: skip
    if unlike:
        console.print(unlike, highlight=False, soft_wrap=True)
    capped = [g.gpu for g in prediction.gpus if g.time and g.time.tf32_capped]
    if capped:
        matmul, cudnn = tf32_switches(
            prediction.step.get("tf32"),
            prediction.step.get("tf32_matmul"),
            prediction.step.get("tf32_cudnn"),
        )
        # which switch let TF32 in: cuDNN's is on by default, so a user who asked nothing
        # had read this as about a TF32 they had not asked for (a hunt)
        allowed = " and ".join(
            [*(["TF32 matmuls (tf32_matmul)"] if matmul else []),
             *(["cuDNN's TF32 (tf32_cudnn, on by default as in PyTorch)"] if cudnn else [])]
        )  # fmt: skip
        console.print(
            f"TF32 on {', '.join(capped)}: with {allowed} the step came out slower than in "
            "strict fp32, so it is timed as in strict fp32 (TF32 tensor cores run at least "
            "the fp32 rate on the same bytes, and cuDNN keeps its fp32 algorithms to pick).",
            highlight=False,
            soft_wrap=True,
        )
    timed_as = timed_as_line([(g.gpu, g.time.timed_as) for g in prediction.gpus
                              if g.time and g.time.timed_as])  # fmt: skip
    if timed_as:
        console.print(timed_as, highlight=False, soft_wrap=True)
    recipe = recipe_line(graph.get("recipe") or {})
    if recipe:
        console.print(recipe, highlight=False, soft_wrap=True)
    stack = prediction.gpus[0].memory.stack
    if stack:
        console.print(f"Stack: {stack_label(stack)}", highlight=False, soft_wrap=True)
        zero = zero_grad_line(stack, prediction.step)
        if zero:
            console.print(zero, highlight=False, soft_wrap=True)
    for line in advice_lines(prediction):
        console.print(line, highlight=False, soft_wrap=True)
    if explain:
        fastest = prediction.best_gpu()
        if len(prediction.gpus) > 1:
            which = "fastest" if not fastest.fits else "fastest that fits"
            console.print(
                f"Explained: {fastest.gpu}, the {which} of the {len(prediction.gpus)} GPUs "
                "(gpu=<id> alone explains another)",
                highlight=False,
                soft_wrap=True,
            )
        for line in explain_lines(fastest, grad_accum=int(prediction.step.get("grad_accum", 1))):
            console.print(line, highlight=False, soft_wrap=True)
        if unknown := prediction.graph.get("unknown_ops"):  # OpGraph.unknown_ops
            names = ", ".join(f"{op} x{n}" for op, n in unknown.items())
            console.print(
                f"ops without an op-registry entry (family 'other'): {names}",
                highlight=False,
                soft_wrap=True,
            )
    return buf.getvalue().rstrip()
