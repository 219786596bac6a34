"""`python -m boom_ml.predict`: every input is checked before torch is imported.

The imports are read from ``python -X importtime`` (one stderr line per module imported):
behaviour, not time.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from boom_ml.errors import InvalidInputError, UnknownGpuError, UnknownModelError
from boom_ml.predict import (
    check_model_syntax,
    check_override_keys,
    config_keys,
    rewrite_aliases,
    validate,
)
from boom_ml.specs import search_max_batch

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "lightgbm", "torch_geometric", "mlflow", "timm", "torchvision")


def run_with_importtime(*args: str) -> tuple[subprocess.CompletedProcess, set[str], list[str]]:
    """(process, top-level packages imported, stderr lines that are not importtime's)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    imported, other = set(), []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[1].strip()
            imported.add(name.split(".")[0])
        elif line.strip():
            other.append(line)
    return proc, imported, other


@pytest.mark.parametrize(
    "arg,words",
    [
        ("gpu=h100-sxn", "error: unknown GPU 'h100-sxn' (did you mean: h100-sxm"),
        # a bare comma list is the list (Hydra alone stops with "Ambiguous value")
        ("gpu=t4,h100-sxn", "error: unknown GPU 'h100-sxn' (did you mean: h100-sxm"),
        ("batch_size=-1", "error: batch_size must be an integer >= 1, got -1"),
        ("amp=fp8", "error: unknown amp 'fp8'; choose one of: none, fp16, bf16"),
        ("model=torchvison:resnet50", "error: unknown model scheme 'torchvison'"),
        (
            "gpu=/nonexistent/my_gpu.yaml",
            "error: GPU spec file not found: /nonexistent/my_gpu.yaml",
        ),
        ("gpus=l4", "error: unknown option 'gpus' (did you mean: gpu?)"),
        ("cache=sometimes", "error: cache must be on or off, got 'sometimes'"),
        ("max_batch=maybe", "error: max_batch must be auto, on or off, got 'maybe'"),
        (
            "batch_size=1e3",
            "error: batch_size must be an integer >= 1, got 1000.0 (a float: write 1000)",
        ),
        ("plot=/dev/null/plots", "error: cannot create plot directory '/dev/null/plots'"),
        ("plot=", "error: plot= needs a directory (plot=figures, plot=. for this one)"),
        ("stack.torch=1.2", "error: unknown stack.torch '1.2'; known releases: 1.12,"),
        ("optimizer.impl=fusd", "error: unknown optimizer.impl 'fusd'; choose one of: auto,"),
        # Hydra's grammar: its parser's lines, a pointer to its docs and exit 1 before
        ("gpu=[l4", "error: 'gpu=[l4' does not parse (no viable alternative at input '[l4')"),
        ("model=timm:vit=x", "error: 'model=timm:vit=x' does not parse (mismatched input '='"),
        # a shipped config's heads, read without transformers (it had traced first)
        (
            "model=hf:meta-llama/Meta-Llama-3-8B parallel.tp=16",
            "error: parallel.tp=16 does not divide the model's 8 key/value heads",
        ),
        ("model=gpt2 parallel.pp=13", "error: parallel.pp=13 exceeds the model's 12 layers"),
    ],
)
def test_bad_input_exits_2_with_one_line_before_torch(arg, words):
    proc, imported, lines = run_with_importtime("-m", "boom_ml.predict", *arg.split())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(words), lines
    assert proc.stdout == ""
    assert "hydra" in imported or arg.startswith("gpus=")  # the check ran, not a crash earlier
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))


def test_malformed_gpu_yaml_exits_2_with_one_line(tmp_path):
    path = tmp_path / "my_gpu.yaml"
    path.write_text("name: X\narchitecture: [hopper\nsm_count: 3\n")
    proc, _, lines = run_with_importtime("-m", "boom_ml.predict", f"gpu={path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines == [
        f"error: {path}: not valid YAML (line 3, column 9: expected ',' or ']', but got ':')"
    ]


def test_help_and_gpu_table_do_not_import_torch():
    proc, imported, _ = run_with_importtime("-m", "boom_ml.predict", "--help")
    assert proc.returncode == 0 and "cache=on|off" in proc.stdout
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))
    proc, imported, _ = run_with_importtime("-m", "boom_ml.gpus", "h100-sxm")
    assert proc.returncode == 0 and "H100" in proc.stdout
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))


