"""Route scaled-dot-product attention to the kernels a CUDA run would launch.

On CPU, ``F.scaled_dot_product_attention`` often takes the math path: it materialises the
B×H×L×S score matrix and upcasts bf16/fp16 to fp32. A CUDA run instead launches one fused
flash or memory-efficient kernel that saves only the output and a log-sum-exp. Both the
memory and the time of attention would be badly wrong if we recorded the CPU path, so this
module calls the CUDA aten ops directly; fake tensors run their meta kernels on any
device, and autograd dispatches to their CUDA backward ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

aten = torch.ops.aten
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _autocast_dtype() -> torch.dtype | None:
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


def cuda_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA through the fused CUDA kernel PyTorch's dispatcher would pick on sm80+.

    Flash for fp16/bf16 without an explicit mask and head_dim ≤ 256; the memory-efficient
    kernel otherwise (it takes an additive bias, and fp32).
    """
    dtype = _autocast_dtype()
    if dtype is not None:
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention: expand K/V heads
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    use_flash = query.dtype in _LOW_PRECISION and attn_mask is None and query.shape[-1] <= 256
    if use_flash:
        return aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill(~bias, float("-inf"))
    elif bias is not None:
        bias = bias.to(query.dtype)
    if bias is not None:
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal, scale=scale
    )[0]


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """While active, ``F.scaled_dot_product_attention`` is :func:`cuda_sdpa`.

    A module attribute swap rather than a TorchFunctionMode: a function mode is switched
    off while it handles ``loss.backward()``, so checkpoint recomputation inside backward
    would fall back to the CPU path and no longer match the forward's saved tensors.
    Models look the function up at call time (``F.scaled_dot_product_attention``), which
    the swap covers, ``nn.MultiheadAttention`` included.
    """
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = cuda_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
