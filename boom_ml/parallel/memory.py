"""Memory of each pipeline stage's rank: the traced per-rank model plus analytic sharding terms.

Start: the allocator replay of the per-rank model (tensor-parallel dimensions divided) with
1 and 2 layers, extrapolated linearly to the stage's layers (``memory_profile.py``), except the
allocator's fragmentation, which stays within the two traces' values. Then:

* a stage that does not hold the embedding (or the LM head) loses their parameters, gradients
  and optimizer state (the 1-layer trace holds both); a tied head is held again by the last
  stage when pp > 1 (Megatron keeps a copy there and all-reduces its gradient); a stage
  without the head also loses the tensors the head's modules hold at each peak (the logits,
  the loss's temporaries, autocast's copy of the head's weight: ``no_head_tensors``);
* ZeRO-1 divides optimizer state by dp, and with it the optimizer's own temporaries (each
  rank steps its shard), ZeRO-2 also gradients (but for what waits for its reduce-scatter at
  a backward's peak: the gradient just made; FSDP2: its unit's and the root's), ZeRO-3 / FSDP
  also parameters,
  and adds all-gather buffers for the largest unit (one layer) plus one prefetched unit, plus
  the root's parameters (embedding, final norm, head): FSDP2 does not reshard the root after
  forward, so they stay gathered through the backward (``_fsdp_state.py``, "For the root, do
  not reshard after forward"; one all-gather of the root per micro-batch in
  ``parallel/traced.py``'s trace); none at the optimizer step's peak: every unit, the root
  among them, is resharded after its backward (``reshard_after_backward``), so the step
  holds sharded parameters only. Under a pipeline (pp > 1) zero2, zero3 and fsdp are FSDP2 as
  ``torch.distributed.pipelining`` runs it (``Layout.fsdp2``): no gradient is sharded until
  the stage's last backward, zero2 (not resharded after forward) keeps the whole stage
  gathered, and zero3 / fsdp, which keep each unit gathered after its backward, peak at a
  backward's end with every unit gathered where that holds more than the backward's peak;
* a gradient a micro-batch computes beside its kept copy is one tensor: a stage holds it up
  to its own largest, not in proportion to its parameters (``gradients.stage_gradient``);
* DDP (dp > 1, no sharding): its Reducer allocates flat buckets over every trainable
  gradient when it is built (``reducer.cpp``, ``initialize_buckets``) and, with PyTorch's
  default ``gradient_as_bucket_view=False``, copies each gradient into them: a second copy of
  the gradients, alive all step; ``parallel.bucket_view=true`` (the gradients are views into
  the buckets, as Megatron's contiguous gradient buffers are) leaves the one copy, the buckets,
  alive all step whatever the gradients the trace holds at the peak;
* pipeline activations in flight (``schedule.peak_in_flight``, from the schedule's operation
  order): 1F1B: stage s holds the activations of min(pp - s, microbatches) micro-batches (the
  first stage the most); GPipe: all m on every stage; interleaved 1F1B: Megatron's warm-up
  chunk-forwards + 1 (at most m * v) chunk-micro-batches, each a chunk of layers / (pp * v)
  layers, i.e. 1 / v of the stage's micro-batch: ``in_flight_microbatches`` is then that count
  / v (a float; ``in_flight_chunks`` keeps the count). The stage holds (that - 1) micro-batches'
  activations more than the traced step, each what a micro-batch's forward leaves for its
  backward (the activations alive when the backward starts, not autocast's weight copies, which
  one autocast region around the schedule caches once: each layer's share,
  and on the last stage the head's logits and loss, once for each micro-batch of the model's
  last chunk in flight, one under interleaving: ``schedule.head_in_flight``; the peak's own
  activations are taken
  mid-backward, where 1- and 2-layer models peak at different moments), none at the
  optimizer step's peak (the pipeline has drained); with one stage (pp = 1) micro-batches run
  one after another whatever the schedule;
* NCCL communicator buffers: NCCL_BUFFSIZE (4 MiB by default, NVIDIA/nccl src/init.cc
  ``DEFAULT_BUFFSIZE (1 << 22)``) per channel and ring peer (2), for each communicator the rank is
  in; channels per communicator: 8 (assumption: NCCL picks 2-32 by topology).
"""

