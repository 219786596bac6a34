"""Route scaled-dot-product attention to the kernels a CUDA run on the target GPU launches.

On CPU, ``F.scaled_dot_product_attention`` often takes the math path: it materialises the
B×H×L×S score matrix and upcasts bf16/fp16 to fp32. A CUDA run instead picks a backend per
GPU (``sdpa_select``: cuDNN, flash, memory-efficient or math, as torch's ``sdp_utils``
does) and, for the fused ones, launches one kernel that saves only the output and a
log-sum-exp. This module picks that backend for the trace's attention architecture group
and calls the same aten op PyTorch's ``scaled_dot_product_attention`` (attention.cpp) would,
with the same preprocessing (head-dim padding for flash, mask conversion and alignment for
memory-efficient); fake tensors run their meta kernels on any device, and autograd
dispatches to their CUDA backward ops. Grouped-query attention reaches the fused kernels
unexpanded (all three take ``enable_gqa`` natively in torch 2.14); only math repeats K/V.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from boom_ml.trace.sdpa_select import (
    CUDNN,
    DEFAULT_GROUP,
    EFFICIENT,
    FLASH,
    SdpaCall,
    TensorInfo,
    call_to_dict,
    select_backend,
)

aten = torch.ops.aten


@dataclass
class SdpaLog:
    """What the trace's SDPA calls did (graph meta ``sdpa``): a model without calls does not
    depend on the attention architecture group, so one trace serves every GPU."""

    group: str
    backends: Counter = field(default_factory=Counter)
    # the distinct calls (what the selection reads): another group whose selection picks the
    # same backend for each of them traces to the same graph (boom_ml.api reuses it)
    inputs: dict[SdpaCall, None] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "group": self.group,
            "calls": sum(self.backends.values()),
            "backends": dict(self.backends),
            "inputs": [call_to_dict(c) for c in self.inputs],
        }


def _autocast_dtype() -> torch.dtype | None:
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


def _info(t: torch.Tensor) -> TensorInfo:
    return TensorInfo(
        tuple(t.shape),
        str(t.dtype).removeprefix("torch."),
        tuple(t.stride()),
        t.storage_offset(),
        t.requires_grad,
    )


def _additive(mask: torch.Tensor | None, dtype: torch.dtype, fill: float) -> torch.Tensor | None:
    """convert_boolean_attn_mask: a bool mask (True = attend) becomes 0 / ``fill``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype))


def cuda_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    log: SdpaLog | None = None,
) -> torch.Tensor:
    """SDPA through the aten op PyTorch's CUDA dispatcher picks for ``log.group``'s GPUs."""
    log = log if log is not None else SdpaLog(DEFAULT_GROUP)
    dtype = _autocast_dtype()
    if dtype is not None:  # CUDA autocast casts every floating argument, a float mask too
        query, key, value = (t.to(dtype) for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    call = SdpaCall(
        _info(query),
        _info(key),
        _info(value),
        None if attn_mask is None else _info(attn_mask),
        dropout_p,
        is_causal,
        enable_gqa,
        grad,
    )
    backend = select_backend(log.group, call)
    log.backends[backend] += 1
    log.inputs[call] = None
    # CUDA autocast casts SDPA's inputs and then runs it with autocast off: the math
    # backend's matmuls stay in its fp32 upcast
    with torch.autocast("cpu", enabled=False) if dtype is not None else contextlib.nullcontext():
        return _dispatch(backend, query, key, value, attn_mask, dropout_p, is_causal, scale,
                         enable_gqa, grad)  # fmt: skip


def _dispatch(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    grad: bool,
) -> torch.Tensor:
    """What ``scaled_dot_product_attention`` (attention.cpp) calls for ``backend``."""
    if backend == FLASH:
        return _flash(query, key, value, dropout_p, is_causal, scale)
    if backend == CUDNN:
        # convert_boolean_attn_mask_cudnn: -65504 rather than -inf (cuDNN's -inf issue)
        bias = _additive(attn_mask, query.dtype, -65504.0)
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, bias, grad, dropout_p, is_causal, False, scale=scale
        )[0]
    bias = _additive(attn_mask, query.dtype, float("-inf"))
    if bias is not None and bias.dtype != query.dtype:
        bias = bias.to(query.dtype)  # the fused kernels take a bias of the inputs' dtype
    if backend == EFFICIENT:
        if bias is not None:
            bias = _preprocess_mask(bias, query, key)
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale
        )[0]
    # math: the materialised B×H×L×S scores, fp32 for half inputs, K/V heads repeated for GQA
    return aten._scaled_dot_product_attention_math(
        query, key, value, bias, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


def _flash(q, k, v, dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """pad_last_dim<8>: flash takes head dims in multiples of 8, padded before the call (a
    copy, saved for backward) and sliced after; the scale stays the unpadded one."""
    head_dim = q.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    pad = -head_dim % 8
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out = aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale
    )
    return out[0][..., :head_dim] if pad else out[0]


def _preprocess_mask(bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """preprocess_mask: a bias whose strides are not multiples of 8 is padded (pad_bias<8>)
    and sliced back, then expanded to B×H×L×S."""
    aligned = bias.stride(-1) == 1 and all(s % 8 == 0 for s in bias.stride()[:-1])
    if not aligned:
        last = bias.shape[-1]
        bias = F.pad(bias, (0, 8 - last % 8))[..., :last]
    return bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


@contextlib.contextmanager
def _single_sequences() -> Iterator[None]:
    """transformers' packed-sequence check answers "no packing", as in the real run.

    Decoders look for several sequences packed into one row (position ids that restart) and
    read the answer off the device; on fake tensors they cannot (``is_tracing``), keep the
    packed mask and so materialise a B×1×L×L mask where a real run passes ``is_causal``
    (and ``enable_gqa``) to SDPA, which decides its kernel. The zoo's rows are one sequence
    each: the check still launches its kernels, then answers None.
    """
    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "find_packed_sequence_indices", None)
    if original is None:  # transformers not loaded, or a release without the check
        yield
        return

    def single(position_ids: torch.Tensor) -> None:
        original(position_ids)
        return None

    module.find_packed_sequence_indices = single
    try:
        yield
    finally:
        module.find_packed_sequence_indices = original


@contextlib.contextmanager
def cuda_attention(group: str = DEFAULT_GROUP) -> Iterator[SdpaLog]:
    """While active, ``F.scaled_dot_product_attention`` is :func:`cuda_sdpa` for ``group``.

    A module attribute swap rather than a TorchFunctionMode: a function mode is switched
    off while it handles ``loss.backward()``, so checkpoint recomputation inside backward
    would fall back to the CPU path and no longer match the forward's saved tensors.
    Models look the function up at call time (``F.scaled_dot_product_attention``), which
    the swap covers, ``nn.MultiheadAttention`` included.
    """
    log = SdpaLog(group)
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = partial(cuda_sdpa, log=log)
    try:
        with _single_sequences():
            yield log
    finally:
        F.scaled_dot_product_attention = original
