"""A deep model traced shallow with one layer repeated (``trace/repeat.py``, ``trace/stretch.py``)
equals the model traced whole: every node, edge and memory event (blocks numbered in order of
allocation), the graph meta, and the predictions made from it. Where layers differ by index it
traces the model whole.

The models are synthetic tiny configs (hidden 64, 8 layers), not published models.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
import pytest

from boom_ml import api
from boom_ml.gpus import parse_gpu_list
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace import REPEAT_ENV, repeat, repeat_enabled
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.repeat import Plan, shallow_options, trace_repeated
from boom_ml.trace.step import trace_step
from boom_ml.trace.stretch import canonical, difference
from boom_ml.zoo import build_model
from tests.tiny_models import tiny_llama_config

LAYERS = 8
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4,
        "n_layer": LAYERS, "n_positions": 128, "vocab_size": 256}  # fmt: skip
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64,
           "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 256, "max_position_embeddings": 128}  # fmt: skip
BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "vocab_size": 256, "max_position_embeddings": 128}  # fmt: skip


def _model(tmp_path: Path, config: dict, name: str = "config.json") -> ModelSpec:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return ModelSpec(f"hf:{path}")


def _llama(tmp_path: Path, **overrides: object) -> ModelSpec:
    return _model(
        tmp_path, tiny_llama_config(vocab_size=256, num_hidden_layers=LAYERS, **overrides)
    )


def _assert_same(repeated: OpGraph | None, traced: OpGraph) -> None:
    assert repeated is not None
    whole = canonical(traced)
    for table in ("nodes", "edges", "mem_events"):
        pd.testing.assert_frame_equal(getattr(repeated, table), getattr(whole, table))
    drop = {"trace_seconds", "repeated_layers"}
    assert {k: v for k, v in repeated.meta.items() if k not in drop} == {
        k: v for k, v in traced.meta.items() if k not in drop
    }
    assert repeated.meta["repeated_layers"] == {"traced": 3, "checked": 4, "layers": LAYERS}


@pytest.mark.parametrize(
    "step",
    [
        {"amp": "bf16", "checkpointing": "full"},
        {"params_dtype": "bf16", "finetune_method": "lora", "optimizer": "adamw8bit"},
        {"params_dtype": "fp16", "master_weights": True},  # loss scale, fp32 copies
        {"amp": "bf16", "finetune_method": "qlora", "checkpointing": "full"},
        {
            "amp": "fp16",
            "optimizer": "adafactor",
            "zero_grad": "zero",
            "checkpointing": "selective",
        },
    ],
)
def test_a_repeated_llama_equals_the_traced_one(tmp_path: Path, step: dict) -> None:
    model = _llama(tmp_path)
    spec = StepSpec(batch_size=2, seq_len=32, **step)
    _assert_same(trace_repeated(model, spec), trace_step(build_model(model), spec))


def test_a_dense_first_layer_is_kept_and_the_next_moe_layer_repeated() -> None:
    """DeepSeek-V2-Lite's shipped config at 11 layers (its first layer dense, the others MoE):
    traced with 4 and 5 layers, layer 2 repeated."""
    model = ModelSpec("hf:deepseek-ai/DeepSeek-V2-Lite", {"num_hidden_layers": 11})
    plan = shallow_options(model)
    assert plan is not None and (plan.repeated, plan.depth) == (2, 4)
    spec = StepSpec(batch_size=1, seq_len=16, amp="bf16")
    repeated = trace_repeated(model, spec)
    assert repeated is not None and repeated.meta["repeated_layers"]["traced"] == 4
    whole = trace_step(build_model(model), spec)
    assert difference(repeated, whole) is None


@pytest.mark.parametrize(
    ("config", "method"),
    [(GPT2, "lora"), (MIXTRAL, "lora"), (BERT, "lora"), (MIXTRAL, "qlora")],
    ids=["gpt2", "mixtral", "bert", "mixtral-qlora"],
)
def test_other_architectures_repeat_exactly(tmp_path: Path, config: dict, method: str) -> None:
    """Mixtral's QLoRA leaves its fused experts unquantised: the count of them grows by a
    layer's share, and the method note that names them says no count."""
    model = _model(tmp_path, config)
    spec = StepSpec(batch_size=2, seq_len=32, amp="bf16", finetune_method=method)
    repeated, whole = trace_repeated(model, spec), trace_step(build_model(model), spec)
    _assert_same(repeated, whole)
    if method == "qlora":  # 3 tensors of 4 experts x 64 x 64 (gate, up: 64 x 128) per layer
        assert whole.meta["recipe"]["unquantized_expert_parameters"] == LAYERS * 4 * 3 * 64 * 64


