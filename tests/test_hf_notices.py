"""The Python API quiets transformers' warnings for the duration of a call (a notebook saw
"`loss_type=None` was set in the config but it is unrecognized" on every hf: prediction,
which the CLI never printed) and leaves the user's own setting as it found it."""

from __future__ import annotations

import logging

import pytest

import boom_ml.api as api
from boom_ml.hf_notices import quiet_transformers


def test_a_call_runs_at_error_level_and_restores_the_users_level(monkeypatch) -> None:
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    levels: list[int] = []

    @quiet_transformers
    def call(value: int) -> int:
        levels.append(hf_logging.get_verbosity())
        return value

    hf_logging.set_verbosity(logging.INFO)
    try:
        assert call(7) == 7
        assert levels == [logging.ERROR] and hf_logging.get_verbosity() == logging.INFO
        monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # the user's own choice stays
        call(8)
        assert levels[-1] == logging.INFO
    finally:
        hf_logging.set_verbosity(logging.WARNING)


def test_predict_runs_quiet(monkeypatch) -> None:
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    seen: list[int] = []

    def stack(_: object) -> None:  # a step inside predict: what level does it run at?
        seen.append(hf_logging.get_verbosity())
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "resolve_stack", stack)
    with pytest.raises(KeyboardInterrupt):
        api.predict("hf:gpt2", gpu="l4")
    assert seen == [logging.ERROR] and hf_logging.get_verbosity() == logging.WARNING
