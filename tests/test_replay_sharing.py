"""Work shared between the GPUs of one prediction gives what each GPU computed alone.

A replay's events are built once per graph and kind of workspace (``estimate._built_replay``)
and each GPU fills in its own workspace sizes; the result must equal ``build_replay`` with
that GPU's workspaces, event for event.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_models import tiny_cnn, tiny_transformer

from boom_ml.gpus import get_gpu
from boom_ml.memory.allocator import simulate
from boom_ml.memory.estimate import _built_replay
from boom_ml.memory.overheads import load_overheads
from boom_ml.memory.replay import build_replay
from boom_ml.specs import StepSpec
from boom_ml.stack import resolve_stack
from boom_ml.trace.step import trace_step

GPUS = ("t4", "v100-sxm2-32gb", "a100-80gb-sxm", "rtx-3060", "h100-sxm")


@pytest.fixture(scope="module")
def graphs():
    return {
        "transformer": trace_step(tiny_transformer(), StepSpec(2, seq_len=16)),
        "cnn": trace_step(tiny_cnn(), StepSpec(4, image_size=16)),  # optional conv workspaces
    }


@pytest.mark.parametrize("name", ["transformer", "cnn"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_shared_build_equals_a_build_per_gpu(graphs, name, accumulate):
    graph, table, stack = graphs[name], load_overheads(), resolve_stack()
    sizes = set()
    for gpu in GPUS:
        for level in ("p10", "p50", "p90"):
            extras = table.allocator_extras(get_gpu(gpu), graph, stack, level)
            assert extras, "the test needs workspaces to fill in"
            sizes.add(tuple(x.nbytes for x in extras))
            alone = build_replay(graph, 3, True, extras, accumulate)
            shared = _built_replay(graph, 3, True, extras, accumulate)
            for field in ("is_alloc", "block", "nbytes", "src", "step"):
                np.testing.assert_array_equal(getattr(shared, field), getattr(alone, field))
            assert shared.synthetic == alone.synthetic
            assert shared.optional == alone.optional
    assert len(sizes) > 1  # GPUs with other workspace sizes did share a build


@pytest.mark.parametrize("name", ["transformer", "cnn"])
def test_allocator_takes_a_replay_as_its_events(graphs, name):
    """``simulate(replay)`` reads the arrays directly: the same answer as its event tuples."""
    graph = graphs[name]
    extras = load_overheads().allocator_extras(get_gpu("t4"), graph, resolve_stack(), "p90")
    replay = build_replay(graph, 3, True, extras)
    peak = simulate(replay.tuples()).peak_reserved
    for capacity in (None, peak, peak // 2):  # unbounded, just enough, out of memory
        a = simulate(replay, capacity, optional=replay.optional)
        b = simulate(replay.tuples(), capacity, optional=replay.optional)
        for field in dataclasses.fields(a):
            np.testing.assert_array_equal(getattr(a, field.name), getattr(b, field.name))


def test_layout_search_keys_are_the_json_of_their_parts():
    """The cached time and memory profile keys are those of ``profile_keys.key_of`` (the disk
    cache keeps its entries)."""
    from dataclasses import asdict

    from boom_ml.parallel import profile_keys as keys

    raw = {"hidden_size": 64, "num_hidden_layers": 2, "id2label": {"1": "b", "0": "a"}}
    gpu, stack = get_gpu("h100-sxm"), str(resolve_stack())
    for step in (StepSpec(4, seq_len=32), StepSpec(1, seq_len=8, lora_targets=("q", "v"))):
        for tp in (1, 2):
            time = keys.key_of("time", keys.timing_identity(), raw, tp, step.to_dict(),
                               asdict(gpu))  # fmt: skip
            assert keys.time_key(raw, tp, step, gpu) == time
            parts = (tp, step, gpu, stack, keys.memory_identity())
            memory = keys.key_of("memory-2", raw, tp, step.to_dict(), asdict(gpu), *parts[3:])
            assert keys.key_around(("memory-2",), keys.canonical_json(raw), parts) == memory


def test_links_and_collectives_as_dicts_equal_asdict():
    """``to_dict`` of the layout search's links and collectives skips ``asdict``'s deep copy:
    the same dicts, key order included."""
    from dataclasses import asdict

    from boom_ml.parallel.collectives import Collective, GroupLink

    link = GroupLink("tp", 8, "nvlink4", 450.0, 1.5, 7.0, nodes=2, sm=90, nic_per_gpu=False)
    assert list(link.to_dict().items()) == list(asdict(link).items())
    coll = Collective("all_reduce", "dp", "gradients", 1 << 20, 3, 1.234567, 0.5, "ring/simple")
    expected = {**asdict(coll), "ms": 1.2346, "exposed_ms": 0.5}
    assert list(coll.to_dict().items()) == list(expected.items())
