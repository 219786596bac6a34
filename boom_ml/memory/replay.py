"""A training loop's alloc/free events, built from one traced step.

The replay models the loop ``for x, y in loader: opt.zero_grad(); x, y = x.cuda(),
y.cuda(); out = model(x); loss = f(out, y); loss.backward(); opt.step()``: Python keeps
the last batch and the last outputs alive until their names are rebound, so the
previous step's device batch dies at the loop head (when ``x`` is rebound to the next
host batch) and its outputs (logits, and whatever else the model returns) only when the
next forward returns (``hold_outputs``). The tracer itself deletes both right away.

With gradient accumulation (``accumulate``) ``zero_grad`` runs only once per optimizer
step, so the gradients of the previous micro-batch stay alive through the next forward
and backward; each new gradient is summed into the existing ``.grad`` in place by
autograd's AccumulateGrad, and the incoming buffer dies right after the sum. Under fp32
master weights the gradients that survive are backward's 16-bit ones (the optimizer casts
them to the copies' fp32 gradients and drops them): each step after the first starts with
them alive, as the earlier micro-batches left them, and the copies' fp32 gradients come and
go as without accumulation.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from boom_ml.memory.overheads import Extra
from boom_ml.trace.graph import OpGraph

PRE_EXISTING = ("parameter", "gradient", "optimizer_state")
# Optimizers whose state is created in the constructor rather than at the first step.
EAGER_STATE_OPTIMIZERS = ("adagrad",)
DEFAULT_STEPS = 3
# Steps a replay may grow to while its reserved peak still rises from one step to the next
# (memory/estimate.py: still_growing); a bound on the work, not a fitted number.
MAX_STEPS = 8


@dataclass
class Replay:
    """Events of ``steps`` consecutive training steps, ready for the allocator.

    ``src`` is the row of ``graph.mem_events`` each event comes from (-1 for a synthetic
    event such as a workspace, whose category is in ``synthetic``); ``step`` is 1-based.
    ``at`` is the row in whose place of the loop the event happens, which names its phase:
    the row itself, except for what the loop frees elsewhere than the trace did (the last
    batch at the loop head, the last outputs when the next forward returns, the last step's
    gradients at its ``zero_grad``), whose own row was a free in another phase.
    """

    is_alloc: np.ndarray
    block: np.ndarray
    nbytes: np.ndarray
    src: np.ndarray
    step: np.ndarray
    at: np.ndarray
    synthetic: dict[int, str] = field(default_factory=dict)  # block → category
    optional: frozenset[int] = frozenset()  # synthetic blocks skipped when they do not fit

    def tuples(self) -> list[tuple[str, int, int]]:
        actions = np.where(self.is_alloc, "alloc", "free")
        return list(zip(actions.tolist(), self.block.tolist(), self.nbytes.tolist(), strict=True))


class _Builder:
    """Accumulates replay events; one instance per replay."""

    def __init__(self) -> None:
        self.rows: list[tuple[bool, int, int, int, int, int]] = []
        self.synthetic: dict[int, str] = {}
        self.optional: set[int] = set()
        self.at = -1  # the row being replayed (Replay.at)

    def add(self, alloc: bool, block: int, nbytes: int, src: int, step: int) -> None:
        self.rows.append((alloc, block, nbytes, src, step, self.at))

    def build(self) -> Replay:
        if not self.rows:
            empty = np.zeros(0, dtype=np.int64)
            return Replay(empty.astype(bool), empty, empty, empty, empty, empty)
        cols = list(zip(*self.rows, strict=True))
        return Replay(
            np.asarray(cols[0], dtype=bool),
            np.asarray(cols[1], dtype=np.int64),
            np.asarray(cols[2], dtype=np.int64),
            np.asarray(cols[3], dtype=np.int64),
            np.asarray(cols[4], dtype=np.int64),
            np.asarray(cols[5], dtype=np.int64),
            self.synthetic,
            frozenset(self.optional),
        )


def build_replay(
    graph: OpGraph,
    steps: int = DEFAULT_STEPS,
    hold_outputs: bool = True,
    extras: list[Extra] | None = None,
    accumulate: bool = False,
) -> Replay:
    """The traced step's events as ``steps`` consecutive steps of a training loop.

    Step 1 starts from parameters only (plus Adagrad's eagerly created state): there are
    no gradients to free and the optimizer state is created lazily, just before the
    first optimizer kernel. Steps >= 2 are the recorded steady-state step, where
    ``zero_grad(set_to_none=True)`` frees the previous step's gradients; with
    ``accumulate`` they survive instead and each new gradient is a transient buffer. A step
    traced with ``zero_grad="zero"`` keeps them from step 1 on (zeroed in place, never freed),
    but for fp32 master weights' gradients, each replaced by the optimizer's cast.
    """
    ev = graph.mem_events
    phase = ev["phase"].to_numpy().astype(str)
    action = ev["action"].to_numpy().astype(str)
    category = ev["category"].to_numpy().astype(str)
    blocks = ev["block"].to_numpy(dtype=np.int64)
    nbytes = ev["bytes"].to_numpy(dtype=np.int64)
    node = ev["node_id"].to_numpy(dtype=np.int64)
    is_alloc = action == "alloc"
    out = _Builder()
    if len(ev) == 0:
        return out.build()
    stride = int(blocks.max()) + 1
    pre = np.isin(phase, PRE_EXISTING)
    body = np.flatnonzero(~pre)
    # zero_grad(set_to_none=False) keeps every gradient: allocated once, alive in every step
    kept_grads = graph.meta.get("step", {}).get("zero_grad") == "zero"
    # fp32 master weights: backward's 16-bit gradients are cast to the copies' fp32 ones and
    # dropped in the optimizer; under accumulation they, not the fp32 ones, are what survives
    # from one micro-batch to the next (the fp32 ones exist from the step to the zero_grad)
    master = bool(graph.meta.get("step", {}).get("master_weights"))
    accumulate_carried = accumulate and not master
    persistent_rows = np.flatnonzero(pre & ((phase != "gradient") | kept_grads) & is_alloc)
    old_grads = set(blocks[pre & (phase == "gradient")].tolist())
    freed_in_body = set(blocks[~pre & ~is_alloc].tolist())
    # Blocks created in the body and still alive at its end: this step's gradients (and
    # anything else the step leaves behind); the next zero_grad releases them.
    carried = [int(blocks[r]) for r in body if is_alloc[r] and int(blocks[r]) not in freed_in_body]
    grad_match = _match_gradients(ev, old_grads, carried)
    dropped: dict[int, int] = {}  # master weights: 16-bit gradient block -> its alloc row
    if master and accumulate:
        grads = body[is_alloc[body] & (category[body] == "gradient")]
        dropped = {int(blocks[r]): int(r) for r in grads if int(blocks[r]) in freed_in_body}

    deferred: dict[int, str] = {}
    if hold_outputs:
        deferred = _held_references(phase, category, node, is_alloc, blocks, body)
    last_of = {p: _last(body, phase, p) for p in ("zero_grad", "forward")}
    zero_grad_end = (
        last_of["zero_grad"] if last_of["zero_grad"] >= 0 or not len(body) else int(body[0])
    )
    opt_rows = body[phase[body] == "optimizer"]
    first_opt = int(opt_rows[0]) if len(opt_rows) else -1
    # An optimizer whose kernels all work in place (bitsandbytes' 8-bit AdamW, SGD with
    # momentum) leaves no event in its phase: its state appears in the first step after the
    # step's last event, the backward's last free (it had come before that free, holding a
    # tied embedding's 154 MB gradient term at gpt2's optimizer-step peak: a hunt)
    state_last = int(body[-1]) if first_opt < 0 and len(body) else -1

    eager_state = str(graph.meta.get("step", {}).get("optimizer", "")) in EAGER_STATE_OPTIMIZERS
    extras = list(extras or [])
    before: dict[int, list[int]] = defaultdict(list)
    after: dict[int, list[int]] = defaultdict(list)
    made_after: dict[int, list[int]] = defaultdict(list)
    for i, x in enumerate(extras):
        (made_after if x.alloc_after_row else before)[x.alloc_before].append(i)
        if x.free_after is not None and not x.persistent:
            after[x.free_after].append(i)

    def synthetic_id(i: int, k: int) -> int:
        # Negative ids never clash with traced blocks; persistent extras use k = 0.
        return -(1 + i + len(extras) * (0 if extras[i].persistent else k))

    def add_extra(i: int, k: int) -> None:
        if k == 1 or not extras[i].persistent:
            out.synthetic[synthetic_id(i, k)] = extras[i].category
            if extras[i].optional:
                out.optional.add(synthetic_id(i, k))
            out.add(True, synthetic_id(i, k), extras[i].nbytes, -1, k)

    state_rows = persistent_rows[phase[persistent_rows] == "optimizer_state"]
    param_rows = persistent_rows[phase[persistent_rows] != "optimizer_state"]
    for r in param_rows:
        out.at = int(r)
        out.add(True, int(blocks[r]), int(nbytes[r]), int(r), 1)
    if eager_state:
        for r in state_rows:
            out.at = int(r)
            out.add(True, int(blocks[r]), int(nbytes[r]), int(r), 1)
    matched = set(grad_match.values())
    pending: dict[str, list[tuple[int, int, int]]] = {"start": [], "forward": []}
    for k in range(1, steps + 1):
        off = k * stride
        held: dict[str, list[tuple[int, int, int]]] = {"start": [], "forward": []}
        out.at = int(body[0]) if len(body) else -1  # the loop head: before the first row
        for blk, size, src in pending["start"]:  # the loop head rebinds the batch names
            out.add(False, blk, size, src, k)
        for r in body.tolist():
            out.at = r
            b = int(blocks[r])
            for i in before.get(r, ()):
                add_extra(i, k)
            if r == first_opt and k == 1 and not eager_state:
                for s in state_rows:  # lazily created at the first optimizer.step()
                    out.add(True, int(blocks[s]), int(nbytes[s]), int(s), 1)
            if b in old_grads and not is_alloc[r]:
                if k == 1 and kept_grads:  # a kept gradient replaced (the fp32 copies' cast)
                    out.add(False, b, int(nbytes[r]), r, k)
                elif k > 1 and b in grad_match and not accumulate_carried:
                    out.add(False, grad_match[b] + off - stride, int(nbytes[r]), r, k)
            elif not is_alloc[r] and b in deferred:
                held[deferred[b]].append((b + off, int(nbytes[r]), r))
            elif k > 1 and is_alloc[r] and (b in dropped or (accumulate_carried and b in matched)):
                # summed into the surviving .grad in place; the incoming buffer dies
                transient = b + (steps + k) * stride if b in dropped else b + off
                out.add(True, transient, int(nbytes[r]), r, k)
                out.add(False, transient, int(nbytes[r]), r, k)
            else:
                out.add(bool(is_alloc[r]), b + off, int(nbytes[r]), r, k)
            for i in made_after.get(r, ()):
                add_extra(i, k)
            for i in after.get(r, ()):
                out.add(False, synthetic_id(i, k), extras[i].nbytes, -1, k)
            if r == state_last and k == 1 and not eager_state:
                for s in state_rows:
                    out.add(True, int(blocks[s]), int(nbytes[s]), int(s), 1)
            if k > 1 and r == zero_grad_end:
                # What the last step left alive that no recorded zero_grad free matched.
                for c in carried:
                    if c not in matched:
                        out.add(False, c + off - stride, 0, -1, k)
                # the earlier micro-batches' 16-bit gradients, which this backward adds into
                for d, a in dropped.items():
                    out.add(True, d + off, int(nbytes[a]), a, k)
            if r == last_of["forward"]:
                for blk, size, src in pending["forward"]:
                    out.add(False, blk, size, src, k)
                pending["forward"] = []
        pending = held
    return out.build()


def event_phases(replay: Replay, graph: OpGraph, count: int | None = None) -> np.ndarray:
    """The phase of each of the first ``count`` events' place in the loop (:attr:`Replay.at`;
    "" for an event before any row): a workspace is its op's, the loop head's frees are the
    ``zero_grad``'s, state made lazily is its first optimizer step's."""
    at = replay.at[:count]
    phases = graph.mem_events["phase"].to_numpy().astype(str)
    return np.where(at >= 0, phases[np.maximum(at, 0)], "")


def sizes_only_change(graph: OpGraph, slope: np.ndarray) -> bool:
    """Whether :func:`build_replay` on ``graph`` with its event sizes moved by ``slope`` (per
    event, times any batch) gives the same events with other sizes, so that :func:`resized`
    can stand in for it. Sizes reach the build's structure in one place: the pairing of
    each pre-existing gradient with the block that replaces it, by size
    (:func:`_match_gradients`); so the sizes of the pre-existing rows and of every block
    the body leaves alive must not move."""
    ev = graph.mem_events
    pre = np.isin(ev["phase"].to_numpy().astype(str), PRE_EXISTING)
    alloc = ev["action"].to_numpy().astype(str) == "alloc"
    blocks = ev["block"].to_numpy(dtype=np.int64)
    carried = np.setdiff1d(blocks[~pre & alloc], blocks[~pre & ~alloc])
    return not np.any(slope[pre | np.isin(blocks, carried)])


def resized(replay: Replay, sizes: np.ndarray) -> Replay:
    """``replay`` with each traced event's bytes read from ``sizes`` (one per row of the
    graph's ``mem_events``; synthetic events keep theirs): :func:`build_replay` of the graph
    with those sizes, where :func:`sizes_only_change` holds, without its loop over events."""
    traced = replay.src >= 0
    nbytes = np.where(traced, np.asarray(sizes, dtype=np.int64)[np.maximum(replay.src, 0)],
                      replay.nbytes)  # fmt: skip
    return replace(replay, nbytes=nbytes)


def _last(rows: np.ndarray, phase: np.ndarray, name: str) -> int:
    hits = rows[phase[rows] == name]
    return int(hits[-1]) if len(hits) else -1


def _match_gradients(ev: pd.DataFrame, old: set[int], carried: list[int]) -> dict[int, int]:
    """Pair each pre-existing gradient block with the block that replaces it in the body.

    Matched by size (all of them are freed together by zero_grad, so which one of two
    equal-size gradients is freed first changes nothing).
    """
    sizes = dict(zip(ev["block"].tolist(), ev["bytes"].tolist(), strict=False))
    by_size: dict[int, list[int]] = defaultdict(list)
    for b in carried:
        by_size[sizes[b]].append(b)
    match: dict[int, int] = {}
    for b in sorted(old):
        queue = by_size.get(sizes[b])
        if queue:
            match[b] = queue.pop(0)
    return match


def _held_references(
    phase: np.ndarray,
    category: np.ndarray,
    node: np.ndarray,
    is_alloc: np.ndarray,
    blocks: np.ndarray,
    body: np.ndarray,
) -> dict[int, str]:
    """Blocks whose free the loop postpones: block → phase after which it is freed.

    Outputs: freed in the loss phase after its last kernel (the tracer's ``del
    outputs``); they die when the next forward returns. Inputs: they die at the start
    of the next step.
    """
    held: dict[int, str] = {}
    loss_rows = body[phase[body] == "loss"]
    with_op = loss_rows[node[loss_rows] >= 0]
    start = int(with_op[-1]) if len(with_op) else -1
    for r in loss_rows:
        if r > start and not is_alloc[r] and node[r] < 0:
            held[int(blocks[r])] = "forward"
    for r in body:
        if not is_alloc[r] and category[r] == "input":
            held[int(blocks[r])] = "start"
    return held


def with_extra_sizes(replay: Replay, extras: list[Extra]) -> Replay:
    """``replay`` (built with extras of the same kinds and rows as ``extras``) with each
    synthetic event's bytes taken from ``extras``: the only place :func:`build_replay` reads
    an extra's size, so the result equals ``build_replay`` with ``extras`` itself.

    A synthetic block id is ``-(1 + i + len(extras) * k)`` for extra ``i``, so ``i`` is its
    id's remainder; the other arrays are shared with ``replay`` (nothing mutates them)."""
    synthetic = np.fromiter(replay.synthetic, dtype=np.int64, count=len(replay.synthetic))
    rows = np.flatnonzero((replay.src == -1) & np.isin(replay.block, synthetic))
    nbytes = replay.nbytes.copy()
    if len(rows):
        sizes = np.asarray([x.nbytes for x in extras], dtype=np.int64)
        nbytes[rows] = sizes[(-replay.block[rows] - 1) % len(extras)]
    return replace(replay, nbytes=nbytes)
