"""The Hugging Face zoo: shipped configs, heads, inputs, transformers releases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from zoo_helpers import CPU, all_on_meta, fake_step

from boom_ml.errors import InvalidInputError
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.zoo import build_model
from boom_ml.zoo.hf_models import CONFIG_DIR, shipped

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
]
# Published parameter counts (millions, rounded): the configs are the real architectures.
PUBLISHED_M = {"gpt2": 124, "bert-base-uncased": 110, "meta-llama/Meta-Llama-3-8B": 8030}


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
    if model_id in PUBLISHED_M:
        n = sum(p.numel() for p in built.module.parameters())
        assert round(n / 1e6) == PUBLISHED_M[model_id]
    batch = built.make_inputs(StepSpec(batch_size=2, seq_len=8), CPU)
    key = "pixel_values" if "vit" in model_id else "input_ids"
    assert batch[key].shape[0] == 2 and "labels" in batch


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
