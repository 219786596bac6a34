"""``model_options``: what the model is built with, on one GPU and under a layout."""

from __future__ import annotations

import json

import pytest
from test_predict_cli import BASE

import boom_ml
from boom_ml.errors import InvalidInputError
from boom_ml.predict import run


def test_model_options_build_the_model_from_the_command_line():
    """inception_v3 at batch 1 needs its aux head off (BatchNorm of a 1x1 map); the error
    names model_options, and with it the step traces (torchvision's 23,834,568 parameters
    without the aux head); build options with keys of their own are refused in it."""
    options = {**BASE, "model": "torchvision:inception_v3", "batch_size": 1, "image_size": None,
               "advice": False, "max_batch": "off"}  # fmt: skip
    with pytest.raises(InvalidInputError, match=r"model_options=\{aux_logits:false\}"):
        run(options)
    result = json.loads(run({**options, "model_options": {"aux_logits": False}}))
    assert result["graph"]["num_parameters"] == 23_834_568
    with pytest.raises(InvalidInputError, match="set it with attention= instead"):
        run({**options, "model_options": {"attn_implementation": "eager"}})
    with pytest.raises(InvalidInputError, match="model_options must be a mapping"):
        run({**options, "model_options": "aux_logits=false"})


def test_model_options_reach_the_layouts_cut_of_the_model():
    """Under a layout the config fields are the model every fact and every rank's cut starts
    from: gpt2 with n_layer=2 over pp=2 is one layer per stage (it was cut as the 12-layer
    config and each rank then rebuilt with 2 layers)."""
    kw = dict(gpu="h100-sxm", batch_size=2, seq_len=128, parallel={"pp": 2}, advice=False)
    two = boom_ml.predict("hf:gpt2", model_options={"n_layer": 2}, **kw).parallel[0]
    whole = boom_ml.predict("hf:gpt2", **kw).parallel[0]
    assert two["parallel"]["layers_per_stage"] == [1, 1]
    assert whole["parallel"]["layers_per_stage"] == [6, 6]
    assert two["time"]["step_ms"] < whole["time"]["step_ms"]


def test_a_misspelled_config_field_is_refused():
    with pytest.raises(InvalidInputError, match=r"n_layr.*did you mean: n_layer"):
        boom_ml.predict("hf:gpt2", gpu="l4", batch_size=1, seq_len=16, advice=False,
                        model_options={"n_layr": 2})  # fmt: skip


def test_the_command_line_spelling_composes_through_hydra():
    """model_options.K=V is added with "+" (the constructor's keys are not in the config)
    and reaches run() as a mapping."""
    from hydra import compose, initialize_config_dir

    from boom_ml.config_help import CONFIG_DIR
    from boom_ml.predict import rewrite_aliases

    argv = rewrite_aliases(["model_options.aux_logits=false", "model=torchvision:inception_v3"])
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("predict", argv)
    assert dict(cfg.model_options) == {"aux_logits": False}


def test_names_a_model_reads_without_declaring_them_pass():
    """Only a near miss of a known field is refused: head_dim and num_key_value_heads (the
    harness's dry-run options, read by the attention code), num_labels, torch_dtype pass."""
    import json as _json

    from boom_ml.zoo.hf_config import check_fields, config_path

    for model in ("gpt2", "bert-base-uncased", "Qwen/Qwen2.5-0.5B"):
        raw = _json.loads(config_path(model).read_text())
        check_fields(raw, {"num_key_value_heads": 2, "head_dim": 16, "num_labels": 3,
                           "torch_dtype": "float32"})  # fmt: skip
    with pytest.raises(InvalidInputError, match="did you mean: num_hidden_layers"):
        check_fields(raw, {"num_hidden_layer": 2})


def test_a_misspelled_field_is_refused_under_a_layout_too():
    with pytest.raises(InvalidInputError, match=r"n_layr.*did you mean: n_layer"):
        boom_ml.predict("hf:gpt2", gpu="h100-sxm", batch_size=2, seq_len=128, advice=False,
                        parallel={"pp": 2}, model_options={"n_layr": 2})  # fmt: skip


@pytest.mark.parametrize("layers", [1, 5])
def test_a_depth_given_resizes_the_per_layer_lists(tmp_path, layers):
    """A config that lists its layers' kinds (transformers writes Gemma 2's, Qwen2's
    layer_types) takes another depth in the lists' pattern: num_hidden_layers=5 of a 2-layer
    config had failed on transformers' check that the two agree. Synthetic config."""
    from transformers import Gemma2Config

    from boom_ml.zoo.hf_config import load_config

    path = tmp_path / "config.json"
    Gemma2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256).to_json_file(path)  # fmt: skip
    assert json.loads(path.read_text())["layer_types"] == ["sliding_attention", "full_attention"]
    built = load_config(path, {"num_hidden_layers": layers})
    pattern = ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
               "sliding_attention"]  # fmt: skip
    assert built.layer_types == pattern[:layers]
    # lists the overrides set themselves are theirs
    mine = ["full_attention"] * layers
    assert load_config(path, {"num_hidden_layers": layers, "layer_types": mine}).layer_types == mine
