"""GPU memory that no traced tensor stands for, term by term, each named and sourced.

The terms live in ``overheads.csv`` (versioned; one row per term, condition and level,
with the provenance of its value). Where a placement says so, a row's value is a
per-unit quantity that the GPU and the graph turn into bytes:

* ``outside``: bytes outside the caching allocator (driver context, kernel images):
  they add to what ``nvidia-smi`` shows and reduce what the allocator can reserve.
* ``per_thread``: outside too, ``bytes`` per resident thread slot of the GPU
  (max threads per SM x SMs): the local memory the driver reserves for thread stacks.
* ``per_handle``: cuBLAS workspace, allocated through the caching allocator once per
  (handle, stream) at the first matmul and never freed. Training uses two handles: the
  Python thread's for forward and the autograd engine thread's for backward.
* ``per_conv``: cuDNN workspace, ``bytes + io_fraction x (bytes read + written)`` of
  each convolution, allocated right before it and freed right after. PyTorch tries the
  heuristic's engines in order and falls back to the next one when a workspace cannot
  be allocated, so these allocations are optional: they never cause an OOM themselves.

A row applies when its ``level`` is empty or the level asked for (p10 / p50 / p90:
where a value cannot be derived, the table gives a central value and a lower and upper
bound), the GPU's compute-capability major is in ``sm_majors`` (empty = any), the step
uses the op family in ``needs`` (empty = always) and the stack satisfies ``when``
(``lazy`` / ``eager`` module loading, ``benchmark`` / ``heuristic`` cuDNN algorithm
choice; empty = always). For each term the first applicable row wins.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from boom_ml.errors import InvalidInputError
from boom_ml.gpus.spec import GpuSpec
from boom_ml.identity_cache import IdentityCache
from boom_ml.stack import Stack, resolve_stack
from boom_ml.trace.graph import OpGraph

TABLE_PATH = Path(__file__).with_name("overheads.csv")
PLACEMENTS = ("outside", "per_thread", "per_handle", "per_conv")
OUTSIDE_PLACEMENTS = ("outside", "per_thread")
LEVELS = ("p10", "p50", "p90")
CONDITIONS = ("lazy", "eager", "benchmark", "heuristic")
COLUMNS = (
    "term",
    "library",
    "placement",
    "level",
    "sm_majors",
    "needs",
    "when",
    "bytes",
    "io_fraction",
    "version",
    "provenance",
)
# Which traced phases run on which CPU thread (= cuBLAS handle).
HANDLE_PHASES = {"forward": ("forward", "loss"), "backward": ("backward", "recompute")}
# Maximum resident threads per SM by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability", row "Maximum number of resident
# threads per SM"); a capability not listed takes its major's first entry.
MAX_THREADS_PER_SM = {
    60: 2048, 61: 2048, 62: 2048, 70: 2048, 72: 2048, 75: 1024, 80: 2048,
    86: 1536, 87: 2048, 89: 1536, 90: 2048, 100: 2048, 103: 2048, 120: 1536,
}  # fmt: skip


def max_threads_per_sm(gpu: GpuSpec) -> int:
    sm = gpu.sm_version
    if sm in MAX_THREADS_PER_SM:
        return MAX_THREADS_PER_SM[sm]
    same_major = [v for k, v in sorted(MAX_THREADS_PER_SM.items()) if k // 10 == sm // 10]
    return same_major[0] if same_major else 2048


@dataclass(frozen=True)
class Term:
    term: str
    library: str  # cuda (the context itself), torch, cublas, cudnn
    placement: str
    level: str  # "" = every level
    sm_majors: tuple[int, ...]  # empty: every GPU
    needs: str  # op family the step must use ("" = always)
    when: tuple[str, ...]  # stack conditions, all must hold
    nbytes: int
    io_fraction: float  # per_conv only
    version: int
    provenance: str

    def applies(self, gpu: GpuSpec, families: set[str], stack: Stack, level: str) -> bool:
        major = gpu.sm_version // 10
        facts = {
            stack.module_loading,
            "benchmark" if stack.cudnn_benchmark else "heuristic",
        }
        return (
            (not self.level or self.level == level)
            and (not self.sm_majors or major in self.sm_majors)
            and (not self.needs or self.needs in families)
            and all(c in facts for c in self.when)
        )


@dataclass(frozen=True)
class Amount:
    """One term's bytes on one GPU, with where the value comes from."""

    term: str
    library: str
    placement: str
    nbytes: int
    provenance: str


