"""The multi-GPU step harness on the CPU: ``launcher=torchrun`` with the gloo backend.

Two ranks are spawned through torch.distributed.run's library API; every row is measured on
the CPU (``device_kind="cpu"``), so the test checks the pipeline (launch, layout wrappers,
one row per rank, validated shards, resume), never the numbers. Pipeline stages are also
checked in one process against the whole model (same logits, bit for bit).
"""

from __future__ import annotations

import gc
import math
import re
import weakref
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from boom_ml.specs import ModelSpec
from boom_ml.zoo import build_model
from data_collection import schema, step_runner, steps
from data_collection.distributed_steps import LayoutError, layouts, rank_key
from data_collection.pipeline_steps import DECODER_TYPES, rank_stages, split_decoder
from data_collection.shards import KEY, read_shards
from tests.test_harness import step_cfg

TINY_GPT2 = [{"name": "hf:gpt2", "batch_sizes": [2], "seq_len": 16,
              "options": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128}}]  # fmt: skip
LAYOUT_COLUMNS = ["rank", "num_gpus", "dp", "tp", "pp", "sharding", "microbatches"]
PIPELINE_COLUMNS = [*LAYOUT_COLUMNS, "stage", "schedule", "virtual_stages"]
# One zoo config per decoder type the pipeline cuts (all small configs shipped with boom_ml)
DECODERS = {"llama": "HuggingFaceTB/SmolLM2-135M", "qwen2": "Qwen/Qwen2.5-0.5B",
            "qwen3": "Qwen/Qwen3-0.6B", "mistral": "mistralai/Mistral-7B-v0.3",
            "olmo2": "allenai/OLMo-2-1124-7B", "phi3": "microsoft/Phi-3-mini-4k-instruct"}  # fmt: skip
LOSS_NOTE = re.compile(r"last-stage loss (\S+)")


def tiny_llama(layers: int) -> list[dict[str, Any]]:
    """SmolLM2-135M's Llama config at the dry run's sizes with ``layers`` layers."""
    return [{"name": "hf:HuggingFaceTB/SmolLM2-135M", "batch_sizes": [2], "seq_len": 16,
             "dry_run_options": {"num_hidden_layers": layers}}]  # fmt: skip


def torchrun_cfg(out: Path, **parallel: Any) -> dict[str, Any]:
    return step_cfg(out, models=TINY_GPT2, amp=["none"], checkpointing=["none"],
                    launcher="torchrun", nproc=2, backend="gloo",
                    parallel={"dp": 2, **parallel})  # fmt: skip


def test_gloo_dry_run_writes_one_row_per_rank_and_resumes(tmp_path: Path) -> None:
    cfg = torchrun_cfg(tmp_path, sharding="none", microbatches=2)
    steps.run_step_sweep(cfg)
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
    assert df["stage"].tolist() == [0, 0] and df["schedule"].tolist() == ["1f1b"] * 2
    # the pipeline keys stay out of a layout without a pipeline: shards of older sweeps resume
    [(_, config)] = step_runner.expand(cfg, "cpu", on_cuda=False)
    old = {"dp": 2, "tp": 1, "pp": 1, "sharding": "none", "microbatches": 2}
    key = step_runner.step_key({**config, "parallel": old})
    assert set(rows[KEY]) == {rank_key(key, r, 2) for r in (0, 1)}
    steps.run_step_sweep(cfg)  # resumed: every rank's row is on disk, nothing re-measured
    assert len(read_shards(tmp_path, "steps")) == 2


def test_layouts_the_harness_cannot_run_fail_in_one_line(tmp_path: Path) -> None:
    base = {"nproc": 4}
    assert [lay["sharding"] for lay in layouts({**base, "parallel": {
        "dp": 4, "sharding": ["none", "zero1", "fsdp"]}})] == ["none", "zero1", "fsdp"]  # fmt: skip
    assert layouts({**base, "parallel": {"dp": 2, "tp": 2, "sharding": "fsdp"}})[0]["tp"] == 2
    with pytest.raises(LayoutError, match="pp>1 with parallel.tp>1 is not supported"):
        layouts({**base, "parallel": {"dp": 1, "tp": 2, "pp": 2, "microbatches": 2}})
    with pytest.raises(LayoutError, match="needs FSDP2"):
        layouts({**base, "parallel": {"dp": 2, "tp": 2, "sharding": "zero1"}})
    with pytest.raises(LayoutError, match="must be equal"):
        layouts({**base, "parallel": {"dp": 2}})
    with pytest.raises(LayoutError, match="parallel.sharding='zero4'"):
        layouts({**base, "parallel": {"dp": 4, "sharding": "zero4"}})
    with pytest.raises(LayoutError, match="not supported"):  # before any process starts
        steps.run_step_sweep(torchrun_cfg(tmp_path, pp=2, dp=1, tp=2))


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


