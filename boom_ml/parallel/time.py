"""Step time of a parallel layout: per-stage compute from the traced rank, collectives from
NCCL's tuning model (ring / tree / NVLS, nccl.py), and the pipeline schedule simulated from per-stage times.

Per micro-batch, stage s takes ``T_s = C_s + X_s``: compute ``C_s`` (its layers, plus the
embedding on the first stage and head + loss on the last, from ``profile.py``) and the
communication on its critical path ``X_s`` (tensor-parallel all-reduces: 2 per layer forward
in the activations' dtype, 2 backward in the gradients' dtype, and under checkpointing 1 more
(PyTorch's non-reentrant checkpoint stops recomputing once the last saved tensor is rebuilt,
before the MLP's output all-reduce) or 2 (Megatron's full recompute); pipeline sends of the
activation forward and its gradient backward). ``C_s`` is at least the host's dispatch time of
the stage's ops (``DISPATCH_US`` each): small tensor-parallel shards are host-bound.

The pipeline (``schedule.py``): each stage's (or, interleaved, each model chunk's) compute and
tensor-parallel time is split into a forward ``F`` and a backward ``B`` by the profile's
``backward_fraction``; one point-to-point send of the activation (or its gradient) between
adjacent stages takes ``send_ms`` and blocks the sender (Megatron's p2p without
``overlap_p2p_comm``), which is the send time ``X_s`` has always charged a stage. The event
simulation of the layout's schedule (1F1B, GPipe or interleaved 1F1B) gives the pipeline time
and the bubble (total minus the busiest rank's busy time). For equal stages without sends,
1F1B and GPipe take ``(m + pp - 1) T`` (1F1B's closed form ``sum_s T_s + (m - 1) max_s T_s``)
with a bubble of ``(pp - 1) / (m + pp - 1)``; interleaved 1F1B over v chunks per rank
``(m + (pp - 1) / v) T`` with a bubble of ``(pp - 1) / (v m + pp - 1)``. Interleaving splits
each rank's layers into v chunks (the first chunk of rank 0 holds the embedding, the last chunk
of the last rank head + loss) and sends v times as often. Each micro-batch after the first
adds its gradients into the kept ones (``parallel.grad_accumulation=add``, autograd's one add
per gradient, timed in the profile; ZeRO-2 and FSDP without a pipeline add into their shards),
spread over the micro-batches' backward passes; ``fused`` (Megatron-LM's gradient accumulation
fusion) has none. After the last micro-batch: data-parallel gradient reduction (DDP all-reduce
overlapping the last backward except its last bucket, which holds the last-ready gradient, the
embedding's; ZeRO-1/2 reduce-scatter (ZeRO-2 after each micro-batch: it keeps only its
gradient shard) + all-gather of the updated parameters; FSDP2 as ``fsdp.py`` says)
and the optimizer step. The counts and bytes of DDP, FSDP2 and tensor-parallel collectives are
checked against the real wrappers traced on a fake process group (``traced.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from boom_ml.parallel.collectives import (
    Collective,
    GroupLink,
    algorithm_for,
    all_gather_ms,
    all_reduce_ms,
    reduce_scatter_ms,
    send_ms,
)
from boom_ml.parallel.fsdp import fsdp_collectives
from boom_ml.parallel.layout import SCHEDULE_NAMES, Layout
from boom_ml.parallel.memory import DDP_BUCKET_BYTES
from boom_ml.parallel.profile import TimeProfile
from boom_ml.parallel.schedule import simulate
from boom_ml.parallel.shard import chunk_layers

METHOD = (
    "per-rank compute: {method} on 1- and 2-layer traces of the {sharded}model, linear in"
    " layers, at least {dispatch_us:g} us of host dispatch per op + NCCL-tuned collectives"
    " (ring/tree/NVLS x LL/LL128/Simple as NCCL's tuning model picks, links.csv; DDP, FSDP2 and tensor-parallel counts and bytes as the wrappers issue them on"
    " a fake process group, tests/test_parallel_traced.py){pipeline}"
)
PIPELINE_METHOD = (
    " + {schedule} pipeline schedule (event simulation of per-stage forward/backward times and"
    " blocking point-to-point sends)"
)
# Host time to dispatch one op in eager PyTorch: ~5 us without autograd, ~7 us with
# (pytorch/pytorch#41383; ~4 us per CUDA op in pytorch/pytorch#82793). When a stage's kernels
# are shorter than that, the GPU waits for the host: a micro-batch takes at least
# ops x DISPATCH_US.
DISPATCH_US = 5.0


@dataclass(frozen=True)
class Shape:
    """What the collectives' sizes depend on."""

    batch_size: int  # micro-batch
    seq_len: int
    hidden: int
    act_bytes: int  # bytes per activation element on the wire (2 under fp16/bf16 autocast)
    checkpointing: bool
    params_layer: int  # per tensor-parallel rank
    params_first: int
    params_last: int
    # bytes per element in the parameters' dtype: gradients (dp reduction, tp backward
    # all-reduces of the residual stream's gradients) and the (not autocast) embedding output
    grad_bytes: int = 4
    param_bytes: int = 4  # bytes per parameter element all-gathered (ZeRO-3 / FSDP)
    # bytes per element of the residual stream a pipeline stage sends: the parameters' dtype
    # (autocast leaves the embedding and the residual adds alone: fp32 + bf16 is fp32)
    residual_bytes: int = 4
    overlap_grad_reduce: bool = True  # DDP buckets overlap backward (False: one reduce at the end)
    full_recompute: bool = False  # Megatron's checkpoint recomputes the whole layer (2 more AR)
    # of params_layer / _first / _last, those with gradients (None: all; fewer under LoRA)
    trainable_layer: int | None = None
    trainable_first: int | None = None
    trainable_last: int | None = None
    # of params_*, the parameters the model stands for (QLoRA's 4-bit weights counted as
    # weights, not as the bytes that hold them: shard.param_counts' logical_*; None: the same)
    logical_layer: int | None = None
    logical_first: int | None = None
    logical_last: int | None = None

    def count(self, role: str, trainable: bool = False, logical: bool = False) -> int:
        """Parameters per layer ('layer'), of the embedding ('first') or of the rest ('last');
        with ``trainable``, those of them that have gradients; with ``logical``, as the model
        stands for them."""
        kind = "trainable" if trainable else "logical" if logical else None
        own = getattr(self, f"{kind}_{role}") if kind else None
        return getattr(self, f"params_{role}") if own is None else own

    def stage_params(
        self, layers: int, first: bool, last: bool, trainable: bool = False, logical: bool = False
    ) -> int:
        """Parameters (or trainable ones, or those the model stands for) of a stage's layers
        and ends."""
        ends = (self.count("first", trainable, logical) if first else 0) + (
            self.count("last", trainable, logical) if last else 0
        )
        return layers * self.count("layer", trainable, logical) + ends