@dataclass(frozen=True)
class Extra:
    """A synthetic allocation inserted into the replay (rows index graph.mem_events)."""

    category: str
    nbytes: int
    alloc_before: int
    free_after: int | None  # None with persistent=True: never freed
    persistent: bool
    optional: bool = False  # skipped, not an OOM, when it cannot be allocated
    # allocated just after the event at row ``alloc_before`` rather than just before it
    alloc_after_row: bool = False


class OverheadTable:
    """The rows of ``overheads.csv`` (or any rows given), with per-GPU selection."""

    def __init__(self, terms: list[Term]) -> None:
        self.terms = terms

    def select(
        self, gpu: GpuSpec, graph: OpGraph, stack: Stack | None = None, level: str = "p50"
    ) -> list[Term]:
        """Applicable rows; for one term name the first matching row wins (table order)."""
        stack = stack if stack is not None else resolve_stack()
        families = _GRAPH_FACTS.get(graph, ("families",), lambda: _families(graph))
        chosen: dict[str, Term] = {}
        for t in self.terms:
            if t.term not in chosen and t.applies(gpu, families, stack, level):
                chosen[t.term] = t
        return list(chosen.values())

    def outside(
        self, gpu: GpuSpec, graph: OpGraph, stack: Stack | None = None, level: str = "p50"
    ) -> list[Amount]:
        """Terms outside the allocator, in bytes on ``gpu``."""
        out = []
        for t in self.select(gpu, graph, stack, level):
            if t.placement == "outside":
                out.append(Amount(t.term, t.library, t.placement, t.nbytes, t.provenance))
            elif t.placement == "per_thread":
                slots = max_threads_per_sm(gpu) * gpu.sm_count
                out.append(Amount(t.term, t.library, t.placement, t.nbytes * slots, t.provenance))
        return out

    def outside_allocator(
        self, gpu: GpuSpec, graph: OpGraph, stack: Stack | None = None, level: str = "p50"
    ) -> dict[str, int]:
        return {a.term: a.nbytes for a in self.outside(gpu, graph, stack, level)}

    def inside(
        self, gpu: GpuSpec, graph: OpGraph, stack: Stack | None = None, level: str = "p50"
    ) -> list[Term]:
        return [t for t in self.select(gpu, graph, stack, level) if t.placement not in
                OUTSIDE_PLACEMENTS]  # fmt: skip

    def allocator_extras(
        self, gpu: GpuSpec, graph: OpGraph, stack: Stack | None = None, level: str = "p50"
    ) -> list[Extra]:
        extras: list[Extra] = []
        for t in self.inside(gpu, graph, stack, level):
            if t.placement == "per_handle":
                extras += _handle_workspaces(graph, t)
            elif t.placement == "per_conv":
                extras += _conv_workspaces(graph, t)
        return extras

    def with_values(self, **values: int) -> OverheadTable:
        """A copy with some terms' byte values replaced (used when fitting)."""
        return OverheadTable(
            [replace(t, nbytes=int(values[t.term])) if t.term in values else t for t in self.terms]
        )


def _first_row_of_nodes(graph: OpGraph, node_ids: np.ndarray) -> int | None:
    """The first mem_events row at or after the first of ``node_ids`` (None if none)."""
    if not len(node_ids):
        return None
    ev_nodes = graph.mem_events["node_id"].to_numpy()
    phases = graph.mem_events["phase"].to_numpy().astype(str)
    candidates = np.flatnonzero(
        (ev_nodes >= int(node_ids.min()))
        & ~np.isin(phases, ("parameter", "gradient", "optimizer_state"))
    )
    return int(candidates[0]) if len(candidates) else None


# What the terms read of a graph, the same for every GPU and level: computed once per graph
# (a prediction over 44 GPUs asks 132 times per candidate step).
_GRAPH_FACTS: IdentityCache[Any] = IdentityCache(64)