def pipeline_rows(out: Path, models: list[dict[str, Any]], nproc: int = 2,
                  step: dict[str, Any] | None = None, **parallel: Any) -> pd.DataFrame:  # fmt: skip
    cfg = torchrun_cfg(out, **{"dp": 1, "pp": 2, "microbatches": 2, **parallel})
    cfg = {**cfg, "models": models, "nproc": nproc, **(step or {})}
    steps.run_step_sweep(cfg)
    df = schema.validate(read_shards(out, "steps"), "steps", "test")
    return df.sort_values(["sharding", "rank"]).reset_index(drop=True)


def last_stage_loss(df: pd.DataFrame) -> float:
    """The loss the last stage's row notes (its last micro-batch); other rows note none."""
    last = df["stage"] == df["pp"] - 1
    assert df.loc[~last, "notes"].isna().all()
    losses = [float(LOSS_NOTE.fullmatch(n).group(1)) for n in df.loc[last, "notes"]]  # type: ignore[union-attr]
    assert len(set(losses)) == 1 and math.isfinite(losses[0])
    return losses[0]


def test_gloo_pipeline_1f1b_and_gpipe_one_row_per_stage(tmp_path: Path) -> None:
    losses = {}
    for schedule in ("1f1b", "gpipe"):
        df = pipeline_rows(tmp_path / schedule, tiny_llama(2), schedule=schedule)
        assert df[PIPELINE_COLUMNS].to_dict("records") == [
            {"rank": r, "num_gpus": 2, "dp": 1, "tp": 1, "pp": 2, "sharding": "none",
             "microbatches": 2, "stage": r, "schedule": schedule, "virtual_stages": 1}
            for r in (0, 1)
        ]  # fmt: skip
        assert (df["global_batch_size"] == 2 * 2 * 1).all() and (df["batch_size"] == 2).all()
        assert (df["step_time_ms"] > 0).all() and not df["oom"].any()
        losses[schedule] = last_stage_loss(df)
    # the same seed, weights and batches: both schedules train alike, only the order differs
    assert losses["1f1b"] == pytest.approx(losses["gpipe"], rel=1e-5)


def test_gloo_pipeline_interleaved_two_stages_per_rank(tmp_path: Path) -> None:
    # under bf16 autocast with full recomputation: the stages' static shapes hold
    step = {"amp": ["bf16"], "checkpointing": ["full"]}
    df = pipeline_rows(tmp_path, tiny_llama(4), step=step, schedule="interleaved",
                       virtual_stages=2)  # fmt: skip
    assert df[PIPELINE_COLUMNS].to_dict("records") == [
        {"rank": r, "num_gpus": 2, "dp": 1, "tp": 1, "pp": 2, "sharding": "none",
         "microbatches": 2, "stage": r, "schedule": "interleaved", "virtual_stages": 2}
        for r in (0, 1)
    ]  # fmt: skip
    assert (df["step_time_ms"] > 0).all()
    assert set(df["amp"]) == {"bf16"} and set(df["checkpointing"]) == {"full"}
    last_stage_loss(df)


@pytest.mark.slow
def test_gloo_pipeline_with_data_parallel_stages(tmp_path: Path) -> None:
    # 4 ranks: 2 pipeline stages x 2 data-parallel replicas (DDP + ZeRO-1, and FSDP2), fp16
    # with one loss scale on every rank
    df = pipeline_rows(tmp_path, tiny_llama(2), nproc=4, step={"amp": ["fp16"]}, dp=2,
                       sharding=["zero1", "fsdp"])  # fmt: skip
    assert df[[*PIPELINE_COLUMNS, "global_batch_size"]].to_dict("records") == [
        {"rank": r, "num_gpus": 4, "dp": 2, "tp": 1, "pp": 2, "sharding": mode,
         "microbatches": 2, "stage": r // 2, "schedule": "1f1b", "virtual_stages": 1,
         "global_batch_size": 2 * 2 * 2}
        for mode in ("fsdp", "zero1") for r in range(4)
    ]  # fmt: skip
    assert (df["step_time_ms"] > 0).all() and set(df["amp"]) == {"fp16"}
    for mode in ("fsdp", "zero1"):
        last_stage_loss(df[df["sharding"] == mode])


