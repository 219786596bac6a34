"""Parameter dtypes as transformers loads them: layers an HF model keeps in fp32 under a
16-bit ``params_dtype``, and an output head that QLoRA leaves unquantised when LoRA wraps it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from boom_ml.report.table import recipe_line
from boom_ml.specs import StepSpec
from tests.test_finetune import TINY_LLAMA, TINY_OTHERS, adopted_bytes, trace

# TINY_OTHERS["t5"]: d_model 32, d_ff 64, one encoder and one decoder block, each with a
# DenseReluDense.wo of 32 x 64: what T5's _keep_in_fp32_modules ("wo") keeps in fp32
WO = 2 * 32 * 64


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("synthetic_tiny_t5") / "config.json"
    path.write_text(json.dumps(TINY_OTHERS["t5"]))
    return f"hf:{path}"


def test_t5_in_fp16_keeps_wo_in_fp32(tiny_t5: str) -> None:
    graph = trace(tiny_t5, params_dtype="fp16", amp="none")
    n = graph.meta["num_trainable_parameters"]
    assert graph.meta["recipe"]["fp32_parameters"] == WO
    weights = 2 * (n - WO) + 4 * WO  # from_pretrained(dtype=torch.float16)'s dtypes
    assert adopted_bytes(graph, "parameter") == weights
    assert adopted_bytes(graph, "gradient") == weights
    assert adopted_bytes(graph, "optimizer_state") == 2 * weights  # AdamW's two states
    assert "0.0 M parameters kept in fp32 as transformers loads" in recipe_line(
        graph.meta["recipe"]
    )


def test_t5_in_bf16_casts_wo_too(tiny_t5: str) -> None:
    # _keep_in_fp32_modules applies to fp16 loading only (its _strict list to bf16 as well)
    graph = trace(tiny_t5, params_dtype="bf16", amp="none")
    n = graph.meta["num_trainable_parameters"]
    assert "fp32_parameters" not in graph.meta["recipe"]
    assert adopted_bytes(graph, "parameter") == 2 * n


def test_t5_qlora_in_fp16_keeps_wo_unquantised_in_fp32(tiny_t5: str) -> None:
    graph = trace(tiny_t5, finetune_method="qlora", params_dtype="fp16", lora_targets=("q", "v"))
    assert graph.meta["recipe"]["fp32_parameters"] == WO
    assert graph.meta["recipe"]["nf4_layers"] == 5 + 9  # all but the two wo


def test_qlora_on_the_head_leaves_it_unquantised(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))  # synthetic, untied head of 1000 x 64
    plain = trace(f"hf:{path}", finetune_method="qlora", params_dtype="bf16")
    head = trace(f"hf:{path}", finetune_method="qlora", params_dtype="bf16",
                 lora_targets=("q_proj", "v_proj", "lm_head"))  # fmt: skip
    # the same 14 block layers quantised; the head stays bf16 under its adapter
    assert head.meta["recipe"]["nf4_layers"] == plain.meta["recipe"]["nf4_layers"] == 14
    base = plain.meta["recipe"]["bytes"]["base_weights_4bit"]
    assert head.meta["recipe"]["bytes"]["base_weights_4bit"] == base
    adapter = 8 * (64 + 1000)  # r = 8: lora_A 8 x 64, lora_B 1000 x 8, fp32 (peft's default)
    assert adopted_bytes(head, "parameter") == adopted_bytes(plain, "parameter") + 4 * adapter
    # parameters counted once: the model's, as peft counts them
    assert head.meta["num_parameters"] == head.meta["recipe"]["peft_all_parameters"]
    assert head.meta["num_parameters"] == plain.meta["num_parameters"] + adapter


def test_a_lora_target_naming_no_module_is_refused(tmp_path: Path) -> None:
    from boom_ml.errors import InvalidInputError

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    # peft placed q_proj alone and dropped vv_proj without a word
    with pytest.raises(InvalidInputError) as err:
        trace(f"hf:{path}", finetune_method="lora", lora_targets=("q_proj", "vv_proj"))
    assert str(err.value).startswith(
        "finetune.targets: 'vv_proj' names no module of this model as built here (2 layers: a"
        " multi-GPU layout builds its ranks so, without the modules of deeper layers) (did you"
        " mean: v_proj"
    )
    # a dotted suffix and a layer by its index pass, as peft matches them
    graph = trace(f"hf:{path}", finetune_method="lora",
                  lora_targets=("self_attn.q_proj", "layers.1.mlp.down_proj"))  # fmt: skip
    assert graph.meta["recipe"]["peft_trainable_parameters"] == 2 * 8 * (64 + 64) + 8 * (128 + 64)


@pytest.mark.parametrize("adapter_dtype", ["fp32", "params"])
def test_adapters_take_peft_s_dtype(tiny_t5: str, adapter_dtype: str) -> None:
    """peft's get_peft_model makes adapters fp32 by default (autocast_adapter_dtype=True);
    with autocast_adapter_dtype=False (adapter_dtype=params) in the base layer's dtype: fp32
    beside T5's kept wo, fp16 beside q. The base layers keep the dtypes decided on the
    model's own names either way."""
    from boom_ml.specs import ModelSpec, StepSpec
    from boom_ml.zoo import build_model
    from boom_ml.zoo.finetune import apply_recipe

    module = build_model(ModelSpec(tiny_t5, {})).module
    apply_recipe(module, StepSpec(finetune_method="lora", params_dtype="fp16",
                                  lora_targets=("q", "wo"), adapter_dtype=adapter_dtype))  # fmt: skip
    dtypes = {
        n: p.dtype for n, p in module.named_parameters() if ".lora_" in n or "base_layer" in n
    }
    in_base = adapter_dtype == "params"
    assert dtypes and all(
        d == (torch.float32 if ".wo." in n or (".lora_" in n and not in_base) else torch.float16)
        for n, d in dtypes.items()
    )


