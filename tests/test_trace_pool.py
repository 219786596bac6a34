"""Traces in worker processes (boom_ml/trace_pool.py): a worker's graph is the caller's own,
a failed worker leaves the trace to the caller, and a prediction takes the traces it started
ahead (the batch search's second batch, the advisor's candidates) from its workers.

Workers fork from the caller before it first runs autograd, and this test process has run
many backward passes by now: every check that forks runs in a fresh interpreter
(:func:`run_fresh`) and reports back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from boom_ml import trace_pool
from boom_ml.errors import InvalidInputError
from boom_ml.specs import ModelSpec
from boom_ml.trace_pool import WORKERS_ENV, configured_workers, shared_pool
from tests.tiny_models import tiny_llama_config

REPO = Path(__file__).resolve().parent.parent

PRELUDE = """
import json, sys
import pandas as pd
from dataclasses import replace
import os
from boom_ml import api, trace_pool
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace_pool import TracePool, trace
MODEL = ModelSpec(sys.argv[1])

def same_graph(a, b):
    for table in ("nodes", "edges", "mem_events"):
        pd.testing.assert_frame_equal(getattr(a, table), getattr(b, table))
    strip = lambda meta: {k: v for k, v in meta.items() if k != "trace_seconds"}
    return strip(a.meta) == strip(b.meta)
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("pool") / "tiny_llama.json"
    path.write_text(json.dumps(tiny_llama_config(vocab_size=32000)))
    return f"hf:{path}"


def run_fresh(code: str, model: str, workers: int = 2) -> dict[str, Any]:
    """``code`` after :data:`PRELUDE` in a new interpreter; it prints one JSON line last."""
    # a cache of its own: a script may empty it
    env = {**os.environ, WORKERS_ENV: str(workers), "BOOM_CACHE_DIR": tempfile.mkdtemp()}
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), model],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_workers_graph_is_the_callers_and_failures_come_back(llama: str) -> None:
    got = run_fresh(
        """
        step = StepSpec(batch_size=2, seq_len=32, amp="bf16", sdpa_group="sm80")
        pool = TracePool(1)
        pool.start()  # before this process runs autograd
        pool.submit(MODEL, step)
        pending = pool.pending(MODEL, step)
        graph = pool.take(MODEL, step)
        same = same_graph(graph, trace(MODEL, step))
        bad = ModelSpec("torchvision:no_such_net")
        pool.submit(bad, StepSpec())
        failed = pool.take(bad, StepSpec())  # None: the caller traces it and meets the error
        print(json.dumps({"pending": pending, "same": same, "failed": failed,
                          "after": pool.pending(MODEL, step), "started": pool.started}))
        """,
        llama,
    )
    assert got == {"pending": True, "same": True, "failed": None, "after": False, "started": 2}


def test_traces_queue_for_a_free_worker_and_a_late_fork_gives_up(llama: str) -> None:
    got = run_fresh(
        """
        steps = [StepSpec(batch_size=b, seq_len=32) for b in (1, 2)]
        pool = TracePool(1)
        for step in steps:
            pool.submit(MODEL, step)
        queued = pool.started  # one worker: the second waits
        second = pool.take(MODEL, steps[1])  # taken first: its turn comes at once
        first = pool.take(MODEL, steps[0])
        batches = [g.meta["step"]["batch_size"] for g in (first, second)]
        # a pool forked after this process ran a backward pass cannot trace: it says so once
        trace(MODEL, steps[0])  # a backward pass here
        late = TracePool(1)
        late.submit(MODEL, steps[0])
        lost = late.take(MODEL, steps[0])
        late.submit(MODEL, steps[1])
        print(json.dumps({"queued": queued, "started": pool.started, "batches": batches,
                          "lost": lost, "broken": late.broken,
                          "then": late.pending(MODEL, steps[1])}))
        """,
        llama,
    )
    assert got == {"queued": 1, "started": 2, "batches": [1, 2], "lost": None, "broken": True,
                   "then": False}  # fmt: skip


