"""Traced OpGraph nodes -> canonical kernel rows -> per-op time predictions.

A node becomes zero or more rows in the canonical kernel convention (the columns of
``data_collection/schema.py``), so that :func:`boom_ml.timing.features.kernel_features`
computes the same features it computes for a measured kernel of that shape. A
``convolution_backward`` node becomes two rows (input and weight gradients) whose times add.
An optimizer, copy or fill node becomes the elementwise row that moves its bytes
(:mod:`boom_ml.timing.bandwidth`), which the elementwise head times. A tensor-core
convolution on NCHW tensors also gets the copy rows of its layout transforms
(:mod:`boom_ml.timing.conv_layout`), zeroed on GPUs whose tensor cores do not take its dtype.

Shape conventions: ``mm(a[M,K], b[K,N])`` is a single GEMM with b=1, m=M, n=K (reduction),
k=N (output width); ``bmm(a[B,M,K], b[B,K,N])`` is b=B, m=M, n=K, k=N (NeuSight's).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd

from boom_ml.estimates import TimeEstimate
from boom_ml.gpus.spec import GpuSpec
from boom_ml.identity_cache import IdentityCache
from boom_ml.timing import conv_layout
from boom_ml.timing.bandwidth import CURVE_FAMILIES, stream_row
from boom_ml.timing.features import distinct_rows, kernel_features, per_gpu
from boom_ml.timing.library_calls import REPEAT, is_rnn, rnn_method, rnn_rows
from boom_ml.timing.size_floor import SizeFloor
from boom_ml.timing.summary import summarise
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.graph import OpGraph

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
NO_TIME_FAMILIES = {"host"}
# Families whose kernels the shape formulas describe poorly (reductions write far less than
# they read, losses and optimizers fuse many steps): they bring the traced bytes and FLOPs.
COUNTED_FAMILIES = {"reduction", "loss", "optimizer", "copy", "fill", "pooling", "other"}
NORM_OPS = {"native_layer_norm": "layer_norm", "layer_norm": "layer_norm",
            "cudnn_batch_norm": "batch_norm", "native_batch_norm": "batch_norm",
            "native_group_norm": "group_norm", "group_norm": "group_norm",
            "_fused_rms_norm": "rms_norm", "rms_norm": "rms_norm"}  # fmt: skip
TRANSCENDENTAL_HINTS = ("exp", "log", "tanh", "gelu", "sigmoid", "silu", "erf", "pow", "sqrt",
                        "sin", "cos", "softplus", "mish", "elu")  # fmt: skip


def _numel(shape: list[int]) -> int:
    return int(math.prod(shape)) if shape else 1


def _base(op: str) -> str:
    """'add_' -> 'add'; backward suffixes stay (they are different kernels)."""
    return op[:-1] if op.endswith("_") and not op.endswith("__") else op


def _dtype(dtypes: list[str], tf32: bool) -> str:
    """The compute dtype of a node's kernel row; ``tf32``: this node's fp32 math may use TF32."""
    for d in dtypes:
        if d in FLOAT_DTYPES:
            if d == "float32" and tf32:
                return "tf32"
            return "float32" if d == "float64" else d
    return "float32"


def _gemm_row(op: str, shapes: list[list[int]]) -> dict[str, Any] | None:
    mats = [s for s in shapes if len(s) >= 2]
    if len(mats) < 2:
        return None
    a, b = mats[-2], mats[-1]
    if len(a) == 2 and len(b) == 2:
        name = "linear" if op in ("addmm", "_addmm_activation") else "mm"
        return {"op": name, "b": 1, "m": a[0], "n": a[1], "k": b[1]}
    batch = _numel(a[:-2])
    return {"op": "bmm", "b": batch, "m": a[-2], "n": a[-1], "k": b[-1]}


def _conv_geometry(x: list[int], w: list[int], out_hw: list[int]) -> dict[str, Any]:
    """Conv fields from input, weight and output spatial shapes (stride/padding inferred)."""
    h, wd = (x[2], x[3]) if len(x) >= 4 else (x[2], 1)
    kh, kw = (w[2], w[3]) if len(w) >= 4 else (w[2], 1)
    oh, ow = (out_hw + [1, 1])[:2]
    fields: dict[str, Any] = {"batch": x[0], "in_channels": x[1], "out_channels": w[0],
                              "kernel_size": kh, "kernel_w": kw, "input_h": h, "input_w": wd,
                              "groups": max(1, x[1] // max(w[1], 1))}  # fmt: skip
    for size, k, o, s_key, p_key in ((h, kh, oh, "stride", "padding"),
                                     (wd, kw, ow, "stride_w", "padding_w")):  # fmt: skip
        stride = max(1, round(size / max(o, 1)))
        pad = max(0, math.ceil(((o - 1) * stride + k - size) / 2))
        fields[s_key], fields[p_key] = stride, pad
    return fields


FOLDED = "depth_folded"  # a 3-D convolution's row: its 2-D implicit-GEMM equivalent
FOLDED_METHOD = "3-D conv as its 2-D implicit GEMM"


def _geometry(x: list[int], w: list[int], out_spatial: list[int]) -> dict[str, Any]:
    """:func:`_conv_geometry`; a 3-D convolution (N, C, D, H, W) as the 2-D one that runs the
    same implicit GEMM: output depth folded into the batch (N*Do), kernel depth into the input
    channels (C*kd), so rows N*Do*Ho*Wo, reduction C/g*kd*kh*kw and outputs O, and the FLOPs,
    are the 3-D convolution's (only the input is read as kd depth slices)."""
    if len(x) != 5:
        return _conv_geometry(x, w, out_spatial)
    depth_out, kd = out_spatial[0], w[2]
    x2 = [x[0] * depth_out, x[1] * kd, x[3], x[4]]
    w2 = [w[0], w[1] * kd, w[3], w[4]]
    return {**_conv_geometry(x2, w2, out_spatial[1:]), FOLDED: True}


