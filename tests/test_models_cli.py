"""``python -m boom_ml.models``: the zoo listing, fast (no torch), with exact parameter counts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from boom_ml.models import config_params, main, shipped_rows

SHIPPED_IDS = [row["id"] for row in shipped_rows()]
WITH_FORMULA = [row["id"] for row in shipped_rows() if row["params"] is not None]


def test_listing_shipped_configs_imports_no_torch() -> None:
    code = (
        "import runpy, sys\n"
        "sys.argv = ['boom_ml.models']\n"
        "try:\n"
        "    runpy.run_module('boom_ml.models', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'listing imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for model_id in SHIPPED_IDS:
        assert model_id in out
    assert "hf:meta-llama/Llama-3.1-8B" in out and "8.03B" in out
    assert "MixtralForCausalLM (MoE)" in out
    assert "torchvision:<name>" in out and "timm:<name>" in out and "file:<path.py>" in out


def test_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert len(rows) == len(SHIPPED_IDS) >= 46
    llama = rows["hf:meta-llama/Llama-3.1-8B"]
    assert llama["params"] == 8_030_261_248 and llama["architecture"] == "LlamaForCausalLM"
    assert llama["source"].startswith("https://huggingface.co/meta-llama/Llama-3.1-8B")
    assert rows["hf:Qwen/Qwen3-30B-A3B"]["moe"] and not rows["hf:gpt2"]["moe"]
    assert rows["hf:gpt2"]["params"] == 124_439_808  # GPT-2 small, as published
    assert rows["hf:tiiuae/falcon-7b"]["params"] == 6_921_720_704  # "7B"
    assert rows["hf:deepseek-ai/DeepSeek-V2-Lite"]["params"] == 15_706_484_224  # "15.7B"


def test_other_schemes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scheme", "torchvision"]) == 0
    names = capsys.readouterr().out.split()
    assert "torchvision:resnet50" in names and all(n.startswith("torchvision:") for n in names)
    assert main(["--scheme", "file"]) == 0
    assert "nothing to list" in capsys.readouterr().out
    assert main(["--scheme", "file", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_formula_counts_a_tiny_config_exactly() -> None:
    raw = {
        "model_type": "qwen2_moe",
        "hidden_size": 8,
        "vocab_size": 10,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 16,
        "num_experts": 3,
        "moe_intermediate_size": 4,
        "shared_expert_intermediate_size": 6,
        "decoder_sparse_step": 2,  # layer 1 sparse, layer 0 dense
    }
    # head_dim 4: q 8*8, k,v 2*8*4, o 8*8, biases 8+2*4; two norms 2*8
    attn = 64 + 64 + 64 + 16 + 16
    dense = 3 * 8 * 16
    sparse = 3 * 8 + 3 * 3 * 8 * 4 + 3 * 8 * 6 + 8
    assert config_params(raw) == 2 * 10 * 8 + 8 + 2 * attn + dense + sparse
    assert config_params({"model_type": "mamba"}) is None  # no formula: left blank


@pytest.mark.parametrize("model_id", WITH_FORMULA)
def test_formula_equals_meta_build(model_id: str) -> None:
    from boom_ml.zoo import build_model

    built = build_model(model_id)
    row = next(r for r in shipped_rows() if r["id"] == model_id)
    assert sum(p.numel() for p in built.module.parameters()) == row["params"]


@pytest.mark.parametrize("norms", [1, None])
def test_falcon_new_layout_counts_its_parallel_norms(tmp_path, norms) -> None:
    """Falcon's new decoder layout has two LayerNorms per block unless
    num_ln_in_parallel_attn says one (Falcon-11B): the formula equals a meta build."""
    from boom_ml.zoo import build_model

    raw = {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4,
           "num_kv_heads": 2, "new_decoder_architecture": True, "parallel_attn": True,
           "num_ln_in_parallel_attn": norms, "num_hidden_layers": 2, "vocab_size": 100}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    built = build_model(f"hf:{tmp_path / 'config.json'}")
    assert config_params(raw) == sum(p.numel() for p in built.module.parameters())