def test_pipeline_layouts_the_harness_cannot_run_fail_in_one_line(tmp_path: Path) -> None:
    def bad(match: str, **parallel: Any) -> None:
        with pytest.raises(LayoutError, match=match):
            layouts({"nproc": 2, "parallel": {"pp": 2, "microbatches": 2, **parallel}})

    assert layouts({"nproc": 2, "parallel": {"pp": 2, "microbatches": 2}})[0]["schedule"] == "1f1b"
    bad(r"1f1b needs parallel.microbatches >= parallel.pp", microbatches=1)
    bad(r"interleaved needs parallel.virtual_stages >= 2", schedule="interleaved")
    bad(r"interleaved needs parallel.microbatches to be a multiple", schedule="interleaved",
        virtual_stages=2, microbatches=3)  # fmt: skip
    bad(r"with parallel.dp=1 and parallel.pp>1 use parallel.sharding=none", sharding="fsdp")
    bad(r"unknown parallel.schedule 'zb'", schedule="zb")
    with pytest.raises(LayoutError, match=r"need parallel.pp>1 \(got schedule=gpipe, pp=1\)"):
        layouts({"nproc": 2, "parallel": {"dp": 2, "schedule": "gpipe"}})

    def sweep(models: list[dict[str, Any]], nproc: int = 2, **parallel: Any) -> None:
        cfg = torchrun_cfg(tmp_path, **{"dp": 1, "pp": nproc, "microbatches": 4, **parallel})
        steps.run_step_sweep({**cfg, "models": models, "nproc": nproc})  # raises before launch

    with pytest.raises(LayoutError, match=r"model_type llama, .*; hf:gpt2 is gpt2$"):
        sweep(TINY_GPT2)
    with pytest.raises(
        LayoutError, match=r"2 stages exceed hf:HuggingFaceTB/SmolLM2-135M's 1 layers"
    ):
        sweep(tiny_llama(1))
    with pytest.raises(LayoutError, match=r"4 stages exceed .*'s 3 layers"):
        sweep(tiny_llama(3), schedule="interleaved", virtual_stages=2)
    with pytest.raises(LayoutError, match=r"6 layers to split into pp x virtual_stages = 4 equal"):
        sweep(tiny_llama(6), schedule="interleaved", virtual_stages=2)
    assert not (tmp_path / "steps").exists()


def _tiny_decoder(kind: str, layers: int, **options: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    opts = {**step_runner.DRY_RUN_HF_OPTIONS, "num_hidden_layers": layers, "pad_token_id": None}
    module = build_model(ModelSpec(f"hf:{DECODERS[kind]}", {**opts, **options}), "cpu").module
    assert module.config.model_type == kind
    return module.eval()


def _run_stages(parts: list[torch.nn.Module], ids: torch.Tensor) -> torch.Tensor:
    out = ids
    for part in parts:
        out = part(out)
    return out


@pytest.mark.parametrize("kind", DECODER_TYPES)
def test_stages_in_a_row_compute_the_whole_models_logits(kind: str) -> None:
    model = _tiny_decoder(kind, layers=3)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        parts = split_decoder(model, [0, 1], 2)
        assert [len(p.base.layers) for p in parts] == [2, 1]  # the remainder on stage 0
        assert torch.equal(_run_stages(parts, ids), whole)


def test_stages_slice_per_layer_attention_types() -> None:
    # Qwen2 with sliding-window attention from layer 2 on: the last stage's only layer slides
    model = _tiny_decoder("qwen2", layers=3, use_sliding_window=True, sliding_window=4,
                          max_window_layers=2)  # fmt: skip
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        parts = split_decoder(model, [0, 1], 2)
        assert parts[1].base.config.layer_types == ["sliding_attention"]
        assert torch.equal(_run_stages(parts, ids), whole)
        parts[1].base.config = model.config  # unsliced, layer 0's full mask: other logits
        assert not torch.equal(_run_stages(parts, ids), whole)


def test_a_rank_keeps_only_its_stages() -> None:
    model = _tiny_decoder("llama", layers=4)
    assert rank_stages(pp=2, virtual_stages=2, pp_rank=1) == [1, 3]
    dropped = [weakref.ref(m) for m in (model, model.model.layers[0], model.model.layers[2])]
    kept = model.model.layers[1].self_attn.q_proj.weight
    parts = split_decoder(model, [1, 3], 4)  # pipeline rank 1 of pp=2 x 2 virtual stages
    del model
    gc.collect()
    assert all(ref() is None for ref in dropped)  # the whole model and the other ranks' layers
    assert parts[0].base.layers[0].self_attn.q_proj.weight is kept
    assert parts[0].base.embed_tokens is None and parts[0].head is None
    assert parts[1].head is not None and isinstance(parts[0].base.norm, torch.nn.Identity)
