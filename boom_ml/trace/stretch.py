"""One layer of a traced step repeated: the graph of the same model with more layers.

A decoder's layers run the same ops on the same shapes, so a step of a model with L layers
is the step of a shallower one with one layer's ops, blocks and events written out again
L - n + 1 times. Every node and memory event of the shallow trace gets a layer tag (the layer
its module, or the parameter its tensors belong to, is in); the tokens of one interior layer
``m`` (a run of them per visit: its parameters, forward, backward, its share of a foreach
optimizer op) are written once per copy, forward in ascending and backward in descending
layer order, and every reference (an event's block and node, an edge's ends) is carried over:
within the layer to the same copy, to the layer before or after to the neighbouring copy, or
at the ends of the run of copies to the shallow trace's own first and last layers. A foreach
node over every layer's tensors (optimizer, zero_grad) keeps one node whose tensor lists are
repeated and whose FLOPs and bytes grow by one layer's share (``Delta``).

``trace/repeat.py`` checks the result against a trace one layer deeper before it trusts it;
:class:`CannotRepeat` says where a graph does not have this shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import pandas as pd

from boom_ml.trace.graph import OpGraph, canonical_free_order
from boom_ml.trace.recorder import BlockNotes

OUTSIDE_PHASES = ("zero_grad", "optimizer")  # ops on every parameter, outside any module
Delta = dict[int, tuple[int, int, int]]  # mixed node -> FLOPs, bytes read, bytes written per layer


class CannotRepeat(Exception):
    """The traced graph is not one layer written out again (the full model is traced)."""


def layer_pattern(list_path: str) -> re.Pattern[str]:
    """Matches a module or parameter path inside layer ``<i>`` of the ModuleList at
    ``list_path`` (a module path may carry the root class's name in front, a parameter's
    a wrapper's prefix)."""
    return re.compile(rf"(?:^|\.){re.escape(list_path)}\.(\d+)(?=\.|$)")


@dataclass
class _Token:
    kind: str  # "n": node, "e": event
    index: int  # node id or event row
    tag: int | None = None


class Tagged:
    """A traced step's nodes and events in order, each tagged with its layer."""

    def __init__(self, graph: OpGraph, notes: BlockNotes, pattern: re.Pattern[str]) -> None:
        self.graph, self.pattern = graph, pattern
        self.nodes: list[dict[str, Any]] = graph.nodes.to_dict("records")
        self.events: list[dict[str, Any]] = graph.mem_events.sort_values("seq").to_dict("records")
        if len(notes.node_blocks) != len(self.nodes):
            raise CannotRepeat("the trace kept no blocks per node")
        self.node_blocks = notes.node_blocks
        self.tokens = _merge(len(self.nodes), self.events)
        self.node_tag: list[int | None] = [None] * len(self.nodes)
        self.mixed: set[int] = set()  # nodes over several layers' tensors (foreach)
        # block -> its layer: its parameter's, the op's that made it, the module it was made in
        self.block_tag: dict[int, int | None] = {}
        self._tag(notes)

    def layer(self, path: str) -> int | None:
        found = self.pattern.search(path) if path else None
        return int(found.group(1)) if found else None

    def _tag(self, notes: BlockNotes) -> None:
        # parameters, their gradients and state, by name (host tensors such as Adam's step
        # counts have no memory events, yet are entries of the optimizer's foreach lists)
        self.block_tag.update((b, self.layer(name)) for b, name in notes.block_param.items())
        for tok in self.tokens:
            if tok.kind == "n":
                tok.tag = self._node_tag(tok.index)
                continue
            event = self.events[tok.index]
            block, node = int(event["block"]), int(event["node_id"])
            if event["action"] != "alloc" or block in self.block_tag:
                continue
            if node >= 0:
                tag = self._made_tag(node, block)
            else:
                tag = self.layer(notes.block_module.get(block, ""))
            self.block_tag[block] = tag
        # events: an op's take the op's tag (a foreach op's: their block's); one outside any
        # op happened once the op before it ended, and takes that op's layer (at a layer's
        # end, the frees of the layer before it), or its block's after an op of no layer
        last: int | None = None
        for tok in self.tokens:
            if tok.kind == "n":
                last = None if tok.index in self.mixed else tok.tag
                continue
            event = self.events[tok.index]
            node, block = int(event["node_id"]), int(event["block"])
            if node >= 0 and node not in self.mixed:
                tok.tag = self.node_tag[node]
            elif node < 0 and last is not None:
                tok.tag = last
            else:
                tok.tag = self.block_tag.get(block)

    def _node_tag(self, node: int) -> int | None:
        """The layer of the node's module; outside the model (zero_grad, the optimizer) the
        layer of the tensors it reads, or mixed when they are of several layers."""
        tag = self.layer(str(self.nodes[node]["module"]))
        if tag is None and self.nodes[node]["phase"] in OUTSIDE_PHASES:
            seen = {self.block_tag.get(b) for b in self.node_blocks[node][0]} - {None}
            if len(seen) > 1:
                self.mixed.add(node)
            tag = seen.pop() if len(seen) == 1 else None
        self.node_tag[node] = tag
        return tag

    def _made_tag(self, node: int, block: int) -> int | None:
        if node not in self.mixed:
            return self.node_tag[node]
        ins, outs = self.node_blocks[node]
        k = outs.index(block) if block in outs else len(ins)
        return self.block_tag.get(ins[k]) if k < len(ins) else None  # output k of input list k

    def entry_tags(self, node: int, outputs: bool) -> list[int | None]:
        """The tag of each input (or output) tensor of ``node``, in the graph's shape lists."""
        return [self.block_tag.get(b) for b in self.node_blocks[node][1 if outputs else 0]]


def _merge(num_nodes: int, events: list[dict[str, Any]]) -> list[_Token]:
    """Nodes and events in one sequence: each node just before its first event (or the next
    node's), each event where its ``seq`` puts it."""
    tokens: list[_Token] = []
    emitted = 0
    for row, event in enumerate(events):
        node = int(event["node_id"])
        if node >= 0:
            if node < emitted - 1:
                raise CannotRepeat("events out of node order")
            while emitted <= node:
                tokens.append(_Token("n", emitted))
                emitted += 1
        tokens.append(_Token("e", row))
    tokens += [_Token("n", i) for i in range(emitted, num_nodes)]
    return tokens


class _Copier:
    """Writes the tokens of ``tagged`` with layer ``m`` repeated ``copies`` times."""

    def __init__(self, tagged: Tagged, m: int, copies: int) -> None:
        if copies < 1 or all(tok.tag != m for tok in tagged.tokens):
            raise CannotRepeat(f"no layer {m} to repeat")
        self.t, self.m, self.copies = tagged, m, copies
        # each node and allocation of a layer numbered in order: the k-th of layer m - 1 or
        # m + 1 stands where the k-th of layer m does in the next copy (runs of frees may
        # differ: the last layer's output is freed by the final norm's backward)
        self.ordinal: dict[int, tuple[str, int]] = {}
        self.by_ordinal: dict[tuple[int, str, int], int] = {}
        counts: dict[tuple[int, str], int] = {}
        for pos, tok in enumerate(tagged.tokens):
            if tok.tag is None or not self._owner(tok):
                continue
            k = counts.get((tok.tag, tok.kind), 0)
            counts[(tok.tag, tok.kind)] = k + 1
            self.ordinal[pos] = (tok.kind, k)
            self.by_ordinal[(tok.tag, tok.kind, k)] = pos
        self.node_pos = {tok.index: i for i, tok in enumerate(tagged.tokens) if tok.kind == "n"}
        self.alloc_pos = {
            int(tagged.events[tok.index]["block"]): i
            for i, tok in enumerate(tagged.tokens)
            if tok.kind == "e" and tagged.events[tok.index]["action"] == "alloc"
        }

    # -- references ----------------------------------------------------------------------
    def _tag_at(self, pos: int | None) -> int | None:
        return None if pos is None else self.t.tokens[pos].tag

    def _owner(self, tok: _Token) -> bool:
        """A node, or an allocation: what references point at."""
        return tok.kind == "n" or self.t.events[tok.index]["action"] == "alloc"

    def _twin(self, pos: int) -> int:
        """The token of layer m at the place of ``pos`` (a token of layer m - 1 or m + 1)."""
        tag = self.t.tokens[pos].tag
        kind, k = self.ordinal[pos]
        twin = self.by_ordinal.get((self.m, kind, k))
        a = self.t.tokens[pos]
        if twin is None or self._signature(a) != self._signature(self.t.tokens[twin]):
            raise CannotRepeat(f"layer {tag} and layer {self.m} differ at their {kind} {k}")
        return twin

    def _signature(self, tok: _Token) -> tuple:
        if tok.kind == "n":
            return ("n", self.t.nodes[tok.index]["op"])
        event = self.t.events[tok.index]
        return event["action"], int(event["bytes"])

    def ref(self, pos: int | None, copy: int | None, tag: int | None) -> tuple[int | None, int]:
        """Where the token at ``pos`` (a node or a block's allocation) lands for a
        reference from copy ``copy`` (None: a token outside the repeated layer, of ``tag``).
        Returns (token position, copy; -1 for no copy)."""
        target = self._tag_at(pos)
        m, last = self.m, self.copies - 1
        if pos is None or target is None:
            return pos, -1
        if copy is None:
            if target != m:
                return pos, -1
            if tag is None:
                raise CannotRepeat("a token outside every layer refers to the repeated one")
            return pos, 0 if tag < m else last
        if target == m:
            return pos, copy
        if target == m - 1:
            return (pos, -1) if copy == 0 else (self._twin(pos), copy - 1)
        if target == m + 1:
            return (pos, -1) if copy == last else (self._twin(pos), copy + 1)
        raise CannotRepeat(f"layer {m} refers to layer {target}")

    # -- order ---------------------------------------------------------------------------
    def order(self) -> Iterator[tuple[int, int | None]]:
        """(token position, copy or None) in the order of the deeper graph."""
        tokens, m = self.t.tokens, self.m
        i = 0
        while i < len(tokens):
            if tokens[i].tag != m:
                yield i, None
                i += 1
                continue
            j = i
            while j < len(tokens) and tokens[j].tag == m:
                j += 1
            copies = range(self.copies)
            for c in copies if self._ascending(i, j) else reversed(copies):
                for k in range(i, j):
                    yield k, c
            i = j

    def _ascending(self, start: int, end: int) -> bool:
        before = next(
            (t.tag for t in reversed(self.t.tokens[:start]) if t.tag not in (None, self.m)), None
        )
        after = next((t.tag for t in self.t.tokens[end:] if t.tag not in (None, self.m)), None)
        up = (before is not None and before < self.m) or (after is not None and after > self.m)
        down = (before is not None and before > self.m) or (after is not None and after < self.m)
        if up == down:
            raise CannotRepeat(f"cannot tell which way the layers run at token {start}")
        return up


def repeat_layer(
    tagged: Tagged, m: int, copies: int, delta: Delta | None = None
) -> tuple[OpGraph, dict[int, int]]:
    """The graph with layer ``m`` of ``tagged`` written ``copies`` times (``copies`` = 1: the
    same graph), and the new id of each foreach node over all layers. ``delta``: one layer's
    FLOPs and bytes of each such node (without it they keep the shallow graph's totals)."""
    cp = _Copier(tagged, m, copies)
    shift = copies - 1
    node_id: dict[tuple[int, int], int] = {}
    block_id: dict[tuple[int, int], int] = {}
    nodes: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []

    def renumber_module(path: str, copy: int | None) -> str:
        def sub(found: re.Match[str]) -> str:
            i = int(found.group(1))
            new = m + copy if (copy is not None and i == m) else (i + shift if i > m else i)
            return found.group(0)[: found.start(1) - found.start(0)] + str(new)

        return tagged.pattern.sub(sub, path) if path else path

    for pos, copy in cp.order():
        tok = tagged.tokens[pos]
        own = -1 if copy is None else copy
        if tok.kind == "n":
            row = dict(tagged.nodes[tok.index])
            node_id[(pos, own)] = row["id"] = len(nodes)
            row["module"] = renumber_module(str(row["module"]), copy)
            if tok.index in tagged.mixed:
                _widen(row, tagged, cp, tok.index, copies, (delta or {}).get(tok.index))
            nodes.append(row)
            continue
        event = dict(tagged.events[tok.index])
        block = int(event["block"])
        bpos, bcopy = cp.ref(cp.alloc_pos.get(block), copy, tok.tag)
        key = (bpos if bpos is not None else -1 - block, bcopy)
        if event["action"] == "alloc":
            block_id.setdefault(key, len(block_id))
        if key not in block_id:
            raise CannotRepeat(f"block {block} is freed before it is allocated")
        event["block"] = block_id[key]
        node = int(event["node_id"])
        if node >= 0:
            npos, ncopy = cp.ref(cp.node_pos[node], copy, tok.tag)
            event["node_id"] = node_id[(npos, ncopy)]
        event["seq"] = len(events)
        events.append(event)
    edges = sorted(_edges(tagged, cp, node_id))
    graph = OpGraph.from_records(
        nodes, [{"src": s, "dst": d} for s, d in edges], events, dict(tagged.graph.meta)
    )
    return graph, {n: node_id[(cp.node_pos[n], -1)] for n in tagged.mixed}


def _edges(tagged: Tagged, cp: _Copier, node_id: dict[tuple[int, int], int]) -> set[tuple]:
    out: set[tuple[int, int]] = set()
    for src, dst in tagged.graph.edges[["src", "dst"]].itertuples(index=False):
        spos, dpos = cp.node_pos[int(src)], cp.node_pos[int(dst)]
        dtag = tagged.tokens[dpos].tag
        if dtag == cp.m:
            for c in range(cp.copies):
                out.add((node_id[cp.ref(spos, c, dtag)], node_id[(dpos, c)]))
        elif int(dst) in tagged.mixed and tagged.tokens[spos].tag == cp.m:
            out.update((node_id[(spos, c)], node_id[(dpos, -1)]) for c in range(cp.copies))
        else:
            out.add((node_id[cp.ref(spos, None, dtag)], node_id[(dpos, -1)]))
    return out


def _widen(
    row: dict[str, Any],
    tagged: Tagged,
    cp: _Copier,
    node: int,
    copies: int,
    delta: tuple[int, int, int] | None,
) -> None:
    """A foreach node over every layer's tensors: its lists with layer m's entries repeated."""
    for outputs, columns in ((False, ("input_shapes", "input_dtypes")), (True, ("output_shapes", "output_dtypes"))):  # fmt: skip
        tags = tagged.entry_tags(node, outputs)
        for column in columns:
            values = json.loads(row[column])
            if len(values) != len(tags):
                raise CannotRepeat(f"node {node}: {column} and its blocks differ in length")
            wide: list[Any] = []
            for tag, run in groupby(zip(tags, values, strict=True), key=lambda e: e[0]):
                entries = [value for _, value in run]
                wide += entries * copies if tag == cp.m else entries  # layer m's, once per copy
            row[column] = json.dumps(wide)
    if delta is not None:
        for column, per_layer in zip(("flops", "bytes_read", "bytes_written"), delta, strict=True):
            row[column] = int(row[column]) + (copies - 1) * per_layer


def canonical(graph: OpGraph) -> OpGraph:
    """``graph`` with blocks numbered in order of allocation and each run of frees outside
    any op in block order (two traces of one step then compare equal)."""
    events = graph.mem_events.sort_values("seq").to_dict("records")
    number: dict[int, int] = {}
    for event in events:
        event["block"] = number.setdefault(int(event["block"]), len(number))
    ordered = canonical_free_order(events)
    for seq, event in enumerate(ordered):
        event["seq"] = seq
    return OpGraph(graph.nodes, graph.edges, pd.DataFrame(ordered, columns=graph.mem_events.columns).astype(graph.mem_events.dtypes.to_dict()), graph.meta)  # fmt: skip


def difference(a: OpGraph, b: OpGraph, skip: set[int] = frozenset()) -> str | None:
    """Where two graphs of one step differ (None: nowhere). ``skip``: nodes whose FLOPs and
    bytes are not compared."""
    if len(a.nodes) != len(b.nodes):
        return f"{len(a.nodes)} nodes against {len(b.nodes)}"
    left, right = a.nodes.reset_index(drop=True), b.nodes.reset_index(drop=True)
    if skip:
        numbers = ["flops", "bytes_read", "bytes_written"]
        rows = list(skip)
        left, right = left.copy(), right.copy()
        left.loc[rows, numbers] = 0
        right.loc[rows, numbers] = 0
    if not left.equals(right):
        diff = (left != right).any(axis=1)
        first = int(diff.idxmax())
        return f"node {first}: {left.loc[first].to_dict()} against {right.loc[first].to_dict()}"
    if set(map(tuple, a.edges.values.tolist())) != set(map(tuple, b.edges.values.tolist())):
        return "edges differ"
    ea, eb = canonical(a).mem_events, canonical(b).mem_events
    if len(ea) != len(eb):
        return f"{len(ea)} memory events against {len(eb)}"
    if not ea.reset_index(drop=True).equals(eb.reset_index(drop=True)):
        diff = (ea.reset_index(drop=True) != eb.reset_index(drop=True)).any(axis=1)
        return f"memory event {int(diff.idxmax())} differs"
    return None
