"""The op registry: one entry per aten ``OpOverloadPacket``, the single source of op metadata.

Each entry says what a CUDA run launches for the op (we trace on fake CPU tensors, and a
few ops have CPU-only names: ``_scaled_dot_product_flash_attention_for_cpu``,
``native_batch_norm``), its family (which decides its time head and feature rows), whether
it launches a kernel at all (views and metadata queries do not), and its FLOP and byte
formulas. Entries are registered in the style of ``torch/utils/flop_counter.py``: by
``register(...)``, which used as a decorator also installs the decorated FLOP formula.

Names are matched exactly, never by prefix (prefixes put ``maximum`` and
``max_pool2d_with_indices`` among the reductions). An op without an entry gets family
"other"; the graph counts them (``OpGraph.unknown_ops``) and ``explain=true`` prints them.
FLOPs default to ``torch.utils.flop_counter``'s formula for the packet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.flop_counter import (
    conv_flop_count,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from boom_ml.trace.families import FAMILIES, UNKNOWN
from boom_ml.trace.sdpa_select import causal_pairs

Packet = torch._ops.OpOverloadPacket
# torch's convention: formula(*args, out_val=out, **kwargs) -> FLOPs of one call.
FlopFormula = Callable[..., int]
# (tensor inputs, outputs not in an input's storage, inputs written in place) -> (read, written)
BytesFormula = Callable[[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], tuple[int, int]]  # fmt: skip


def view_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def streamed_bytes(
    inputs: list[torch.Tensor], fresh: list[torch.Tensor], mutated: list[torch.Tensor]
) -> tuple[int, int]:
    """Every input read once; every new output and every in-place target written once."""
    return sum(map(view_bytes, inputs)), sum(map(view_bytes, fresh)) + sum(map(view_bytes, mutated))


@dataclass(frozen=True)
class OpEntry:
    """What the tracer and the timing models know about one op."""

    name: str  # "aten.mm": the packet's qualified name
    family: str
    cuda_name: str  # the op a CUDA run launches for the same call ("cudnn_convolution")
    kernel: bool = True  # False: launches no GPU kernel (views, metadata, bare allocations)
    allocates: bool = False  # a bare allocation (empty*): no kernel, but its block is recorded
    flops: FlopFormula | None = None
    bytes: BytesFormula = streamed_bytes


REGISTRY: dict[Packet, OpEntry] = {}
# Registered names this PyTorch does not have (a test asserts none under the pinned one).
MISSING: list[str] = []
# FLOP formulas torch's registry lacks, as shape formulas: FlopCounterMode(custom_mapping=)
# takes them as they are, which is how trace_step's cross-check counts like we do.
EXTRA_FLOP_SHAPE_FORMULAS: dict[Packet, Callable[..., int]] = {}


def _packet(qualified: str) -> Packet | None:
    namespace, _, name = qualified.rpartition(".")
    try:
        return getattr(getattr(torch.ops, namespace or "aten"), name)
    except (AttributeError, RuntimeError):
        return None


def register(
    names: str,
    family: str,
    *,
    cuda: str | None = None,
    kernel: bool = True,
    allocates: bool = False,
    nbytes: BytesFormula = streamed_bytes,
) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Register the space-separated ops ``names`` ("mm addmm", "prim.device"; aten by default).

    Used bare, each entry takes torch's FLOP formula for its packet, if any. Used as a
    decorator, the decorated function (a shape formula, as torch's are written) is the FLOP
    formula of every op in ``names``. ``cuda`` renames them to the op a CUDA run launches.
    """
    if family not in FAMILIES or family == UNKNOWN:
        raise ValueError(f"register({names!r}): {family!r} is not a registry family")
    packets = []
    for qualified in names.split():
        qualified = qualified if "." in qualified else f"aten.{qualified}"
        packet = _packet(qualified)
        if packet is None:
            MISSING.append(qualified)
            continue
        if packet in REGISTRY:
            raise ValueError(f"{qualified} is registered twice")
        REGISTRY[packet] = OpEntry(
            name=qualified,
            family=family,
            cuda_name=cuda or qualified.rpartition(".")[2],
            kernel=kernel,
            allocates=allocates,
            flops=flop_registry.get(packet),
            bytes=nbytes,
        )
        packets.append(packet)

    def decorate(formula: Callable[..., int]) -> Callable[..., int]:
        for packet in packets:
            EXTRA_FLOP_SHAPE_FORMULAS[packet] = formula
            REGISTRY[packet] = replace(REGISTRY[packet], flops=shape_wrapper(formula))
        return formula

    return decorate