from __future__ import annotations

from typing import Any

from boom_ml.identity_cache import IdentityCache
from boom_ml.parallel.collectives import DDP_BUCKET_BYTES, MIB  # noqa: F401 (re-exported)
from boom_ml.parallel.gradients import largest_tensor, sharded_gradient, stage_gradient, unreduced
from boom_ml.parallel.layout import SCHEDULE_NAMES, Layout
from boom_ml.parallel.memory_profile import MemoryProfile
from boom_ml.parallel.schedule import head_in_flight, peak_in_flight

NCCL_BUFFSIZE = 4 * MIB  # NCCL DEFAULT_BUFFSIZE (src/init.cc), per channel and peer
NCCL_CHANNELS = 8  # assumption (NCCL chooses by topology)
NCCL_PEERS = 2  # a ring: previous and next rank
METHOD = (
    "{method} per rank (1- and 2-layer traces of the tp-sharded model, linear in layers)"
    " + analytic sharding (ZeRO/FSDP, DDP bucket, {schedule} in-flight activations, NCCL buffers)"
)


def _extrapolate(values: list[float], layers: int) -> float:
    """v(L) = v(1) + (v(2) - v(1)) * (L - 1)."""
    return values[0] + (values[1] - values[0]) * (layers - 1)


def _fragmentation(breakdowns: list[dict[str, int]], linear: int) -> int:
    """What to add to the linearly extrapolated fragmentation: it is kept within the range
    of the 1- and 2-layer traces. Reserved-but-unused bytes come from the caching allocator's
    rounding and segment reuse; a repeated layer reuses the blocks its predecessor freed, so
    the waste does not grow by a fixed amount per layer, and a line through two noisy points
    went negative (Llama-3-8B dp8 FSDP: -3.5 GiB) or ten times the traced value."""
    lo, hi = sorted(b.get("fragmentation", 0) for b in breakdowns[:2])
    return int(min(max(linear, lo), hi) - linear)


# Categories whose bytes at a peak depend on the moment it falls at (the state categories are
# alive all step and linear in layers exactly)
MOMENT_CATEGORIES = ("activation", "temporary", "gradient", "autocast_copy", "input")


def _moment_categories(bd: dict[str, int]) -> dict[str, int]:
    """``bd`` with no moment category below zero, their sum kept. A line through two peaks
    that fall at different moments of a window (Llama-3.2-1B at tp=8: the 1-layer model's
    backward peak at its end, all gradients and no activations; the 2-layer model's in the
    middle) had printed negative gradient and temporary bytes; the bytes the line gives the
    window's moment categories together are shared among those it gives a positive value."""
    if all(bd.get(k, 0) >= 0 for k in MOMENT_CATEGORIES):
        return bd
    positive = {k: bd[k] for k in MOMENT_CATEGORIES if bd.get(k, 0) > 0}
    pool = max(sum(bd.get(k, 0) for k in MOMENT_CATEGORIES), 0)
    share = sum(positive.values())
    out = {**bd, **{k: 0 for k in MOMENT_CATEGORIES if k in bd}}
    for k, v in positive.items():
        out[k] = int(pool * v / share)
    out[max(positive, key=positive.get, default="activation")] += pool - sum(
        out.get(k, 0) for k in MOMENT_CATEGORIES
    )  # the rounding, so that the sum is kept to the byte
    return out


def communicators(layout: Layout, stage: int = 0, tied: bool = False) -> int:
    """NCCL communicators of a rank of pipeline stage ``stage``: its tp and dp groups, one
    per pipeline peer it sends to or receives from (ProcessGroupNCCL makes a two-rank
    communicator per pair; the first and last stage have one peer, a middle one two, and
    interleaving joins the last to the first), and a tied embedding's group of the first and
    last stage. Every stage had been counted two for the pipeline (a hunt)."""
    count = sum(1 for n in (layout.tp, layout.dp) if n > 1)
    pp = layout.pp
    if pp > 1:
        near = (stage - 1, stage + 1)
        wrap = layout.virtual_stages > 1
        peers = {s % pp for s in near} if wrap else {s for s in near if 0 <= s < pp}
        count += len(peers - {stage})
        count += tied and stage in (0, pp - 1)
    return count


