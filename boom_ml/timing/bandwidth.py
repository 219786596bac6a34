"""Optimizer, copy, cast and fill kernels timed by the elementwise head as a bandwidth curve.

No optimizer kernel (``_foreach_*``, ``_fused_adamw_``, ...) nor copy, cast or fill was ever
measured: NeuSight, Vidur and DeepBench time GEMMs, convolutions, norms and elementwise ops.
These kernels are memory-bound streams: each element of some tensors is read once and each
element of others written once. So a traced node is described as the stream it is (bytes read
and written, elements per tensor, dtype, tensors read; :func:`describe`) and then as the
elementwise kernel that moves the same bytes (:meth:`Stream.row`), which the elementwise head,
fit on measured streams of many GPUs, times: its GPU features make the curve GPU-specific, and
in a fold model the elementwise head trained without the held-out GPU keeps it leak-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from boom_ml.timing.features import DTYPE_BYTES, ELEMENTWISE, FAMILY_HEAD, HEAD_FEATURES

METHOD = "elementwise-head (bandwidth curve)"
# Heads whose rows are streams; their rows sit in the elementwise head's feature space.
CURVE_HEADS = ("optimizer", "copy")
CURVE_FAMILIES = frozenset(f for f, h in FAMILY_HEAD.items() if h in CURVE_HEADS)
assert all(HEAD_FEATURES[h] == HEAD_FEATURES["elementwise"] for h in CURVE_HEADS)
# The most tensors an elementwise op of the head's vocabulary reads (add3, where, addcmul): a
# stream that reads more is described as one of these moving the same bytes.
MAX_ARITY = max(arity for arity, _ in ELEMENTWISE.values())
INT_BYTES = {"int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
# Multi-tensor kernels: their inputs are tensor lists of equal length (torch's
# MultiTensorApply / FusedOptimizerTensorListMetadata).
LIST_PREFIXES = ("_foreach_", "_fused_", "_amp_foreach_")
# PyTorch's fused optimizers: the schema marks the grads list written, but the kernel stores
# it only when a GradScaler passes grad_scale, and found_inf with it (aten/src/ATen/native/
# cuda: fused_adam_utils.cuh "Conditional Gradient Store", fused_adagrad_utils.cuh,
# FusedSgdKernel.cu). Value: whether one step-count tensor per parameter follows the lists.
FUSED_GRADS = {"_fused_adam": True, "_fused_adamw": True, "_fused_adagrad": True,
               "_fused_sgd": False}  # fmt: skip
# Fused optimizers that take a square root and divide per element (Adam's denominator).
FUSED_SQRT = {"_fused_adam", "_fused_adamw", "_fused_adagrad"}
# Ops whose first input is overwritten, never read: the recorder counts every input as read.
OVERWRITES = {"copy", "copy_", "_foreach_copy_", "_foreach_zero_"}


def width(dtype: str) -> int:
    """Bytes per element of ``dtype`` (float and integer types; 4 when unknown)."""
    return DTYPE_BYTES.get(dtype) or INT_BYTES.get(dtype, 4)


@dataclass(frozen=True)
class Stream:
    """A memory-bound kernel: what it reads and writes, over how many elements."""

    op: str
    read_bytes: float
    write_bytes: float
    numel: int  # elements per streamed tensor (for a list kernel, per list)
    dtype: str  # the widest floating dtype streamed
    transcendental: bool

    @property
    def nbytes(self) -> float:
        return self.read_bytes + self.write_bytes

    @property
    def tensors_read(self) -> float:
        """Tensors (lists) of ``numel`` elements of ``dtype`` that the bytes read amount to."""
        return self.read_bytes / (max(self.numel, 1) * width(self.dtype))

    def row(self) -> dict[str, Any]:
        """The canonical elementwise row that moves the same bytes.

        An elementwise row of arity a over n elements moves elt*n*(a+1) bytes (a tensors
        read, one written; features.py). The stream keeps its bytes exactly and its tensors
        read (capped at MAX_ARITY, within the head's vocabulary); n follows. So fused AdamW
        (4 lists read, 3 written) over N fp32 elements is an arity-3 op over 7N/4 elements.
        """
        arity = min(max(round(self.tensors_read), 1), MAX_ARITY)
        numel = max(round(self.nbytes / (width(self.dtype) * (arity + 1))), 1)
        return {"op": self.op, "numel": numel, "rows": 1, "cols": numel, "arity": arity,
                "transcendental": float(self.transcendental), "bytes": self.nbytes,
                "flops": math.nan, "dtype": self.dtype, "stream_numel": self.numel,
                "bytes_read": self.read_bytes, "bytes_written": self.write_bytes}  # fmt: skip


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape)) if shape else 1


def list_length(shapes: Sequence[Sequence[int]]) -> int:
    """Tensors per list of a multi-tensor kernel: the shortest prefix the next one repeats.

    (Lists hold the same shapes in the same order: params, grads, exp_avgs, ...) No repeat:
    one list of every input. A list that itself repeats (every tensor one shape) reads as
    more, shorter lists: the bytes stay right, only the elements per list are fewer.
    """
    for t in range(1, len(shapes) // 2 + 1):
        if list(shapes[t : 2 * t]) == list(shapes[:t]):
            return t
    return len(shapes)


def describe(
    op: str,
    family: str,
    shapes: Sequence[Sequence[int]],
    outs: Sequence[Sequence[int]],
    in_dtypes: Sequence[str],
    out_dtypes: Sequence[str],
    bytes_read: float,
    bytes_written: float,
) -> Stream:
    """The stream a traced optimizer, copy or fill node is (shapes, dtypes, traced bytes).

    Starts from the recorder's counts (every input view read; fresh outputs and inputs the
    schema marks mutable written) and corrects the kernels where they are not the traffic:
    a fill reads nothing, ``copy_`` does not read what it overwrites, and a fused optimizer
    does not write its grads unless a GradScaler passed ``grad_scale``.
    """
    read, written = float(bytes_read), float(bytes_written)
    floats = [d for d in [*in_dtypes, *out_dtypes] if d in DTYPE_BYTES and d != "tf32"]
    dtype = max(floats, key=DTYPE_BYTES.__getitem__, default="float32")
    is_list = op.startswith(LIST_PREFIXES)
    t = list_length(shapes) if is_list else len(shapes)
    if is_list:
        numel = sum(_numel(s) for s in shapes[:t])
    else:
        numel = max([_numel(s) for s in outs if s] or [_numel(s) for s in shapes] or [1])
    first = (shapes[:t] if is_list else shapes[:1]) if shapes else []
    if family == "fill":  # the input is a template (ones_like) or the tensor overwritten
        read = 0.0
    elif op in OVERWRITES and first:
        read -= sum(_numel(s) for s in first) * width(in_dtypes[0])
    fused = op.rstrip("_")
    if fused in FUSED_GRADS and len(shapes) >= 2 * t and not _grad_scaled(shapes, t, fused):
        written -= sum(_numel(s) for s in shapes[t : 2 * t]) * width(in_dtypes[t])
    return Stream(op, max(read, 0.0), max(written, 0.0), numel, dtype, _transcendental(op))


def _grad_scaled(shapes: Sequence[Sequence[int]], t: int, fused: str) -> bool:
    """Whether a fused optimizer call got grad_scale: two 0-dim tensors (grad_scale and
    found_inf) past its lists and step counts; an lr tensor would be one."""
    lists = 1
    while list(shapes[lists * t : (lists + 1) * t]) == list(shapes[:t]):
        lists += 1
    extra = len(shapes) - lists * t - (t if FUSED_GRADS[fused] else 0)
    return extra >= 2


def _transcendental(op: str) -> bool:
    """Whether the kernel evaluates a square root, exponential or division per element."""
    base = op.removeprefix("_foreach_").rstrip("_")
    if op.rstrip("_") in FUSED_SQRT:
        return True
    return ELEMENTWISE.get(base, (1, False))[1] if op.startswith("_foreach_") else False


def stream_row(op: str, family: str, shapes, outs, node: Any) -> dict[str, Any]:
    """The canonical (elementwise-space) row of a traced optimizer, copy or fill node."""
    stream = describe(op, family, shapes, outs, json.loads(node.input_dtypes),
                      json.loads(node.output_dtypes), node.bytes_read, node.bytes_written)  # fmt: skip
    return stream.row()