def test_the_repeated_layers_are_the_deep_models(tmp_path: Path) -> None:
    """What the repeat writes: 8 layers' modules, parameters and SDPA calls, one foreach
    AdamW step over all 8 layers' tensors (9 per layer: 4 attention, 3 MLP, 2 norms)."""
    model = _llama(tmp_path)
    graph = trace_repeated(model, StepSpec(batch_size=2, seq_len=32, amp="bf16"))
    assert graph is not None
    layers = graph.nodes.module.str.extract(r"layers\.(\d+)\.")[0].dropna().astype(int)
    assert sorted(layers.unique()) == list(range(LAYERS))
    assert graph.meta["sdpa"]["calls"] == LAYERS
    lerp = graph.nodes[graph.nodes.op == "_foreach_lerp_"]
    assert len(lerp) == 1
    # exp_avg and the gradients: 2 lists of 9 x 8 layer tensors + embedding, norm, head
    assert len(json.loads(lerp.input_shapes.iloc[0])) == 2 * (9 * LAYERS + 3)


def test_predictions_from_a_repeated_trace_equal_the_whole_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _llama(tmp_path)
    gpus = parse_gpu_list(["a100-80gb-sxm", "t4"])
    step = StepSpec(batch_size=2, seq_len=32, amp="fp16", checkpointing="full")
    repeated = api.Session(model.text, cache=False).evaluate(step, gpus, max_batch=True)
    monkeypatch.setenv(REPEAT_ENV, "0")
    assert trace_repeated(model, step) is None
    whole = api.Session(model.text, cache=False).evaluate(step, gpus, max_batch=True)
    assert repeated == whole


def test_layers_that_differ_by_index_trace_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = StepSpec(batch_size=1, seq_len=32, amp="bf16")
    # Gemma 2 alternates sliding-window and global attention: its config as transformers
    # fills it in says so, and were it read from the json alone, the 4-layer check would
    gemma2 = _model(tmp_path, {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                               "vocab_size": 256, "sliding_window": 16,
                               "max_position_embeddings": 128}, "gemma2.json")  # fmt: skip
    assert shallow_options(gemma2) is None
    plan = Plan(LAYERS, 1, {n: {"num_hidden_layers": n} for n in (3, 4)})
    monkeypatch.setattr(repeat, "shallow_options", lambda model: plan)
    with caplog.at_level(logging.INFO, logger="boom_ml.trace.repeat"):
        assert trace_repeated(gemma2, step) is None
    assert "3 layers repeated once differ from 4" in caplog.text
    monkeypatch.undo()
    # the config says so: not even traced shallow
    typed = _llama(tmp_path, layer_types=["sliding_attention", "full_attention"] * 4)
    assert shallow_options(typed) is None
    same = _llama(tmp_path, layer_types=["full_attention"] * LAYERS)
    assert shallow_options(same) == Plan(
        LAYERS,
        1,
        {n: {"num_hidden_layers": n, "layer_types": ["full_attention"] * n} for n in (3, 4)},
    )
    assert shallow_options(_llama(tmp_path, decoder_sparse_step=2)) is None
    shallow = _model(tmp_path, tiny_llama_config(num_hidden_layers=repeat.MIN_LAYERS - 1))
    assert shallow_options(shallow) is None
    assert shallow_options(ModelSpec("torchvision:resnet50")) is None
    assert shallow_options(ModelSpec("resnet50")) is None
    assert shallow_options(ModelSpec("Qwen/Qwen2.5-0.5B")).layers == 24  # a bare hub name: hf:
    # a LoRA target in one layer (layer 5 of 8): the shallow models have no such layer
    lora = StepSpec(batch_size=1, seq_len=32, finetune_method="lora",
                    lora_targets=("q_proj", "model.layers.5.mlp.down_proj"))  # fmt: skip
    assert trace_repeated(_llama(tmp_path), lora) is None
    assert repeat._names_a_layer(("0.fc",)) and not repeat._names_a_layer(("q_proj", "fc1"))


def test_the_off_switch_is_a_cache_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from boom_ml.trace_cache import cache_key

    model, step = _llama(tmp_path), StepSpec(batch_size=2, seq_len=32)
    on = cache_key(model, step)
    monkeypatch.setenv(REPEAT_ENV, "0")
    assert cache_key(model, step) != on
    for off in ("false", "Off", "no"):
        monkeypatch.setenv(REPEAT_ENV, off)
        assert not repeat_enabled()
    monkeypatch.setenv(REPEAT_ENV, "1")
    assert repeat_enabled() and cache_key(model, step) == on


def test_the_table_and_json_say_which_layers_were_traced(tmp_path: Path) -> None:
    from boom_ml.report.table import render_table

    model = _llama(tmp_path)
    p = api.predict(model.text, gpu="a100-80gb-sxm", batch_size=2, seq_len=32, advice=False,
                    cache=False, max_batch=False)  # fmt: skip
    assert p.to_dict()["graph"]["repeated_layers"] == {"traced": 3, "checked": 4, "layers": LAYERS}
    assert f"(3 and 4 of its {LAYERS} layers, one repeated)" in render_table(p)
