"""Per-GPU memory terms that the traced tensors do not show, each named and sourced.

The terms live in ``overheads.csv`` (versioned, one row per term and condition, with the
provenance of its value). Two kinds:

* outside the allocator (``placement=outside``): the CUDA context and what the driver
  loads into it later (kernel modules loaded lazily, library handles). They add to
  what ``nvidia-smi`` shows and reduce what the allocator can reserve.
* inside the allocator: buffers PyTorch allocates through the caching allocator that no
  traced tensor stands for. ``per_handle`` is the cuBLAS workspace, allocated once per
  (handle, stream) at the first matmul and never freed: training uses two handles, the
  Python thread's for forward and the autograd engine thread's for backward.
  ``per_conv`` is a cuDNN workspace, allocated right before a convolution and freed
  right after it.

A row applies when the GPU's compute-capability major is in ``sm_majors`` (empty = any)
and the step uses the op family in ``needs`` (empty = always).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from boom_ml.errors import InvalidInputError
from boom_ml.gpus.spec import GpuSpec
from boom_ml.trace.graph import OpGraph

TABLE_PATH = Path(__file__).with_name("overheads.csv")
PLACEMENTS = ("outside", "per_handle", "per_conv")
COLUMNS = (
    "term",
    "placement",
    "sm_majors",
    "needs",
    "bytes",
    "per_batch_elem",
    "version",
    "provenance",
)
# Which traced phases run on which CPU thread (= cuBLAS handle).
HANDLE_PHASES = {"forward": ("forward", "loss"), "backward": ("backward", "recompute")}


@dataclass(frozen=True)
class Term:
    term: str
    placement: str
    sm_majors: tuple[int, ...]  # empty: every GPU
    needs: str  # op family the step must use ("" = always)
    nbytes: int
    per_batch_elem: float  # per_conv only: workspace bytes per output element (0 = fixed)
    version: int
    provenance: str

    def applies(self, gpu: GpuSpec, families: set[str]) -> bool:
        major = gpu.sm_version // 10
        return (not self.sm_majors or major in self.sm_majors) and (
            not self.needs or self.needs in families
        )


@dataclass(frozen=True)
class Extra:
    """A synthetic allocation inserted into the replay (rows index graph.mem_events)."""

    category: str
    nbytes: int
    alloc_before: int
    free_after: int | None  # None with persistent=True: never freed
    persistent: bool


class OverheadTable:
    """The rows of ``overheads.csv`` (or any rows given), with per-GPU selection."""

    def __init__(self, terms: list[Term]) -> None:
        self.terms = terms

    def select(self, gpu: GpuSpec, graph: OpGraph) -> list[Term]:
        """Applicable rows; for one term name the first matching row wins (table order)."""
        families = set(graph.nodes["family"].astype(str)) if len(graph.nodes) else set()
        chosen: dict[str, Term] = {}
        for t in self.terms:
            if t.term not in chosen and t.applies(gpu, families):
                chosen[t.term] = t
        return list(chosen.values())

    def outside_allocator(self, gpu: GpuSpec, graph: OpGraph) -> dict[str, int]:
        return {t.term: t.nbytes for t in self.select(gpu, graph) if t.placement == "outside"}

    def allocator_extras(self, gpu: GpuSpec, graph: OpGraph) -> list[Extra]:
        extras: list[Extra] = []
        for t in self.select(gpu, graph):
            if t.placement == "per_handle":
                extras += _handle_workspaces(graph, t)
            elif t.placement == "per_conv":
                extras += _conv_workspaces(graph, t)
        return extras

    def with_values(self, **values: int) -> OverheadTable:
        """A copy with some terms' byte values replaced (used when fitting)."""
        return OverheadTable(
            [
                Term(**{**t.__dict__, "nbytes": int(values[t.term])}) if t.term in values else t
                for t in self.terms
            ]
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


def _handle_workspaces(graph: OpGraph, term: Term) -> list[Extra]:
    nodes = graph.nodes
    out: list[Extra] = []
    for phases in HANDLE_PHASES.values():
        ids = (
            nodes["id"].to_numpy()[
                (nodes["family"].astype(str) == term.needs)
                & nodes["phase"].astype(str).isin(phases)
            ]
            if term.needs
            else nodes["id"].to_numpy()[nodes["phase"].astype(str).isin(phases)]
        )
        row = _first_row_of_nodes(graph, np.asarray(ids))
        if row is not None:
            out.append(Extra("workspace", term.nbytes, row, None, True))
    return out


def _conv_workspaces(graph: OpGraph, term: Term) -> list[Extra]:
    """One transient workspace per convolution kernel, sized by the table's rule."""
    nodes = graph.nodes
    conv = nodes[nodes["family"].astype(str) == "conv"]
    if conv.empty:
        return []
    ev = graph.mem_events
    ev_nodes = ev["node_id"].to_numpy()
    out: list[Extra] = []
    for nid, shapes in zip(conv["id"].tolist(), conv["output_shapes"].tolist(), strict=True):
        elems = sum(int(np.prod(s)) for s in json.loads(shapes))
        size = int(term.nbytes + term.per_batch_elem * elems)
        rows = np.flatnonzero(ev_nodes == nid)
        if size <= 0 or not len(rows):
            continue
        out.append(Extra("workspace", size, int(rows[0]), int(rows[-1]), False))
    return out


@cache
def load_overheads(path: str | Path = TABLE_PATH) -> OverheadTable:
    """Read the overhead table; every row must name where its value comes from."""
    with open(path, newline="") as fh:
        rows = [r for r in csv.DictReader(line for line in fh if not line.startswith("#"))]
    terms: list[Term] = []
    for i, r in enumerate(rows):
        if set(COLUMNS) - set(r):
            raise InvalidInputError(f"{path}: missing column(s) {sorted(set(COLUMNS) - set(r))}")
        if r["placement"] not in PLACEMENTS or not r["provenance"].strip():
            raise InvalidInputError(f"{path} row {i}: bad placement or empty provenance")
        terms.append(
            Term(
                term=r["term"],
                placement=r["placement"],
                sm_majors=tuple(int(x) for x in r["sm_majors"].split(";") if x.strip()),
                needs=r["needs"].strip(),
                nbytes=int(r["bytes"]),
                per_batch_elem=float(r["per_batch_elem"] or 0),
                version=int(r["version"]),
                provenance=r["provenance"],
            )
        )
    return OverheadTable(terms)