def tp_collectives(
    shape: Shape, layers: int, first: bool, last: bool, group: GroupLink
) -> list[Collective]:
    """Tensor-parallel all-reduces of one micro-batch on one stage.

    Row-parallel outputs (attention and MLP) are all-reduced in forward in the activations'
    dtype; the column-parallel inputs' gradients in backward in the dtype of the residual
    stream, the parameters' (fp32 under PyTorch autocast: the all-reduce sits before
    autocast's cast, as traced through DTensor in ``traced.py``; fp16 in Megatron's fp16 model).
    """
    if group.size <= 1:
        return []
    tokens = shape.batch_size * shape.seq_len * shape.hidden
    act = tokens * shape.act_bytes
    recompute = (2 if shape.full_recompute else 1) if shape.checkpointing else 0
    what = "layer outputs (attention and MLP, forward" + (" and recompute)" if recompute else ")")
    out = [Collective("all_reduce", "tp", what, act, (2 + recompute) * layers, 0.0, 0.0),
           Collective("all_reduce", "tp", "layer input gradients (attention and MLP, backward)",
                      tokens * shape.grad_bytes, 2 * layers, 0.0, 0.0)]  # fmt: skip
    if first:  # the embedding is not autocast: its output is in the parameters' dtype
        out.append(Collective("all_reduce", "tp", "vocab-parallel embedding output",
                              tokens * shape.grad_bytes, 1, 0, 0))  # fmt: skip
    if last:
        out.append(Collective("all_reduce", "tp", "LM head input gradient",
                              tokens * shape.grad_bytes, 1, 0, 0))  # fmt: skip
        small = shape.batch_size * shape.seq_len * 4
        out.append(Collective("all_reduce", "tp", "vocab-parallel cross-entropy (max, sum, target)",
                              small, 3, 0, 0))  # fmt: skip
    for c in out:
        c.ms = all_reduce_ms(c.bytes, group) * c.calls
        c.exposed_ms = c.ms
    return out


