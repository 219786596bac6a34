"""The trace follows the target GPU's SDPA backend (boom_ml/trace/sdpa_select.py, attention.py).

The selection table is torch 2.14's ``select_sdp_backend`` (cuda/sdp_utils.cpp) for dense
inputs with PyTorch's defaults; the default stack is torch 2.14 + CUDA 13.0 + cuDNN 9.24,
where cuDNN attention comes first on sm90/sm100.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_llama_config

from boom_ml.gpus import parse_gpu_list
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.stack import resolve_stack
from boom_ml.trace.ops import REGISTRY
from boom_ml.trace.sdpa_select import (
    GROUPS,
    SdpaCall,
    TensorInfo,
    causal_pairs,
    sdpa_group,
    sdpa_traits,
    select_backend,
)
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model

aten = torch.ops.aten
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def pick(sm: int, dtype: str, head_dim: int = 64, mask: bool = False, **kw: object) -> str:
    """The backend for q (2, 8, Lq, d) and k/v (2, kv_heads, Lk, d) on compute capability sm."""
    seq_q, seq_k = kw.pop("seq_q", 128), kw.pop("seq_k", 128)
    kv_heads = 2 if kw.get("enable_gqa") else 8
    d = DTYPES[dtype]
    call = SdpaCall(
        TensorInfo((2, 8, seq_q, head_dim), d),
        TensorInfo((2, kv_heads, seq_k, head_dim), d),
        TensorInfo((2, kv_heads, seq_k, head_dim), d),
        TensorInfo((2, 1, seq_q, seq_k), "bool") if mask else None,
        **kw,
    )
    return select_backend(sdpa_group(sm), call)


# (sm, dtype, head_dim, mask, extra) -> backend; the comment names the deciding filter
TABLE = [
    (61, "fp32", 64, False, {}, "efficient"),  # sm50-79: mem-efficient takes fp16 and fp32
    (61, "fp16", 20, False, {}, "efficient"),  # no tensor cores: alignment 1
    (61, "bf16", 64, False, {}, "math"),  # bf16 kernels need sm80
    (70, "fp16", 64, False, {}, "efficient"),  # flash needs sm80
    (70, "fp16", 20, False, {}, "math"),  # fp16 tensor cores: head dim % 8
    (70, "fp32", 20, False, {}, "efficient"),  # fp32 on sm70: alignment 1
    (70, "bf16", 64, False, {}, "math"),
    (75, "fp16", 64, True, {}, "efficient"),  # masks are fine for mem-efficient
    (75, "fp16", 64, False, {"enable_gqa": True}, "efficient"),  # native GQA
    (80, "fp16", 64, False, {}, "flash"),
    (80, "bf16", 256, False, {}, "flash"),
    (80, "bf16", 264, False, {}, "efficient"),  # flash: head dim <= 256
    (80, "bf16", 60, False, {}, "flash"),  # flash pads the head dim to 64
    (80, "bf16", 60, True, {}, "math"),  # mem-efficient: head dim % 8 for half
    (80, "fp32", 64, False, {}, "efficient"),  # flash is fp16/bf16 only
    (80, "fp32", 66, False, {}, "math"),  # fp32 on sm80: head dim % 4
    (80, "bf16", 64, True, {}, "efficient"),  # flash takes no mask
    (80, "bf16", 64, False, {"enable_gqa": True}, "flash"),
    (80, "bf16", 64, False, {"is_causal": True, "seq_q": 64}, "efficient"),  # non-square causal
    (80, "bf16", 200, False, {}, "flash"),
    (86, "bf16", 200, False, {}, "efficient"),  # sm86-89: flash backward head dim (192, 224]
    (86, "bf16", 200, False, {"requires_grad": False}, "flash"),  # only with gradients
    (89, "bf16", 240, False, {}, "flash"),  # (224, 256] without dropout
    (89, "bf16", 240, False, {"dropout_p": 0.1}, "efficient"),
    (120, "bf16", 200, False, {}, "efficient"),
    (90, "bf16", 128, False, {}, "cudnn"),  # cuDNN first on sm90 (cuDNN > 9.15)
    (90, "bf16", 64, True, {}, "cudnn"),
    (90, "bf16", 64, False, {"enable_gqa": True}, "cudnn"),
    (90, "fp32", 64, False, {}, "efficient"),
    (90, "bf16", 256, False, {}, "cudnn"),  # d256 forward and backward
    (90, "bf16", 160, False, {}, "flash"),  # cuDNN backward: <= 128, 192/128 or 256
    (90, "bf16", 160, False, {"requires_grad": False}, "cudnn"),
    (90, "bf16", 60, False, {}, "flash"),  # cuDNN: head dim % 8
    (90, "bf16", 64, False, {"dropout_p": 0.1}, "flash"),  # cuDNN dropout in 1/16 steps
    (90, "bf16", 64, False, {"dropout_p": 0.125}, "cudnn"),
    (100, "fp16", 64, False, {}, "cudnn"),
    (37, "fp16", 64, False, {}, "math"),  # outside [sm50, sm121]
]


@pytest.mark.parametrize(("sm", "dtype", "head_dim", "mask", "extra", "expected"), TABLE)
def test_selection_table(sm, dtype, head_dim, mask, extra, expected) -> None:
    assert pick(sm, dtype, head_dim, mask, **dict(extra)) == expected


def test_groups_of_every_gpu_and_stack() -> None:
    groups = {g.id: sdpa_group(g.sm_version) for g in parse_gpu_list("all")}
    assert groups["t4"] == groups["v100-sxm2-32gb"] == "sm70"
    assert groups["p100-pcie-16gb"] == "sm50"
    assert groups["a100-80gb-sxm"] == "sm80"
    assert groups["l4"] == groups["a10"] == groups["rtx-5090"] == "sm86"
    assert groups["h100-sxm"] == groups["b200"] == "sm90-cudnn-d256"
    assert set(groups.values()) <= set(GROUPS)
    # the default stack is torch 2.14's default wheel; older cuDNN releases differ on sm90
    assert sdpa_group(90, resolve_stack()) == "sm90-cudnn-d256"
    assert sdpa_group(90, resolve_stack({"torch": "2.14", "cuda": "12.6"})) == "sm80"
    assert sdpa_group(90, resolve_stack({"torch": "2.11", "cuda": "12.8"})) == "sm90-cudnn"
    assert sdpa_traits(121) == GROUPS["sm86"] and sdpa_traits(130) == GROUPS["math"]
    # a running torch's own build (data_collection/op_profiles.py): CUDNN_VERSION integers
    assert sdpa_traits(90, "12.4", 90100) == GROUPS["sm80"]
    assert sdpa_traits(100, "13.0", 92400) == GROUPS["sm90-cudnn-d256"]
    assert sdpa_traits(101, "12.8", 91701) == GROUPS["sm80"]  # CUDA < 13: minor 0 or 3 only


def _shape(*s: int) -> torch.Tensor:
    return torch.empty(s, device="meta")


def test_causal_attention_flops_count_the_kept_pairs() -> None:
    b, h, n, d = 2, 4, 32, 16
    q = k = v = out = g = _shape(b, h, n, d)
    fwd_full = 4 * b * h * n * n * d  # QK^T and PV, 2 FLOPs per multiply-add
    bwd_full = 10 * b * h * n * n * d  # recomputed QK^T and four gradient matmuls
    kept = n * (n + 1) // 2  # query i sees keys 0..i
    forwards = {
        aten._scaled_dot_product_flash_attention: lambda c: (q, k, v, 0.0, c),
        aten._scaled_dot_product_efficient_attention: lambda c: (q, k, v, None, True, 0.0, c),
        aten._scaled_dot_product_cudnn_attention: lambda c: (q, k, v, None, True, 0.0, c),
    }
    for op, args in forwards.items():
        flops = REGISTRY[op].flops
        assert flops(*args(False), out_val=out) == fwd_full == 524288
        assert flops(*args(True), out_val=out) == fwd_full * kept // (n * n) == 270336
        assert flops(*args(True), out_val=out) == fwd_full // 2 + fwd_full // (2 * n)
    none = [None] * 6
    backwards = {
        aten._scaled_dot_product_flash_attention_backward: lambda c: ((g, q, k, v, *none, 0.0, c)),
        aten._scaled_dot_product_efficient_attention_backward: lambda c: (
            (g, q, k, v, *none[:5], 0.0, [True] * 4, c)
        ),
        aten._scaled_dot_product_cudnn_attention_backward: lambda c: (
            (g, q, k, v, *none, None, None, None, 0.0, c)
        ),
    }
    for op, args in backwards.items():
        flops = REGISTRY[op].flops
        assert flops(*args(False), out_val=None) == bwd_full == 1310720
        assert flops(*args(True), out_val=None) == bwd_full // 2 + bwd_full // (2 * n) == 675840
    # non-square (mem-efficient): upper-left alignment, as PyTorch's tril
    assert causal_pairs(16, 32) == 136 and causal_pairs(32, 16) == 136 + 16 * 16
    flops = REGISTRY[aten._scaled_dot_product_efficient_attention].flops
    q16 = _shape(b, h, 16, d)
    assert flops(q16, k, v, None, True, 0.0, True, out_val=q16) == 4 * b * h * 136 * d


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    path = tmp_path_factory.mktemp("gqa_llama") / "config.json"
    path.write_text(json.dumps(tiny_llama_config(vocab_size=1000)))  # 4 query, 2 KV heads
    return ModelSpec(f"hf:{path}", {"attn_implementation": "sdpa"})


def _trace(model: ModelSpec, gpu: str, **step: object):
    group = sdpa_group(parse_gpu_list(gpu)[0].sm_version)
    spec = StepSpec(batch_size=2, seq_len=32, sdpa_group=group, **step)
    return trace_step(build_model(model), spec)


@pytest.mark.parametrize(
    ("gpu", "backend"),
    [("t4", "efficient"), ("a100-80gb-sxm", "flash"), ("h100-sxm", "cudnn")],
)
def test_gqa_llama_follows_the_gpu(llama: ModelSpec, gpu: str, backend: str) -> None:
    graph = _trace(llama, gpu, amp="fp16")
    assert graph.meta["sdpa"]["backends"] == {backend: 2}  # one call per layer
    assert graph.meta["step"]["sdpa_group"] == sdpa_group(parse_gpu_list(gpu)[0].sm_version)
    nodes = graph.nodes[graph.nodes.family == "attention"]
    fwd = nodes[nodes.op == f"_scaled_dot_product_{backend}_attention"]
    bwd = nodes[nodes.op == f"_scaled_dot_product_{backend}_attention_backward"]
    assert len(fwd) == len(bwd) == 2
    for shapes in fwd.input_shapes.map(json.loads):
        # K and V reach the kernel with their 2 heads: no repeat_kv / repeat_interleave copy
        assert shapes[0] == [2, 4, 32, 16] and shapes[1] == shapes[2] == [2, 2, 32, 16]
    # HF passes is_causal (no materialised mask), so the fused kernel's FLOPs are causal
    causal_fwd = 4 * 2 * 4 * 16 * causal_pairs(32, 32)
    assert fwd.flops.tolist() == [causal_fwd, causal_fwd]


def test_math_backend_expands_gqa_heads(llama: ModelSpec) -> None:
    graph = _trace(llama, "t4", amp="bf16")  # no bf16 kernel before sm80: math
    assert graph.meta["sdpa"]["backends"] == {"math": 2}
    assert not (graph.nodes.family == "attention").any()
    # the materialised scores (fp32: math upcasts half inputs) and K/V repeated to 4 heads
    bmm_inputs = graph.nodes[graph.nodes.op == "bmm"].input_shapes.map(json.loads)
    assert [[8, 32, 16], [8, 16, 32]] in bmm_inputs.tolist()
    expanded = graph.nodes[graph.nodes.output_shapes == json.dumps([[2, 2, 2, 32, 16]])]
    assert expanded.op.tolist().count("clone") == 4  # repeat_interleave of K and V, 2 layers
    assert set(graph.nodes[graph.nodes.op == "bmm"].output_dtypes) == {'["float32"]'}


CNN = """
import torch
class Net(torch.nn.Sequential):
    def example_inputs(self, batch_size, device):
        return torch.randn(batch_size, 3, 16, 16, device=device)