def _conv_rows(
    op: str, shapes: list[list[int]], outs: list[list[int]]
) -> list[tuple[dict[str, Any], list[list[int]]]]:
    """(kernel row, the shapes that kernel reads and writes) per convolution kernel."""
    if op == "convolution_backward":
        if len(shapes) < 3 or len(shapes[1]) not in (3, 4, 5) or len(shapes[2]) != len(shapes[1]):
            return []
        grad, x, w = shapes[0], shapes[1], shapes[2]
        geo = _geometry(x, w, grad[2:])
        rows = []
        if any(o == x for o in outs):
            rows.append(({**geo, "grad_wrt": "input"}, [grad, w, x]))
        if any(o == w for o in outs) or not rows:
            rows.append(({**geo, "grad_wrt": "weight"}, [x, grad, w]))
        return rows
    if len(shapes) < 2 or len(shapes[0]) not in (3, 4, 5) or not outs:
        return []
    if len(shapes[1]) != len(shapes[0]):
        return []
    return [(_geometry(shapes[0], shapes[1], outs[0][2:]), [shapes[0], shapes[1], outs[0]])]


def _rowwise(numel: int, cols: int) -> dict[str, Any]:
    cols = max(int(cols), 1)
    return {"numel": numel, "rows": max(numel // cols, 1), "cols": cols}


def node_rows(
    nodes: pd.DataFrame, tf32: Tf32 | bool | None = None, channels_last: bool = False
) -> pd.DataFrame:
    """Canonical kernel rows for ``nodes`` (an OpGraph node table), with ``node_pos``.

    ``tf32``: PyTorch's two switches (None: its defaults, cuDNN on, matmuls off); a
    convolution follows the cuDNN one, GEMMs and attention the matmul one. Without
    ``channels_last`` (tensors in NCHW, PyTorch's default) a convolution that may run on
    tensor cores adds its layout-transform rows (``conv_layout.MARK`` names their dtype).
    """
    flags = Tf32.of(tf32)
    out: list[dict[str, Any]] = []
    # a step's nodes repeat (every layer the same ops on the same shapes): rows are made once
    # per distinct signature (a Llama-3-8B graph: 10,790 nodes, 207 signatures)
    made: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for pos, node in enumerate(nodes.itertuples(index=False)):
        family = str(node.family)
        if family in NO_TIME_FAMILIES:
            continue
        key = (family, node.op, node.input_shapes, node.output_shapes, node.input_dtypes,
               node.output_dtypes, node.phase, node.flops, node.bytes_read, node.bytes_written)  # fmt: skip
        rows = made.get(key)
        if rows is None:
            rows = made[key] = _node_rows(node, family, flags, channels_last)
        out += [{"node_pos": pos, **row} for row in rows]
    return pd.DataFrame(out)


def _node_rows(node: Any, family: str, flags: Tf32, channels_last: bool) -> list[dict[str, Any]]:
    """One node's kernel rows (without its position)."""
    op = str(node.op)
    shapes = json.loads(node.input_shapes)
    outs = [s for s in json.loads(node.output_shapes) if s]
    in_dt, out_dt = json.loads(node.input_dtypes), json.loads(node.output_dtypes)
    matrix = family in ("gemm", "conv", "attention")
    # cuDNN's RNNs follow the cuDNN switch (RNN.cpp: allowTF32CuDNN(Float32Op::RNN))
    tf32 = flags.cudnn if is_rnn(op) else flags.for_family(family)
    base = {
        "family": family,
        "dtype": _dtype(in_dt + out_dt, matrix and tf32),
        "direction": "backward" if node.phase == "backward" else "forward",
    }
    convs = _conv_rows(op, shapes, outs) if family == "conv" else []
    if convs:
        out = []
        for row, operands in convs:
            out.append({**base, "op": "conv2d", **row})
            # NCHW: cuDNN's layout transforms around tensor cores
            if not (channels_last and conv_layout.takes_channels_last(shapes)):
                out += [
                    {**base, **r} for r in conv_layout.transform_rows(row, operands, base["dtype"])
                ]
        return out
    return [{**base, **row} for row in _shape_rows(family, op, shapes, outs, node)]


def _shape_rows(family: str, op: str, shapes, outs, node) -> list[dict[str, Any]]:
    if is_rnn(op):
        return rnn_rows(op, shapes, outs)
    counted = {"flops": float(node.flops), "bytes": float(node.bytes_read + node.bytes_written)}
    big = max([_numel(s) for s in outs + shapes] or [1])
    generic = [{"op": _base(op), "numel": big, **counted, "family": family}]
    if family == "gemm":
        row = _gemm_row(op, shapes)
        return [row] if row else generic
    if family == "conv":  # kernel rows come from _conv_rows (node_rows); not this one (a
        # transposed or otherwise unread convolution): the conv head's geometry does not
        # describe it, so its counted FLOPs and bytes are timed on an unmodelled op's roofline
        return [{**generic[0], "family": "other"}]
    if family == "attention":
        q = next((s for s in shapes if len(s) == 4), None)
        ks = [s for s in shapes if len(s) == 4]
        if q is None:
            return generic
        kv = ks[2] if op.endswith("_backward") and len(ks) > 2 else (ks[1] if len(ks) > 1 else q)
        # the traced FLOPs count a causal mask's kept pairs only (trace/ops.py: _causal):
        # the attention features take them where they are below the full-square formula
        return [{"op": "sdpa", "batch": q[0], "heads": q[1], "seq_q": q[2], "seq_kv": kv[2],
                 "head_dim": q[3], "flops": counted["flops"]}]  # fmt: skip
    if family == "norm":
        name = NORM_OPS.get(op.removesuffix("_backward"), op)
        x = max(shapes, key=_numel) if shapes else [1]
        if name == "batch_norm":  # per-channel statistics over N*H*W
            c = x[1] if len(x) > 1 else 1
            return [{"op": name, **_rowwise(_numel(x), _numel(x) // max(c, 1))}]
        cols = _row_length(name, x, shapes + outs)
        return [{"op": name, **_rowwise(_numel(x), cols)}]
    if family == "softmax":
        x = max(shapes, key=_numel) if shapes else [1]
        name = "log_softmax" if "log_softmax" in op else "softmax"
        return [{"op": name, **_rowwise(_numel(x), x[-1] if x else 1)}]
    if family == "embedding":
        if op == "embedding" and len(shapes) >= 2:
            idx = _numel(shapes[1])
            dim = shapes[0][-1]
            return [{"op": "embedding", "numel": idx * dim, "rows": idx, "cols": dim}]
        return [{"op": _base(op), **_rowwise(big, outs[0][-1] if outs and outs[0] else 1),
                 **counted}]  # fmt: skip
    if family == "elementwise":
        return [_elementwise_row(op, shapes, outs)]
    if family in CURVE_FAMILIES:  # optimizer, copy, fill: streams (bandwidth.py)
        return [stream_row(op, family, shapes, outs, node)]
    return generic  # reduction, loss, pooling, other


def _row_length(name: str, x: list[int], shapes: list[list[int]]) -> int:
    """Elements a norm normalises together: ``x``'s elements over its statistics' count.

    The statistics (mean and rstd) are outputs of a forward node and inputs of a backward one:
    (B, S, 1) for a layer or RMS norm over (B, S, H), (N, G) for a group norm over (N, C, H, W),
    whatever the module's affine weight is (a group norm's weight is (C,), not a row). Where a
    node shows none, the weight's elements (the trailing dims of ``x`` it matches), else
    ``x``'s last dim."""
    if name == "group_norm":
        stats = [s for s in shapes if len(s) == 2 and s != x and x and s[0] == x[0]]
    else:  # x's leading dims, then ones
        stats = [s for s in shapes if len(s) == len(x) and s != x and _leading_then_ones(s, x)]
    if stats:
        return max(_numel(x) // max(_numel(stats[0]), 1), 1)
    params = [s for s in shapes if len(s) >= 1 and s != x and _numel(s) > 1]
    suffix = [s for s in params if len(s) <= len(x) and x[len(x) - len(s) :] == s]
    return _numel(suffix[0]) if suffix else (x[-1] if x else 1)


def _leading_then_ones(s: list[int], x: list[int]) -> bool:
    """Whether ``s`` is ``x`` with one or more trailing dims set to 1."""
    k = len(s)
    while k > 0 and s[k - 1] == 1:
        k -= 1
    return k < len(x) and s[:k] == x[:k]


def _elementwise_row(op: str, shapes, outs) -> dict[str, Any]:
    numel = max([_numel(s) for s in outs] or [_numel(s) for s in shapes] or [1])
    full = sum(1 for s in shapes if _numel(s) == numel)
    name = _base(op)
    if name in ("add", "sub", "mul", "div", "pow") and full <= 1 and len(shapes) <= 1:
        name = f"{name}_scalar"  # tensor op scalar: one operand streamed, as NeuSight's *u ops
    trans = float(any(t in name for t in TRANSCENDENTAL_HINTS))
    return {"op": name, "numel": numel, "rows": 1, "cols": numel, "arity": max(full, 1),
            "transcendental": trans}  # fmt: skip


# node_rows depends on the graph only, not the GPU: one prediction over many GPUs parses
# the node shapes once.
_ROWS_CACHE: IdentityCache[pd.DataFrame] = IdentityCache(400)  # a dataset holds ~240 graphs
# one per (graph, GPUs): the features and the size floor's one-element copies; a graph has
# two, its GPUs' and their anchors' (anchors.py)
_FEATS_CACHE: IdentityCache[tuple[pd.DataFrame, SizeFloor]] = IdentityCache(800)


_UNIQUE_CACHE: IdentityCache[tuple[pd.DataFrame, np.ndarray]] = IdentityCache(400)


def _distinct_rows(rows: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """The distinct kernel rows (node position and layout mark left out) and, for each row
    of ``rows``, the index of its distinct row."""
    return distinct_rows(rows.drop(columns=["node_pos", conv_layout.MARK, REPEAT], errors="ignore"))


def _cached_node_rows(nodes: pd.DataFrame, tf32: Tf32, channels_last: bool) -> pd.DataFrame:
    return _ROWS_CACHE.get(
        nodes, (tf32, channels_last), lambda: node_rows(nodes, tf32, channels_last)
    )


def predict_nodes(
    nodes: pd.DataFrame,
    gpu: GpuSpec,
    tf32: Tf32 | bool | None = None,
    model: Any = None,
    channels_last: bool = False,
) -> pd.DataFrame:
    """Per-node ``ms``, ``p10``, ``p90`` and ``method`` on ``gpu`` (host nodes: 0 ms, 'none')."""
    pred = predict_nodes_many(nodes, [gpu], tf32=tf32, model=model, channels_last=channels_last)
    return pd.DataFrame({k: v[0] for k, v in pred.items()})


def node_ms_many(
    nodes: pd.DataFrame,
    gpus: list[GpuSpec],
    tf32: Tf32 | bool | None = None,
    model: Any = None,
    channels_last: bool = False,
) -> np.ndarray:
    """Median per-node ms of ``nodes`` on each of ``gpus`` ((len(gpus), len(nodes)))."""
    return predict_nodes_many(
        nodes, gpus, tf32=tf32, model=model, median_only=True, channels_last=channels_last
    )["ms"]


def predict_nodes_many(
    nodes: pd.DataFrame,
    gpus: list[GpuSpec],
    tf32: Tf32 | bool | None = None,
    model: Any = None,
    median_only: bool = False,
    channels_last: bool = False,
) -> dict[str, np.ndarray]:
    """``ms``, ``p10``, ``p90`` and ``method`` per GPU and node ((len(gpus), len(nodes)) each):
    :func:`predict_nodes` on each GPU, featurised and predicted in one call (features are
    per row, so batching does not change them). ``median_only``: p10/p90 repeat the median.
    ``channels_last``: the step's convolutions run on NHWC tensors (no layout transforms)."""
    from boom_ml.timing import anchors
    from boom_ml.timing import gemm as gemm_tiles
    from boom_ml.timing.gemm import gemm_model_for, retime_gemm_many
    from boom_ml.timing.heads import load_model

    # GEMM hook (gemm.py; off in step times until the GNN is retrained on it): before
    # `model` defaults
    gemm = gemm_model_for(model) if gemm_tiles.STEP_TIMES else None
    model = model if model is not None else load_model()
    shape = (len(gpus), len(nodes))
    out = {"ms": np.zeros(shape), "p10": np.zeros(shape), "p90": np.zeros(shape)}
    method = np.full(shape, "none", dtype=object)
    rows = _cached_node_rows(nodes, Tf32.of(tf32), channels_last)
    if rows.empty or not gpus:
        return {**out, "method": method}
    # Every model here times a row from the row alone, so identical rows (a model's repeated
    # blocks: 4,383 kernel rows of a Llama-3-8B step, 101 distinct) are featurised and timed once.
    base, same = _UNIQUE_CACHE.get(rows, (), lambda: _distinct_rows(rows))

    def timed(specs: list[GpuSpec], median_only: bool) -> pd.DataFrame:
        # Features do not depend on the heads: CV folds that swap heads reuse them.
        feats, floor = _FEATS_CACHE.get(
            nodes, (Tf32.of(tf32), channels_last, *specs), lambda: _features(base, specs)
        )
        pred = floor.lift(model.predict_features(feats, median_only), model)  # size floor
        return retime_gemm_many(base, specs, pred, gemm)  # GEMM rows: tile/wave model, if any

    # no slower than on a measured GPU this one beats on every spec number (anchors.py)
    pred = anchors.cap(base, gpus, timed(gpus, median_only), model, lambda a: timed(a, True))
    pos = rows["node_pos"].to_numpy()
    keep = _layout_gate(rows, gpus)
    if REPEAT in rows:  # kernels a node runs many times (an RNN's per-step GEMMs)
        keep = keep * rows[REPEAT].fillna(1).to_numpy(dtype=float)
    for col, src in (("ms", "pred_ms"), ("p10", "p10_ms"), ("p90", "p90_ms")):
        values = pred[src].to_numpy().reshape(len(gpus), len(base))[:, same] * keep
        for k in range(len(gpus)):
            np.add.at(out[col][k], pos, values[k])  # sums multi-row nodes
    methods = pred["method"].to_numpy().reshape(len(gpus), len(base))[:, same]
    marked = rows[conv_layout.MARK].notna().to_numpy() if conv_layout.MARK in rows else None
    own = ~marked if marked is not None else np.ones(len(rows), dtype=bool)
    for k in range(len(gpus)):  # a conv node is named by its kernel, not its transforms
        method[k, pos[own]] = methods[k][own]
    if REPEAT in rows:  # a library call's many kernels (rnn_kernels), each by its own model
        for node_pos in np.unique(pos[rows[REPEAT].notna().to_numpy()]):
            node = nodes.iloc[int(node_pos)]
            shapes, outs = json.loads(node.input_shapes), json.loads(node.output_shapes)
            for k, gpu in enumerate(gpus):
                method[k, node_pos] = rnn_method(str(node.op), shapes, outs, gpu)
    if FOLDED in rows:  # no 3-D convolution was measured: say the row is the 2-D equivalent
        folded = pos[rows[FOLDED].eq(True).to_numpy() & own]
        method[:, folded] = [[f"{m} ({FOLDED_METHOD})" for m in row] for row in method[:, folded]]
    return {**out, "method": method}


def _features(base: pd.DataFrame, gpus: list[GpuSpec]) -> tuple[pd.DataFrame, SizeFloor]:
    """Features of ``base`` repeated once per GPU (GPU-major) and their size floor."""
    frame, specs = per_gpu(base, gpus)
    return kernel_features(frame, specs), SizeFloor.of(frame, specs)


def _layout_gate(rows: pd.DataFrame, gpus: list[GpuSpec]) -> np.ndarray | float:
    """1 for every row on every GPU, 0 for layout-transform rows on a GPU whose tensor cores do
    not take that convolution's dtype ((len(gpus), len(rows)), or 1.0 without such rows)."""
    if conv_layout.MARK not in rows.columns:
        return 1.0
    marks = rows[conv_layout.MARK].to_numpy()
    is_layout = pd.notna(marks)
    gate = np.ones((len(gpus), len(rows)))
    for k, gpu in enumerate(gpus):
        gate[k, is_layout] = [conv_layout.on_tensor_cores(d, gpu) for d in marks[is_layout]]
    return gate


def estimate_per_op(
    graph: OpGraph,
    gpu: GpuSpec,
    tf32: Tf32 | bool | None = None,
    top_n: int = 10,
    model: Any = None,
) -> TimeEstimate:
    """Step time of ``graph`` on ``gpu``: the sum of per-op predictions.

    Ops of families with a learned head get its prediction; the others a calibrated
    roofline (``boom_ml.timing.heads``). ``model`` is a PerOpModel (default: the packaged
    one, or ``$BOOM_PER_OP_MODEL``). A missing or corrupt model raises ArtifactError (one
    line, exit 2 in the CLI): silently falling back to the roofline would hide it behind
    worse numbers.
    """
    pred = predict_nodes(graph.nodes, gpu, tf32=tf32, model=model)
    return summarise(
        graph.nodes,
        pred["ms"].to_numpy(),
        method="per-op",
        top_n=top_n,
        p10=pred["p10"].to_numpy(),
        p90=pred["p90"].to_numpy(),
        methods=pred["method"].to_numpy(),
    )
