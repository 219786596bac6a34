"""The on-disk trace cache (boom_ml.trace_cache) and its use by boom_ml.api.Session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.graph import OpGraph
from boom_ml.trace_cache import TraceCache, cache_key

REPO = Path(__file__).resolve().parent.parent
MLP = """
import torch
class Mlp(torch.nn.Sequential):
    def example_inputs(self, batch_size, device):
        return torch.randn(batch_size, 8, device=device)
def make(width=16):
    return Mlp(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
"""
STEP = StepSpec(batch_size=4, image_size=None)


def small_graph(n: int, tag: str = "") -> OpGraph:
    nodes = [
        {"id": i, "aten_op": "aten.mm.default", "op": "mm", "family": "gemm", "phase": "forward",
         "module": tag, "input_shapes": "[[4, 4]]", "input_dtypes": "[\"torch.float32\"]",
         "output_shapes": "[[4, 4]]", "output_dtypes": "[\"torch.float32\"]", "flops": 128,
         "bytes_read": 128, "bytes_written": 64}
        for i in range(n)
    ]  # fmt: skip
    return OpGraph.from_records(nodes, [], [], meta={"trace_seconds": 1.5, "tag": tag})


@pytest.fixture
def mlp_file(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    return path


def test_key_follows_model_step_options_and_file_contents(mlp_file):
    model = ModelSpec(f"file:{mlp_file}:make")
    key = cache_key(model, STEP)
    assert key == cache_key(ModelSpec(f"file:{mlp_file}:make"), StepSpec(batch_size=4))
    assert key != cache_key(model, StepSpec(batch_size=5))
    assert key != cache_key(model, StepSpec(batch_size=4, amp="bf16"))
    assert key != cache_key(ModelSpec(model.text, {"width": 32}), STEP)
    assert key != cache_key(ModelSpec("torchvision:resnet18"), STEP)
    mlp_file.write_text(MLP + "\n# edited\n")  # the user's model changed: a new entry
    assert key != cache_key(model, STEP)


def test_key_follows_library_versions_and_trace_version(monkeypatch):
    import boom_ml.trace
    import boom_ml.trace_cache as tc

    model = ModelSpec("torchvision:resnet18")
    key = cache_key(model, STEP)
    versions = {**tc.library_versions(), "transformers": "0.0.1"}
    monkeypatch.setattr(tc, "library_versions", lambda: versions)
    assert cache_key(model, STEP) != key
    monkeypatch.undo()
    monkeypatch.setattr(boom_ml.trace, "TRACE_VERSION", boom_ml.trace.TRACE_VERSION + 1)
    tc.code_digest.cache_clear()
    try:
        assert cache_key(model, STEP) != key
    finally:
        monkeypatch.undo()
        tc.code_digest.cache_clear()
    assert cache_key(model, STEP) == key


def test_put_get_round_trip_and_miss(tmp_path):
    cache = TraceCache(tmp_path)
    model = ModelSpec("torchvision:resnet18")
    assert cache.get(model, STEP) is None
    graph = small_graph(5, "a")
    entry = cache.put(model, STEP, graph)
    assert entry == tmp_path / cache_key(model, STEP)
    got = cache.get(model, STEP)
    assert got is not None and got.meta == {**graph.meta, "from_cache": True}
    pd.testing.assert_frame_equal(got.nodes, graph.nodes)
    assert cache.get(model, StepSpec(batch_size=8)) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_damaged_entry_is_a_miss_and_removed(tmp_path):
    cache = TraceCache(tmp_path)
    model = ModelSpec("torchvision:resnet18")
    entry = cache.put(model, STEP, small_graph(3))
    (entry / "nodes.parquet").write_bytes(b"not parquet")
    assert cache.get(model, STEP) is None
    assert not entry.exists()


def test_size_cap_evicts_least_recently_used(tmp_path):
    model = ModelSpec("torchvision:resnet18")
    steps = [StepSpec(batch_size=b) for b in (1, 2, 3)]
    cache = TraceCache(tmp_path, max_bytes=10**9)
    entries = [cache.put(model, s, small_graph(50, str(s.batch_size))) for s in steps]
    one = cache.size_bytes() // 3
    for age, entry in zip((300, 200, 100), entries, strict=True):  # batch 1 is the oldest
        os.utime(entry, (1e9 - age, 1e9 - age))
    assert cache.get(model, steps[0]) is not None  # a hit makes batch 1 the newest
    cache.max_bytes = 2 * one + one // 2
    assert cache.evict() == [entries[1]]  # batch 2: now the least recently used
    assert [e.name for _, _, e in cache.entries()] == [entries[2].name, entries[0].name]
    assert cache.size_bytes() <= cache.max_bytes


def test_session_reuses_the_disk_cache_and_cache_off_bypasses_it(tmp_path, mlp_file, monkeypatch):
    import boom_ml.api as api
    import boom_ml.trace.step as tracer
    import boom_ml.zoo as zoo

    monkeypatch.setenv("BOOM_CACHE_DIR", str(tmp_path / "cache"))
    model = f"file:{mlp_file}:make"
    first = api.Session(model).graph(STEP)
    calls = []
    real_trace, real_build = tracer.trace_step, zoo.build_model

    def counting(built, step):
        calls.append(step)
        return real_trace(built, step)

    def no_build(spec):
        raise AssertionError("the model was built on a cache hit")

    monkeypatch.setattr(tracer, "trace_step", counting)
    monkeypatch.setattr(zoo, "build_model", no_build)
    again = api.Session(model).graph(STEP)  # a fresh session, as in a new process
    assert calls == [] and again.meta == {**first.meta, "from_cache": True}
    pd.testing.assert_frame_equal(again.nodes, first.nodes)
    pd.testing.assert_frame_equal(again.mem_events, first.mem_events)

    monkeypatch.setattr(zoo, "build_model", real_build)
    entries = sorted(p.name for p in (tmp_path / "cache" / "traces").iterdir())
    api.Session(model, cache=False).graph(STEP)
    # traced, although the cache holds this step (its optimizer's implementation resolved, as
    # predict() resolves it)
    assert calls == [replace(STEP, optimizer_impl="foreach")]
    assert sorted(p.name for p in (tmp_path / "cache" / "traces").iterdir()) == entries


SCRIPT = """
import json, sys
import boom_ml.api as api
p = api.predict(model=sys.argv[1], gpu=["l4", "t4"], batch_size=4, advice=False)
# On a cache hit neither the tracer nor the model's library is imported, let alone run.
if sys.argv[2] == "forbid" and "boom_ml.trace.step" in sys.modules:
    raise SystemExit("the tracer was imported although the step was cached")
print(json.dumps(p.to_dict()))
"""


def test_second_process_with_the_same_config_does_not_trace(tmp_path, mlp_file):
    env = {**os.environ, "BOOM_CACHE_DIR": str(tmp_path / "cache")}
    model = f"file:{mlp_file}:make"

    def predict(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SCRIPT, model, mode], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    first = predict("trace")
    assert first.returncode == 0, first.stderr[-2000:]
    second = predict("forbid")
    assert second.returncode == 0, second.stderr[-2000:]
    first_json, second_json = json.loads(first.stdout), json.loads(second.stdout)
    assert not first_json["graph"].pop("trace_from_cache")
    assert second_json["graph"].pop("trace_from_cache")  # the table says so too
    assert second_json == first_json


def test_a_file_models_key_follows_the_modules_beside_it(tmp_path) -> None:
    """A factory that imports a helper module beside it: editing the helper's width had been
    served the old graph from the cache (a hunt); a file elsewhere in the tree is not read."""
    (tmp_path / "helper_mod.py").write_text("WIDTH = 64\n")
    (tmp_path / "model.py").write_text("from helper_mod import WIDTH\ndef make(): ...\n")
    (tmp_path / "deeper").mkdir()
    (tmp_path / "deeper" / "other.py").write_text("X = 1\n")
    model, step = ModelSpec(f"file:{tmp_path / 'model.py'}:make"), StepSpec(batch_size=2)
    before = cache_key(model, step)
    (tmp_path / "deeper" / "other.py").write_text("X = 2\n")
    assert cache_key(model, step) == before
    (tmp_path / "helper_mod.py").write_text("WIDTH = 1024\n")
    assert cache_key(model, step) != before
