"""A rank's gradient bytes at a peak of its step: what a pipeline stage holds of the traced
model's (a gradient computed beside its kept copy is one tensor, held by the stage whose
parameter it is), and what waits whole for its reduce-scatter where each micro-batch's
gradients are sharded (ZeRO-2: the gradient just made; FSDP2: its unit's and the root's).
``memory.py`` applies them to each stage's peak."""

from __future__ import annotations

from boom_ml.memory.allocator_config import K_MIN_BLOCK_SIZE
from boom_ml.parallel.layout import Layout
from boom_ml.parallel.memory_profile import MemoryProfile


def largest_tensor(prof: MemoryProfile, layers: int, first: bool, last: bool, pp: int) -> int:
    """The largest trainable tensor the stage holds, elements (0: a profile without them)."""
    big = prof.largest
    if not big:
        return 0
    tied = (prof.trainable or prof.params).get("tied", 0) if last and pp > 1 else 0
    return max(big["layers"] if layers else 0, big["first"] if first else 0,
               max(big["last"], tied) if last else 0)  # fmt: skip


def stage_gradient(
    prof: MemoryProfile, traced: float, ratio: float, layers: int, largest: int, drained: bool
) -> tuple[float, float]:
    """(gradient bytes the stage holds at a peak, of them a fresh one beside its kept copy).

    The traced model's gradient bytes at the peak are at most all its gradients (those
    alive, a share of them mid-backward) plus, under accumulation, the one just computed
    and not yet added into its kept copy (the LM head's, 2.1 GB of a Llama in fp32). The
    first part is scaled to the stage by its trainable parameters; the fresh one is one
    tensor, so a stage holds at most its own largest: the head's had been shared out in
    proportion, a middle stage given 1.08 GB more than it holds and the first 0.4 GB less
    (a hunt). The optimizer step's and zero_grad's gradients (fp32 casts under master
    weights among them) are scaled as they were."""
    if drained or prof.master_weights or not prof.largest or not prof.tensors:
        # master weights: the traced gradients are the 16-bit ones and fp32 copies beside
        # them (zero_grad=zero keeps the fp32 ones all step), none of them a fresh one (a
        # review: 2N bytes of fp32 copies had been read as one and cut to a tensor)
        return traced * ratio, 0.0
    t, n = prof.trainable or prof.params, prof.tensors
    every = (layers * t["layers"] + t["first"] + t["last"]) * prof.trainable_bytes
    # each gradient as the allocator holds it: rounded up to its 512-byte blocks
    rounding = K_MIN_BLOCK_SIZE * (layers * n["layers"] + n["first"] + n["last"])
    fresh = traced - every - rounding
    if fresh <= 0:
        return traced * ratio, 0.0
    held = min(fresh, largest * prof.trainable_bytes)
    return (traced - fresh) * ratio + held, held


def sharded_gradient(grad: float, fresh: float, waiting: float, zero: int, dp: int) -> float:
    """A rank's gradient bytes at a peak where each micro-batch's are reduce-scattered:
    ``grad`` as one GPU holds it at the peak (``fresh`` of it computed beside its kept copy),
    ``waiting``: what the backward holds whole for its reduction (:func:`unreduced`). All had
    been divided by dp: a Llama's embedding gradient, whole at the backward's end, came out
    1.5 GB short at dp=4 (a hunt)."""
    kept = grad - fresh
    if fresh > 0:  # accumulation: the kept gradients are shards, the fresh one waits whole
        return kept / dp + (max(fresh, waiting) if zero >= 3 else fresh)
    whole = min(waiting, kept)
    return (kept - whole) / dp + whole


def unreduced(prof: MemoryProfile, layout: Layout, layers: int) -> float:
    """Gradient bytes a rank holds whole at a backward's peak where each micro-batch's
    gradients are reduce-scattered (pipeline-free ZeRO-2 and FSDP): FSDP2 reduces a unit's
    gradients after its backward, so one layer's and the root's (embedding, final norm, head:
    reduced at the backward's end) wait whole; ZeRO-2 reduces each gradient as it is made, so
    the largest one waits."""
    t, big, gb = prof.trainable or prof.params, prof.largest, prof.trainable_bytes
    if layout.zero_stage >= 3:
        return (t["first"] + t["last"] + (t["layers"] if layers else 0)) * gb
    return max(big.values(), default=0) * gb
