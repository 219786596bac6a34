"""The Hugging Face zoo: shipped configs, heads, inputs, transformers releases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from zoo_helpers import CPU, all_on_meta, fake_step, tiny_config

from boom_ml.errors import InvalidInputError
from boom_ml.hf_shipped import CONFIG_DIR, shipped
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.zoo import build_model

REQUIRED_HF = [
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "bert-base-uncased",
    "bert-large-uncased",
    "facebook/opt-1.3b",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Meta-Llama-3-8B",
    "google/vit-base-patch16-224",
    "t5-base",
    "EleutherAI/gpt-neo-125M",
    "cerebras/Cerebras-GPT-111M",
    "distilbert/distilgpt2",
    "t5-small",
    "facebook/opt-125m",
    # issue #15: the configs people fine-tune today
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.2-3B",
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-1.5B",
    "Qwen/Qwen2.5-3B",
    "Qwen/Qwen2.5-7B",
    "Qwen/Qwen2.5-14B",
    "Qwen/Qwen2.5-32B",
    "Qwen/Qwen2.5-72B",
    "Qwen/Qwen3-0.6B",
    "Qwen/Qwen3-4B",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3-14B",
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen1.5-MoE-A2.7B",
    "mistralai/Mistral-7B-v0.3",
    "mistralai/Mixtral-8x7B-v0.1",
    "google/gemma-2-2b",
    "google/gemma-2-9b",
    "google/gemma-3-1b-pt",
    "microsoft/Phi-3-mini-4k-instruct",
    "microsoft/phi-4",
    "deepseek-ai/DeepSeek-V2-Lite",
    "allenai/OLMo-2-1124-7B",
    "HuggingFaceTB/SmolLM2-135M",
    "HuggingFaceTB/SmolLM2-360M",
    "HuggingFaceTB/SmolLM2-1.7B",
    "tiiuae/falcon-7b",
    "facebook/deit-base-patch16-224",
    "google/flan-t5-base",
]
# Published parameter counts (millions, rounded): the configs are the real architectures.
PUBLISHED_M = {
    "gpt2": 124,
    "bert-base-uncased": 110,
    "meta-llama/Meta-Llama-3-8B": 8030,
    "Qwen/Qwen2.5-0.5B": 494,  # model card: 0.49B
    "Qwen/Qwen1.5-MoE-A2.7B": 14316,  # model card: 14.3B in total
    "facebook/deit-base-patch16-224": 87,  # DeiT paper: 86M
}
# Exact counts of a build from the shipped config; the first two equal the published exact
# totals (Llama-3.1-8B: 8,030,261,248; SmolLM2-135M: 134,515,008).
EXACT_PARAMS = {
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "HuggingFaceTB/SmolLM2-135M": 134_515_008,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "mistralai/Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen/Qwen3-30B-A3B": 30_532_122_624,
    "deepseek-ai/DeepSeek-V2-Lite": 15_706_484_224,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
}
# Shipped mixture-of-experts configs and how many of their layers route tokens.
MOE_LAYERS = {
    "mistralai/Mixtral-8x7B-v0.1": 32,
    "Qwen/Qwen3-30B-A3B": 48,
    "Qwen/Qwen1.5-MoE-A2.7B": 24,
    "deepseek-ai/DeepSeek-V2-Lite": 26,  # first_k_dense_replace = 1
}


def test_hf_gpt2_small_seq() -> None:
    built = build_model("hf:gpt2")
    assert built.source == "hf" and built.family == "transformer" and all_on_meta(built)
    assert built.default_seq_len == 1024
    batch = built.make_inputs(StepSpec(batch_size=3, seq_len=16), CPU)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (3, 16) and batch["input_ids"].dtype == torch.int64
    assert batch["labels"].shape == (3, 16)
    fake_step(built, StepSpec(batch_size=2, seq_len=16), checkpointing=True)


def test_materialize_keeps_tied_weights() -> None:
    built = build_model("hf:gpt2", device="meta")
    n_before = len(list(built.module.parameters()))
    with FakeTensorMode(allow_non_fake_inputs=True):
        m = built.materialize("cpu")
    assert m.lm_head.weight is m.transformer.wte.weight
    assert len(list(m.parameters())) == n_before


def test_materialize_shared_module_and_buffers() -> None:
    """A module reachable under two names (T5's ``shared`` embedding in transformers 4.x)
    gets one new weight, and buffers are materialised too."""
    built = build_model("hf:gpt2", device="meta")
    with torch.device("meta"):
        emb = torch.nn.Embedding(10, 4)
        holder = torch.nn.Module()
        holder.a, holder.b = emb, emb
        holder.register_buffer("scale", torch.ones(3))
    built.module = holder
    with FakeTensorMode(allow_non_fake_inputs=True):
        m = built.materialize("cpu")
    assert m.a.weight is m.b.weight and isinstance(m.a.weight, torch.nn.Parameter)
    assert m.a.weight.device.type == "cpu" and m.a.weight.shape == (10, 4)
    assert m.scale.device.type == "cpu" and not isinstance(m.scale, torch.nn.Parameter)


@pytest.mark.parametrize(
    ("version", "keyword"),
    [("4.50.3", "torch_dtype"), ("4.55.4", "torch_dtype"), ("4.56.0", "dtype"), ("5.2.1", "dtype")],
)
def test_dtype_keyword_follows_transformers_release(
    monkeypatch: pytest.MonkeyPatch, version: str, keyword: str
) -> None:
    import transformers

    from boom_ml.zoo import hf_models

    monkeypatch.setattr(transformers, "__version__", version)
    hf_models._dtype_keyword.cache_clear()
    try:
        assert hf_models._dtype_keyword() == keyword
    finally:
        hf_models._dtype_keyword.cache_clear()


def test_required_configs_are_shipped() -> None:
    assert set(REQUIRED_HF) <= set(shipped())
    for path in CONFIG_DIR.glob("*.json"):
        raw = json.loads(path.read_text())
        assert raw["architectures"] and raw["model_type"]


@pytest.mark.parametrize("model_id", sorted(shipped()))
def test_shipped_config_builds_on_meta(model_id: str) -> None:
    built = build_model(f"hf:{model_id}")
    assert all_on_meta(built)
    arch = json.loads(shipped()[model_id].read_text())["architectures"][0]
    assert type(built.module).__name__ == arch
    assert built.module.config._attn_implementation in ("sdpa", "eager")
    n = sum(p.numel() for p in built.module.parameters())
    if model_id in PUBLISHED_M:
        assert round(n / 1e6) == PUBLISHED_M[model_id]
    if model_id in EXACT_PARAMS:
        assert n == EXACT_PARAMS[model_id]
    assert built.info["moe_layers"] == MOE_LAYERS.get(model_id, 0)
    raw = json.loads(shipped()[model_id].read_text())
    assert raw["_name_or_path"] == model_id  # every shipped config names its source id
    batch = built.make_inputs(StepSpec(batch_size=2, seq_len=8), CPU)
    key = "pixel_values" if built.default_image_size is not None else "input_ids"
    assert batch[key].shape[0] == 2 and "labels" in batch


@pytest.mark.parametrize("model_id", sorted(MOE_LAYERS))
def test_shipped_moe_configs_train_every_expert(model_id: str) -> None:
    """Two layers of each shipped MoE config: forward + backward on fake tensors, every
    expert's weights get a gradient (even routing reaches all of them)."""
    layers = {"num_hidden_layers": 2}
    if model_id.startswith("deepseek"):
        layers["first_k_dense_replace"] = 1  # one dense layer, one MoE layer
    built = build_model(ModelSpec(f"hf:{model_id}", layers))
    fake_step(built, StepSpec(batch_size=2, seq_len=16))


def test_hf_defaults() -> None:
    assert build_model("hf:bert-base-uncased").default_seq_len == 512
    assert build_model("hf:meta-llama/Llama-3.2-1B").default_seq_len == 2048
    assert build_model("hf:facebook/opt-125m").default_seq_len == 2048
    vit = build_model("hf:google/vit-base-patch16-224")
    assert vit.default_image_size == 224 and vit.default_seq_len is None


@pytest.mark.parametrize("model_id", ["hf:t5-small", "hf:bert-base-uncased"])
def test_hf_encoder_and_seq2seq_step(model_id: str) -> None:
    spec = ModelSpec(model_id, {"num_layers": 1} if "t5" in model_id else {"num_hidden_layers": 1})
    fake_step(build_model(spec), StepSpec(batch_size=2, seq_len=8), checkpointing=True)


def test_hf_seq_len_beyond_learned_positions() -> None:
    built = build_model("hf:gpt2")
    with pytest.raises(InvalidInputError, match="1024 learned positions"):
        built.make_inputs(StepSpec(batch_size=1, seq_len=2048), CPU)


def test_roberta_positions_start_after_its_padding_index(tmp_path: Path) -> None:
    """A hunt: RoBERTa's 514 positions traced at 514, where transformers numbers them from
    padding_idx + 1 and a GPU fails past 512; its default length keeps inside them too."""
    cfg = {"model_type": "roberta", "architectures": ["RobertaForMaskedLM"], "hidden_size": 32,
           "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64,
           "vocab_size": 100, "max_position_embeddings": 130, "pad_token_id": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    built = build_model(f"hf:{tmp_path / 'config.json'}")
    assert built.make_inputs(StepSpec(batch_size=1), CPU)["input_ids"].shape == (1, 128)
    with pytest.raises(InvalidInputError, match=r"129 exceeds its 128 learned positions \(numbered"
                       r" from padding_idx \+ 1 = 2\)$"):  # fmt: skip
        built.make_inputs(StepSpec(batch_size=1, seq_len=129), CPU)


def test_a_model_of_text_and_images_together_is_one_line(tmp_path: Path) -> None:
    """A hunt: CLIPModel (vocabulary in text_config) had failed in randint(0, 0)."""
    sub = {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1,
           "intermediate_size": 64}  # fmt: skip
    cfg = {"model_type": "clip", "architectures": ["CLIPModel"],
           "text_config": {**sub, "vocab_size": 100},
           "vision_config": {**sub, "image_size": 32, "patch_size": 8}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidInputError, match="CLIPModel takes text and images together"
                       r" \(input_ids and pixel_values\), which the hf zoo does not make"):  # fmt: skip
        build_model(f"hf:{tmp_path / 'config.json'}")


def test_hf_local_config_and_overrides(tmp_path: Path) -> None:
    cfg = json.loads(shipped()["gpt2"].read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in (str(tmp_path), str(tmp_path / "config.json")):
        built = build_model(ModelSpec(f"hf:{name}", {"n_layer": 2}))
        assert len(built.module.transformer.h) == 2


def test_hf_without_architectures_uses_natural_head(tmp_path: Path) -> None:
    path = tmp_path / "bert.json"
    path.write_text(json.dumps({"model_type": "bert", "num_hidden_layers": 1}))
    assert type(build_model(f"hf:{path}").module).__name__ == "BertForMaskedLM"


def test_hf_architectures_null_uses_natural_head(tmp_path: Path) -> None:
    """``"architectures": [null]`` (a config written by a script) crashed with a traceback
    (getattr: attribute name must be string); it now means no architecture."""
    path = tmp_path / "bert.json"
    path.write_text(
        json.dumps({"model_type": "bert", "num_hidden_layers": 1, "architectures": [None]})
    )
    assert type(build_model(f"hf:{path}").module).__name__ == "BertForMaskedLM"


def test_malformed_hf_config(tmp_path: Path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidInputError, match="broken.json"):
        build_model(f"hf:{bad}")
    untyped = tmp_path / "untyped.json"
    untyped.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(InvalidInputError, match="model_type"):
        build_model(f"hf:{untyped}")


# ---- names ---------------------------------------------------------------------------------


# ---- architectures beyond the shipped configs (tiny configs, built offline) ----------------


def test_bad_config_values_and_unbuildable_configs_are_one_line_errors(tmp_path: Path) -> None:
    """transformers 5 validates configs through huggingface_hub's strict dataclasses, whose
    errors are no ValueError, and some configs build into a KeyError or ZeroDivisionError:
    each is one InvalidInputError, not a traceback."""
    path = tmp_path / "config.json"
    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}  # fmt: skip
    path.write_text(json.dumps(raw))
    for options, words in (
        ({"hidden_size": 66}, "not a multiple of the number of attention heads"),
        ({"num_hidden_layers": "two"}, "expected int, got str"),
        # a zero width or head count: one line naming it (it had been transformers'
        # "division or modulo by zero", or empty tensors and "0 parameters": a hunt)
        ({"num_attention_heads": 0}, "num_attention_heads=0 builds empty layers"),
        ({"intermediate_size": 0}, "intermediate_size=0 builds empty layers"),
        ({"vocab_size": 0}, "vocab_size=0 builds empty layers"),
        (
            {"num_key_value_heads": 3},
            r"num_attention_heads \(4\) must be a multiple of"
            r" num_key_value_heads \(3\)",
        ),
        ({"num_hidden_layers": -1}, "num_hidden_layers=-1: a count or size cannot be negative"),
        # zero layers had built the embedding and head alone, without a word (a hunt)
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 leaves the model without layers"),
    ):
        with pytest.raises(InvalidInputError, match=words):
            build_model(ModelSpec(f"hf:{path}", options=options))
    with pytest.raises(InvalidInputError, match="torchvision:resnet50: cannot build: RuntimeError"):
        build_model(ModelSpec("torchvision:resnet50", options={"width_per_group": -64}))
    with pytest.raises(InvalidInputError, match="num_classes=-5: a torchvision classifier needs"):
        build_model(ModelSpec("torchvision:resnet18", options={"num_classes": -5}))


@pytest.mark.parametrize(
    ("quant", "said"),
    [({"quant_method": "gptq", "bits": 4, "group_size": 128}, "(gptq, 4-bit)"),
     ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "(bitsandbytes, 4-bit)"),
     ({"quant_method": "fp8"}, "(fp8)")],
)  # fmt: skip
def test_a_quantized_checkpoints_config_is_built_as_its_float_model_with_a_note(
    tmp_path: Path, quant: dict, said: str
) -> None:
    """A GPTQ / bitsandbytes / FP8 repository's config had been traced in fp32 without a word
    (a hunt): the note says its quantization is not modelled."""
    path = tmp_path / "config.json"
    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
           "vocab_size": 256, "quantization_config": quant}  # fmt: skip
    path.write_text(json.dumps(raw))
    (note,) = build_model(f"hf:{path}").info["notes"]
    assert note.startswith(f"the config's quantization_config {said} is not modelled")
    del raw["quantization_config"]
    path.write_text(json.dumps(raw))
    assert build_model(f"hf:{path}").info["notes"] == []