def test_predictions_take_their_announced_traces_from_workers(llama: str) -> None:
    """The batch search's second batch, and every candidate of the advisor, traced in a
    worker (the caller's own tracer fails if it is asked); the results are the same."""
    got = run_fresh(
        """
        from boom_ml.gpus import get_gpu
        a100 = get_gpu("a100-80gb-sxm")
        # 1.6 GiB: the step needs 2.9 (its fp32 logits), half or less of the batch fits
        tiny = replace(a100, id="a100-tiny", memory_bytes=1600 * 2**20,
                       total_memory_bytes=1600 * 2**20)
        kwargs = dict(batch_size=8, seq_len=512, cache=False)
        strip = lambda doc: {**doc, "graph": {k: v for k, v in doc["graph"].items()
                                              if k != "trace_seconds"}}
        calls = {"pooled": 0, "alone": 0}
        here, run = trace_pool.trace, ["pooled"]

        def traced_here(model, step):
            calls[run[0]] += 1
            return here(model, step)

        trace_pool.trace = traced_here
        pool = trace_pool.shared_pool(MODEL)
        pooled = api.predict(MODEL.text, gpu=[a100, tiny], **kwargs)
        run[0] = "alone"
        os.environ["BOOM_TRACE_WORKERS"] = "0"  # no pool from here on
        alone = api.predict(MODEL.text, gpu=[a100, tiny], **kwargs)
        print(json.dumps({"same": strip(pooled.to_dict()) == strip(alone.to_dict()),
                          "advice": bool(pooled.advice.get("a100-tiny")),
                          "in_workers": pool.started, **calls}))
        """,
        llama,
    )
    assert got["same"] and got["advice"]
    # the same traces, most of them in workers: the batch search's second batch (4 beside
    # 8) and every candidate of the advice
    assert got["in_workers"] + got["pooled"] == got["alone"]
    assert got["in_workers"] >= 4 and got["pooled"] < got["in_workers"]


def test_workers_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert configured_workers() == 3
    monkeypatch.setenv(WORKERS_ENV, "0")
    assert configured_workers() == 0 and shared_pool(ModelSpec("torchvision:resnet18")) is None
    monkeypatch.setenv(WORKERS_ENV, "two")
    with pytest.raises(InvalidInputError, match="BOOM_TRACE_WORKERS must be a whole number"):
        configured_workers()
    monkeypatch.delenv(WORKERS_ENV)
    monkeypatch.setattr(trace_pool, "_DEFAULT_ON", False)  # the Python API: none by default
    assert configured_workers() == 0
    monkeypatch.setattr(trace_pool, "_DEFAULT_ON", True)  # the CLI: the usable CPUs, up to 4
    cpus = len(os.sched_getaffinity(0))
    assert configured_workers() == (min(cpus, trace_pool.MAX_DEFAULT_WORKERS) if cpus > 1 else 0)


def test_the_cli_starts_workers_by_default_and_prints_the_same(llama: str, tmp_path: Path) -> None:
    """The CLI's default (workers on a multi-CPU machine) against none: one JSON document."""
    docs = []
    for workers in (None, "0"):
        env = {k: v for k, v in os.environ.items() if k != WORKERS_ENV}
        env["BOOM_CACHE_DIR"] = str(tmp_path / f"cache-{workers}")  # both trace everything
        if workers is not None:
            env[WORKERS_ENV] = workers
        done = subprocess.run(
            [sys.executable, "-m", "boom_ml.predict", f"model={llama}",
             "gpu=[a100-80gb-sxm,t4]", "batch_size=8", "seq_len=512", "output=json"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        doc = json.loads(done.stdout)
        doc["graph"].pop("trace_seconds")
        docs.append(doc)
    assert docs[0] == docs[1]


def test_the_layout_search_takes_its_small_traces_from_workers(llama: str) -> None:
    """Every tensor-parallel degree's 1- and 2-layer traces run in workers; the layouts found
    are those found without them."""
    got = run_fresh(
        """
        import boom_ml.parallel.memory_profile as memory_profile
        import boom_ml.parallel.profile as profile
        from boom_ml.gpus import get_gpu
        from boom_ml.parallel.search import search_layouts_many
        gpus = [get_gpu("a100-80gb-sxm"), get_gpu("t4")]
        step = StepSpec(batch_size=8, seq_len=512)
        pool = trace_pool.shared_pool(MODEL)
        pooled = search_layouts_many(MODEL.text, gpus, step, max_gpus=8)
        in_workers = pool.started
        profile.forget_traces()
        profile._MEMO.clear()
        memory_profile._MEMO.clear()
        os.environ["BOOM_TRACE_WORKERS"] = "0"  # no pool from here on
        import shutil
        shutil.rmtree(os.environ["BOOM_CACHE_DIR"])  # profiles cached on disk: none now
        alone = search_layouts_many(MODEL.text, gpus, step, max_gpus=8)
        strip = lambda found: {g: {k: v for k, v in r.items() if k != "seconds"}
                               for g, r in found.items()}
        print(json.dumps({"same": strip(pooled) == strip(alone), "in_workers": in_workers,
                          "traced_alone": len(profile._TRACED),
                          "layouts": sum(len(r["layouts"]) for r in alone.values())}))
        """,
        llama,
    )
    # tiny Llama (4 query, 2 key/value heads): tp 1 and 2 (4 would split its key/value heads,
    # layout.validate), 1 and 2 layers each
    assert got["same"] and got["layouts"] > 0
    assert got["in_workers"] == got["traced_alone"] == 4
