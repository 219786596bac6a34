"""Stand-ins for bitsandbytes' CUDA kernels, as ``boom::`` ops the tracer records.

bitsandbytes' kernels cannot run on fake CPU tensors, so each kernel a QLoRA step or an
8-bit optimizer launches is an op here with the same inputs, outputs and in-place writes
(hence the same bytes read and written) and no real computation: fake tensors only need
shapes and dtypes. Each is registered in the op registry (``trace/ops.py``) under the
family whose time head fits it: dequantisation is elementwise, the optimizer updates are
optimizer kernels. What they stand for, with bitsandbytes 0.50's names:

* ``dequantize_blockwise``: the nested (double-quantised) absmax, 8-bit → fp32
  (``_dequantize_blockwise_impl`` with the 256-value code and blocksize 256)
* ``dequantize_nf4``: packed NF4 weight → a dense ``dtype`` weight (``dequantize_4bit``)
* ``optimizer_update_8bit_blockwise_``: one AdamW step on uint8 states with per-256 absmax
  (``F.optimizer_update_8bit_blockwise``: dequantise, update, requantise in one kernel)
* ``optimizer_update_32bit_``: the fp32-state step bitsandbytes uses for tensors under
  ``min_8bit_size`` (``F.optimizer_update_32bit``)
"""

from __future__ import annotations

import torch
from torch import Tensor

from boom_ml.trace.ops import register


@torch.library.custom_op("boom::dequantize_blockwise", mutates_args=())
def dequantize_blockwise(quantized: Tensor, absmax: Tensor, code: Tensor) -> Tensor:
    return torch.empty(quantized.shape, dtype=torch.float32, device=quantized.device)


@dequantize_blockwise.register_fake
def _(quantized: Tensor, absmax: Tensor, code: Tensor) -> Tensor:
    return torch.empty(quantized.shape, dtype=torch.float32, device=quantized.device)


@torch.library.custom_op("boom::dequantize_nf4", mutates_args=())
def dequantize_nf4(
    packed: Tensor, absmax: Tensor, code: Tensor, rows: int, cols: int, dtype: torch.dtype
) -> Tensor:
    return torch.empty((rows, cols), dtype=dtype, device=packed.device)


@dequantize_nf4.register_fake
def _(
    packed: Tensor, absmax: Tensor, code: Tensor, rows: int, cols: int, dtype: torch.dtype
) -> Tensor:
    return torch.empty((rows, cols), dtype=dtype, device=packed.device)


@torch.library.custom_op(
    "boom::optimizer_update_8bit_blockwise_",
    mutates_args=("param", "state1", "state2", "absmax1", "absmax2"),
)
def optimizer_update_8bit_blockwise_(
    param: Tensor,
    grad: Tensor,
    state1: Tensor,
    state2: Tensor,
    absmax1: Tensor,
    absmax2: Tensor,
    qmap1: Tensor,
    qmap2: Tensor,
) -> None:
    return None


@optimizer_update_8bit_blockwise_.register_fake
def _(param, grad, state1, state2, absmax1, absmax2, qmap1, qmap2) -> None:  # noqa: ANN001
    return None


@torch.library.custom_op(
    "boom::optimizer_update_32bit_", mutates_args=("param", "state1", "state2")
)
def optimizer_update_32bit_(param: Tensor, grad: Tensor, state1: Tensor, state2: Tensor) -> None:
    return None


@optimizer_update_32bit_.register_fake
def _(param, grad, state1, state2) -> None:  # noqa: ANN001
    return None


register("boom.dequantize_blockwise boom.dequantize_nf4", "elementwise")
register("boom.optimizer_update_8bit_blockwise_ boom.optimizer_update_32bit_", "optimizer")
