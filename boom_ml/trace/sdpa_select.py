"""Which SDPA kernel PyTorch's CUDA dispatcher launches on a given GPU, without a GPU.

A transcription of ``select_sdp_backend`` in torch 2.14's
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (and the dense-input checks of
``sdp_utils_cpp.h``, shipped in torch's include directory) for dense inputs with PyTorch's
defaults: every backend enabled, no deterministic mode, no FA3. The function names below
(``check_...``) are the C++ filters each line follows.

The checks read the GPU only through a few traits, so GPUs fall into a handful of
*attention architecture groups* (:func:`sdpa_group`): every GPU of a group picks the same
kernel for every call. The trace is made per group (``StepSpec.sdpa_group``); a prediction
over many GPUs traces once per group, and only for models that call SDPA at all.

Torch-free: ``Session.evaluate`` groups a GPU list before it knows whether it must trace.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from boom_ml.errors import InvalidInputError

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
_HALF = ("float16", "bfloat16")
# kCuDNNFrontendSupportsD256 (cudnn_frontend >= 1.24): assumed true for torch 2.14's pinned
# frontend; it only moves head dims in (128, 256] on sm90/sm10x from flash to cuDNN.
CUDNN_FRONTEND_D256 = True


@dataclass(frozen=True)
class SdpaTraits:
    """What ``sdp_utils`` reads about the device (``cudaDeviceProp``) and the cuDNN build."""

    efficient: bool  # check_mem_efficient_hardware_support: [sm50, sm121]
    flash: bool  # check_flash_/check_cudnn_hardware_support: [sm80, sm121]
    major: int  # 5, 7 or 8+: the dtype lists and minimum_gemm_alignment look at major >= 7 / >= 8
    flash_train_head_dim_limit: bool  # ..._gt192_constraints_on_sm86_89_or_120: sm86-89, sm120-121
    cudnn_first: bool  # check_prefer_cudnn_attention: cuDNN > 9.15 on sm9x/sm10x
    cudnn_d256: bool  # check_cudnn_tensor_shapes: head dims up to 256 (sm90/sm10x, cuDNN > 9.22)


# The groups: one label per distinct set of traits (a test checks every GPU maps onto one).
GROUPS: dict[str, SdpaTraits] = {
    "math": SdpaTraits(False, False, 0, False, False, False),
    "sm50": SdpaTraits(True, False, 5, False, False, False),
    "sm70": SdpaTraits(True, False, 7, False, False, False),
    "sm80": SdpaTraits(True, True, 8, False, False, False),
    "sm86": SdpaTraits(True, True, 8, True, False, False),
    "sm90-cudnn": SdpaTraits(True, True, 8, False, True, False),
    "sm90-cudnn-d256": SdpaTraits(True, True, 8, False, True, True),
}
# What a trace without a group follows: the A100 (sm80), the default GPU, as before groups.
DEFAULT_GROUP = "sm80"
DEFAULT_CUDA, DEFAULT_CUDNN = "13.0", "9.24.0.43"  # torch 2.14's default wheel (stacks.csv)


def cudnn_version_int(text: str | int | None) -> int:
    """``"9.24.0.43"`` → 92400, cuDNN's own CUDNN_VERSION encoding (8.x: major * 1000); an
    int (``torch.backends.cudnn.version()``) is that encoding already, None is no cuDNN."""
    if text is None or isinstance(text, int):
        return int(text or 0)
    parts = [int(p) for p in str(text).split(".")[:3]] + [0, 0]
    major, minor, patch = parts[:3]
    return major * (10000 if major >= 9 else 1000) + minor * 100 + patch


def sdpa_traits(
    sm_version: int, cuda: str = DEFAULT_CUDA, cudnn: str | int | None = DEFAULT_CUDNN
) -> SdpaTraits:
    """The traits of compute capability ``sm_version`` (86 = 8.6) under a CUDA/cuDNN build."""
    major, minor = divmod(int(sm_version), 10)
    if not 50 <= sm_version <= 121:
        return GROUPS["math"]
    if major < 8:
        return GROUPS["sm70" if major >= 7 else "sm50"]
    version = cudnn_version_int(cudnn)
    cuda_major = int(str(cuda).split(".")[0])
    # check_prefer_cudnn_attention: CUDA 13 builds any minor, older builds minor 0 or 3
    prefer = version > 91500 and major in (9, 10) and (cuda_major >= 13 or minor in (0, 3))
    if prefer:
        sm107_old = sm_version == 107 and version <= 92500  # is_unsupported_sm107
        d256 = version > 92200 and CUDNN_FRONTEND_D256 and not sm107_old
        return GROUPS["sm90-cudnn-d256" if d256 else "sm90-cudnn"]
    limit = 86 <= sm_version <= 89 or 120 <= sm_version <= 121
    return GROUPS["sm86" if limit else "sm80"]


def sdpa_group(sm_version: int, stack: Any = None) -> str:
    """The attention architecture group of a GPU: GPUs of one group select the same kernels.

    ``stack`` (a :class:`boom_ml.stack.Stack`) gives the CUDA and cuDNN releases, which
    decide whether cuDNN attention comes first on sm90/sm100, and the torch release: before
    2.0 there is no fused attention (the math group); None: torch 2.14's default wheel (CUDA
    13.0, cuDNN 9.24.0.43), the release these rules are transcribed from.
    """
    cuda, cudnn = (DEFAULT_CUDA, DEFAULT_CUDNN) if stack is None else (stack.cuda, stack.cudnn)
    if stack is not None and _before_2_0(stack.torch):
        # scaled_dot_product_attention came with torch 2.0: code for 1.x multiplies, softmaxes
        # and multiplies again, the math path's kernels and saved tensors
        return "math"
    traits = sdpa_traits(sm_version, cuda, cudnn)
    return next(name for name, t in GROUPS.items() if t == traits)


def _before_2_0(release: str) -> bool:
    return int(str(release).split(".")[0]) < 2


def check_group(group: str | None) -> None:
    if group is not None and group not in GROUPS:
        raise InvalidInputError(f"unknown sdpa_group {group!r}; choose one of: {', '.join(GROUPS)}")


@dataclass(frozen=True)
class TensorInfo:
    """What the filters read of a tensor."""

    shape: tuple[int, ...]
    dtype: str = "float16"  # torch dtype name without "torch."
    stride: tuple[int, ...] | None = None  # None: contiguous
    storage_offset: int = 0
    requires_grad: bool = False

    @property
    def last_stride(self) -> int:
        return 1 if self.stride is None else self.stride[-1]


@dataclass(frozen=True)
class SdpaCall:
    query: TensorInfo
    key: TensorInfo
    value: TensorInfo
    attn_mask: TensorInfo | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = True  # input_requires_grad: an input requires grad and grad mode is on


def call_to_dict(call: SdpaCall) -> dict[str, Any]:
    """A call as JSON (graph meta); :func:`call_from_dict` reads it back."""
    return asdict(call)


def call_from_dict(data: dict[str, Any]) -> SdpaCall:
    def info(d: dict[str, Any] | None) -> TensorInfo | None:
        if d is None:
            return None
        stride = d.get("stride")
        return TensorInfo(tuple(d["shape"]), d["dtype"], None if stride is None else tuple(stride),
                          d["storage_offset"], d["requires_grad"])  # fmt: skip

    fields = {k: v for k, v in data.items() if k not in ("query", "key", "value", "attn_mask")}
    return SdpaCall(info(data["query"]), info(data["key"]), info(data["value"]),  # type: ignore[arg-type]
                    info(data["attn_mask"]), **fields)  # fmt: skip


def same_backends(sdpa_meta: dict[str, Any], group: str) -> bool:
    """Whether every SDPA call a trace recorded (graph meta ``sdpa``) picks the same backend
    in ``group`` as in the group it was traced for: then tracing for ``group`` gives the same
    graph (the trace depends on the group only through these choices)."""
    return backends(sdpa_meta, group) == backends(sdpa_meta, sdpa_meta["group"])


def backends(sdpa_meta: dict[str, Any], group: str) -> tuple[str, ...]:
    """The backend each SDPA call a trace recorded would pick in ``group``: groups with the
    same tuple trace to the same graph. A trace from before the inputs were recorded tells
    no more than its group."""
    inputs = sdpa_meta.get("inputs")
    if inputs is None:
        return (group,)
    return tuple(select_backend(group, call_from_dict(d)) for d in inputs)


def select_backend(group: str, call: SdpaCall) -> str:
    """``select_sdp_backend``: the first backend of the priority order whose filters pass."""
    traits = GROUPS[group]
    # priority_order: flash, efficient, math, cudnn (math is always enabled, so cuDNN is
    # never reached) unless check_prefer_cudnn_attention puts cuDNN first
    order = [CUDNN, FLASH, EFFICIENT, MATH] if traits.cudnn_first else [FLASH, EFFICIENT, MATH]
    checks = {CUDNN: can_use_cudnn, FLASH: can_use_flash, EFFICIENT: can_use_efficient}
    for backend in order:
        if backend == MATH or checks[backend](traits, call):
            return backend
    return MATH


def _dense_common(call: SdpaCall, ignore_singleton: bool) -> bool:
    q, k, v, mask = call.query, call.key, call.value, call.attn_mask
    if 0 in (q.shape[-2], k.shape[-2]):  # check_nonzero_sequence_lengths_dense
        return False
    # check_last_dim_stride_equals_1_dense (a GPU mask needs stride 1 too)
    strides_one = all(t.last_stride == 1 for t in (q, k, v))
    if ignore_singleton:
        strides_one = strides_one or q.shape[-1] == 1
    return strides_one and (mask is None or mask.last_stride == 1)


def _heads_ok(call: SdpaCall, gqa: bool, same_kv_heads: bool, mqa: bool = True) -> bool:
    """check_batch_size_and_num_heads_dense<gqa, same_kv_heads, mqa>."""
    q, k, v = call.query.shape, call.key.shape, call.value.shape
    if not q[0] == k[0] == v[0]:
        return False
    hq, hk, hv = q[-3], k[-3], v[-3]
    if call.enable_gqa and gqa:  # check_grouped_query_attention
        if same_kv_heads and hk != hv:
            return False
        return hq % hk == 0 and (same_kv_heads or hq % hv == 0)
    if hq == hk == hv:
        return True
    return mqa and hq > 0 and hk == 1 and hv == 1


def _dtypes(call: SdpaCall, allowed: tuple[str, ...]) -> bool:
    """check_tensor_dtype: q, k and v of one dtype, in the allowed list."""
    d = call.query.dtype
    return d == call.key.dtype == call.value.dtype and d in allowed


def _four_d(call: SdpaCall) -> bool:  # check_tensor_shapes
    return len(call.query.shape) == len(call.key.shape) == len(call.value.shape) == 4


def can_use_flash(traits: SdpaTraits, call: SdpaCall) -> bool:
    q, k, v = call.query, call.key, call.value
    dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if not traits.flash or not _four_d(call) or call.attn_mask is not None:
        return False  # hardware [sm80, sm121]; check_tensor_shapes; check_for_attn_mask
    if not (dq == dk == dv and dq <= 256):  # check_head_dim_size_flash
        return False
    if traits.flash_train_head_dim_limit and call.requires_grad:
        # flash's backward fails for head_dim in (192, 224], or (224, 256] with dropout
        if not (dq <= 192 or (call.dropout_p == 0.0 and dq > 224)):
            return False
    if call.is_causal and q.shape[-2] != k.shape[-2]:  # check_flash_causal_non_square_seqlens
        return False
    if not _dtypes(call, _HALF):  # check_dtypes_low_precision (sm80+)
        return False
    return _heads_ok(call, gqa=True, same_kv_heads=True) and _dense_common(call, True)


def minimum_gemm_alignment(major: int, dtype: str) -> int:
    """Head-dim alignment of the CUTLASS memory-efficient kernel (minimum_gemm_alignment)."""
    half = dtype in _HALF
    tensor_cores = major >= 8 or (major >= 7 and half)  # use_tensor_cores
    alignment = 4 if major >= 8 else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def can_use_efficient(traits: SdpaTraits, call: SdpaCall) -> bool:
    q, k, v = call.query, call.key, call.value
    if not traits.efficient or not _four_d(call):  # hardware [sm50, sm121]; tensor shapes
        return False
    align = minimum_gemm_alignment(traits.major, q.dtype)
    dq, dv = q.shape[-1], v.shape[-1]
    # check_head_dim_size_mem_efficient: no upper bound, only alignment
    if not (dq == k.shape[-1] and dq > 0 and dv > 0 and dq % align == 0 and dv % align == 0):
        return False
    if traits.major >= 8:  # check_data_ptr_alignment_mem_efficient: storage offsets
        if any(t.storage_offset % align for t in (q, k, v)):
            return False
    if not (_dense_common(call, False) and _heads_ok(call, gqa=True, same_kv_heads=True)):
        return False
    allowed = ("float16", "float32", "bfloat16") if traits.major >= 8 else ("float16", "float32")
    return _dtypes(call, allowed)


def _mask_shape_ok(call: SdpaCall) -> bool:
    """check_attn_mask_shape: 2-D (L|1, S|1) or 4-D (B|1, H|1, L|1, S|1), no grad."""
    mask = call.attn_mask
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    q, k = call.query.shape, call.key.shape
    m = mask.shape

    def fits(dim: int, target: int) -> bool:
        return dim == target or dim == 1

    if len(m) < 2 or not (fits(m[-2], q[2]) and fits(m[-1], k[2])):
        return False
    return len(m) == 2 or (len(m) == 4 and fits(m[0], q[0]) and fits(m[1], q[1]))


def can_use_cudnn(traits: SdpaTraits, call: SdpaCall) -> bool:
    q, k, v = call.query, call.key, call.value
    if not traits.flash or not _four_d(call) or not _dtypes(call, _HALF):
        return False  # hardware [sm80, sm121]; check_tensor_shapes; check_dtypes_low_precision
    if not _mask_shape_ok(call) or call.dropout_p * 16.0 != int(call.dropout_p * 16.0):
        return False  # check_attn_mask_shape; check_cudnn_dropout (multiples of 1/16)
    if not (_dense_common(call, True) and _heads_ok(call, gqa=True, same_kv_heads=False)):
        return False
    # check_cudnn_tensor_shapes
    if q.shape[0] > 65535 or q.shape[1] > 65535:
        return False
    d_qk, d_v, s_q, s_k = q.shape[3], v.shape[3], q.shape[2], k.shape[2]
    limit = 256 if traits.cudnn_d256 else 192 if (d_qk, d_v) == (192, 128) else 128
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8 or s_k == 1:
        return False
    if call.dropout_p != 0.0 and s_q == 1:
        return False
    if call.requires_grad and traits.cudnn_d256:  # check_cudnn_d256_bprop_head_dim
        return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    return True


def causal_pairs(seq_q: Any, seq_k: Any) -> Any:
    """(query, key) pairs a causal mask keeps: query i sees keys 0..i (PyTorch's upper-left
    ``tril``), so a square mask keeps L(L+1)/2 of L² and the fused kernels skip the rest.
    Integers or arrays alike (the tracer's counts and the attention features' rows)."""
    m = seq_q - (seq_q - seq_k) * (seq_q > seq_k)  # the shorter of the two
    return m * (m + 1) // 2 + (seq_q - m) * seq_k
