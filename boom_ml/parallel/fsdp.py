"""FSDP2's collectives over the data-parallel group in one step, with a pipeline and without.

The counts are the wrappers' own: ``tests/test_parallel_traced.py`` runs FSDP2 alone and under
``torch.distributed.pipelining``'s schedules on PyTorch's fake process group and compares.
"""

from __future__ import annotations

from boom_ml.parallel.collectives import Collective, GroupLink, all_gather_ms, reduce_scatter_ms
from boom_ml.parallel.layout import Layout


def fsdp_collectives(
    layout: Layout, group: GroupLink, *, params: int, layer_params: int | None, trainable: int,
    layer_trainable: int | None, unit_params: int, param_bytes: int, grad_bytes: int,
    backward_ms: float, compute_mb_ms: float,
) -> list[Collective]:  # fmt: skip
    """FSDP2's gathers and reductions over dp in one step, ``fully_shard`` per layer and then
    the root (traced in traced.py). ``params`` / ``trainable``: the rank's, of which
    ``layer_params`` / ``layer_trainable`` in its layers (default: all), one unit per
    ``unit_params``; ``backward_ms`` / ``compute_mb_ms``: a micro-batch's. Without a pipeline,
    per micro-batch a layer is gathered in forward and again in backward (a checkpointed layer's
    recompute reuses the latter), the root once, every unit reduce-scattered. Under
    ``torch.distributed.pipelining`` the stage keeps its units gathered after backward and syncs
    no gradient before its last backward (``backward_maybe_with_nosync``), then reduces each unit
    once (``perform_reduce_grad``) with no compute left to hide it. ``zero2`` there is FSDP2 that
    does not reshard after forward either (torchtitan's default under a pipeline): each unit is
    gathered once. ``zero3`` / ``fsdp`` reshard after each forward, the root too: the next
    backward gathers again (m + 1 gathers a unit in 1F1B and GPipe)."""
    m = layout.microbatches
    piped = layout.pp > 1
    layer_params = params if layer_params is None else layer_params
    layer_trainable = trainable if layer_trainable is None else layer_trainable
    units = max(1, round(layer_params / unit_params)) if layer_params else 0
    unit_p = layer_params // units if units else 0
    unit_g = layer_trainable // units if units else 0
    root_p, root_g = params - layer_params, trainable - layer_trainable
    # a gather carries frozen weights in ``param_bytes`` and trainable ones in their own width
    # (``grad_bytes``: LoRA's fp32 adapters beside bf16 weights)
    unit_b = (unit_p - unit_g) * param_bytes + unit_g * grad_bytes
    root_b = (root_p - root_g) * param_bytes + root_g * grad_bytes
    unit_ag = all_gather_ms(unit_b, group)
    root_ag = all_gather_ms(root_b, group)
    unit_rs = reduce_scatter_ms(unit_g * grad_bytes, group) if unit_g else 0.0
    root_rs = reduce_scatter_ms(root_g * grad_bytes, group) if root_g else 0.0
    # per unit and step (tests/test_parallel_traced.py runs torch's schedules over FSDP2):
    # gathers of a layer unit and of the root, micro-batches whose first gathers nothing hides,
    # and how the rows say it
    kept = piped and layout.zero_stage == 2  # gathered once, in the first forward
    if kept:
        gathers, root_gathers, starts = 1, 1, 1
        when, root_when = "gathered once, kept through the micro-batches", "gathered once"
    elif piped:
        gathers = root_gathers = m + 1
        starts, when, root_when = 1, "each forward, then kept from backward on", "each forward"
    else:
        gathers, root_gathers, starts = 2 * m, m, m
        when, root_when = "forward and backward", "not resharded after forward"
    reduces = 1 if piped else m
    # prefetch hides the gathers (and, unpiped, the reductions) behind compute, except each
    # start's first ones (the root's, then the first layer's); under a pipeline the reductions
    # come after the last backward, where nothing hides them, and so does the root's in either
    # case: the embedding's gradient is the backward's last, and the optimizer step waits for
    # its reduction (a hunt: it had counted as hidden). What compute cannot hide is
    # shared out in proportion to each collective's hideable time, none beyond its own
    hide = compute_mb_ms - backward_ms if kept else m * compute_mb_ms
    rows = [  # (op, what, bytes per call, calls, ms, ms that could not be hidden, present)
        ("all_gather", f"layer parameters (FSDP unit, {when})", unit_b,
         gathers * units, gathers * units * unit_ag, unit_ag * starts, units),
        ("reduce_scatter", "layer gradients (FSDP unit" + (", after the last micro-batch)" if piped
         else ")"), unit_g * grad_bytes, units * reduces, units * unit_rs * reduces,
         units * unit_rs if piped else 0.0, unit_g),
        ("all_gather", f"root parameters (embedding, norm, head: {root_when})",
         root_b, root_gathers, root_ag * root_gathers, root_ag * starts, root_p),
        ("reduce_scatter", "root gradients (FSDP root unit)", root_g * grad_bytes,
         reduces, root_rs * reduces, root_rs, root_g),
    ]  # fmt: skip
    hideable = sum(ms - fixed for *_, ms, fixed, _ in rows)
    rest = max(0.0, hideable - hide)
    out = []
    for op, what, nbytes, calls, ms, fixed, present in rows:
        if present:
            share = (ms - fixed) / hideable if hideable > 0 else 0.0
            out.append(Collective(op, "dp", what, nbytes, calls, ms, fixed + rest * share))
    return out
