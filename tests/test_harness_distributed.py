"""The multi-GPU step harness on the CPU: ``launcher=torchrun`` with the gloo backend.

Two ranks are spawned through torch.distributed.run's library API; every row is measured on
the CPU (``device_kind="cpu"``), so the test checks the pipeline (launch, layout wrappers,
one row per rank, validated shards, resume), never the numbers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from data_collection import schema, steps
from data_collection.distributed_steps import LayoutError, layouts
from data_collection.shards import KEY, read_shards
from tests.test_harness import step_cfg

TINY_GPT2 = [{"name": "hf:gpt2", "batch_sizes": [2], "seq_len": 16,
              "options": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128}}]  # fmt: skip
LAYOUT_COLUMNS = ["rank", "num_gpus", "dp", "tp", "pp", "sharding", "microbatches"]


def torchrun_cfg(out: Path, **parallel: Any) -> dict[str, Any]:
    return step_cfg(out, models=TINY_GPT2, amp=["none"], checkpointing=["none"],
                    launcher="torchrun", nproc=2, backend="gloo",
                    parallel={"dp": 2, **parallel})  # fmt: skip


def test_gloo_dry_run_writes_one_row_per_rank_and_resumes(tmp_path: Path) -> None:
    cfg = torchrun_cfg(tmp_path, sharding="none", microbatches=2)
    started = time.monotonic()
    steps.run_step_sweep(cfg)
    took = time.monotonic() - started
    rows = read_shards(tmp_path, "steps", keep_extra=True)
    df = schema.validate(rows[schema.columns("steps")], "steps", "test")
    assert len(df) == 2 and rows[KEY].is_unique  # one shard key per rank
    assert df[LAYOUT_COLUMNS].sort_values("rank").to_dict("records") == [
        {"rank": r, "num_gpus": 2, "dp": 2, "tp": 1, "pp": 1, "sharding": "none",
         "microbatches": 2} for r in (0, 1)
    ]  # fmt: skip
    assert (df["batch_size"] == 2).all() and (df["global_batch_size"] == 2 * 2 * 2).all()
    assert (df["step_time_ms"] > 0).all() and not df["oom"].any()
    assert set(df["device_kind"]) == {"cpu"} and df["peak_allocated_bytes"].isna().all()
    assert took < 60, f"the 2-rank gloo dry run took {took:.0f} s"
    steps.run_step_sweep(cfg)  # resumed: every rank's row is on disk, nothing re-measured
    assert len(read_shards(tmp_path, "steps")) == 2


def test_layouts_the_harness_cannot_run_fail_in_one_line(tmp_path: Path) -> None:
    base = {"nproc": 4}
    assert [lay["sharding"] for lay in layouts({**base, "parallel": {
        "dp": 4, "sharding": ["none", "zero1", "fsdp"]}})] == ["none", "zero1", "fsdp"]  # fmt: skip
    assert layouts({**base, "parallel": {"dp": 2, "tp": 2, "sharding": "fsdp"}})[0]["tp"] == 2
    with pytest.raises(LayoutError, match="pp>1 is not supported by the harness yet"):
        layouts({**base, "parallel": {"dp": 1, "tp": 2, "pp": 2}})
    with pytest.raises(LayoutError, match="needs FSDP2"):
        layouts({**base, "parallel": {"dp": 2, "tp": 2, "sharding": "zero1"}})
    with pytest.raises(LayoutError, match="must be equal"):
        layouts({**base, "parallel": {"dp": 2}})
    with pytest.raises(LayoutError, match="parallel.sharding='zero4'"):
        layouts({**base, "parallel": {"dp": 4, "sharding": "zero4"}})
    with pytest.raises(LayoutError, match="not supported"):  # before any process starts
        steps.run_step_sweep(torchrun_cfg(tmp_path, pp=2, dp=1))


def test_gloo_tensor_parallel_with_the_models_own_tp_plan(tmp_path: Path) -> None:
    # SmolLM2-135M's Llama config, cut to one layer of 4 query / 2 key-value heads (the dry
    # run's 1 key-value head cannot be split over 2 ranks)
    tiny_llama = [{"name": "hf:HuggingFaceTB/SmolLM2-135M", "batch_sizes": [2], "seq_len": 16,
                   "dry_run_options": {"num_attention_heads": 4, "num_key_value_heads": 2,
                                       "head_dim": 16}}]  # fmt: skip
    cfg = {**torchrun_cfg(tmp_path, dp=1, tp=2), "models": tiny_llama}
    steps.run_step_sweep(cfg)
    df = schema.validate(read_shards(tmp_path, "steps"), "steps", "test")
    assert df[LAYOUT_COLUMNS].sort_values("rank").to_dict("records") == [
        {"rank": r, "num_gpus": 2, "dp": 1, "tp": 2, "pp": 1, "sharding": "none",
         "microbatches": 1} for r in (0, 1)
    ]  # fmt: skip
    assert (df["global_batch_size"] == 2).all() and (df["step_time_ms"] > 0).all()