def in_flight_counts(layout: Layout, microbatches: int | None = None) -> list[tuple[float, int]]:
    """Per stage: (stage-micro-batches, chunk-micro-batches) of activations in flight at the
    peak under the layout's schedule; (1, v) for one stage."""
    m = layout.microbatches if microbatches is None else microbatches
    v = layout.virtual_stages
    if layout.pp == 1:
        return [(1, v)]
    chunks = peak_in_flight(layout.schedule, layout.pp, m, v)
    return [(c / v if c % v else c // v, c) for c in chunks]


def _held(p: dict[str, int], layers: int, first: bool, last: bool, pp: int) -> tuple[int, int]:
    """(parameters the stage holds, parameters of the traced model scaled to its layers)."""
    held = layers * p["layers"] + (p["first"] if first else 0) + (p["last"] if last else 0)
    if last and pp > 1 and p["tied"]:
        held += p["tied"]
    return held, layers * p["layers"] + p["first"] + p["last"]


def _held_per_microbatch(
    prof: MemoryProfile, bd: dict[str, int], layers: int, last: bool
) -> tuple[float, float]:
    """What one micro-batch's forward leaves on a stage for its backward: (its layers' share,
    each layer's the 2-layer trace's less the 1-layer one's; on the last stage what the rest of
    the traced model leaves, nearly all of it the head's logits and loss, the embedding
    keeping only its token ids)."""
    if not prof.held:  # a profile made without them (a synthetic one): the peak's activations
        return bd.get("activation", 0), 0.0
    one, two = prof.held
    return (two - one) * layers, ((2 * one - two) if last else 0)


# The parts of the step with no micro-batch in flight: the pipeline has drained by the
# optimizer step, and the next step's zero_grad comes before its first forward. What the step
# left (fp32 master gradients of the rank's ZeRO-1 shard alone) is alive in both; no FSDP unit
# is gathered in either.
DRAINED = ("optimizer", "zero_grad")


def stage_memory(
    prof: MemoryProfile, layout: Layout, stage: int, layers: int, microbatches: int
) -> dict[str, Any]:
    """Per-rank memory of pipeline stage ``stage`` holding ``layers`` layers (JSON-able).

    The 1- and 2-layer replays' peaks inside the optimizer step and outside it are each
    extrapolated to the stage's layers and sharded; the larger is the rank's. (A small
    model peaks in its backward pass; the whole one may peak in its optimizer step, whose
    memory grows with the parameters.) Under ZeRO / FSDP each rank steps only its shard, so
    the optimizer's own temporaries (foreach AdamW's square roots: the size of every
    parameter it steps) shrink by dp too.
    """
    views = prof.windows or {"rest": _peak_view(prof)}
    stages = [_stage_at(prof, view, layout, stage, layers, microbatches, name in DRAINED,
                        ends_backward=name in ("backward", "rest"))
              for name, view in views.items()]  # fmt: skip
    return max(stages, key=lambda st: st["total_bytes"])


def _head_share(view: dict[str, Any]) -> dict[str, int]:
    """What the head's modules hold at this peak (logits, the loss's temporaries, autocast's
    copy of the head's weight), by category: the 2-layer trace's (the head does not change
    with depth; that trace reaches the part's peak as a deeper model does). A stage without
    the head holds none of it."""
    shares = view.get("head") or []
    return {k: int(v) for k, v in shares[-1].items() if v} if shares else {}


def _peak_view(prof: MemoryProfile) -> dict[str, Any]:
    """The step's own peak (a profile without windows)."""
    return {"totals": prof.totals, "p10": prof.p10, "p90": prof.p90,
            "breakdowns": prof.breakdowns}  # fmt: skip


# a profile peak extrapolated to a layer count: a layout search asks the same ones for every
# sharding and layout (208k calls, 5 s, in a helper's profile)
_AT_LAYERS: IdentityCache[tuple[dict[str, int], float, float, float]] = IdentityCache(4096)


def _at_layers(view: dict[str, Any], layers: int) -> tuple[dict[str, int], float, float, float]:
    """A peak's breakdown (fragmentation corrected), total, p10 and p90 extrapolated to
    ``layers`` layers (the breakdown a copy the caller may change)."""

    def compute() -> tuple[dict[str, int], float, float, float]:
        breakdowns = view["breakdowns"]
        bd = {k: int(_extrapolate([breakdowns[0].get(k, 0), breakdowns[1].get(k, 0)], layers))
              for k in set(breakdowns[0]) | set(breakdowns[1])}  # fmt: skip
        bd = _moment_categories(bd)
        frag_fix = _fragmentation(breakdowns, bd.get("fragmentation", 0))
        bd["fragmentation"] = bd.get("fragmentation", 0) + frag_fix
        total = _extrapolate(view["totals"], layers) + frag_fix
        # each trace's p10 and p90 are the least and most of its three replays (estimate.py),
        # but three lines through two points each can cross: ViT-B/16's 12 layers came out
        # 2.7 GiB with a p90 of 2.5 (a p90 replay packs its cuDNN workspace differently at 1
        # and 2 layers); the band keeps the estimate inside it, as one GPU's does
        p10 = min(_extrapolate(view["p10"], layers) + frag_fix, total)
        p90 = max(_extrapolate(view["p90"], layers) + frag_fix, total)
        return bd, total, p10, p90

    bd, *rest = _AT_LAYERS.get(view, (layers,), compute)
    return (dict(bd), *rest)


def _stage_at(
    prof: MemoryProfile, view: dict[str, Any], layout: Layout, stage: int, layers: int,
    microbatches: int, drained: bool = False, ends_backward: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """``stage_memory`` at one peak (``view``: totals, p10, p90, breakdowns of the 1- and
    2-layer replays, and the optimizer-phase temporaries alive at it); ``ends_backward``: a
    backward ends in this part of the step (its window's); ``drained``: no
    micro-batch in flight there (the optimizer step's)."""
    pp, dp, zero = layout.pp, layout.dp, layout.zero_stage
    first, last = stage == 0, stage == pp - 1
    bd, total, p10, p90 = _at_layers(view, layers)
    terms: dict[str, float] = {}

    # Parameters this stage holds; the traced 1-layer model holds embedding and head.
    held, traced = _held(prof.params, layers, first, last, pp)
    # of those, the ones with gradients and optimizer state (all unless LoRA froze the rest)
    held_t, traced_t = _held(prof.trainable or prof.params, layers, first, last, pp)
    # Parameters and optimizer state live all step; gradients only partly at the peak (all of
    # them under accumulation): what the stage holds of those at the peak, scaled by params.
    ratio = held_t / traced_t if traced_t else 1.0
    grad_peak, fresh = stage_gradient(prof, bd.get("gradient", 0), ratio, layers,
                                       largest_tensor(prof, layers, first, last, pp), drained)  # fmt: skip
    terms["stage_parameters"] = (
        (held - traced) * prof.param_bytes
        + (held_t - traced_t) * prof.optimizer_bytes
        + grad_peak
        - bd.get("gradient", 0)
    )
    param_b = held * prof.param_bytes
    opt_b = held_t * prof.optimizer_bytes
    # the optimizer's own temporaries (foreach AdamW's square roots) are the size of what the
    # stage steps, not of the traced model: every stage had been charged the embedding's and
    # the head's (a middle stage of Llama-3-8B 4.2 GB over: a hunt)
    transient = _extrapolate(view.get("optimizer_transient") or [0, 0], layers)
    if transient > 0 and ratio != 1:
        terms["stage_optimizer_temporaries"] = transient * (ratio - 1)
    if zero >= 1 and dp > 1:
        terms["zero_optimizer_state"] = -opt_b * (1 - 1 / dp)
        if transient > 0:
            terms["zero_optimizer_temporaries"] = -transient * ratio * (1 - 1 / dp)
    # FSDP2 under torch.distributed.pipelining syncs no gradient until the stage's last
    # backward (stage.py's backward_maybe_with_nosync): they are whole until the optimizer's
    sharded = layout.shards_microbatch_gradients or (zero >= 2 and drained)
    if sharded and dp > 1 and grad_peak > 0:
        waiting = unreduced(prof, layout, layers) if ends_backward and not drained else 0.0
        terms["zero_gradients"] = sharded_gradient(grad_peak, fresh, waiting, zero, dp) - grad_peak
    elif zero == 1 and dp > 1 and drained and prof.master_weights and grad_peak > 0:
        # ZeRO-1 over fp32 master weights (Megatron's distributed optimizer, DeepSpeed's
        # stage 1): a rank casts to fp32 and steps its shard's gradients alone; the other
        # shards' 16-bit gradients stay as backward left them, until zero_grad
        terms["zero_gradients"] = -grad_peak * (1 - 1 / dp) + held_t * prof.trainable_bytes * (
            1 - 1 / dp
        )
    if layout.fsdp2 and dp > 1:
        terms["zero_parameters"] = -param_b * (1 - 1 / dp)
    if layout.fsdp2 and dp > 1 and not drained:
        # the unsharded unit being used plus one prefetched (two layers' parameters), and the
        # root's, gathered from its forward to the end of the backward; a pipeline stage that
        # does not reshard after forward (zero2) keeps all of its units gathered through the
        # micro-batches (the stage keeps them after backward; zero3's next forward reshards)
        root = held - layers * prof.params["layers"]
        gathered = held if zero == 2 else 2 * prof.params["layers"] + root
        terms["fsdp_allgather_buffers"] = gathered * prof.param_bytes
    if dp > 1 and zero == 0:
        # the buckets take the gradients' dtype: fp32 for LoRA's adapters beside bf16 weights
        # (they had been counted in the weights' width, half of it: a hunt)
        bucket = held_t * prof.trainable_bytes
        # gradient_as_bucket_view: the gradients are views into the buckets, which the Reducer
        # allocates when it is built and holds all step (it had charged one 25 MiB bucket, the
        # gradients gone where set_to_none had freed them: 4.9 GB short at a forward's peak),
        # so the gradients alive at the peak are inside them; under master weights some are
        # fp32 copies outside them, which the trace does not tell apart: the buckets whole (an
        # upper bound; they had vanished beside 7.7 GB of fp32 gradients: a review)
        kept = 0.0 if prof.master_weights else grad_peak - fresh
        terms["ddp_bucket"] = max(bucket - kept, 0.0) if layout.bucket_view else bucket
    in_flight, in_flight_chunks = in_flight_counts(layout, microbatches)[stage]
    if in_flight > 1 and not drained:  # what each further micro-batch's forward leaves
        body, head = _held_per_microbatch(prof, bd, layers, last)
        # the head's logits once per micro-batch of the last chunk in flight, which under
        # interleaving is not every chunk-micro-batch's (schedule.head_in_flight)
        heads = head_in_flight(layout.schedule, pp, microbatches, layout.virtual_stages)
        terms["pipeline_activations"] = (in_flight - 1) * body + (heads - 1) * head
    if zero >= 3 and dp > 1 and pp > 1 and ends_backward and not drained:
        # the stage keeps each unit gathered after its backward (stage.py), so a backward's
        # end holds every unit, with one micro-batch fewer in flight: the larger of that and
        # the backward's peak (two units gathered, the micro-batches in flight) is the part's
        active = bd.get("activation", 0) + terms.get("pipeline_activations", 0)
        body = min(_held_per_microbatch(prof, bd, layers, last)[0], active)
        if held * prof.param_bytes - body > terms["fsdp_allgather_buffers"]:
            terms["fsdp_allgather_buffers"] = held * prof.param_bytes
            terms["backward_end_activations"] = -body
    tied = bool((prof.params or {}).get("tied"))
    terms["nccl_buffers"] = (
        communicators(layout, stage, tied) * NCCL_BUFFSIZE * NCCL_CHANNELS * NCCL_PEERS
    )
    head = _head_share(view) if pp > 1 and not last else {}
    if head:
        terms["no_head_tensors"] = -sum(head.values())

    delta = sum(terms.values())
    adjusted = dict(bd)
    adjusted["parameter"] = int(bd.get("parameter", 0) + (held - traced) * prof.param_bytes
                                + terms.get("zero_parameters", 0))  # fmt: skip
    adjusted["optimizer_state"] = int(
        bd.get("optimizer_state", 0)
        + (held_t - traced_t) * prof.optimizer_bytes
        + terms.get("zero_optimizer_state", 0)
    )
    if grad_peak > 0:
        adjusted["gradient"] = int(grad_peak + terms.get("zero_gradients", 0))
    adjusted["activation"] = int(bd.get("activation", 0) + terms.get("pipeline_activations", 0)
                                 + terms.get("backward_end_activations", 0))  # fmt: skip
    adjusted["temporary"] = int(bd.get("temporary", 0) + terms.get("zero_optimizer_temporaries", 0)
                                + terms.get("stage_optimizer_temporaries", 0))  # fmt: skip
    for cat, nbytes in head.items():
        adjusted[cat] = int(adjusted.get(cat, 0) - nbytes)
    for name in ("fsdp_allgather_buffers", "ddp_bucket", "nccl_buffers"):
        if terms.get(name):
            adjusted[name] = int(terms[name])
    total_b = int(total + delta)
    # the categories add up to the total, as one GPU's do: a term divided by a dp that does
    # not divide it rounds apart from the sum (dp=3: one byte, a hunt)
    rounding = total_b - sum(adjusted.values())
    if rounding and abs(rounding) < len(adjusted):
        adjusted[max(adjusted, key=adjusted.get)] += rounding
    p10 = int(p10 + delta)
    p90 = int(p90 + delta)
    cap = prof.capacity_bytes
    fit = fit_verdict(p10, p90, cap)
    return {
        "stage": stage,
        "layers": layers,
        "parameters": int(_held(prof.logical or prof.params, layers, first, last, pp)[0]),
        "trainable_parameters": int(held_t),
        "total_bytes": total_b,
        "p10_bytes": p10,
        "p90_bytes": p90,
        "capacity_bytes": cap,
        "headroom_bytes": cap - total_b,
        "fits": fit == "yes",
        "fit": fit,
        "breakdown": adjusted,
        "parallel_terms": {k: int(v) for k, v in terms.items()},
        "in_flight_microbatches": in_flight,  # a float under interleaving (chunks / v)
        "in_flight_chunks": in_flight_chunks,
    }


def fit_verdict(p10_bytes: int, p90_bytes: int, capacity: int) -> str:
    """yes: the upper estimate fits; tight: the lower one alone; no: neither."""
    return "yes" if p90_bytes <= capacity else ("tight" if p10_bytes <= capacity else "no")


def rank_memory(prof: MemoryProfile, layout: Layout, layers_per_stage: list[int]) -> dict[str, Any]:
    """``memory.*`` of the worst rank, plus ``per_stage`` when pp > 1."""
    stages = [
        stage_memory(prof, layout, s, n, layout.microbatches)
        for s, n in enumerate(layers_per_stage)
    ]
    worst = max(stages, key=lambda st: st["total_bytes"])
    out = {k: v for k, v in worst.items() if k not in ("stage", "layers")}
    out["worst_stage"] = worst["stage"]
    out["method"] = METHOD.format(
        method=prof.method,
        schedule=SCHEDULE_NAMES[layout.schedule] if layout.pp > 1 else "no pipeline",
    )
    out["terms"] = [dict(t) for t in prof.terms] + [  # the profile is cached: copies
        {"term": "nccl_buffers", "library": "nccl", "bytes": worst["parallel_terms"]["nccl_buffers"],
         "where": "outside allocator",  # NCCL allocates its buffers itself (cudaMalloc)
         "source": "NCCL_BUFFSIZE default 4 MiB (NVIDIA/nccl src/init.cc DEFAULT_BUFFSIZE) x "
                   f"{NCCL_CHANNELS} channels (assumption) x {NCCL_PEERS} ring peers x "
                   f"{communicators(layout, worst['stage'], bool(prof.params.get('tied')))}"
                   " communicators"},
    ]  # fmt: skip
    if layout.pp > 1:
        out["per_stage"] = stages
    return out