def test_t5_without_is_encoder_decoder_takes_its_class_default(tmp_path: Path) -> None:
    """A hand-written T5 config without ``is_encoder_decoder`` (T5Config defaults it to True)
    gets the decoder start token every T5 uses, and traces."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
                                "d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4,
                                "num_layers": 2, "num_decoder_layers": 1, "vocab_size": 100}))  # fmt: skip
    built = build_model(f"hf:{path}")
    assert built.module.config.decoder_start_token_id == 0  # the pad token, as T5's configs say
    fake_step(built, StepSpec(batch_size=2, seq_len=16))


def test_notes_name_an_unknown_architecture_and_a_scan_traced_without_its_kernels(
    tmp_path: Path,
) -> None:
    """An ``architectures`` name transformers lacks is traced with the model_type's natural
    head, and a Mamba scan as transformers' loop over tokens: the build notes both."""
    weird = tmp_path / "weird.json"
    weird.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForSomethingWeird"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}))  # fmt: skip
    built = build_model(f"hf:{weird}")
    assert built.info["notes"] == [
        "transformers has no class 'LlamaForSomethingWeird' (the config's architectures); "
        "traced as LlamaForCausalLM, the natural head of model_type 'llama'"
    ]
    mamba = tiny_config(tmp_path, "mamba", "MambaForCausalLM", hidden_size=32,
                         num_hidden_layers=1, vocab_size=64, state_size=4)  # fmt: skip
    (note,) = build_model(mamba).info["notes"]
    assert note.startswith("mamba's scan traced as transformers' PyTorch loop over tokens")
    assert "mamba-ssm, causal-conv1d" in note
    plain = tiny_config(tmp_path, "llama", "LlamaForCausalLM", hidden_size=32,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         vocab_size=64)  # fmt: skip
    assert build_model(plain).info["notes"] == []


