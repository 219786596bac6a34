"""A step traced with flash attention, re-expressed as the cuDNN-attention step of a GPU group
whose SDPA calls all pick cuDNN where these picked flash (A100 → H100, say), without tracing.

The two traces differ only where the attention ops are: the op, and the side outputs each
meta kernel returns (``_scaled_dot_product_flash_attention`` returns a 2-element uint64 RNG
state, a uint64 offset and an empty debug mask; ``_scaled_dot_product_cudnn_attention`` an
int64 seed and offset, no debug mask, and its log-sum-exp with a trailing unit dimension).
Everything else the step does (the model's ops, the autograd engine's order, every other
allocation) does not depend on which fused kernel ran. ``tests/test_cudnn_from_flash.py``
compares a derived graph with the traced one, node for node and event for event.

Only calls that reach flash and cuDNN unchanged are derived: head dims that are multiples of
8 (flash pads others, cuDNN does not), no mask (cuDNN takes one as a bias input; flash never
gets one), inputs that require grad (cuDNN skips the log-sum-exp otherwise), no dropout
(cuDNN takes dropout in multiples of 1/16; no such trace was compared).
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from boom_ml.trace.graph import OpGraph
from boom_ml.trace.sdpa_select import (
    CUDNN,
    DEFAULT_GROUP,
    FLASH,
    GROUPS,
    backends,
    call_from_dict,
    same_backends,
)

FORWARD = "_scaled_dot_product_flash_attention"
BACKWARD = "_scaled_dot_product_flash_attention_backward"
TO = {
    FORWARD: "_scaled_dot_product_cudnn_attention",
    BACKWARD: "_scaled_dot_product_cudnn_attention_backward",
}
# tensor positions: forward outputs (out, logsumexp, rng state, offset, debug mask),
# backward inputs (grad_out, q, k, v, out, logsumexp, rng state, offset)
LSE, SEED, OFFSET, DEBUG = 1, 2, 3, 4
BACKWARD_LSE, BACKWARD_SEED = 5, 6
SEED_BYTES = {"flash": 16, "cudnn": 8}  # 2 x uint64 philox state; one int64 seed


def derivable(sdpa_meta: dict[str, Any], group: str) -> bool:
    """Whether every SDPA call of a trace (graph meta ``sdpa``) that picked flash picks cuDNN
    in ``group``, every other call the same backend as traced, and the flash calls are ones
    this module re-expresses exactly."""
    inputs = sdpa_meta.get("inputs")
    if not inputs:
        return False
    before = backends(sdpa_meta, sdpa_meta["group"])
    after = backends(sdpa_meta, group)
    for data, old, new in zip(inputs, before, after, strict=True):
        flash_to_cudnn = old == FLASH and new == CUDNN and _plain(data)
        if not (flash_to_cudnn or (old != FLASH and old == new)):
            return False
    return FLASH in before


def trace_order(groups: list[str]) -> list[str]:
    """The distinct ``groups`` in the order to trace them: those that do not put cuDNN
    attention first before those that do (a flash trace re-expresses for cuDNN, not back)."""
    distinct = list(dict.fromkeys(groups))
    return [g for g in distinct if not GROUPS[g].cudnn_first] + [
        g for g in distinct if GROUPS[g].cudnn_first
    ]


def for_group(graph: OpGraph, group: str | None) -> OpGraph | None:
    """``graph`` as tracing it for ``group`` would give it, without tracing: ``graph`` itself
    where no SDPA call picks another kernel there (or the model makes none), re-expressed
    where its flash calls turn cuDNN calls; None where it must be traced."""
    group = group or DEFAULT_GROUP
    sdpa = graph.meta.get("sdpa") or {}
    if not sdpa.get("calls") or same_backends(sdpa, group):
        return graph
    return cudnn_from_flash(graph, group)


def _plain(data: dict[str, Any]) -> bool:
    call = call_from_dict(data)
    return (
        call.attn_mask is None
        and call.requires_grad
        and call.dropout_p == 0.0  # cuDNN's dropout state: not compared with a trace here
        and call.query.shape[-1] % 8 == 0
    )


def cudnn_from_flash(graph: OpGraph, group: str) -> OpGraph | None:
    """``graph`` as tracing it for ``group`` would give it, or None when not derivable."""
    sdpa = graph.meta.get("sdpa") or {}
    if not derivable(sdpa, group):
        return None
    nodes = graph.nodes.copy()
    events = graph.mem_events
    forward = nodes["op"] == FORWARD
    backward = nodes["op"] == BACKWARD
    dropped: set[int] = set()  # debug-mask blocks: cuDNN returns none
    seeds: set[int] = set()
    # one new block per output of a forward op, in output order
    # (of the forward attention nodes only: grouping every node's allocations took 0.05 s)
    ids = nodes.loc[forward, "id"]
    alloc = (events["action"] == "alloc") & events["node_id"].isin(ids)
    allocs = events[alloc].groupby("node_id")["block"].agg(list)
    for i in nodes.index[forward]:
        shapes = json.loads(nodes.at[i, "output_shapes"])
        dtypes = json.loads(nodes.at[i, "output_dtypes"])
        blocks = allocs[nodes.at[i, "id"]]
        seeds.add(blocks[SEED])
        dropped.add(blocks[DEBUG])
        shapes = [shapes[0], [*shapes[LSE], 1], [], []]
        dtypes = [dtypes[0], dtypes[LSE], "int64", "int64"]
        nodes.at[i, "output_shapes"] = json.dumps(shapes)
        nodes.at[i, "output_dtypes"] = json.dumps(dtypes)
        nodes.at[i, "bytes_written"] -= SEED_BYTES["flash"] - SEED_BYTES["cudnn"]
    for i in nodes.index[backward]:
        shapes = json.loads(nodes.at[i, "input_shapes"])
        dtypes = json.loads(nodes.at[i, "input_dtypes"])
        shapes[BACKWARD_LSE] = [*shapes[BACKWARD_LSE], 1]
        shapes[BACKWARD_SEED] = []
        dtypes[BACKWARD_SEED] = dtypes[BACKWARD_SEED + 1] = "int64"
        nodes.at[i, "input_shapes"] = json.dumps(shapes)
        nodes.at[i, "input_dtypes"] = json.dumps(dtypes)
        nodes.at[i, "bytes_read"] -= SEED_BYTES["flash"] - SEED_BYTES["cudnn"]
    for name, new in TO.items():
        at = nodes["op"] == name
        nodes.loc[at, "aten_op"] = f"aten.{new}.default"
        nodes.loc[at, "op"] = new
    kept = events[~events["block"].isin(dropped)].copy()
    kept.loc[kept["block"].isin(seeds), "bytes"] = SEED_BYTES["cudnn"]
    # block ids number storages as the tracer first meets them: one fewer per dropped mask
    gone = pd.Series(sorted(dropped))
    kept["block"] = kept["block"] - gone.searchsorted(kept["block"]).astype("int64")
    kept["seq"] = range(len(kept))
    meta = dict(graph.meta)
    meta["step"] = {**meta["step"], "sdpa_group": group}
    calls = dict(sdpa.get("backends", {}))
    calls[CUDNN] = calls.get(CUDNN, 0) + calls.pop(FLASH, 0)
    meta["sdpa"] = {**sdpa, "group": group, "backends": calls}
    return OpGraph(nodes, graph.edges.copy(), kept.reset_index(drop=True), meta)