def pp_collectives(
    shape: Shape, first: bool, last: bool, group: GroupLink, chunks: int = 1
) -> list[Collective]:
    """Activation sends of one micro-batch leaving or entering a stage (forward and backward).

    ``chunks``: model chunks the rank holds (interleaved schedule): each chunk sends and
    receives, except the model's first chunk (nothing in, no gradient out) and its last.
    """
    if group.size <= 1:
        return []
    act = shape.batch_size * shape.seq_len * shape.hidden * shape.residual_bytes
    # per chunk it sends its output forward and its input's gradient backward, and receives
    # the two it needs; none before the first or after the last. A transfer is the sender's
    # time (it blocks it) and the receiver's wait, so the stage is charged its own sends
    sends = (4 * chunks - (2 if last else 0) - (2 if first else 0)) // 2
    ms = send_ms(act, group) * sends
    return [Collective("send_recv", "pp", "activations and their gradients sent", act, sends,
                       ms, ms)]  # fmt: skip


def dp_collectives(
    shape: Shape, layout: Layout, params: int, backward_ms: float, compute_mb_ms: float,
    group: GroupLink, embed_group: GroupLink | None, tied_params: int,
    layer_params: int | None = None, last_ready_bytes: int = 0,
    trainable: int | None = None, layer_trainable: int | None = None,
) -> list[Collective]:  # fmt: skip
    """Gradient reduction (and ZeRO-3 / FSDP parameter gathers) over dp for one step.

    ``layer_params``: of ``params``, those in the layers (FSDP units; the rest, embedding, final
    norm and head, is the root unit; default: all). ``trainable`` / ``layer_trainable``: the
    same for the parameters that have gradients (default: all; LoRA's adapters only): only
    their gradients are reduced and only they are updated, while FSDP gathers every parameter.
    ``last_ready_bytes``: the gradient that becomes ready last (the embedding's on the first
    stage), which DDP's last bucket holds. ``tied_params``: the tied head's trainable ones.
    """
    out: list[Collective] = []
    m = layout.microbatches
    trainable = params if trainable is None else trainable
    if group.size > 1:
        grads = trainable * shape.grad_bytes
        # the last bucket: the last-ready gradient plus what came after the previous bucket
        # closed (under one cap; collectives.ddp_buckets): at most this. Nothing is left of
        # the backward to hide its reduction, whichever collective reduces it.
        last = min(grads, last_ready_bytes + DDP_BUCKET_BYTES)
        if layout.zero_stage == 0:
            ms = all_reduce_ms(grads, group)
            if shape.overlap_grad_reduce:
                last_bucket = all_reduce_ms(last, group)
                exposed = max(last_bucket, ms - backward_ms)
            else:
                exposed = ms
            out.append(Collective("all_reduce", "dp", "gradients (DDP)", grads, 1, ms, exposed))
        elif not layout.fsdp2:  # ZeRO-1 / ZeRO-2 (DeepSpeed's: without a pipeline)
            rs = reduce_scatter_ms(grads, group)
            exposed = (
                rs
                if not shape.overlap_grad_reduce
                else max(reduce_scatter_ms(last, group), rs - backward_ms)
            )
            # ZeRO-2 keeps only its shard of the gradients (memory.py), so it reduces after
            # every micro-batch's backward (DeepSpeed's stage 2 does); ZeRO-1 accumulates the
            # whole gradients and reduces once
            calls = m if layout.shards_microbatch_gradients else 1
            out.append(Collective("reduce_scatter", "dp", "gradients (ZeRO)", grads, calls,
                                  calls * rs, calls * exposed))  # fmt: skip
            pbytes = trainable * shape.grad_bytes  # the updated ones, in their own width
            ag = all_gather_ms(pbytes, group)
            out.append(
                Collective("all_gather", "dp", "updated parameters (ZeRO)", pbytes, 1, ag, ag)
            )
        else:
            out += fsdp_collectives(layout, group, params=params, layer_params=layer_params,
                                    trainable=trainable, layer_trainable=layer_trainable,
                                    unit_params=shape.params_layer, param_bytes=shape.param_bytes,
                                    grad_bytes=shape.grad_bytes, backward_ms=backward_ms,
                                    compute_mb_ms=compute_mb_ms)  # fmt: skip
    if embed_group is not None and tied_params:
        nbytes = tied_params * shape.grad_bytes
        ms = all_reduce_ms(nbytes, embed_group)
        out.append(Collective("all_reduce", "embedding", "tied embedding gradient (first and last stage)",
                              nbytes, 1, ms, ms))  # fmt: skip
    return out


