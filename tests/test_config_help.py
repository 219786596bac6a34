"""``--help`` of the Hydra entries: the command's docstring, then its YAML keys with comments."""

from __future__ import annotations

import importlib
import sys

import hydra
import pytest
import yaml

from boom_ml.config_help import CONFIG_DIR, config_keys

ENTRIES = [
    ("boom_ml.predict_ops", "main", "predict_ops"),
    ("training.train_ops", "main", "train_ops"),
    ("training.train_gemm", "main", "train_gemm"),
    ("training.train_gnn", "main", "train_gnn"),
    ("data_collection.kernels", "_hydra_main", "collect/kernels"),
    ("data_collection.steps", "_hydra_main", "collect/steps"),
]


@pytest.mark.parametrize(("module", "entry", "config"), ENTRIES)
def test_help_prints_the_docstring_and_every_key_without_running(
    module: str, entry: str, config: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("--help ran the Hydra entry")

    monkeypatch.setattr(hydra, "main", must_not_run)
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    mod = importlib.import_module(module)
    getattr(mod, entry)()
    out = capsys.readouterr().out
    assert out.splitlines()[0] == mod.__doc__.strip().splitlines()[0]
    lines = out.splitlines()
    keys = yaml.safe_load((CONFIG_DIR / f"{config}.yaml").read_text())
    user_keys = set(keys) - {"defaults", "hydra"}
    assert user_keys and all(any(line.startswith(f"{k}:") for line in lines) for k in user_keys)
    assert not any(line.startswith(("hydra:", "defaults:", "# @package")) for line in lines)
    assert "--hydra-help" in lines[-1]


def test_config_keys_keeps_comments_and_drops_hydra_blocks() -> None:
    text = config_keys("train_gnn")
    assert "  spec_context: true        # false: the GNN does not see the GPU's spec-sheet" in text
    assert "override hydra/job_logging" not in text and "output_subdir" not in text


def test_commands_without_options_answer_help_and_refuse_arguments(capsys):
    """training.layout_check / label_check / step_spread take no options: --help prints what
    they do (layout_check ran its two-minute job on --help), anything else is exit 2."""
    from boom_ml.config_help import doc_help_or_no_args

    assert doc_help_or_no_args("What it does.\n", ["--help"]) is True
    assert capsys.readouterr().out == "What it does.\n"
    assert doc_help_or_no_args("What it does.", []) is False
    with pytest.raises(SystemExit) as stop:
        doc_help_or_no_args("What it does.", ["--verbose"])
    assert stop.value.code == 2 and "takes no arguments (got --verbose)" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["training.step_spread", "training.gemm_spread"])
def test_a_training_check_on_a_fresh_clone_says_to_import_in_one_line(module, tmp_path) -> None:
    """A hunt: with no data/ yet (a fresh clone), eight training commands ended in a traceback
    of a FileNotFoundError that already said what to run; it is that line, exit status 2."""
    import os
    import subprocess

    env = {**os.environ, "BOOM_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    kind = "steps" if "step" in module else "kernels"
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: no {kind} datasets in {tmp_path / kind}; run `python -m data_collection.import_public`"
    ]


@pytest.mark.parametrize(("module", "entry", "config"), ENTRIES[:4])
def test_a_misspelt_key_is_one_line_and_exit_2_before_hydra(
    module: str, entry: str, config: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Hydra answers an unknown key in five lines with exit 1; the entries answer first."""

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bad key reached the Hydra entry")

    monkeypatch.setattr(hydra, "main", must_not_run)
    monkeypatch.setattr(sys, "argv", [module, "bogus_key=1"])
    with pytest.raises(SystemExit) as exited:
        getattr(importlib.import_module(module), entry)()
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown option 'bogus_key'")


def test_a_plus_key_may_add_to_a_mapping_of_the_config_only() -> None:
    """``+data.exclude_gpus.<gpu>=why`` (README, the GEMM model's diagnosis) adds a key to a
    mapping; ``+`` on a scalar's child, or a new key without ``+``, stays an error."""
    from boom_ml.errors import InvalidInputError
    from boom_ml.predict import check_override_keys

    check_override_keys(["+data.exclude_gpus.p100-pcie-16gb=diagnostic"], "train_gemm")
    with pytest.raises(InvalidInputError, match="unknown option 'data.exclude_gpus.p100'"):
        check_override_keys(["data.exclude_gpus.p100=why"], "train_gemm")
    with pytest.raises(InvalidInputError, match="unknown option 'seed.x'"):
        check_override_keys(["+seed.x=1"], "train_gemm")


def test_predicts_help_lists_the_optimizers_as_the_error_does() -> None:
    """The refusal of an unknown optimizer lists them in --help's order (it had run in the
    order they were added: a hunt)."""
    from boom_ml.specs import OPTIMIZERS

    text = (CONFIG_DIR / "predict.yaml").read_text()
    start = text.index("optimizer=NAME") + len("optimizer=NAME")
    listed = text[start : text.index("(8-bit", start)].replace("\n", " ")
    assert [name.strip() for name in listed.split("|")] == list(OPTIMIZERS)