def test_qlora_keeps_the_module_of_the_last_weight_as_transformers_does() -> None:
    """transformers' get_keys_to_not_convert keeps the owner of the model's last parameter
    unquantised where that is a ``.weight`` (a bias-free head; ViT's classifier, whose last
    parameter is its bias, is quantised); the recipe had kept only the output embeddings."""
    from boom_ml.zoo.finetune import apply_recipe

    step = StepSpec(finetune_method="qlora", lora_targets=("0",), params_dtype="bf16")
    layers = {}
    for bias in (True, False):
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 8, bias=bias))  # fmt: skip
        layers[bias] = apply_recipe(model, step)["nf4_layers"]
    assert layers == {True: 3, False: 2}  # the LoRA target's base layer is quantised either way


@pytest.mark.parametrize(("adapter_dtype", "gemm"), [("fp32", "float32"), ("params", "bfloat16")])
def test_adapter_matmuls_run_in_the_adapters_dtype(tmp_path: Path, adapter_dtype, gemm) -> None:
    """peft casts an adapter's input to the adapter's dtype: fp32 adapters on a bf16 model
    multiply in fp32 (peft's default), bf16 ones in bf16."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    graph = trace(f"hf:{path}", params_dtype="bf16", finetune_method="lora",
                  adapter_dtype=adapter_dtype)  # fmt: skip
    nodes = graph.nodes
    adapters = nodes[nodes.module.astype(str).str.contains("lora_") & nodes.family.eq("gemm")]
    assert len(adapters) and set(adapters.input_dtypes) == {f'["{gemm}", "{gemm}"]'}


def test_fp16_autocast_over_fp16_weights_takes_fp32_adapters() -> None:
    """GradScaler unscales the trainable gradients: LoRA's fp32 adapters (peft's default) are
    all that trains on fp16 weights, so amp=fp16 params_dtype=fp16 runs (the usual T4 QLoRA
    recipe); fp16 adapters or full training are refused."""
    from boom_ml.errors import InvalidInputError

    StepSpec(amp="fp16", params_dtype="fp16", finetune_method="qlora")
    for refused in ({"finetune_method": "lora", "adapter_dtype": "params"}, {}):
        with pytest.raises(InvalidInputError, match="GradScaler cannot unscale fp16 gradients"):
            StepSpec(amp="fp16", params_dtype="fp16", **refused)


def test_the_cli_checks_the_step_with_its_finetune_keys() -> None:
    """The CLI's check before torch is imported reads the finetune.* keys too: it had refused
    the T4 QLoRA recipe (amp=fp16 params_dtype=fp16) as if it trained every weight."""
    from boom_ml.errors import InvalidInputError
    from boom_ml.predict import validate

    options = {"model": "hf:gpt2", "gpu": "t4", "amp": "fp16", "params_dtype": "fp16",
               "finetune": {"method": "qlora"}}  # fmt: skip
    assert validate(options)["finetune"] == {"method": "qlora"}
    with pytest.raises(InvalidInputError, match=r"\(or finetune.adapter_dtype=fp32, peft's"):
        validate({**options, "finetune": {"method": "qlora", "adapter_dtype": "params"}})