def step_time(
    prof: TimeProfile, shape: Shape, layout: Layout, layers_per_stage: list[int],
    groups: dict[str, GroupLink], tied_params: int = 0, compute_scale: float = 1.0,
    dispatch_us: float = DISPATCH_US, other_scale: float = 1.0,
) -> dict[str, Any]:  # fmt: skip
    """``time.*`` of one optimizer step over the global batch (JSON-able).

    ``compute_scale`` multiplies every compute time, ``other_scale`` further the time of the
    memory-bound (non-GEMM, non-attention) kernels; both are 1 unless calibrated.
    """
    pp, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    chunks = chunk_layers(layers_per_stage, v)  # per rank, its chunks' layers

    def chunk_compute(n: int, first: bool, last: bool) -> float:
        total = n * prof.layer_ms + (prof.first_ms if first else 0) + (prof.last_ms if last else 0)
        matrix = n * prof.layer_matrix_ms + (prof.last_matrix_ms if last else 0)
        # other_scale: memory-bound kernels only (1 = as predicted)
        compute = compute_scale * (matrix + other_scale * (total - matrix))
        ops = n * prof.layer_ops + (prof.first_ops if first else 0) + (prof.last_ops if last else 0)
        return max(compute, ops * dispatch_us * 1e-3)

    tied = tied_params if pp > 1 else 0
    ends = [shape.count("first", True), shape.count("last", True)]
    traced_ends = sum(ends) - tied  # the 1-layer trace holds a tied weight once

    def ends_share(first: bool, last: bool) -> float:
        """Of the per-parameter work of the ends (embedding, final norm, head: optimizer step,
        gradient adds) the 1-layer trace timed, the share of a stage holding first / last (a
        tied head's copy on the last stage of a pipeline is stepped there too)."""
        mine = (ends[0] if first else 0) + (ends[1] if last else 0)
        return mine / traced_ends if traced_ends > 0 else float(first or last)

    def chunk_adds(n: int, first: bool, last: bool) -> float:
        """ms each micro-batch after the first adds into the chunk's kept gradients."""
        if layout.grad_accumulation != "add" or m == 1:
            return 0.0
        ms = n * prof.accumulate_layer_ms + ends_share(first, last) * prof.accumulate_ends_ms
        if layout.shards_microbatch_gradients:  # added into 1/dp shards
            ms /= layout.dp
        return compute_scale * other_scale * ms  # memory-bound kernels

    # per virtual stage j = chunk * pp + rank (model order): forward and backward of one
    # micro-batch, compute and tensor-parallel all-reduces split by the backward share
    bwd = prof.backward_fraction
    fwd_ms, bwd_ms = [0.0] * (pp * v), [0.0] * (pp * v)
    stages = []
    for s, layers_c in enumerate(chunks):
        compute = accumulate = 0.0
        for c, n in enumerate(layers_c):
            j = c * pp + s
            cfirst, clast = j == 0, j == pp * v - 1
            cc = chunk_compute(n, cfirst, clast)
            tp = sum(x.ms for x in tp_collectives(shape, n, cfirst, clast, groups["tp"]))
            # micro-batches are alike in the schedule: each carries its share of the adds
            add = chunk_adds(n, cfirst, clast) * (m - 1) / m
            fwd_ms[j], bwd_ms[j] = (1 - bwd) * (cc + tp), bwd * (cc + tp) + add
            compute += cc + add
            accumulate += add * m
        n = sum(layers_c)
        first, last = s == 0, s == pp - 1
        # the rank's all-reduces: linear in layers, so the sum over its chunks
        colls = tp_collectives(shape, n, first, last, groups["tp"])
        colls += pp_collectives(shape, first, last, groups["pp"], chunks=v)
        crit = sum(c.ms for c in colls)
        for c in colls:  # per micro-batch -> per step
            c.calls *= m
            c.ms *= m
            c.exposed_ms *= m
        params = shape.stage_params(n, first, last)
        trainable = shape.stage_params(n, first, last, trainable=True)
        logical = shape.stage_params(n, first, last, logical=True)
        opt = compute_scale * (n * prof.opt_layer_ms + ends_share(first, last) * prof.opt_ends_ms)
        if layout.zero_stage >= 1:
            opt /= layout.dp  # each rank steps its shard
        stages.append({"stage": s, "layers": n, "compute_ms": compute, "comm_ms": crit,
                       "micro_ms": compute + crit, "optimizer_ms": opt, "params": params,
                       "accumulate_ms": accumulate,
                       "trainable": trainable, "logical_params": logical,
                       "collectives": colls, "first": first, "last": last})  # fmt: skip
    p2p = 0.0
    if pp > 1:
        act = shape.batch_size * shape.seq_len * shape.hidden * shape.residual_bytes
        p2p = send_ms(act, groups["pp"])
        run = simulate(fwd_ms, bwd_ms, m, layout.schedule, pp=pp, p2p_ms=p2p)
        pipe_ms, bubble_ms = run.total_ms, run.bubble_ms
        busy, peaks = run.busy_ms, run.peak_in_flight
        ends = [max(end for (_, j, _), end in run.ends.items() if j % pp == r) for r in range(pp)]
    else:  # one rank: micro-batches run one after another whatever the schedule
        pipe_ms, bubble_ms = m * (sum(fwd_ms) + sum(bwd_ms)), 0.0
        busy, peaks, ends = [pipe_ms], [v], [pipe_ms]
    embed = groups["embedding"] if pp > 1 else None
    for st, rank_busy, peak, end in zip(stages, busy, peaks, ends, strict=True):
        st["busy_ms"] = rank_busy
        st["in_flight_chunks"] = peak
        # after its last backward a rank reduces its gradients over dp and steps its
        # optimizer: the step ends when the last rank has (not always the busiest one: the
        # first stages hold the extra layers of an uneven split, and 1F1B ends on rank 0)
        st["dp"] = dp_collectives(
            shape, layout, st["params"], st["compute_ms"] * prof.backward_fraction,
            st["compute_ms"], groups["dp"], embed, tied,
            layer_params=st["layers"] * shape.params_layer,
            last_ready_bytes=shape.count("first", True) * shape.grad_bytes if st["first"] else 0,
            trainable=st["trainable"], layer_trainable=st["layers"] * shape.count("layer", True),
        )  # fmt: skip
        st["end_ms"] = end
        st["exposed_dp_ms"] = sum(c.exposed_ms for c in st["dp"])
        st["finish_ms"] = end + st["exposed_dp_ms"] + st["optimizer_ms"]
    worst = max(stages, key=lambda st: st["micro_ms"])
    dp = worst["dp"]
    colls = worst["collectives"] + dp
    for c in colls:  # what NCCL's tuner runs for one call (nccl.py)
        c.algorithm = algorithm_for(c.op, c.bytes, groups[c.group])
    last = max(stages, key=lambda st: st["finish_ms"])
    step = last["finish_ms"]
    comm = sum(c.ms for c in colls)
    exposed = sum(c.exposed_ms for c in colls)
    return {
        "step_ms": round(step, 4),
        "compute_ms": round(m * worst["compute_ms"] + worst["optimizer_ms"], 4),
        "comm_ms": round(comm, 4),
        "exposed_comm_ms": round(exposed, 4),
        "bubble_ms": round(bubble_ms, 4),
        "bubble_fraction": round(bubble_ms / step, 4) if step > 0 else 0.0,
        "pipeline_ms": round(pipe_ms, 4),
        "optimizer_ms": round(worst["optimizer_ms"], 4),
        "accumulate_ms": round(worst["accumulate_ms"], 4),
        "critical_stage": worst["stage"],
        "finish_stage": last["stage"],  # the rank whose optimizer step ends the step
        "collectives": sorted((c.to_dict() for c in colls), key=lambda c: -c["ms"]),
        "per_stage": [
            {
                k: (round(val, 4) if isinstance(val, float) else val)
                for k, val in st.items()
                if k not in ("collectives", "first", "last", "dp")
            }
            for st in stages
        ],  # fmt: skip
        "schedule": layout.schedule,
        "virtual_stages": v,
        # one micro-batch's forward and backward per virtual stage, model order (chunk c of
        # rank r is c * pp + r): what the schedule simulation ran (the pipeline plot re-runs it)
        "virtual_stage_ms": [
            {"forward_ms": round(f, 4), "backward_ms": round(b, 4)}
            for f, b in zip(fwd_ms, bwd_ms, strict=True)
        ],
        "p2p_ms": round(p2p, 4),
        "method": METHOD.format(
            method=prof.method,
            sharded=f"tp={layout.tp}-sharded " if layout.tp > 1 else "",
            dispatch_us=dispatch_us,
            pipeline=PIPELINE_METHOD.format(schedule=SCHEDULE_NAMES[layout.schedule])
            if layout.pp > 1
            else "",
        ),
    }
