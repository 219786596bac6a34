"""Pipeline schedules as a small event simulation: GPipe, 1F1B and interleaved 1F1B.

The pipeline is ``pp * v`` virtual stages in model order; virtual stage ``j`` is model chunk
``j // pp`` of pipeline rank ``j % pp`` (Megatron-LM's layout: rank r holds chunks r, r + pp,
r + 2 pp, ...; with ``v = 1`` a virtual stage is a rank's whole stage). Each rank runs its
operations, a forward ``F(j, i)`` or a backward ``B(j, i)`` of micro-batch i on one of its
chunks, in the order its schedule prescribes:

* GPipe (Huang et al. 2019): all m forwards, then all m backwards, both in micro-batch order
  (as ``torch.distributed.pipelining``'s ``ScheduleGPipe`` runs them);
* 1F1B / PipeDream-Flush (Narayanan et al. 2021; Megatron-LM's
  ``forward_backward_pipelining_without_interleaving``): ``min(pp - r - 1, m)`` warm-up
  forwards, then one forward and one backward in turn, then the cool-down backwards;
* interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM's
  ``forward_backward_pipelining_with_interleaving`` in
  ``megatron/core/pipeline_parallel/schedules.py``): the rank's m * v chunk-forwards run in
  Megatron's schedule table (``get_schedule_table``): micro-batches go round in groups of
  ``microbatch_group_size_per_vp_stage`` (default pp, ``model_parallel_config.py``), every
  chunk in turn taking the whole group; the k-th backward is on chunk ``v - 1 -`` (the chunk
  of the k-th forward), same micro-batch. Warm-up: ``(pp - r - 1) * 2 + (v - 1) * group``
  chunk-forwards (``get_pp_rank_microbatches``; all m * v if fewer), then forward k + warm-up
  and backward k in turn (forward first), then the cool-down backwards.

An operation starts when its rank is free and its input is ready: a forward needs the forward
of the same micro-batch on the previous virtual stage, a backward the backward on the next
one (the last virtual stage's backward: its own forward). Between ranks the input arrives
``p2p_ms`` after the producing operation ends. Sends block the sender for ``p2p_ms`` too
(``blocking_sends``, the default): Megatron's point-to-point calls wait for their batched
isend/irecv to finish unless ``overlap_p2p_comm`` is on, which is also what the per-stage
send time of ``time.py`` has always charged each stage (one send per direction it sends in).
GPipe is charged the same way (an assumption: ``ScheduleGPipe`` sends asynchronously, which
``blocking_sends=False`` models); with equal stages its forwards then wait on each send of the
stage before, so its bubble exceeds 1F1B's by about a send per micro-batch. When the stage
after is the slower one (the last stage holds head and loss) nothing waits and the two
bubbles are equal.

Results: the step's pipeline time, per rank its busy time (compute plus blocking sends), the
bubble (total minus the busiest rank's busy time), and per rank the peak number of
chunk-micro-batches whose forward is done and whose backward is not (activations in flight;
the operation order alone fixes it, so :func:`peak_in_flight` needs no times).

No code is copied from Megatron-LM or PyTorch; the orders above are re-derived from their
descriptions and checked against the closed forms in ``tests/test_parallel_schedule.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from boom_ml.parallel.layout import SCHEDULES

Op = tuple[str, int, int]  # ("F" | "B", virtual stage, micro-batch)


def interleaved_warmup(
    pp: int, rank: int, microbatches: int, v: int, group: int | None = None
) -> int:
    """Megatron's warm-up chunk-forwards of ``rank`` under interleaving, at most all m * v."""
    group = pp if group is None else group
    return min((pp - rank - 1) * 2 + (v - 1) * group, microbatches * v)


