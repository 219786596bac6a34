"""``explain=true``: where one GPU's step time and peak memory go, with each number's method."""

from __future__ import annotations

from boom_ml.estimates import GpuPrediction

GIB = 1024**3
MIB = 1024**2


def explain_lines(result: GpuPrediction, top_n: int = 8, grad_accum: int = 1) -> list[str]:
    """Where the time and the peak memory go on one GPU, with the method of each number."""
    m, t = result.memory, result.time
    lines = [f"Time on {result.gpu}: {t.step_ms:.1f} ms ({t.method})"]
    if t.overhead_ms:  # the GNN's per-step term: in step_ms, in no op, module or phase
        lines.append(
            f"  of which {t.overhead_ms:.2f} ms is the GNN's per-step overhead"
            f" ({100 * t.overhead_ms / t.step_ms:.0f} %), in no op, module or phase below"
            " (JSON time.overhead_ms)"
        )
    if t.gnn_clamped:
        lines.append(
            f"  the GNN read this GPU's {', '.join(t.gnn_clamped)} at the edge of its training"
            " GPUs' range (beyond it; JSON time.gnn_clamped)"
        )
    # under accumulation the ops, modules and blocks are one micro-batch's, run N times
    micro = t.micro_step_ms if grad_accum > 1 and t.micro_step_ms else None
    if micro:
        once = t.by_phase.get("optimizer", 0.0) + t.by_phase.get("zero_grad", 0.0)
        adds = (
            f", each after the first adding {t.accumulate_ms:.2f} ms into the kept gradients"
            if t.accumulate_ms
            else ""
        )
        lines.append(
            f"  ops, modules and blocks below are one micro-batch's ({micro:.1f} ms, run "
            f"{grad_accum} times{adds})"
            + (f" and the optimizer step's ({once:.1f} ms, run once)" if once else "")
        )
    whole, of = (micro, "a micro-batch") if micro else (t.step_ms, "the step")
    lines += [
        f"    {o['op']:<45} {o['phase']:<10} {o['ms']:>9.2f} ms  x{o['calls']:<5} "
        f"{o.get('method', '')}".rstrip()
        for o in t.top_ops[:top_n]
    ]
    lines += [
        f"  whole blocks: {b['module']} x{b['blocks']}, {b['ms']:.2f} ms "
        f"({100 * b['ms'] / whole:.1f} % of {of})"
        for b in t.block_totals[:4]
        if whole > 0
    ]
    lines.append("  by module (repeated blocks summed, xN: how many):")
    lines += [
        f"    {o['module']:<55} {o['ms']:>9.2f} ms{_blocks(o)}"
        for o in (t.top_module_groups or t.top_modules)[:top_n]
    ]
    lines.append(
        f"Memory on {result.gpu} at the peak ({m.method}): {m.total_bytes / GIB:.2f} GiB, "
        f"during {m.peak_op or '-'} ({m.peak_phase or '-'})"
    )
    if m.reserved_peak_op and (m.reserved_peak_op, m.reserved_peak_phase) != (
        m.peak_op,
        m.peak_phase,
    ):  # the allocator's segments peak elsewhere: idle cached ones make the fragmentation
        lines.append(
            f"  the caching allocator's reserved memory last grew during {m.reserved_peak_op}"
            f" ({m.reserved_peak_phase or '-'}); its segments cached then and idle at the peak"
            " are the fragmentation below"
        )
    lines += breakdown_lines(m.breakdown)
    if m.by_module:
        lines.append("  by module (repeated blocks summed):")
        for row in (m.by_module_group or m.by_module)[:top_n]:
            lines.append(
                f"    {row['module'] or '(top level)':<55} {row['bytes'] / GIB:>8.2f} GiB{_blocks(row)}"
            )
    return lines + overhead_lines(result)


def _blocks(row: dict) -> str:
    """'  x36' after a module kind that sums 36 repeated blocks (trace/module_paths.py)."""
    n = row.get("blocks", 1)
    return f"  x{n}" if n > 1 else ""


def overhead_lines(result: GpuPrediction) -> list[str]:
    """Each term outside the traced tensors on one GPU (p50), with where its value comes from."""
    m = result.memory
    return outside_lines(result.gpu, m.p10_bytes, m.p90_bytes, m.capacity_bytes, m.fit, m.terms,
                         m.capacity_source)  # fmt: skip


def breakdown_lines(breakdown: dict[str, int]) -> list[str]:
    """The peak's bytes by category, largest first (empty categories left out)."""
    return [
        f"    {category:<20} {nbytes / GIB:>8.2f} GiB"
        for category, nbytes in sorted(breakdown.items(), key=lambda kv: -kv[1])
        if nbytes
    ]


def outside_lines(
    gpu: str, p10: int, p90: int, capacity: int, fit: str | None, terms: list[dict],
    capacity_source: str | None = None,
) -> list[str]:  # fmt: skip
    """The memory range and verdict on ``gpu``, then one line per term outside the traced
    tensors: bytes, where, source (one GPU's step and a layout's worst rank alike)."""
    lines = [
        f"Memory terms outside the traced tensors on {gpu} (p50; range {p10 / GIB:.2f}–"
        f"{p90 / GIB:.2f} GiB, usable {capacity / GIB:.2f} GiB, verdict {fit or '-'}):"
    ]
    lines += [
        f"    {t['term']:<17} {t['library']:<7} {t['bytes'] / MIB:>9.1f} MiB  "
        f"({t['where']})  {t['source']}"
        for t in terms
    ]
    if capacity_source:
        lines.append(f"    usable memory: {capacity_source}")
    return lines