def test_session_is_exported_without_importing_torch_at_import_boom_ml():
    proc, imported, _ = run_with_importtime("-c", "import boom_ml")
    assert proc.returncode == 0 and imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))
    check = "import boom_ml, boom_ml.session; print(boom_ml.Session is boom_ml.session.Session)"
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          cwd=REPO, timeout=120)  # fmt: skip
    assert proc.stdout == "True\n", proc.stderr[-2000:]


def test_config_keys_are_read_from_the_yaml_with_nested_keys(tmp_path, monkeypatch):
    (tmp_path / "nested.yaml").write_text(
        "defaults: [_self_]\nmodel: x\nstack:\n  torch: null\n  cuda: '12.4'\nhydra:\n  run: {}\n"
    )
    monkeypatch.setattr("boom_ml.predict.CONFIG_DIR", str(tmp_path))
    assert config_keys("nested") == {"model", "stack", "stack.torch", "stack.cuda"}
    check_override_keys(["stack.torch=2.5.1", "stack={torch: 2.5.1}", "hydra.run.dir=."], "nested")
    with pytest.raises(InvalidInputError, match=r"unknown option 'stack\.torh' \(did you mean"):
        check_override_keys(["stack.torh=2.5.1"], "nested")
    with pytest.raises(InvalidInputError, match="unknown option 'model.name'"):
        check_override_keys(["+model.name=3"], "nested")


def test_a_key_given_twice_is_refused_unless_sweeping():
    """Two spellings of one key (optimizer.impl= and optimizer_impl=): Hydra kept the last
    silently."""
    argv = rewrite_aliases(["optimizer_impl=fused", "optimizer.impl=loop"])
    with pytest.raises(
        InvalidInputError, match=r"optimizer_impl is given twice \('fused' and 'loop'\)"
    ):
        check_override_keys(argv)
    check_override_keys(["-m", "batch_size=8", "batch_size=16"])  # a sweep may repeat keys


def test_the_shell_split_braces_are_said():
    # bash turns model_options={n_layer:2,n_head:4} into two words, one per k:v
    argv = ["model_options=n_layer:2", "model_options=n_head:4"]
    with pytest.raises(InvalidInputError) as err:
        check_override_keys(argv)
    assert str(err.value) == (
        "model_options is given twice ('n_layer:2' and 'n_head:4'); give it once (the shell "
        "split model_options={...} at its commas: quote it, 'model_options={n_layer:2,n_head:4}')"
    )
    # a key that takes no mapping was not split by the shell: two models are two values
    with pytest.raises(InvalidInputError) as err:
        check_override_keys(["model=hf:gpt2", "model=hf:gpt2-medium"])
    assert str(err.value) == "model is given twice ('hf:gpt2' and 'hf:gpt2-medium'); give it once"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gpu=[l4,", "t4]"], "'gpu=[l4,' and 't4]' are one value split at a space: quote it "
                              "(\"gpu=[l4, t4]\") or leave the space out"),
        (["gpu=nvidia", "l4"], "'l4' is not key=value: give every option as key=value"),
        (["model=x", "gpu"], "'gpu' is not key=value: give it as gpu=..."),
        (["--gpu", "l4"], "unknown flag '--gpu': give it as gpu=..."),
        (["--gpux=l4"], "unknown flag '--gpux=l4': options are key=value (did you mean: gpu?)"),
        (["model_options={drop_rate:", "0.1}"], "'model_options={drop_rate:' and '0.1}' are one "
         "value split at a space: quote it (\"model_options={drop_rate: 0.1}\") or leave the "
         "space out"),
        (["gpu=l4", "--cfg", "job", "batch_size=2"], "'batch_size=2' comes after a flag that "
         "follows other key=value options: give the key=value options together, before or "
         "after the flags"),
    ],
)  # fmt: skip
def test_words_that_are_not_key_value_are_one_line(argv, message):
    with pytest.raises(InvalidInputError) as err:
        check_override_keys(argv)
    assert str(err.value) == message


