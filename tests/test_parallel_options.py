"""Step options under a parallel layout: accumulation is the layout's micro-batches, outputs
made for one GPU are refused in one line, and no collective is exposed beyond its own time."""

from __future__ import annotations

import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.layout import Layout, for_parallel_step
from boom_ml.parallel.time import step_time
from tests.test_parallel import LAYERS, _groups, _profile, _shape


def test_grad_accum_is_the_layouts_micro_batches() -> None:
    assert for_parallel_step(Layout(dp=2), grad_accum=4).microbatches == 4
    assert for_parallel_step(Layout(), grad_accum=4) == Layout()  # one GPU: its own accumulation
    with pytest.raises(InvalidInputError, match="give one of them"):
        for_parallel_step(Layout(dp=2, microbatches=2), grad_accum=4)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"plot": "/tmp/p"}, "plot="),
        ({"explain": True}, "explain=true"),
        ({"max_batch_on": True}, "max_batch=on"),
    ],  # fmt: skip
)
def test_single_gpu_outputs_are_refused_for_a_layout(kwargs, words) -> None:
    with pytest.raises(InvalidInputError) as err:
        for_parallel_step(Layout(dp=2), **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)
    for_parallel_step(Layout(), **kwargs)  # one GPU produces them


def test_the_cli_refuses_them_before_importing_torch() -> None:
    from boom_ml.predict import validate

    with pytest.raises(InvalidInputError, match="explain=true"):
        validate({"model": "hf:gpt2", "gpu": "l4", "parallel": {"dp": 2}, "explain": True})


def test_no_fsdp_collective_is_exposed_beyond_its_time() -> None:
    """A slow link and almost no compute: most communication is exposed, none beyond itself."""
    from boom_ml.parallel.collectives import GroupLink

    groups = _groups(dp=4)
    groups["dp"] = GroupLink("dp", 4, "eth-25g", 2.5, 20.0, 30.0)
    layout = Layout(dp=4, sharding="fsdp", microbatches=2)
    out = step_time(_profile(0.001), _shape(1), layout, [LAYERS], groups)
    dp = [c for c in out["collectives"] if c["group"] == "dp"]
    assert all(c["exposed_ms"] <= c["ms"] + 1e-9 for c in dp)
    # everything but the compute that hides part of it is exposed, in sum
    hidden = layout.microbatches * LAYERS * 0.001
    total = sum(c["ms"] for c in dp) - hidden
    assert sum(c["exposed_ms"] for c in dp) == pytest.approx(total, abs=4e-4)  # 4 decimals