def make():
    return Net(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
               torch.nn.Linear(8 * 14 * 14, 4))
"""


def _count_traces(monkeypatch: pytest.MonkeyPatch) -> list[StepSpec]:
    import boom_ml.trace.step as tracer

    calls: list[StepSpec] = []
    real = tracer.trace_step

    def counting(built, step):
        calls.append(step)
        return real(built, step)

    monkeypatch.setattr(tracer, "trace_step", counting)
    return calls


def test_cnn_on_two_architectures_is_traced_once(tmp_path, monkeypatch) -> None:
    import boom_ml.api as api

    path = tmp_path / "cnn.py"
    path.write_text(CNN)
    calls = _count_traces(monkeypatch)
    gpus = parse_gpu_list(["t4", "a100-80gb-sxm"])
    session = api.Session(f"file:{path}:make", cache=False)
    results = session.evaluate(StepSpec(batch_size=2), gpus)
    assert [r.gpu for r in results] == ["t4", "a100-80gb-sxm"]
    assert len(calls) == 1 and calls[0].sdpa_group == "sm70"  # the first GPU's group
    assert session.graph(StepSpec(batch_size=2)).meta["sdpa"]["calls"] == 0
    session.evaluate(StepSpec(batch_size=2), gpus[::-1])  # a100 first: still no new trace
    assert len(calls) == 1


def test_llm_is_traced_once_per_group_in_the_users_order(llama, monkeypatch) -> None:
    import boom_ml.api as api

    calls = _count_traces(monkeypatch)
    gpus = parse_gpu_list(["a100-80gb-sxm", "t4", "a100-40gb-pcie"])
    session = api.Session(llama.text, cache=False, options=llama.options)
    step = StepSpec(batch_size=2, seq_len=32, amp="fp16", optimizer="none")
    results = session.evaluate(step, gpus)
    assert [r.gpu for r in results] == [g.id for g in gpus]
    assert [c.sdpa_group for c in calls] == ["sm80", "sm70"]
    # predict() reads the step's graph back without a group: the first GPU's
    graph = session.graph(replace(step, grad_accum=1))
    assert graph.meta["sdpa"]["backends"] == {"flash": 2} and len(calls) == 2


@pytest.mark.parametrize(
    ("group", "dtype", "head_dim", "mask_len", "backend"),
    [
        ("sm80", torch.bfloat16, 60, None, "flash"),  # head dim padded to 64, sliced back
        ("sm80", torch.float32, 64, 30, "efficient"),  # bool mask -> bias, padded to 32
        ("sm90-cudnn-d256", torch.bfloat16, 64, 30, "cudnn"),
        ("sm70", torch.bfloat16, 64, 30, "math"),
    ],
)
def test_each_backend_runs_forward_and_backward(group, dtype, head_dim, mask_len, backend) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from boom_ml.trace.attention import cuda_attention

    seq_k = mask_len or 32
    with FakeTensorMode(), cuda_attention(group) as log:
        q = torch.randn(2, 4, 32, head_dim, dtype=dtype, requires_grad=True)
        k = torch.randn(2, 2, seq_k, head_dim, dtype=dtype, requires_grad=True)
        v = torch.randn(2, 2, seq_k, head_dim, dtype=dtype, requires_grad=True)
        mask = None if mask_len is None else torch.ones(2, 1, 32, seq_k, dtype=torch.bool)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True
        )
        out.sum().backward()
        assert out.shape == q.shape and out.dtype == dtype
        assert k.grad.shape == k.shape and q.grad.shape == q.shape
    assert dict(log.backends) == {backend: 1}


def test_a_group_whose_calls_pick_the_same_kernels_reuses_the_trace(llama, monkeypatch) -> None:
    """sm86 runs flash for these calls as sm80 does: one trace serves both; sm70 differs."""
    import boom_ml.api as api
    from boom_ml.trace.sdpa_select import call_from_dict, call_to_dict, same_backends

    calls = _count_traces(monkeypatch)
    gpus = parse_gpu_list(["a100-80gb-sxm", "a10g", "t4", "rtx-3090"])
    session = api.Session(llama.text, cache=False, options=llama.options)
    step = StepSpec(batch_size=2, seq_len=32, amp="fp16", optimizer="none")
    results = session.evaluate(step, gpus)
    assert [r.gpu for r in results] == [g.id for g in gpus]
    assert [c.sdpa_group for c in calls] == ["sm80", "sm70"]
    meta = session.graph(replace(step, grad_accum=1)).meta["sdpa"]
    assert same_backends(meta, "sm86") and not same_backends(meta, "sm70")
    recorded = [call_from_dict(d) for d in meta["inputs"]]
    assert recorded and [call_to_dict(c) for c in recorded] == meta["inputs"]


def test_a_cnn_cached_for_one_group_is_not_traced_again_for_another(tmp_path, monkeypatch) -> None:
    """The disk cache is keyed by attention group; a step without SDPA traced for one group
    is stored for the default one too, and any group reads it from there."""
    import boom_ml.api as api

    monkeypatch.setenv("BOOM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "cnn.py"
    path.write_text(CNN)
    calls = _count_traces(monkeypatch)
    step = StepSpec(batch_size=2)
    api.Session(f"file:{path}:make").evaluate(step, parse_gpu_list(["t4"]))  # sm70 first
    assert [c.sdpa_group for c in calls] == ["sm70"]
    for first in (["a100-80gb-sxm"], ["p100-pcie-16gb", "h100-sxm"]):  # sm80; sm50 first
        api.Session(f"file:{path}:make").evaluate(step, parse_gpu_list(first))
    assert len(calls) == 1


def test_a_stack_before_torch_2_has_no_fused_attention() -> None:
    from boom_ml.stack import resolve_stack
    from boom_ml.trace.sdpa_select import sdpa_group

    assert sdpa_group(80, resolve_stack({"torch": "1.13"})) == "math"
    assert sdpa_group(80, resolve_stack({"torch": "2.6"})) == "sm80"