def test_hydras_own_flags_and_their_values_pass():
    """As Hydra's own parser reads them: values, attached short values, abbreviations,
    a key's deletion, and shell completion's words."""
    check_override_keys(["--cfg", "job", "gpu=l4", "--config-name=predict", "-m", "--info"])
    check_override_keys(["-h"])
    check_override_keys(["--resolve", "-c", "all", "batch_size=2"])
    check_override_keys(["--info", "config"])
    check_override_keys(["-cjob", "gpu=l4", "~plot"])
    check_override_keys(["--multi", "batch_size=8", "batch_size=16"])  # a sweep may repeat
    check_override_keys(["-sc", "install=bash"])


def test_predict_yaml_keys_include_cache():
    assert {"model", "gpu", "batch_size", "cache", "plot"} <= config_keys("predict")


def test_a_bare_comma_list_is_the_list_unless_sweeping():
    argv = ["gpu=l4,t4", "finetune.targets=q_proj,v_proj", "gpu=[a,b]", "gpu='a,b'", "gpu=all"]
    assert rewrite_aliases(argv) == [
        "gpu=[l4,t4]",
        "finetune.targets=[q_proj,v_proj]",
        "gpu=[a,b]",
        "gpu='a,b'",
        "gpu=all",
    ]
    assert rewrite_aliases(["--multirun", "gpu=l4,t4"]) == ["--multirun", "gpu=l4,t4"]


@pytest.mark.parametrize(
    ("argv", "rewritten"),
    [
        (["optimizer.impl=fused", "+optimizer.impl=foreach", "optimizer=adamw", "--help"],
         ["optimizer_impl=fused", "+optimizer_impl=foreach", "optimizer=adamw", "--help"]),
        # YAML reads stack.torch=2.10 as the number 2.1, another release: quoted, it is 2.10
        (["stack.torch=2.10", "stack.cuda=12.8", "stack.cudnn='9.1.0.70'", "stack.torch=null"],
         ["stack.torch='2.10'", "stack.cuda='12.8'", "stack.cudnn='9.1.0.70'", "stack.torch=null"]),
        # the constructor's keys are not in the config: Hydra adds them with "+"
        (["model_options.aux_logits=false", "+model_options.x=1", "model_options={a: 1}"],
         ["+model_options.aux_logits=false", "+model_options.x=1", "model_options={a: 1}"]),
    ],
    ids=["optimizer.impl alias", "release numbers stay text", "model_options keys added"],
)  # fmt: skip
def test_aliases_and_release_numbers_are_rewritten(argv, rewritten):
    assert rewrite_aliases(argv) == rewritten


@pytest.mark.parametrize(
    "text,words",
    [
        ("", "empty model name"),
        ("torchvision:", "names no model after the scheme"),
        ("timn:resnet50", "unknown model scheme 'timn'.*did you mean: timm"),
        ("file:model.py", "names no factory"),
        ("file:/no/such/dir/model.py:make", "no such file '/no/such/dir/model.py'"),
        ("my_model.py:make", "a model factory in a file is named file:my_model.py:make"),
    ],
)
def test_model_syntax_errors(text, words):
    with pytest.raises(UnknownModelError, match=words):
        check_model_syntax(text)


@pytest.mark.parametrize(
    "text",
    ["resnet50", "torchvision:resnet50", "hf:meta-llama/Meta-Llama-3-8B", "meta-llama/x:main"],
)
def test_model_syntax_accepts_names_without_looking_them_up(text):
    check_model_syntax(text)  # "torchvision:resnet5O" would pass too: names resolve later


