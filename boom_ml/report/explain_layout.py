"""``explain=true`` for a multi-GPU layout: how its step time adds up, stage by stage, and
where the worst rank's memory goes, with each term's source."""

from __future__ import annotations

from typing import Any

from boom_ml.report.explain import GIB, breakdown_lines, outside_lines

# the layout's own memory terms (boom_ml/parallel/memory.py), already inside the categories
PARALLEL_TERMS = {
    "stage_parameters": "this stage's parameters against the traced 1-layer model's",
    "zero_optimizer_state": "optimizer state on other ranks (ZeRO / FSDP)",
    "zero_optimizer_temporaries": "optimizer temporaries on other ranks",
    "stage_optimizer_temporaries": "this stage's optimizer temporaries against the traced model's",
    "zero_gradients": "gradients on other ranks (ZeRO-2 / FSDP)",
    "zero_parameters": "parameters on other ranks (ZeRO-3 / FSDP)",
    "fsdp_allgather_buffers": "FSDP-gathered parameters (units in use and prefetched, root; a pipeline stage's all where it peaks so)",
    "ddp_bucket": "DDP gradient buckets",
    "pipeline_activations": "activations of further micro-batches in flight",
    "backward_end_activations": "a micro-batch's activations its backward freed (FSDP peak: a "
    "backward's end, every unit gathered)",
    "nccl_buffers": "NCCL communicator buffers",
    "no_head_tensors": "LM head tensors on another stage",
}
# ZeRO-1 over fp32 master weights shards the fp32 gradients alone (memory.py: the other
# shards' 16-bit ones stay); its term had read "ZeRO-2 / FSDP" (a hunt)
ZERO1_TERMS = {"zero_gradients": "other shards' fp32 gradients (ZeRO-1; 16-bit kept)"}


def layout_explain_lines(entry: dict[str, Any]) -> list[str]:
    """One GPU's layout prediction (``Prediction.parallel[i]``) explained."""
    return _time_lines(entry) + _memory_lines(entry)


def _time_lines(entry: dict[str, Any]) -> list[str]:
    t, lay = entry["time"], entry["parallel"]
    m = lay["microbatches"]
    run = (
        f"{lay.get('schedule', '1f1b')} over {m} micro-batch{'es' if m > 1 else ''}, "
        f"{lay['pp']} stages"
        if lay["pp"] > 1
        else f"{m} micro-batch{'es' if m > 1 else ''} one after another"
    )
    critical, done = t["critical_stage"], t["finish_stage"]
    last = t["per_stage"][done]
    rank = f"stage {done}'s " if lay["pp"] > 1 else ""
    lines = [
        f"Time on {entry['gpu']}: {t['step_ms']:.1f} ms = {rank}last backward ending at"
        f" {last['end_ms']:.1f} ms ({run}; the pipeline {t['pipeline_ms']:.1f}) + its optimizer"
        f" step {last['optimizer_ms']:.1f} + its exposed data-parallel communication"
        f" {last['exposed_dp_ms']:.1f} (method: the collectives' line above)",
        "  per stage: one micro-batch's compute and tensor-parallel communication; over the step"
        " the busy time, the gradient adds and the optimizer step",
    ]
    for st in t.get("per_stage", []):
        mark = "  (slowest micro-batch)" if st["stage"] == critical and lay["pp"] > 1 else ""
        lines.append(
            f"    stage {st['stage']}: {st['layers']} layers, compute {st['compute_ms']:.2f} ms"
            f" + comm {st['comm_ms']:.2f} ms a micro-batch; busy {st.get('busy_ms', 0):.1f} ms,"
            f" adds {st['accumulate_ms']:.2f} ms, optimizer {st['optimizer_ms']:.2f} ms,"
            f" {st.get('logical_params', st['params']) / 1e6:.1f} M parameters{mark}"
        )
    if lay["pp"] > 1:
        lines.append(
            f"  bubble {t['bubble_ms']:.1f} ms ({100 * t['bubble_fraction']:.1f} % of the step);"
            f" a send between stages {t['p2p_ms']:.3f} ms"
        )
    lines.append("  every collective of the slowest micro-batch's stage (whole step):")
    lines += [
        f"    {c['op']:<15} {c['group']:<9} {c.get('what', '')}: {c['bytes'] / 2**20:.1f} MiB"
        f" x{c.get('calls', 1)}, {c['ms']:.2f} ms, exposed {c.get('exposed_ms', 0):.2f},"
        f" {c.get('algorithm', '-')}"
        for c in t.get("collectives", [])
    ]
    return lines


def _memory_lines(entry: dict[str, Any]) -> list[str]:
    m = entry.get("memory")
    if not m:
        return []
    stages = m.get("per_stage") or []
    where = f", stage {m['worst_stage']} of {len(stages)}" if len(stages) > 1 else ""
    lines = [
        f"Memory on {entry['gpu']}, worst rank{where}: {m['total_bytes'] / GIB:.2f} GiB"
        f" ({m['method']})"
    ]
    lines += breakdown_lines(m["breakdown"])
    layout_terms = [(k, v) for k, v in (m.get("parallel_terms") or {}).items() if v]
    if layout_terms:
        names = PARALLEL_TERMS
        if entry.get("parallel", {}).get("sharding") == "zero1":
            names = {**PARALLEL_TERMS, **ZERO1_TERMS}
        lines.append("  of which the layout's terms (+ added, - taken away by sharding):")
        lines += [f"    {names.get(k, k):<45} {v / GIB:>+8.2f} GiB" for k, v in layout_terms]
    if len(stages) > 1:
        lines.append(
            "  per stage: "
            + ", ".join(f"stage {i} {s['total_bytes'] / GIB:.2f} GiB" for i, s in enumerate(stages))
        )
    return lines + outside_lines(entry["gpu"], m["p10_bytes"], m["p90_bytes"],
                                 m["capacity_bytes"], m.get("fit"), m.get("terms") or [])  # fmt: skip
