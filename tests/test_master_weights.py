"""master_weights=true: 16-bit parameters stepped through fp32 copies (Megatron-LM's --fp16 /
--bf16, DeepSpeed, apex O2).

The model is test_finetune's synthetic tiny Llama (2 layers, hidden 64, untied vocab 1000).
Bytes are exact: a parameter costs 2 bytes, its fp32 copy 4 and AdamW's two fp32 moments 8;
the fp32 gradients of the copies live from one step to the next ``zero_grad``.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.specs import StepSpec
from tests.test_finetune import TINY_LLAMA, adopted_bytes, trace


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("synthetic_tiny_llama") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return f"hf:{path}"


@pytest.fixture(scope="module")
def fp16_master(tiny_llama: str):
    return trace(tiny_llama, params_dtype="fp16", master_weights=True, optimizer="adamw")


def _ops(graph, phase: str) -> pd.Series:
    nodes = graph.nodes
    return nodes[nodes["phase"] == phase]["op"].value_counts()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_bytes_per_parameter(tiny_llama: str, dtype: str) -> None:
    graph = trace(tiny_llama, params_dtype=dtype, master_weights=True, optimizer="adamw")
    plain = trace(tiny_llama, params_dtype=dtype, optimizer="adamw")
    n = graph.meta["num_trainable_parameters"]
    # the model's weights stay 16-bit (the rest of "parameter" is the rotary buffer)
    assert adopted_bytes(graph, "parameter") == adopted_bytes(plain, "parameter") < 2 * n + 64
    assert adopted_bytes(plain, "gradient") == 2 * n
    assert adopted_bytes(graph, "gradient") == 4 * n  # the copies' fp32 gradients
    assert adopted_bytes(plain, "optimizer_state") == 2 * 2 * n  # 16-bit moments
    scale = 2 * 4 if dtype == "fp16" else 0  # fp16: the loss scale and the inf flag
    assert adopted_bytes(graph, "optimizer_state") == (4 + 8) * n + scale


def test_the_step_casts_unscales_and_copies_back(fp16_master) -> None:
    tensors = 3 + 9 * 2  # embedding, final norm, head; 7 linears and 2 norms per layer
    ops = _ops(fp16_master, "optimizer")
    assert ops["_to_copy"] == tensors  # one fp32 gradient per 16-bit one
    assert ops["_amp_foreach_non_finite_check_and_unscale_"] == 1
    assert ops["_foreach_copy_"] == 1  # the copies back into the fp16 parameters
    # the 16-bit gradients are dropped as their fp32 copies are made
    events = pd.DataFrame(fp16_master.mem_events)
    dropped = events[(events.action == "free") & (events.phase == "optimizer")
                     & (events.category == "gradient")]  # fmt: skip
    n = fp16_master.meta["num_trainable_parameters"]
    assert dropped.bytes.sum() == 2 * n
    # the loss is scaled before backward (fp16 only)
    assert "mul" in _ops(fp16_master, "backward")


def test_bf16_has_no_loss_scale(tiny_llama: str) -> None:
    graph = trace(tiny_llama, params_dtype="bf16", master_weights=True, optimizer="adamw")
    assert "_amp_foreach_non_finite_check_and_unscale_" not in _ops(graph, "optimizer")


@pytest.mark.parametrize(
    "fields",
    [
        {"params_dtype": "fp32"},
        {"params_dtype": "bf16", "amp": "bf16"},
        # a hunt's: no optimizer to own the copies ('NoneType' has no attribute 'scale_loss')
        {"params_dtype": "fp16", "optimizer": "none"},
        # a hunt's: peft's fp32 adapters are all that trains, nothing to copy (it ran unchanged)
        {"params_dtype": "bf16", "finetune_method": "lora"},
        {"params_dtype": "bf16", "finetune_method": "qlora"},
    ],
)
def test_master_weights_need_16_bit_parameters_without_autocast(fields) -> None:
    with pytest.raises(InvalidInputError) as err:
        StepSpec(master_weights=True, **fields)
    assert "master_weights=true" in str(err.value) and "\n" not in str(err.value)


def test_label_and_parallel_state_bytes() -> None:
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.memory_profile import memory_profile
    from tests.test_parallel import SYNTHETIC_TINY_LLAMA

    step = StepSpec(batch_size=2, seq_len=32, params_dtype="bf16", master_weights=True)
    assert step.label() == "batch 2, seq 32, params_dtype=bf16, master_weights=true"
    prof = memory_profile(SYNTHETIC_TINY_LLAMA, 1, step, get_gpu("h100-sxm"))
    assert (prof.param_bytes, prof.optimizer_bytes) == (2.0, 12.0)  # ZeRO's K = 12


@pytest.mark.parametrize(
    "fields", [{"params_dtype": "fp16"}, {"params_dtype": "bf16", "master_weights": True}]
)
def test_advice_for_16_bit_parameters_proposes_no_autocast(fields) -> None:
    from boom_ml.gpus import get_gpu
    from boom_ml.report.levers import single_changes

    gpu = get_gpu("v100-sxm2-16gb")  # no bf16: fp32 steps are offered amp=fp16
    assert single_changes(StepSpec(batch_size=4), gpu)[0][0] == "amp=fp16"
    labels = [label for label, _, _ in single_changes(StepSpec(batch_size=4, **fields), gpu)]
    # autocast over 16-bit parameters was offered, and raised for fp16 parameters
    assert labels[0] == "checkpointing=full" and not [x for x in labels if x.startswith("amp")]


def _gradient_bytes_at_backward(graph, **replay_kw) -> list[int]:
    """Live bytes of category ``gradient`` when each replayed step's backward starts."""
    from boom_ml.memory.replay import build_replay

    replay = build_replay(graph, steps=3, **replay_kw)
    category = graph.mem_events["category"].to_numpy().astype(str)
    phase = graph.mem_events["phase"].to_numpy().astype(str)
    sizes: dict[int, tuple[int, bool]] = {}
    live, starts, seen = 0, [], set()
    for i in range(len(replay.block)):
        src, k = int(replay.src[i]), int(replay.step[i])
        # (the kept 16-bit gradients are allocated early from their backward rows)
        opens = src >= 0 and phase[src] == "backward" and category[src] != "gradient"
        if opens and k not in seen:
            seen.add(k)
            starts.append(live)
        block = int(replay.block[i])
        if replay.is_alloc[i]:
            assert block not in sizes, f"block {block} allocated twice while alive"
            grad = src >= 0 and category[src] == "gradient"
            sizes[block] = (int(replay.nbytes[i]), grad)
            live += sizes[block][0] if grad else 0
        else:
            size, grad = sizes.pop(block)
            live -= size if grad else 0
    return starts