def test_validate_normalises_cache_and_checks_values():
    base = {"model": "torchvision:resnet50", "gpu": ["l4"], "batch_size": 2}
    assert validate({**base, "cache": "off"})["cache"] is False
    assert validate({**base, "cache": True})["cache"] is True
    assert [validate({**base, "max_batch": v})["max_batch"] for v in ("on", True, "false")] == [
        "on",
        "on",
        "off",
    ]
    # auto searches the largest batch for up to 8 GPUs; gpu=all (44) would spend ~13 s on it
    assert [search_max_batch("auto", n) for n in (1, 8, 9)] == [True, True, False]
    assert search_max_batch("on", 44) and not search_max_batch(False, 1)
    # on / off / yes / no are a switch's words: advice=off had been refused beside max_batch=off
    said = validate(
        {**base, "advice": "off", "explain": "yes", "finetune": {"double_quant": "yes"},
         "parallel": {"bucket_view": "off"}, "stack": {"cudnn_benchmark": "ON", "torch": "2.4"}}
    )  # fmt: skip
    assert (said["advice"], said["explain"], said["finetune"], said["parallel"]) == (
        False,
        True,
        {"double_quant": True},
        {"bucket_view": False},
    )
    assert said["stack"] == {"cudnn_benchmark": True, "torch": "2.4"}
    assert validate({**base, "tf32": 1})["tf32"] is True  # Hydra reads tf32=1 as a number
    assert validate({**base, "max_batch": 0, "cache": "no"})["max_batch"] == "off"
    with pytest.raises(InvalidInputError, match="tf32 must be true or false, got 2"):
        validate({**base, "tf32": 2})
    with pytest.raises(InvalidInputError, match="tf32 must be true or false, got 'y'"):
        validate({**base, "tf32": "y"})
    with pytest.raises(InvalidInputError, match="image_size must be an integer >= 1"):
        validate({**base, "image_size": "big"})
    # before torch: a choice no model takes (was "applies to hf: models only" after 5 s)
    with pytest.raises(InvalidInputError, match="unknown attention 'flash'; choose one of: sdpa"):
        validate({**base, "attention": "flash"})
    with pytest.raises(UnknownGpuError, match="unknown GPU 'h100-sxn'"):
        validate({**base, "gpu": ["l4", "h100-sxn"]})


def test_numbers_must_be_finite_and_releases_strings() -> None:
    """finetune.alpha=nan ran with a null alpha and dropout=nan turned LoRA's dropout off; a
    Python float release (2.10 is 2.1) named another release without a word."""
    import math

    from boom_ml.specs import check_number
    from boom_ml.stack import resolve_stack

    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(InvalidInputError, match="must be a number"):
            check_number("finetune.alpha", value, 0.0, None)
    check_number("finetune.alpha", 16.0, 0.0, None)
    with pytest.raises(InvalidInputError, match=r"stack.torch must be a string such as '2.10'"):
        resolve_stack({"torch": 2.1})


def test_cost_column_tells_cheap_gpus_apart() -> None:
    """Cents alone printed 0.03 for an H100, an A100 and an L4 ($0.0289, 0.0260, 0.0256)."""
    from boom_ml.estimates import usd_text

    got = [usd_text(x) for x in (0.0289, 0.026, 0.02561, 0.685, 1.294, 12.34, 99.96, 1234.5,
                                 1.4e-5, 0.0)]  # fmt: skip
    assert got == ["0.0289", "0.0260", "0.0256", "0.685", "1.29", "12.3", "100", "1234",
                   "0.0000140", "0"]  # fmt: skip


def test_samples_per_second_keep_three_figures_below_ten():
    """A QLoRA step of 86 s on a T4 printed 0.0 samples/s (a helper's hunt)."""
    from boom_ml.estimates import rate_text

    got = [rate_text(x) for x in (0.046312, 5.234, 9.96, 10.0, 1284.64, 6.998, 0.83, 0.0)]
    # trailing zeros kept: 6.998 had printed 7, a QLoRA 0.830 printed 0.83
    assert got == ["0.0463", "5.23", "10.0", "10.0", "1284.6", "7.00", "0.830", "0"]


def test_another_tools_name_for_a_key_is_pointed_at_ours() -> None:
    """format=json said "unknown option 'format'" and no more (a hunt): no spelling distance
    leads from format to output."""
    from boom_ml.predict import validate

    for key, ours in (("format", "output"), ("batch", "batch_size"), ("precision", "amp")):
        with pytest.raises(
            InvalidInputError, match=rf"^unknown option\(s\): {key} \(did you mean: {ours}\?\)$"
        ):
            validate({"model": "hf:gpt2", key: "x"})


def test_true_for_a_key_of_named_choices_is_said_as_typed():
    """checkpointing=true reaches the check as Python's True: the error had said "unknown
    checkpointing True"; it says what was typed and what true most likely meant."""
    from boom_ml.specs import StepSpec

    with pytest.raises(InvalidInputError) as err:
        StepSpec(checkpointing=True)
    assert str(err.value) == (
        "unknown checkpointing true; choose one of: none, full, selective (did you mean "
        "checkpointing=full?)"
    )
    with pytest.raises(InvalidInputError, match=r"^unknown amp false; choose one of: none, fp16"):
        StepSpec(amp=False)
