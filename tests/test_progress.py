"""Progress lines on a terminal (``boom_ml/progress.py``); the traced model is synthetic."""

from __future__ import annotations

import io
import sys
from dataclasses import replace

import pytest
from rich.console import Console
from tiny_models import tiny_cnn

from boom_ml import progress
from boom_ml.specs import StepSpec
from boom_ml.trace.step import trace_step


@pytest.fixture
def terminal() -> io.StringIO:
    out = io.StringIO()
    assert progress.to_terminal(Console(file=out, force_terminal=True, width=200))
    yield out
    progress.off()


def test_a_trace_names_itself_on_the_terminal(terminal: io.StringIO) -> None:
    trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, amp="bf16"))
    assert "tracing test:tiny-cnn: batch 4, image 32, amp=bf16" in terminal.getvalue()
    assert progress._status is None  # the line is gone once the trace is


def test_a_rank_model_is_named_by_its_model_not_its_cache_file(
    terminal: io.StringIO, monkeypatch, tmp_path
) -> None:
    """A layout's per-rank traces showed the config file boom-ml writes for them
    ("tracing hf:/home/u/.cache/boom_ml/parallel/config-3f32....json: batch 4")."""
    import json

    from boom_ml.parallel.shard import load_raw, rank_model
    from boom_ml.zoo import build_model

    monkeypatch.setenv("BOOM_CACHE_DIR", str(tmp_path))
    raw = {**load_raw("hf:gpt2"), "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128}
    model = rank_model(json.dumps(raw, sort_keys=True))
    assert model.text.endswith(".json") and model.shown == "gpt2's 2-layer per-rank model"
    trace_step(build_model(model), StepSpec(batch_size=2, seq_len=8, optimizer="sgd"))
    assert "tracing gpt2's 2-layer per-rank model: batch 2, seq 8" in terminal.getvalue()
    assert "config-" not in terminal.getvalue()


def test_nested_tasks_show_the_inner_one_then_the_outer_again(terminal: io.StringIO) -> None:
    with progress.task("outer work"):
        with progress.task("inner work"):
            assert progress._messages == ["outer work", "inner work"]
        assert progress._messages == ["outer work"]
    assert progress._messages == [] and progress._status is None
    assert "outer work" in terminal.getvalue()  # the inner one shows at the next refresh


def test_off_by_default_and_a_plain_line_when_stderr_is_no_terminal(monkeypatch) -> None:
    with progress.task("nobody sees this"):  # a library call: off
        assert progress._messages == []
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    assert progress.to_terminal() is False  # no status line: a log, 30 s apart
    try:
        with progress.task("a short trace"):
            assert progress._messages == ["a short trace"]
    finally:
        progress.off()
    assert log.getvalue() == ""  # shorter than the interval: nothing printed


def test_a_log_names_the_running_task_until_it_is_off() -> None:
    import time

    log = io.StringIO()
    progress.to_log(log, every_s=0.01)
    try:
        with progress.task("searching layouts"), progress.task("tracing a rank"):
            waited = time.monotonic()
            while "tracing a rank" not in log.getvalue() and time.monotonic() - waited < 10:
                time.sleep(0.01)
    finally:
        progress.off()
    first = log.getvalue().splitlines()[0]
    assert first.startswith("boom_ml: ") and first.endswith(" s, tracing a rank")
    printed = log.getvalue()
    time.sleep(0.05)  # no task runs and the heartbeat has stopped: nothing more
    assert log.getvalue() == printed


def test_step_label_names_what_differs_from_the_defaults() -> None:
    step = StepSpec(batch_size=2, seq_len=128, checkpointing="full", finetune_method="lora")
    assert step.label() == "batch 2, seq 128, checkpointing=full, finetune_method=lora"
    # a GPU list traces once per attention group: the two lines had read the same (a hunt)
    assert (
        replace(step, sdpa_group="sm70")
        .label()
        .endswith("finetune_method=lora, attention kernels of sm70")
    )