def _families(graph: OpGraph) -> frozenset[str]:
    return frozenset(graph.nodes["family"].astype(str)) if len(graph.nodes) else frozenset()


def _handle_rows(graph: OpGraph, needs: str) -> tuple[int, ...]:
    """Per phase of :data:`HANDLE_PHASES`, the event row where its first handle is created
    (ops of family ``needs`` only, when given)."""
    nodes = graph.nodes
    rows = []
    for phases in HANDLE_PHASES.values():
        in_phase = nodes["phase"].astype(str).isin(phases)
        if needs:
            in_phase &= nodes["family"].astype(str) == needs
        row = _first_row_of_nodes(graph, np.asarray(nodes["id"].to_numpy()[in_phase]))
        if row is not None:
            rows.append(row)
    return tuple(rows)


def _handle_workspaces(graph: OpGraph, term: Term) -> list[Extra]:
    key = ("handle_rows", term.needs)
    rows = _GRAPH_FACTS.get(graph, key, lambda: _handle_rows(graph, term.needs))
    return [Extra("workspace", term.nbytes, row, None, True) for row in rows]


def conv_workspace_bytes(graph: OpGraph, term: Term) -> dict[int, int]:
    """Workspace bytes of each convolution node (node id → bytes; zero sizes left out)."""
    nodes = graph.nodes
    conv = nodes[nodes["family"].astype(str) == "conv"]
    io = conv["bytes_read"].to_numpy(dtype=np.int64) + conv["bytes_written"].to_numpy(np.int64)
    sizes = (term.nbytes + term.io_fraction * io).astype(np.int64)
    return {
        int(n): int(s) for n, s in zip(conv["id"].tolist(), sizes.tolist(), strict=True) if s > 0
    }


def _conv_workspaces(graph: OpGraph, term: Term) -> list[Extra]:
    """One transient, optional workspace per convolution kernel, sized by the table's rule.

    PyTorch's cuDNN convolutions take their outputs allocated (``raw_cudnn_convolution_*_out``)
    and allocate the workspace inside, trying the next engine when it cannot: the workspace
    comes after the node's last allocation and goes before anything the node frees. Placed
    before the outputs, a workspace that fitted had made an output fail (an OOM PyTorch would
    not hit), and a batch search had found larger batches fitting where smaller ones did not.
    """
    sizes = conv_workspace_bytes(graph, term)
    if not sizes:
        return []
    ev = graph.mem_events
    ev_nodes = ev["node_id"].to_numpy()
    allocs = ev["action"].to_numpy().astype(str) == "alloc"
    out: list[Extra] = []
    for nid, size in sizes.items():
        rows = np.flatnonzero(ev_nodes == nid)
        made = rows[allocs[rows]]
        if len(made):
            row = int(made[-1])
            out.append(Extra("workspace", size, row, row, False, True, alloc_after_row=True))
        elif len(rows):
            out.append(Extra("workspace", size, int(rows[0]), int(rows[-1]), False, True))
    return out


def _split(cell: str, cast: type = str) -> tuple:
    return tuple(cast(x.strip()) for x in cell.split(";") if x.strip())


@cache
def load_overheads(path: str | Path = TABLE_PATH) -> OverheadTable:
    """Read the overhead table; every row must name where its value comes from."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    terms: list[Term] = []
    for i, r in enumerate(rows):
        if set(COLUMNS) - set(r):
            raise InvalidInputError(f"{path}: missing column(s) {sorted(set(COLUMNS) - set(r))}")
        when = _split(r["when"])
        if (
            r["placement"] not in PLACEMENTS
            or not r["provenance"].strip()
            or (r["level"] and r["level"] not in LEVELS)
            or set(when) - set(CONDITIONS)
        ):
            raise InvalidInputError(
                f"{path} row {i}: bad placement, level or condition, or empty provenance"
            )
        terms.append(
            Term(
                term=r["term"],
                library=r["library"],
                placement=r["placement"],
                level=r["level"],
                sm_majors=_split(r["sm_majors"], int),
                needs=r["needs"].strip(),
                when=when,
                nbytes=int(r["bytes"]),
                io_fraction=float(r["io_fraction"] or 0),
                version=int(r["version"]),
                provenance=r["provenance"],
            )
        )
    return OverheadTable(terms)
