"""Nodes that stand for a library call running many kernels: a cuDNN RNN call.

Such a node becomes the kernel rows of what the library runs (``trace/rnn_kernels.py``),
each with ``repeat``: how many times it runs (a recurrent GEMM once per time step). The
kernels are issued back to back from C++, so they are timed as kernels, without the launch
gap of an eager op (``features.LIBRARY``), as DeepBench measured its kernels.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.features import LIBRARY
from boom_ml.trace import rnn_kernels

REPEAT = "repeat"  # a row's kernel runs this many times (default 1)
RNN_METHOD = "cudnn-rnn kernels (gemm-tiles + elementwise-head)"
RNN_OPS = {f"cudnn_{m}": m for m in rnn_kernels.MODES}


def is_rnn(op: str) -> bool:
    """Whether ``op`` (a node's CUDA op name) is a cuDNN RNN call, forward or backward."""
    return op.removesuffix("_backward") in RNN_OPS


def rnn_rows(op: str, shapes: list[list[int]], outs: list[list[int]]) -> list[dict[str, Any]]:
    """A cuDNN RNN call's node as the kernels it runs (``shapes``/``outs``: its tensors')."""
    backward = op.endswith("_backward")
    mode = RNN_OPS[op.removesuffix("_backward")]
    output = shapes[3] if backward else outs[0]  # backward's inputs: x, hx, cx, output, ...
    shape = rnn_kernels.shape_of(mode, shapes[0], shapes[1], shapes[2], output)
    return [{**row, "source": LIBRARY} for row in rnn_kernels.kernel_rows(shape, backward)]


PERSISTENT_NOTE = "cuDNN runs its persistent kernel here: timed as the standard one, likely slow"


def rnn_method(op: str, shapes: list[list[int]], outs: list[list[int]], gpu: GpuSpec) -> str:
    """How a cuDNN RNN call is timed on ``gpu``: its standard algorithm's kernels, and where
    PyTorch picks the small-hidden persistent kernel instead (``rnn_kernels.persistent``),
    a note that the standard kernels are all that is modelled."""
    backward = op.endswith("_backward")
    mode = RNN_OPS[op.removesuffix("_backward")]
    output = shapes[3] if backward else outs[0]
    shape = rnn_kernels.shape_of(mode, shapes[0], shapes[1], shapes[2], output)
    if rnn_kernels.persistent(shape, backward, gpu.sm_version // 10):
        return f"{RNN_METHOD}; {PERSISTENT_NOTE}"
    return RNN_METHOD


def library_rows(kernels: list[dict[str, Any]], dtype: str, direction: str) -> pd.DataFrame:
    """Kernel rows of kernels a library call issues back to back, in ``dtype`` and
    ``direction`` (for scoring such kernels alone: ``training/validate_rnn.py``)."""
    return pd.DataFrame([{**k, "dtype": dtype, "direction": direction, "source": LIBRARY}
                         for k in kernels])  # fmt: skip


def library_ms(rows: pd.DataFrame, gpu: GpuSpec, model: Any = None) -> float:
    """The call's time on ``gpu`` (ms): each row timed as ``predict_ops`` times kernel rows
    (the heads, GEMM rows by the tile/wave model), times its ``repeat``. ``model``: a
    PerOpModel (None: the packaged heads)."""
    from boom_ml.timing.anchors import time_kernel_rows
    from boom_ml.timing.gemm import gemm_model_for
    from boom_ml.timing.heads import load_model

    per_op = model if model is not None else load_model()
    base = rows.drop(columns=[REPEAT])
    pred = time_kernel_rows(base, gpu, per_op, gemm_model_for(per_op))
    return float((pred["pred_ms"].to_numpy() * rows[REPEAT].to_numpy(dtype=float)).sum())
