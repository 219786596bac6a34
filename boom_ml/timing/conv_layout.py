"""Layout transforms of tensor-core convolutions on NCHW tensors (PyTorch's default layout).

cuDNN's tensor-core convolution kernels work on NHWC data; given NCHW tensors, "the cuDNN
library may use padding, folding, and NCHW-to-NHWC transformations to call the Tensor Core
operations" (cuDNN Developer Guide, Legacy API, Convolution Functions: Data and Filter
Formats, and its "Tensor Transformations" section). Profiles of NCHW mixed-precision steps show
them as separate ``nchwToNhwcKernel`` / ``nhwcToNchwKernel`` launches, and the measured rows
agree: timm's AMP training benchmark on an RTX 3090 (``../shared/data/timm_bench``) ran its CNNs
in ``channels_last`` in 0.82x the NCHW time (median over the traced models with both layouts).

The model: every operand and result of a tensor-core convolution kernel in NCHW passes through
one transform, a copy that reads and writes it once, timed like any copy (the elementwise head
as a bandwidth curve, :mod:`boom_ml.timing.bandwidth`). A forward convolution transforms its
input, weight and output; a backward one per gradient row its two operands and the gradient it
writes. No constant is fitted. With ``channels_last`` (the model and input converted with
``memory_format=torch.channels_last``) there is none. Depthwise convolutions (one input channel
per group) do not run on tensor cores and keep none. Whether a convolution runs on tensor cores
is a property of the GPU (:func:`on_tensor_cores`), so the rows carry the dtype that decides it
and :mod:`boom_ml.timing.per_op` zeroes them on GPUs without those tensor cores.
"""

from __future__ import annotations

import json
import math
from typing import Any

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.bandwidth import Stream, width

# Lowest compute capability (sm major*10+minor) whose tensor cores take this conv dtype:
# fp16 from Volta (sm70), bf16 from Ampere (sm80) (CUDA C++ Programming Guide, Warp Matrix
# Functions: element types by architecture). The guide's transform sentence is about the
# tensor-op math type (CUDNN_TENSOR_OP_MATH), which PyTorch sets for fp16/bf16 convolutions;
# fp32 convolutions on TF32 run under the default math type and are left out: nothing we read
# says they transform, and cnn_step_times' A100 fp32 rows (PyTorch 1.7, TF32 on) went from
# 1.12x under- to 1.42x over-predicted by the per-op sum when they were charged transforms.
TENSOR_CORE_SM = {"float16": 70, "bfloat16": 80}
MARK = "layout_dtype"  # column of a transform row: the conv dtype that needs tensor cores


def transform_rows(conv: dict[str, Any], operands: list[list[int]], dtype: str) -> list[dict]:
    """Copy rows for the NCHW<->NHWC transforms of one convolution kernel row ``conv``.

    ``operands``: the shapes it reads and writes. No rows when the dtype never runs on tensor
    cores or the convolution is depthwise."""
    depthwise = conv.get("groups", 1) > 1 and conv["groups"] == conv.get("in_channels")
    if dtype not in TENSOR_CORE_SM or depthwise:
        return []
    rows = []
    for shape in operands:
        n = int(math.prod(shape)) if shape else 1
        nbytes = float(n * width(dtype))
        row = Stream("copy", nbytes, nbytes, n, dtype, False).row()
        rows.append({**row, "op": "copy", "family": "copy", MARK: dtype})
    return rows


def takes_channels_last(shapes: list[list[int]]) -> bool:
    """Whether a convolution's tensors (``shapes``: its inputs', the first its data) can be in
    channels_last: 4-D ones (``torch.channels_last``) and 5-D ones (``channels_last_3d``); a
    Conv1d's 3-D tensors have no such format (PyTorch: "required rank 4 tensor"), so they keep
    their transforms whatever the step asks (a hunt: an audio Conv1d net had come out 10 %
    faster with channels_last=true)."""
    return bool(shapes) and len(shapes[0]) >= 4


def has_channels_last_convolutions(nodes: Any) -> bool:
    """Whether a graph's nodes (an OpGraph's frame) hold a convolution on 4-D or 5-D tensors,
    which ``channels_last`` lays out (:func:`takes_channels_last`)."""
    convs = nodes.loc[nodes["family"].eq("conv"), "input_shapes"]
    return any(takes_channels_last(json.loads(shapes)) for shapes in convs)


def on_tensor_cores(dtype: str, gpu: GpuSpec) -> bool:
    """Whether ``gpu``'s tensor cores run convolutions of ``dtype`` (so NCHW needs transforms)."""
    need = TENSOR_CORE_SM.get(dtype)
    return need is not None and gpu.sm_version >= need