def packet_name(func: Any) -> str:
    """'aten.mm' for aten.mm.default."""
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "_qualified_op_name", str(packet)).replace("::", ".")


def entry_of(func: Any) -> OpEntry:
    """The entry of ``func`` (an OpOverload or its packet); family "other" when unregistered."""
    packet = getattr(func, "overloadpacket", func)
    entry = REGISTRY.get(packet)
    if entry is not None:
        return entry
    name = packet_name(func)
    return OpEntry(name, UNKNOWN, name.rpartition(".")[2], flops=flop_registry.get(packet))


def family_of(func: Any) -> str:
    """Family of an op (``aten.mm`` → "gemm"), as the kernel harness labels its rows."""
    return entry_of(func).family


def flops_of(entry: OpEntry, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one call by the entry's formula (0 for ops without one)."""
    if entry.flops is None:
        return 0
    return int(entry.flops(*args, **kwargs, out_val=out))


# -- no kernel -------------------------------------------------------------------------------
# No node is recorded for these, so their family is never read; it only names what they are.
register(
    "profiler._record_function_enter profiler._record_function_enter_new "
    "profiler._record_function_exit prim.device prim.layout",
    "elementwise",
    kernel=False,
)
register(
    "size sym_size stride sym_stride numel sym_numel dim storage_offset "
    "sym_storage_offset is_contiguous is_strides_like_format is_non_overlapping_and_dense "
    "sym_is_contiguous _local_scalar_dense lift_fresh",
    "elementwise",
    kernel=False,
)
register(
    "detach alias view _unsafe_view reshape _reshape_alias t transpose permute expand "
    "squeeze unsqueeze slice select split split_with_sizes unbind chunk as_strided "
    "view_as_real view_as_complex unfold diagonal narrow set_",
    "copy",
    kernel=False,
)
register("empty empty_like empty_strided new_empty new_empty_strided resize_", "fill",
         kernel=False, allocates=True)  # fmt: skip

# -- matrix families ---------------------------------------------------------------------------
register("mm addmm bmm baddbmm addbmm _addmm_activation matmul _scaled_mm", "gemm")
register("convolution", "conv", cuda="cudnn_convolution")
register("_convolution cudnn_convolution cudnn_convolution_transpose "
         "convolution_overrideable convolution_backward_overrideable _slow_conv2d_forward "
         "_slow_conv2d_backward _conv_depthwise2d", "conv")  # fmt: skip


@register("convolution_backward", "conv")
def conv_backward_flops(
    grad_out_shape: Any,
    x_shape: Any,
    w_shape: Any,
    _bias: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    _groups: int,
    output_mask: list[bool],
    out_shape: Any = None,
    **kw: Any,
) -> int:
    """The input gradient as torch counts it; the weight gradient as many FLOPs as the
    forward convolution. torch's formula counts the weight gradient as one convolution over
    every input channel, which is ``groups`` times too many for a grouped convolution (each
    output channel sees C/groups inputs): a depthwise 3x3 over C channels came out C times
    its forward, and ConvNeXt-T's batch-32 step 2.48 TFLOP where it does 0.85."""
    flops = 0
    if output_mask[0]:  # a transposed convolution of grad_out with the weight
        flops += conv_flop_count(list(grad_out_shape), list(w_shape), list(out_shape[0]),
                                 not transposed)  # fmt: skip
    if output_mask[1]:  # the forward's count: weight w_shape, output grad_out_shape
        flops += conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return flops


register("_efficient_attention_forward _efficient_attention_backward _flash_attention_forward "
         "_flash_attention_backward", "attention")  # fmt: skip


def _causal(full: int, q_shape: Any, k_shape: Any, args: tuple, kw: dict, at: int) -> int:
    """torch's formulas count every pair ("NB: We aren't accounting for causal attention
    here"); with ``is_causal`` (positional ``at`` or keyword) only the kept pairs count."""
    causal = kw.get("is_causal", args[at] if len(args) > at else False)
    if not causal:
        return full
    seq_q, seq_k = q_shape[-2], k_shape[-2]
    return full * causal_pairs(seq_q, seq_k) // (seq_q * seq_k)  # full is a multiple of L*S


# Forward ops: is_causal's index among all arguments (q, k, v first).
_FORWARD_CAUSAL_AT = {
    "_scaled_dot_product_flash_attention": 4,
    "_scaled_dot_product_efficient_attention": 6,
    "_scaled_dot_product_cudnn_attention": 6,
    "_scaled_dot_product_flash_attention_for_cpu": 4,
}
# Backward ops (grad_out, q, k, v first).
_BACKWARD_CAUSAL_AT = {
    "_scaled_dot_product_flash_attention_backward": 11,
    "_scaled_dot_product_efficient_attention_backward": 11,
    "_scaled_dot_product_cudnn_attention_backward": 14,
    "_scaled_dot_product_flash_attention_for_cpu_backward": 7,
}


def _register_sdpa(name: str, at: int, backward: bool) -> None:
    # The CPU flash kernels are counted (and named) as their CUDA twins.
    cuda = name.removesuffix("_for_cpu") if name.endswith("_for_cpu") else None
    cuda = "_scaled_dot_product_flash_attention_backward" if name.endswith("cpu_backward") else cuda

    @register(name, "attention", cuda=cuda)
    def formula(*args: Any, out_shape: Any = None, **kw: Any) -> int:
        if backward:
            g, q, k, v = args[:4]
            return _causal(sdpa_backward_flop_count(g, q, k, v), q, k, args, kw, at)
        q, k, v = args[:3]
        return _causal(sdpa_flop_count(q, k, v), q, k, args, kw, at)


for _name, _at in _FORWARD_CAUSAL_AT.items():
    _register_sdpa(_name, _at, backward=False)
for _name, _at in _BACKWARD_CAUSAL_AT.items():
    _register_sdpa(_name, _at, backward=True)


# -- row-wise and lookup families ------------------------------------------------------------
register("native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional "
         "_native_batch_norm_legit_no_training _batch_norm_with_update "
         "_batch_norm_with_update_functional", "norm", cuda="cudnn_batch_norm")  # fmt: skip
register("native_batch_norm_backward batch_norm_backward", "norm", cuda="cudnn_batch_norm_backward")
register("cudnn_batch_norm cudnn_batch_norm_backward native_layer_norm native_layer_norm_backward "
         "native_group_norm native_group_norm_backward _fused_rms_norm _fused_rms_norm_backward",
         "norm")  # fmt: skip
register("_softmax _softmax_backward_data _log_softmax _log_softmax_backward_data _safe_softmax",
         "softmax")  # fmt: skip
register("embedding embedding_dense_backward _embedding_bag _embedding_bag_backward "
         "embedding_renorm_", "embedding")  # fmt: skip
register("nll_loss_forward nll_loss_backward nll_loss2d_forward nll_loss2d_backward mse_loss "
         "mse_loss_backward binary_cross_entropy binary_cross_entropy_backward "
         "binary_cross_entropy_with_logits smooth_l1_loss smooth_l1_loss_backward huber_loss "
         "huber_loss_backward", "loss")  # fmt: skip
register("sum mean amax amin aminmax max min var std var_mean std_mean norm linalg_vector_norm "
         "argmax argmin any all prod cumsum cumprod logsumexp nansum", "reduction")  # fmt: skip
register("max_pool2d_with_indices max_pool2d_with_indices_backward max_pool3d_with_indices "
         "max_pool3d_with_indices_backward avg_pool2d avg_pool2d_backward avg_pool3d "
         "avg_pool3d_backward _adaptive_avg_pool2d _adaptive_avg_pool2d_backward "
         "_adaptive_avg_pool3d _adaptive_avg_pool3d_backward adaptive_max_pool2d "
         "adaptive_max_pool2d_backward adaptive_max_pool3d adaptive_max_pool3d_backward "
         "max_unpool2d max_unpool3d", "pooling")  # fmt: skip

# -- optimizer: multi-tensor and fused kernels --------------------------------------------------
_FOREACH = ("abs acos add addcdiv addcmul asin atan ceil clamp_max clamp_min copy cos cosh div "
            "erf erfc exp expm1 floor frac lerp lgamma log log10 log1p log2 maximum minimum mul "
            "neg pow reciprocal round rsqrt sigmoid sign sin sinh sqrt sub tan tanh trunc zero")  # fmt: skip
register(" ".join(f"_foreach_{o} _foreach_{o}_" for o in _FOREACH.split()), "optimizer")
register("_foreach_norm _foreach_max _foreach_clone _foreach_powsum _fused_adam _fused_adam_ "
         "_fused_adamw _fused_adamw_ _fused_sgd _fused_sgd_ _fused_adagrad _fused_adagrad_ "
         "_amp_foreach_non_finite_check_and_unscale _amp_foreach_non_finite_check_and_unscale_ "
         "_amp_update_scale _amp_update_scale_", "optimizer")  # fmt: skip

# -- data movement and fills -----------------------------------------------------------------
register("_to_copy copy copy_ _copy_from _copy_from_and_resize clone cat stack index_select "
         "gather scatter scatter_ scatter_add scatter_add_ scatter_reduce scatter_reduce_ index "
         "index_put index_put_ _index_put_impl_ index_add index_add_ index_copy index_copy_ "
         "index_fill index_fill_ constant_pad_nd _unsafe_index _unsafe_index_put "
         "reflection_pad1d reflection_pad2d reflection_pad3d reflection_pad1d_backward "
         "reflection_pad2d_backward reflection_pad3d_backward replication_pad1d replication_pad2d "
         "replication_pad3d replication_pad1d_backward replication_pad2d_backward "
         "replication_pad3d_backward", "copy")  # fmt: skip
register("fill fill_ zero_ zeros ones full zeros_like ones_like full_like new_zeros new_ones "
         "new_full scalar_tensor", "fill")  # fmt: skip

# -- elementwise: one pass over the elements (the ``_`` twin is the in-place kernel) ----------
_POINTWISE = (
    "abs add sub mul div neg reciprocal pow sqrt rsqrt exp exp2 expm1 log log1p log2 log10 "
    "sin cos tan tanh sinh cosh asin acos atan atan2 erf erfc erfinv sigmoid logit sign "
    "floor ceil round trunc frac remainder fmod clamp clamp_min clamp_max "
    "lerp addcmul addcdiv relu gelu silu mish hardsigmoid hardswish hardtanh elu leaky_relu "
    "threshold masked_fill eq ne lt le gt ge logical_and logical_or logical_not "
    "bitwise_and bitwise_or bitwise_xor bitwise_not nan_to_num tril triu "
    "bernoulli uniform normal exponential random copysign square"
)
register(" ".join(f"{o} {o}_" for o in _POINTWISE.split()), "elementwise")
register("rsub maximum minimum softplus where isnan isinf "
         "gelu_backward silu_backward mish_backward hardsigmoid_backward hardswish_backward "
         "hardtanh_backward elu_backward leaky_relu_backward softplus_backward tanh_backward "
         "sigmoid_backward threshold_backward native_dropout native_dropout_backward "
         "glu glu_backward _prelu_kernel _prelu_kernel_backward arange linspace rand randn "
         "randint randperm select_backward slice_backward slice_scatter select_scatter "
         "as_strided_scatter roll flip repeat sort topk masked_scatter "
         "im2col col2im", "elementwise")  # fmt: skip
register(" ".join(f"{o} {o}_backward" for o in (
    "upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact1d "
    "_upsample_nearest_exact2d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
    "upsample_bicubic2d upsample_trilinear3d _upsample_bilinear2d_aa _upsample_bicubic2d_aa"
).split()), "elementwise")  # fmt: skip
# A metadata-only in-place view, but recorded as a kernel node so far: dropping it would
# renumber the nodes of every graph that has one (the GNN's training graphs among them).
register("as_strided_", "elementwise")
