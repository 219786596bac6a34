"""LoRA targets where peft's table names none the model has (Phi-3, DeepSeek-V2) and on MoE
models' fused experts (synthetic configs, built on the meta device)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama_config

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.zoo import build_model

# synthetic: test_finetune.py's Llama (2 layers, hidden 64, vocab 1000)
TINY_LLAMA = tiny_llama_config(vocab_size=1000, rope_theta=10000.0, tie_word_embeddings=False)
# synthetic: a 2-layer Phi-3 of width 64 (4 query and 2 KV heads of 16), vocab 256
TINY_PHI3 = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
             "pad_token_id": 0}  # fmt: skip


def test_lora_targets_where_peft_has_no_default(tmp_path: Path) -> None:
    """peft has no LoRA default for phi3: the target set most of peft's architectures use that
    the model has every name of is taken (qkv_proj: (16 + 2 x 2 x 16) x 64 in a layer), and
    the recipe says so; a model with a default of its own keeps it, without a note; a model
    with none of them stops with its linear layers named."""
    from boom_ml.errors import InvalidInputError
    from boom_ml.zoo.finetune import apply_recipe

    (tmp_path / "phi3.json").write_text(json.dumps(TINY_PHI3))
    (tmp_path / "llama.json").write_text(json.dumps(TINY_LLAMA))
    lora = StepSpec(finetune_method="lora", lora_r=8)
    phi3 = apply_recipe(build_model(ModelSpec(f"hf:{tmp_path / 'phi3.json'}")).module, lora)
    assert phi3["lora_targets"] == ["qkv_proj"]
    assert phi3["peft_trainable_parameters"] == 2 * 8 * (64 + 128)  # A: 8 x 64, B: 128 x 8
    assert phi3["lora_targets_chosen"] == (
        "peft has no default for phi3; its most common one this model has"
    )
    llama = apply_recipe(build_model(ModelSpec(f"hf:{tmp_path / 'llama.json'}")).module, lora)
    assert llama["lora_targets"] == ["q_proj", "v_proj"] and "lora_targets_chosen" not in llama
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(InvalidInputError, match=r"this model's linear layers: 0, 2\)"):
        apply_recipe(plain, lora)
    # a hunt: a Sequential inside a module had its layers listed as 0, 10, 2, ... (names
    # finetune.targets does not take alone); now as it takes them, in order
    nested = torch.nn.Module()
    nested.net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(11)])
    names = ", ".join(f"net.{i}" for i in range(11))
    with pytest.raises(InvalidInputError, match=rf"this model's linear layers: {names}\)"):
        apply_recipe(nested, lora)


# synthetic: a 2-layer Mixtral of width 64 with 4 experts of 64
TINY_MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                "vocab_size": 256, "max_position_embeddings": 128}  # fmt: skip


def test_all_linear_on_fused_experts_needs_no_dropout(tmp_path: Path) -> None:
    """peft's all-linear reaches transformers 5's fused expert weights through its
    ParamWrapper, which takes no dropout: the error says which setting to change, and
    with it the trainable count is peft's own on a CPU model of the same config."""
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralConfig, MixtralForCausalLM

    from boom_ml.errors import InvalidInputError
    from boom_ml.zoo.finetune import apply_recipe

    (tmp_path / "mixtral.json").write_text(json.dumps(TINY_MIXTRAL))
    spec = ModelSpec(f"hf:{tmp_path / 'mixtral.json'}")
    step = StepSpec(finetune_method="lora", lora_targets=("all-linear",))
    with pytest.raises(InvalidInputError, match="needs finetune.dropout=0$"):
        apply_recipe(build_model(spec).module, step)
    no_dropout = StepSpec(finetune_method="lora", lora_targets=("all-linear",), lora_dropout=0.0)
    with warnings.catch_warnings():  # peft's alpha_pattern warning had reached the user
        warnings.simplefilter("error", RuntimeWarning)
        facts = apply_recipe(build_model(spec).module, no_dropout)
    config = MixtralConfig(**{k: v for k, v in TINY_MIXTRAL.items() if k != "model_type"})
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    peft_model = get_peft_model(MixtralForCausalLM(config), lora)
    assert facts["peft_trainable_parameters"] == peft_model.get_nb_trainable_parameters()[0]
    # the fused experts are adapted as parameters: named beside the modules
    placed = peft_model.peft_config["default"]
    assert facts["lora_target_parameters"] == sorted(placed.target_parameters) != []


def test_a_moe_model_without_lora_targets_is_told_the_whole_fix() -> None:
    """DeepSeek-V2-Lite has no target set of peft's table (no v_proj); the hint names
    all-linear, which on its fused experts needs no dropout: said at once, not on the retry."""
    from boom_ml.errors import InvalidInputError
    from boom_ml.zoo.finetune import apply_recipe

    spec = ModelSpec("hf:deepseek-ai/DeepSeek-V2-Lite", {"num_hidden_layers": 2})
    with pytest.raises(InvalidInputError, match="all-linear also adapts .* finetune.dropout=0$"):
        apply_recipe(build_model(spec).module, StepSpec(finetune_method="lora"))
    dense = StepSpec(finetune_method="lora", lora_dropout=0.0)  # nothing to add then
    with pytest.raises(InvalidInputError, match=r"kv_a_proj_with_mqa.*\)$"):
        apply_recipe(build_model(spec).module, dense)


def test_a_target_peft_cannot_wrap_is_named_with_gpt2s_conv1d_layers() -> None:
    """finetune.targets=[attn] on GPT-2: peft's message prints the whole GPT2Attention over
    many lines, of which the error kept "Target module GPT2Attention(", and the hint listed
    lm_head alone, GPT-2's c_attn, c_proj and c_fc being transformers' Conv1D (a hunt)."""
    from boom_ml.errors import InvalidInputError
    from boom_ml.zoo.finetune import apply_recipe

    for target, cls in (("attn", "GPT2Attention"), ("ln_1", "LayerNorm")):
        step = StepSpec(finetune_method="lora", lora_targets=(target,))
        with pytest.raises(InvalidInputError) as err:
            apply_recipe(build_model(ModelSpec("hf:gpt2", {"n_layer": 1})).module, step)
        assert f"('{target}' is a {cls}, not a layer peft wraps (" in str(err.value)
        assert str(err.value).endswith("this model's linear layers: c_attn, c_fc, c_proj, lm_head)")
        assert "\n" not in str(err.value) and "Currently, only" not in str(err.value)
