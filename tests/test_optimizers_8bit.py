"""Issue #15's optimizers: bitsandbytes' 8-bit AdamW (plain and paged), Lion, fused AdamW,
Nesterov SGD. State sizes are exact; the models are synthetic tiny Llama configs."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from tiny_models import tiny_llama_config

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.stack import resolve_optimizer_impl, resolve_stack
from boom_ml.trace.optimizers import make_optimizer
from boom_ml.trace.optimizers_8bit import AdamW8bit, adam8bit_state_bytes
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model

# synthetic: 2 layers, hidden 64, vocab 2000 (embedding and head: 128,000 weights each,
# above bitsandbytes' 1e5 paging threshold; every other tensor is below it)
TINY = tiny_llama_config(vocab_size=2000, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("synthetic_tiny_llama") / "config.json"
    path.write_text(json.dumps(TINY))
    return f"hf:{path}"


def trace(model: str, **step: object) -> object:
    return trace_step(build_model(ModelSpec(model)), StepSpec(batch_size=2, seq_len=32, **step))


def state_bytes(graph: object) -> int:
    events = pd.DataFrame(graph.mem_events)
    held = events[(events.action == "alloc") & (events.phase == "optimizer_state")]
    return int(held.bytes.sum())


def param_numels() -> list[int]:
    h, f, v, layers = 64, 128, 2000, 2
    # q k v o gate up down, two norms
    block = [h * h, 32 * h, 32 * h, h * h, f * h, f * h, h * f, h, h]
    return [v * h] + block * layers + [h, v * h]


def test_adam8bit_state_bytes_formula() -> None:
    # >= 4096 elements: two uint8 states + two fp32 absmax per block of 256
    assert adam8bit_state_bytes(4096 * 4096) == 2 * 4096 * 4096 + 2 * 4 * 65536
    assert adam8bit_state_bytes(4097) == 2 * 4097 + 2 * 4 * 17  # a partial block counts
    # smaller tensors keep two fp32 states
    assert adam8bit_state_bytes(4095) == 2 * 4 * 4095


def test_adam8bit_state_tensors_on_real_tensors() -> None:
    big = torch.nn.Parameter(torch.zeros(10_000))
    small = torch.nn.Parameter(torch.zeros(100))
    opt = AdamW8bit([big, small])
    for p in (big, small):
        p.grad = torch.zeros_like(p)
    opt.step()
    s = opt.state[big]
    assert s["state1"].dtype == s["state2"].dtype == torch.uint8
    assert s["state1"].numel() == 10_000
    assert s["absmax1"].dtype == torch.float32 and s["absmax1"].numel() == 40  # ceil(10000/256)
    assert s["qmap1"].numel() == 256 and s["qmap1"] is opt.state[big]["qmap1"]
    assert opt.state[small]["state1"].dtype == torch.float32
    assert "absmax1" not in opt.state[small]


def test_adamw8bit_traced_state_bytes(tiny: str) -> None:
    graph = trace(tiny, optimizer="adamw8bit")
    qmaps = 2 * 256 * 4  # one signed and one unsigned dynamic map for the optimizer
    assert state_bytes(graph) == sum(map(adam8bit_state_bytes, param_numels())) + qmaps
    updates = graph.nodes[graph.nodes.op == "optimizer_update_8bit_blockwise_"]
    assert len(updates) == sum(n >= 4096 for n in param_numels())
    assert (graph.nodes.op == "optimizer_update_32bit_").sum() == sum(
        n < 4096 for n in param_numels()
    )
    assert graph.meta["method_notes"]


def test_paged_state_is_not_on_the_device(tiny: str) -> None:
    plain = state_bytes(trace(tiny, optimizer="adamw8bit"))
    paged = trace(tiny, optimizer="paged-adamw8bit")
    # embedding and head (128,000 elements each) page their two uint8 states out
    assert plain - state_bytes(paged) == 2 * (2 * 2000 * 64)
    events = pd.DataFrame(paged.mem_events)
    assert "host" not in set(events.category)
    total = len(param_numels())
    assert f"paged state on the host (2 of {total} trainable parameters: those of 100,000" in (
        paged.meta["method_notes"][0])  # fmt: skip
    from boom_ml.trace.optimizers_8bit import AdamW8bit

    small = AdamW8bit([torch.nn.Parameter(torch.zeros(32_768))], paged=True)  # a LoRA matrix
    assert "nothing paged" in small.method_notes[0]
    # LoRA: the frozen base weight has no gradient, so no state to page (a hunt's finding)
    frozen = torch.nn.Parameter(torch.zeros(1_000_000), requires_grad=False)
    lora = AdamW8bit([frozen, torch.nn.Parameter(torch.zeros(32_768))], paged=True)
    assert "nothing paged" in lora.method_notes[0]


def test_lion_state_is_one_buffer_in_param_dtype(tiny: str) -> None:
    n = sum(param_numels())
    assert state_bytes(trace(tiny, optimizer="lion")) == 4 * n
    assert state_bytes(trace(tiny, optimizer="lion", params_dtype="bf16")) == 2 * n
    assert state_bytes(trace(tiny, optimizer="adamw", params_dtype="bf16")) == 2 * 2 * n


def test_fused_and_nesterov(tiny: str) -> None:
    fused = trace(tiny, optimizer="adamw-fused")
    assert "_fused_adamw_" in set(fused.nodes.op)
    assert fused.meta["step"]["optimizer_impl"] == "fused"
    # two fp32 moments, and a 4-byte step count per tensor on the GPU (fused: on the
    # parameter's device; the other implementations keep it on the host)
    assert state_bytes(fused) == 2 * 4 * sum(param_numels()) + 4 * len(param_numels())
    nesterov = trace(tiny, optimizer="sgd-nesterov")
    assert state_bytes(nesterov) == 4 * sum(param_numels())  # one momentum buffer


def test_new_names_build_and_resolve() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    stack = resolve_stack()
    assert resolve_optimizer_impl("adamw-fused", "auto", stack) == "fused"
    assert resolve_optimizer_impl("adamw8bit", "auto", stack) == "loop"
    assert make_optimizer("sgd-nesterov", p).defaults["nesterov"] is True
    assert type(make_optimizer("paged-adamw8bit", p)).__name__ == "AdamW8bit"
    assert make_optimizer("paged-adamw8bit", p).paged is True


def test_8bit_state_is_in_the_replayed_peak(tiny: str) -> None:
    """bitsandbytes' kernels work in place (no event in the optimizer phase): the replay must
    still create the state in the first step, so the steady-state peak holds it."""
    from boom_ml.gpus import parse_gpu_list
    from boom_ml.memory.estimate import estimate_memory

    gpu = parse_gpu_list("a100-80gb-sxm")[0]
    plain = trace(tiny, optimizer="adamw8bit")
    held = estimate_memory(plain, gpu).breakdown.get("optimizer_state", 0)
    ev = pd.DataFrame(plain.mem_events)
    made = ev[(ev.category == "optimizer_state") & (ev.action == "alloc")]["bytes"]
    # every state tensor alive at the peak, each block rounded up to 512 bytes
    assert held == sum(-(-int(b) // 512) * 512 for b in made) > state_bytes(plain)
    paged = estimate_memory(trace(tiny, optimizer="paged-adamw8bit"), gpu)
    assert paged.breakdown.get("optimizer_state", 0) < held
