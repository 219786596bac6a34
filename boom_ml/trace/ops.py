"""The aten-op registry: CPU op → CUDA-equivalent op, op family, and FLOP formulas.

We trace on fake CPU tensors, but predict for CUDA: a few ops have CPU-only names
(``_scaled_dot_product_flash_attention_for_cpu``, ``native_batch_norm``) that a CUDA run
would launch under another name. The CUDA name is what timing models and reports use.
FLOPs come from ``torch.utils.flop_counter``'s registry, plus formulas for the CPU-named
attention kernels that the registry lacks (so attention FLOPs are not silently zero).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

aten = torch.ops.aten

# Ops that launch no kernel on a GPU: metadata queries, views, and bare allocations.
NO_KERNEL_OPS = {
    "profiler._record_function_enter",
    "profiler._record_function_enter_new",
    "profiler._record_function_exit",
    "prim.device",
    "prim.layout",
    "aten.size",
    "aten.sym_size",
    "aten.stride",
    "aten.sym_stride",
    "aten.numel",
    "aten.sym_numel",
    "aten.dim",
    "aten.storage_offset",
    "aten.sym_storage_offset",
    "aten.is_contiguous",
    "aten.is_strides_like_format",
    "aten.is_non_overlapping_and_dense",
    "aten.sym_is_contiguous",
    "aten.detach",
    "aten.alias",
    "aten.view",
    "aten._unsafe_view",
    "aten.reshape",
    "aten.t",
    "aten.transpose",
    "aten.permute",
    "aten.expand",
    "aten.squeeze",
    "aten.unsqueeze",
    "aten.slice",
    "aten.select",
    "aten.split",
    "aten.split_with_sizes",
    "aten.unbind",
    "aten.chunk",
    "aten.as_strided",
    "aten.view_as_real",
    "aten.view_as_complex",
    "aten._reshape_alias",
    "aten.unfold",
    "aten.diagonal",
    "aten.narrow",
    "aten.lift_fresh",
    "aten._local_scalar_dense",
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.resize_",
    "aten.set_",
}
ALLOC_ONLY_OPS = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
                  "aten.new_empty_strided", "aten.resize_"}  # fmt: skip

# CPU op name (overload packet) → what CUDA launches for the same call.
CUDA_NAMES = {
    "aten._scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
    "aten.native_batch_norm": "cudnn_batch_norm",
    "aten._native_batch_norm_legit": "cudnn_batch_norm",
    "aten._native_batch_norm_legit_functional": "cudnn_batch_norm",
    "aten._native_batch_norm_legit_no_training": "cudnn_batch_norm",
    "aten._batch_norm_with_update": "cudnn_batch_norm",
    "aten._batch_norm_with_update_functional": "cudnn_batch_norm",
    "aten.native_batch_norm_backward": "cudnn_batch_norm_backward",
    "aten.batch_norm_backward": "cudnn_batch_norm_backward",
    "aten.convolution": "cudnn_convolution",
    "aten.convolution_backward": "convolution_backward",
    "aten.max_pool2d_with_indices": "max_pool2d_with_indices",
    "aten._log_softmax": "_log_softmax",
    "aten.mkldnn_rnn_layer": "_cudnn_rnn",
}

_FAMILY_PREFIXES = [
    ("attention", ("_scaled_dot_product", "_flash_attention", "_efficient_attention")),
    ("gemm", ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "matmul")),
    ("conv", ("cudnn_convolution", "convolution", "_convolution", "conv")),
    ("norm", ("native_layer_norm", "cudnn_batch_norm", "native_group_norm", "_fused_rms_norm",
              "layer_norm", "group_norm")),
    ("softmax", ("_softmax", "_log_softmax", "softmax")),
    ("embedding", ("embedding",)),
    ("loss", ("nll_loss", "cross_entropy", "mse_loss", "binary_cross_entropy")),
    ("optimizer", ("_foreach_", "_fused_adam", "_fused_adamw", "_fused_sgd",
                   "_amp_foreach_non_finite", "_amp_update_scale")),
    ("copy", ("_to_copy", "copy_", "clone", "contiguous", "cat", "stack", "index_select",
              "gather", "scatter", "index", "constant_pad_nd", "_unsafe_index")),
    ("reduction", ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm",
                   "linalg_vector_norm", "argmax", "any", "all", "prod", "cumsum")),
    ("pooling", ("max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool")),
]  # fmt: skip

# FLOP formulas the registry lacks: the CPU attention kernels count as their CUDA twins.


# They take shapes, like the registry's own formulas; FlopCounterMode(custom_mapping=...)
# accepts them as they are, which is how the tests check our totals against it.


def _cpu_flash_fwd(q_shape, k_shape, v_shape, *args: Any, out_shape: Any = None, **kw: Any) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _cpu_flash_bwd(
    g_shape, q_shape, k_shape, v_shape, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    return sdpa_backward_flop_count(g_shape, q_shape, k_shape, v_shape)


EXTRA_FLOP_SHAPE_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_bwd,
}
FLOP_FORMULAS = {
    **flop_registry,
    **{k: shape_wrapper(v) for k, v in EXTRA_FLOP_SHAPE_FORMULAS.items()},
}


def packet_name(func: Any) -> str:
    """'aten.mm' for aten.mm.default."""
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "_qualified_op_name", str(packet)).replace("::", ".")


def cuda_op_name(packet: str) -> str:
    """The op a CUDA run would launch for the traced CPU op ``packet`` ('aten.mm' → 'mm')."""
    return CUDA_NAMES.get(packet, packet.split(".", 1)[-1])


def op_family(op: str, phase: str = "forward") -> str:
    """Family of a canonical CUDA op name; 'elementwise' when nothing more specific fits."""
    base = op.removesuffix("_backward").removesuffix("_backward_data")
    if base in ("fill_", "zero_", "zeros", "ones", "full", "zeros_like", "ones_like",
                "full_like", "new_zeros", "new_ones", "new_full", "scalar_tensor"):  # fmt: skip
        return "fill"
    for family, prefixes in _FAMILY_PREFIXES:
        if any(base == p or base.startswith(p) for p in prefixes):
            return family
    return "elementwise"


def flops_of(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one call, by the registry's formula (0 for ops it does not count)."""
    formula = FLOP_FORMULAS.get(func.overloadpacket)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))