def schedule_table(microbatches: int, v: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each chunk-forward of a rank, in order (Megatron's table).

    Micro-batches go in groups of ``group``; within a group every chunk takes all of the
    group's micro-batches before the next chunk starts. A last group shorter than ``group``
    is merged into the one before it, as Megatron does.
    """
    table: list[tuple[int, int]] = []
    for start in range(0, microbatches, group):
        if start + group >= microbatches:
            members = range(start, microbatches)
        else:
            members = range(start, start + group)
        table += [(i, c) for c in range(v) for i in members]
        if start + group >= microbatches:
            break
    return table


def rank_ops(schedule: str, pp: int, microbatches: int, v: int, rank: int) -> list[Op]:
    """The operations of pipeline rank ``rank`` in the order it runs them."""
    m = microbatches
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    if schedule == "gpipe":
        stages = [c * pp + rank for c in range(v)]
        fwd = [("F", j, i) for i in range(m) for j in stages]
        bwd = [("B", j, i) for i in range(m) for j in reversed(stages)]
        return fwd + bwd
    if schedule == "1f1b":
        if v != 1:
            raise ValueError("1F1B runs one chunk per rank (virtual_stages=1)")
        warm = min(pp - rank - 1, m)
        fwd = [("F", rank, i) for i in range(m)]
        bwd = [("B", rank, i) for i in range(m)]
    else:
        table = schedule_table(m, v, pp)
        warm = interleaved_warmup(pp, rank, m, v)
        fwd = [("F", c * pp + rank, i) for i, c in table]
        bwd = [("B", (v - 1 - c) * pp + rank, i) for i, c in table]
    ops = fwd[:warm]
    for k in range(len(fwd) - warm):
        ops += [fwd[warm + k], bwd[k]]
    return ops + bwd[len(fwd) - warm :]


def peak_in_flight(schedule: str, pp: int, microbatches: int, v: int = 1) -> list[int]:
    """Per rank: the most chunk-micro-batches whose forward is done and backward is not.

    1F1B: ``min(pp - r, m)``; GPipe: ``m * v``; interleaved: Megatron's warm-up + 1, at most
    ``m * v`` (the forward after the warm-up runs before the first backward).
    """
    return list(_peaks(schedule, pp, microbatches, v))


@functools.lru_cache(maxsize=256)
def _peaks(schedule: str, pp: int, microbatches: int, v: int) -> tuple[int, ...]:
    out = []
    for rank in range(pp):
        live = peak = 0
        for kind, _, _ in rank_ops(schedule, pp, microbatches, v, rank):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def head_in_flight(schedule: str, pp: int, microbatches: int, v: int = 1) -> int:
    """Of the last rank's chunk-micro-batches in flight at its peak, those of the model's last
    chunk, the one with the head (under interleaving the last rank's warm-up runs its first
    chunk, so one head's logits are in flight where 1 / v of every micro-batch's layers are
    more than once); the most at any moment the peak count is reached."""
    head, live, peak, heads, most = v * pp - 1, 0, 0, 0, 0
    for kind, chunk, _ in rank_ops(schedule, pp, microbatches, v, pp - 1):
        step = 1 if kind == "F" else -1
        live += step
        heads += step if chunk == head else 0
        if live > peak:
            peak, most = live, heads
        elif live == peak:
            most = max(most, heads)
    return most


@dataclass
class PipelineRun:
    """One simulated pipeline step (times in ms)."""

    total_ms: float
    bubble_ms: float
    busy_ms: list[float]  # per rank: compute plus blocking sends
    peak_in_flight: list[int]  # per rank, chunk-micro-batches
    starts: dict[Op, float] = field(default_factory=dict, repr=False)
    ends: dict[Op, float] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"total_ms": self.total_ms, "bubble_ms": self.bubble_ms,
                "busy_ms": self.busy_ms, "peak_in_flight": self.peak_in_flight}  # fmt: skip


def simulate(
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    microbatches: int,
    schedule: str = "1f1b",
    pp: int | None = None,
    p2p_ms: float = 0.0,
    blocking_sends: bool = True,
) -> PipelineRun:
    """Simulate one step over virtual stages with per-micro-batch times ``forward_ms[j]`` and
    ``backward_ms[j]`` (model order, ``pp * v`` of them; ``pp`` defaults to their number, i.e.
    one chunk per rank)."""
    stages = len(forward_ms)
    if len(backward_ms) != stages or stages == 0:
        raise ValueError("forward_ms and backward_ms need one time per virtual stage")
    pp = stages if pp is None else pp
    if stages % pp:
        raise ValueError(f"{stages} virtual stages do not split over pp={pp} ranks")
    v = stages // pp
    m = microbatches
    orders = [rank_ops(schedule, pp, m, v, r) for r in range(pp)]
    ends: dict[Op, float] = {}
    starts: dict[Op, float] = {}
    free = [0.0] * pp
    busy = [0.0] * pp
    nxt = [0] * pp
    last = stages - 1
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            order = orders[r]
            while nxt[r] < len(order):
                op = order[nxt[r]]
                kind, j, i = op
                if kind == "F":
                    dep = ("F", j - 1, i) if j > 0 else None
                else:
                    dep = ("B", j + 1, i) if j < last else ("F", j, i)
                ready = 0.0
                if dep is not None:
                    done = ends.get(dep)
                    if done is None:
                        break  # its input is not computed yet: another rank goes first
                    ready = done + (p2p_ms if dep[1] % pp != r else 0.0)
                start = max(free[r], ready)
                dur = forward_ms[j] if kind == "F" else backward_ms[j]
                end = start + dur
                starts[op], ends[op] = start, end
                sends = (kind == "F" and j < last) or (kind == "B" and j > 0)
                hold = p2p_ms if blocking_sends and sends and pp > 1 else 0.0
                free[r] = end + hold
                busy[r] += dur + hold
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} schedule deadlocks (pp={pp}, v={v}, m={m})")
    total = max(ends.values())
    peaks = peak_in_flight(schedule, pp, m, v)
    return PipelineRun(total, total - max(busy), busy, peaks, starts, ends)