@pytest.mark.parametrize(
    ("zero_grad", "accumulate", "expected"),
    [
        ("set_to_none", False, [0, 0, 0]),
        # kept zeroed: the copies' fp32 gradients, once (the step's cast replaces each one)
        ("zero", False, [4, 4, 4]),
        # accumulation: the earlier micro-batches' 16-bit gradients, not the fp32 ones
        ("set_to_none", True, [0, 2, 2]),
        ("zero", True, [4, 6, 6]),
    ],
)
def test_gradients_alive_when_backward_starts(tiny_llama, zero_grad, accumulate, expected):
    graph = trace(tiny_llama, params_dtype="bf16", master_weights=True, optimizer="adamw",
                  zero_grad=zero_grad)  # fmt: skip
    n = graph.meta["num_trainable_parameters"]
    starts = _gradient_bytes_at_backward(graph, accumulate=accumulate, hold_outputs=False)
    assert starts == [e * n for e in expected]


def test_a_recipe_of_fp32_adapters_drops_the_master_copies() -> None:
    """The advice's LoRA / QLoRA recipes for a bf16 step with master weights train fp32
    adapters, which need no copy (and refuse one); adapters in the weights' dtype keep it."""
    from boom_ml.gpus import get_gpu
    from boom_ml.report.levers import RECIPE_LEVELS, recipe_changes

    step = StepSpec(batch_size=4, params_dtype="bf16", master_weights=True)
    for level in RECIPE_LEVELS:
        for _, changed, _ in recipe_changes(step, get_gpu("a100-80gb-sxm"), level):
            assert changed.finetune_method in ("lora", "qlora") and not changed.master_weights
    kept = replace(step, adapter_dtype="params")
    (_, changed, _), *_ = recipe_changes(kept, get_gpu("a100-80gb-sxm"))
    assert changed.master_weights and changed.finetune_method == "lora"