def test_a_build_oom_on_a_gpu_stays_an_oom(monkeypatch) -> None:
    """A measurement builds on the GPU, and an out-of-memory error there must reach the step
    runner as one (it records an ``oom`` row), not as a one-line input error."""
    from boom_ml.zoo import common, hf_models

    def oom(*args: object, **kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (synthetic, in a test)")

    monkeypatch.setattr(hf_models, "build_on_device", oom)
    monkeypatch.setattr(common, "build_on_device", oom)  # torchvision's and timm's builds
    for name in ("hf:gpt2", "torchvision:resnet18", "timm:resnet18"):
        with pytest.raises(torch.cuda.OutOfMemoryError):
            build_model(name)


def test_a_shipped_id_without_its_org_is_that_config() -> None:
    """A hunt: model=Qwen2.5-0.5B was refused ("did you mean hf:Qwen/Qwen2.5-0.5B") though
    --help says a bare name works where one shipped config has it; a name that several orgs
    would share stays unknown, and an org-less shipped id (gpt2) is itself."""
    from boom_ml.hf_shipped import lookup
    from boom_ml.zoo import resolve_name

    assert lookup("Qwen2.5-0.5B") == lookup("qwen2.5-0.5b") == "Qwen/Qwen2.5-0.5B"
    assert lookup("gpt2") == "gpt2" and lookup("Llama-3.2") is None
    assert resolve_name("Qwen2.5-0.5B") == "hf:Qwen2.5-0.5B"
    assert build_model("Qwen2.5-0.5B").info["config_path"] == str(shipped()["Qwen/Qwen2.5-0.5B"])


def test_a_model_without_attention_records_no_implementation(tmp_path: Path) -> None:
    """A hunt: HF's ConvNeXt came out with attn=eager in the table's header."""
    cfg = {"model_type": "convnext", "architectures": ["ConvNextForImageClassification"],
           "hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1], "image_size": 32}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert build_model(f"hf:{tmp_path / 'config.json'}").info["attn_implementation"] is None
    assert build_model("hf:gpt2").info["attn_implementation"] == "sdpa"
