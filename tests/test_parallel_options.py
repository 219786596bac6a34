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


def test_build_options_reach_the_rank_model() -> None:
    """attention=eager (and moe.imbalance) change the rank's trace as they change one GPU's."""
    import json

    from boom_ml.parallel.profile import _graphs
    from boom_ml.parallel.shard import rank_config, rank_model, with_build_options
    from boom_ml.specs import StepSpec
    from tests.test_parallel import SYNTHETIC_TINY_LLAMA

    options = {"attn_implementation": "eager", "moe_imbalance": 1.0}
    raw = with_build_options(SYNTHETIC_TINY_LLAMA, options)
    model = rank_model(json.dumps(rank_config(raw, 1, 1)))
    assert model.options == options and "_boom" not in open(model.name).read()
    step = StepSpec(batch_size=2, seq_len=32)
    ops = {k: set(g.nodes["op"]) for k, g in (("sdpa", _graphs(SYNTHETIC_TINY_LLAMA, 1, step)[0][0]),
                                              ("eager", _graphs(raw, 1, step)[0][0]))}  # fmt: skip
    assert not [op for op in ops["eager"] if "attention" in op] and "_softmax" in ops["eager"]
    assert [op for op in ops["sdpa"] if "attention" in op]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"parallel": {"dpp": 2}}, "unknown parallel option(s): dpp"),
        ({"cluster": {"gpu_per_node": 2}}, "unknown cluster option(s): gpu_per_node"),
        ({"moe": {"imbalanse": 3}}, "unknown moe option(s): imbalanse"),
        ({"moe": {"imbalance": 0.5}}, "moe.imbalance must be a number >= 1.0"),
    ],  # fmt: skip
)
def test_the_api_names_bad_keys_in_one_line(kwargs, words) -> None:
    import boom_ml

    with pytest.raises(InvalidInputError) as err:
        boom_ml.predict("hf:gpt2", gpu="l4", **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)
