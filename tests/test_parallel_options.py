"""Step options under a parallel layout: accumulation is the layout's micro-batches, explain
and plots, build options, and no collective exposed beyond its own time (what a layout refuses:
test_parallel_refusals.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.layout import Layout, as_one_gpu, for_parallel_step
from boom_ml.parallel.time import step_time
from tests.test_parallel import LAYERS, _groups, _profile, _shape


def test_grad_accum_is_the_layouts_micro_batches() -> None:
    assert for_parallel_step(Layout(dp=2), grad_accum=4).microbatches == 4
    assert for_parallel_step(Layout(), grad_accum=4) == Layout()  # one GPU: its own accumulation
    with pytest.raises(InvalidInputError, match="give one of them"):
        for_parallel_step(Layout(dp=2, microbatches=2), grad_accum=4)


def test_one_gpus_micro_batches_are_its_grad_accum() -> None:
    assert as_one_gpu(Layout(microbatches=4), 1) == (Layout(), 4)
    for layout in (Layout(dp=2, microbatches=4), Layout(microbatches=4, bucket_view=True)):
        assert as_one_gpu(layout, 1) == (layout, 1)  # a layout, or a layout's own option
    assert as_one_gpu(Layout(microbatches=2), 4) == (Layout(microbatches=2), 4)  # refused next
    assert as_one_gpu(Layout(), 4) == (Layout(), 4)


def test_one_gpus_micro_batches_predict_as_grad_accum(tmp_path) -> None:
    """The single-GPU trace of the whole step, not the layout's 1- and 2-layer extrapolation
    (their fragmentation differed: Qwen2.5-0.5B 14.05 against 14.58 GB)."""
    import json

    from boom_ml import api
    from tests.test_parallel import SYNTHETIC_TINY_LLAMA

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SYNTHETIC_TINY_LLAMA))
    kw = dict(gpu="h100-sxm", batch_size=2, seq_len=32, advice=False, max_batch="off")
    micro = api.predict(f"hf:{path}", parallel={"microbatches": 2}, **kw).to_dict()
    accum = api.predict(f"hf:{path}", grad_accum=2, **kw).to_dict()
    assert micro["gpus"] == accum["gpus"] and micro["step"] == accum["step"]
    assert micro["step"]["grad_accum"] == 2 and not micro.get("parallel")
    from boom_ml.predict import validate  # explain= is for one GPU: accepted here

    validate({"model": "hf:gpt2", "gpu": "l4", "parallel": {"microbatches": 2}, "explain": True})


def test_advice_for_one_gpus_micro_batches_keeps_the_users_key() -> None:
    """The advice's options are keys to add to the command: grad_accum= beside the user's
    parallel.microbatches= would be refused, so the micro-batches keep that key."""
    from dataclasses import replace

    from boom_ml import api
    from boom_ml.gpus import get_gpu

    gpu = replace(get_gpu("a100-80gb-sxm"), id="a100-small", memory_bytes=700 * 2**20,
                  total_memory_bytes=700 * 2**20)  # fmt: skip
    p = api.predict("torchvision:resnet18", gpu=gpu, batch_size=256, image_size=64,
                    parallel={"microbatches": 2}, max_batch="off")  # fmt: skip
    items = p.advice["a100-small"]
    split = [a for a in items if "grad_accum" in a.settings]
    assert split and all("grad_accum" not in a.options for a in items)
    assert all(a.options["parallel.microbatches"] == a.settings["grad_accum"] for a in split)


def test_explain_adds_up_a_layouts_step_and_its_worst_rank(tmp_path) -> None:
    """explain=true was refused for a layout; it now says how the step time adds up (the last
    rank to finish: its last backward, optimizer step and exposed data-parallel collectives),
    each stage's share and the worst rank's memory with the layout's own terms."""
    import json

    from boom_ml import api
    from boom_ml.predict import run
    from tests.test_parallel import SYNTHETIC_TINY_LLAMA

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SYNTHETIC_TINY_LLAMA))
    opts = dict(gpu="h100-sxm", batch_size=2, seq_len=32, advice=False, max_batch="off",
                parallel={"dp": 2, "pp": 2, "microbatches": 4, "sharding": "zero1"})  # fmt: skip
    prediction = api.predict(f"hf:{path}", **opts)
    entry = prediction.parallel[0]
    t, m = entry["time"], entry["memory"]
    assert prediction.step["seq_len"] == entry["parallel"]["seq_len"] == 32
    # no seq_len asked: the model's default, said as a one-GPU step says it (a hunt: None)
    default = api.predict(f"hf:{path}", **{**opts, "seq_len": None})
    assert default.step["seq_len"] == 128  # the config's max_position_embeddings
    # 1F1B ends on rank 0 (the first stage's last backward), and the step with its optimizer
    # step: no rank finishes later
    last = t["per_stage"][t["finish_stage"]]
    assert t["finish_stage"] == 0 and last["end_ms"] == pytest.approx(t["pipeline_ms"], abs=1e-3)
    assert t["step_ms"] == max(st["finish_ms"] for st in t["per_stage"]) == last["finish_ms"]
    dp_exposed = last["exposed_dp_ms"]
    assert last["finish_ms"] == pytest.approx(
        last["end_ms"] + dp_exposed + last["optimizer_ms"], abs=1e-3
    )
    text = run({"model": f"hf:{path}", **opts, "explain": True})
    assert (
        f"Time on h100-sxm: {t['step_ms']:.1f} ms = stage 0's last backward ending at "
        f"{last['end_ms']:.1f} ms (1f1b over 4 micro-batches, 2 stages; the pipeline "
        f"{t['pipeline_ms']:.1f}) + its optimizer step {last['optimizer_ms']:.1f} + its exposed "
        f"data-parallel communication {dp_exposed:.1f}"
    ) in text
    for st in t["per_stage"]:
        assert (
            f"stage {st['stage']}: {st['layers']} layers, compute {st['compute_ms']:.2f} ms" in text
        )
    assert f"worst rank, stage {m['worst_stage']} of 2: {m['total_bytes'] / 2**30:.2f} GiB" in text
    # ZeRO-1 over dp=2 takes half of the stage's AdamW state (8 bytes a parameter) away
    trainable = t["per_stage"][m["worst_stage"]]["trainable"]
    assert m["parallel_terms"]["zero_optimizer_state"] == -trainable * 8 // 2
    assert "optimizer state on other ranks (ZeRO / FSDP)" in text
    assert "nccl_buffers" in text and "Memory terms outside the traced tensors" in text


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

    from boom_ml.parallel.profile import rank_graphs
    from boom_ml.parallel.shard import rank_config, rank_model, with_build_options
    from boom_ml.specs import StepSpec
    from tests.test_parallel import SYNTHETIC_TINY_LLAMA

    options = {"attn_implementation": "eager", "moe_imbalance": 1.0}
    raw = with_build_options(SYNTHETIC_TINY_LLAMA, options)
    model = rank_model(json.dumps(rank_config(raw, 1, 1)))
    assert model.options == options and "_boom" not in open(model.name).read()
    step = StepSpec(batch_size=2, seq_len=32)
    ops = {k: set(g.nodes["op"]) for k, g in (("sdpa", rank_graphs(SYNTHETIC_TINY_LLAMA, 1, step)[0][0]),
                                              ("eager", rank_graphs(raw, 1, step)[0][0]))}  # fmt: skip
    assert not [op for op in ops["eager"] if "attention" in op] and "_softmax" in ops["eager"]
    assert [op for op in ops["sdpa"] if "attention" in op]


def _fake_parallel(record: dict):
    """A stand-in for predict_parallel: one entry per GPU that does not fit, and where the
    call looked for its cache."""

    def fake(model, gpus, step, layout, nodes, stack=None, options=None):
        from boom_ml.parallel.shard import cache_dir

        record["cache"] = cache_dir()
        record["model"] = model
        return [{"gpu": g.id, "fits": False} for g in gpus]

    return fake


def test_a_layout_that_does_not_fit_is_advised_layouts_that_do(monkeypatch) -> None:
    import boom_ml
    import boom_ml.api as api
    import boom_ml.parallel.predict as parallel_predict

    seen: dict = {}
    monkeypatch.setattr(parallel_predict, "predict_parallel", _fake_parallel(seen))
    searched = []

    def search(model, gpus, step, cluster=None, stack=None, options=None, requested=None):
        searched.append(
            (step.batch_size, step.grad_accum, step.checkpointing, [g.id for g in gpus], requested)
        )
        return {g.id: {"layouts": [], "searched": 5, "valid": 5, "fitting": 0, "seconds": 0.1,
                       "max_gpus": 64} for g in gpus}  # fmt: skip

    monkeypatch.setattr(api, "search_layouts_many", search)
    out = boom_ml.predict("hf:gpt2", gpu="l4", batch_size=4, parallel={"dp": 2, "microbatches": 3})
    # at the layout's micro-batch and count; again with checkpointing where nothing fits;
    # priced per step of its global batch, 4 x 3 x dp 2 samples (a hunt: dp was left out)
    assert searched == [(4, 3, "none", ["l4"], 24), (4, 3, "full", ["l4"], 24)]
    assert out.layout_advice["l4"]["searched"] == 5
    searched.clear()
    boom_ml.predict("hf:gpt2", gpu="l4", parallel={"dp": 2}, advice=False)
    assert searched == []


def test_a_bare_hf_name_runs_a_layout_and_its_search(monkeypatch) -> None:
    """``model=gpt2`` (a bare name --help documents) traced on one GPU but was refused under a
    layout ("parallel layouts support hf: models for now, got 'gpt2'"), and the advisor skipped
    its layout search for it: the name is resolved as one GPU's trace resolves it, and a
    layout's prediction says where its results are when asked for a best GPU."""
    import boom_ml
    import boom_ml.parallel.predict as parallel_predict
    from boom_ml.parallel.shard import load_raw

    assert load_raw("gpt2") == load_raw("hf:gpt2")
    with pytest.raises(
        InvalidInputError, match="support hf: models for now, got 'torchvision:squeezenet1_1'"
    ):
        load_raw("squeezenet1_1")
    seen: dict = {}
    monkeypatch.setattr(parallel_predict, "predict_parallel", _fake_parallel(seen))
    out = boom_ml.predict("gpt2", gpu="l4", parallel={"dp": 2}, advice=False)
    assert seen["model"] == out.model == "hf:gpt2"
    assert out.gpus == [] and out.parallel == [{"gpu": "l4", "fits": False, "stack_missing": None}]
    with pytest.raises(ValueError, match=r"no single-GPU rows; read \.parallel"):
        out.best_gpu()


def test_cache_off_under_a_layout_keeps_nothing(monkeypatch, tmp_path) -> None:
    import boom_ml
    import boom_ml.parallel.predict as parallel_predict

    monkeypatch.setenv("BOOM_CACHE_DIR", str(tmp_path))
    seen: dict = {}
    monkeypatch.setattr(parallel_predict, "predict_parallel", _fake_parallel(seen))
    boom_ml.predict("hf:gpt2", gpu="l4", parallel={"dp": 2}, cache=False, advice=False)
    assert tmp_path not in seen["cache"].parents and not seen["cache"].exists()  # removed after
    boom_ml.predict("hf:gpt2", gpu="l4", parallel={"dp": 2}, advice=False)
    assert seen["cache"] == tmp_path / "parallel"


def test_pipeline_stages_step_only_their_own_ends() -> None:
    """The optimizer step of the ends (embedding; final norm and head) goes to the stage that
    holds them, by their parameters (``_shape``: V*H first, V*H + H last), not to both; a tied
    head's copy on the last stage is stepped there as well."""
    from dataclasses import replace

    prof = replace(_profile(), opt_layer_ms=1.0, opt_ends_ms=3.0)
    first, last = 256 * 64, 256 * 64 + 64
    whole = step_time(prof, _shape(1), Layout(), [2], _groups())
    piped = step_time(prof, _shape(1), Layout(pp=2), [1, 1], _groups(pp=2))
    stage = {s["stage"]: s["optimizer_ms"] for s in piped["per_stage"]}
    assert whole["optimizer_ms"] == pytest.approx(2 + 3)
    assert stage[0] == pytest.approx(1 + 3 * first / (first + last), abs=1e-4)
    assert stage[1] == pytest.approx(1 + 3 * last / (first + last), abs=1e-4)
    # tied: the 1-layer trace timed the shared weight once (ends 256*64 + 64); the last stage
    # holds a copy of it (params_last 256*64 + 64 + the tied 256*64)
    tied = replace(_shape(1), params_last=64 + 256 * 64, params_first=256 * 64)
    tied_piped = step_time(prof, tied, Layout(pp=2), [1, 1], _groups(pp=2), tied_params=256 * 64)
    stage = {s["stage"]: s["optimizer_ms"] for s in tied_piped["per_stage"]}
    assert stage[0] == pytest.approx(1 + 3 * first / (first + 64), abs=1e-4)
    assert stage[1] == pytest.approx(1 + 3 * (64 + 256 * 64) / (first + 64), abs=1e-4)


def test_a_layouts_plot_replays_its_pipeline(tmp_path) -> None:
    """plot= was refused for a layout; it now draws the step's pipeline, re-simulated from
    the per-virtual-stage times the JSON holds, which must give the step's own pipeline time
    and bubble, on the fastest GPU whose worst rank fits."""
    import json

    from boom_ml import api
    from boom_ml.parallel.schedule import simulate
    from tests.test_parallel import SYNTHETIC_TINY_LLAMA

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SYNTHETIC_TINY_LLAMA))
    out = api.predict(f"hf:{path}", gpu=["a100-80gb-sxm", "h100-sxm"], batch_size=2, seq_len=32,
                      advice=False, max_batch="off", plot=str(tmp_path / "figs"),
                      parallel={"pp": 2, "microbatches": 4})  # fmt: skip
    t = next(e for e in out.parallel if e["gpu"] == "h100-sxm")["time"]
    assert len(t["virtual_stage_ms"]) == 2
    run = simulate([s["forward_ms"] for s in t["virtual_stage_ms"]],
                   [s["backward_ms"] for s in t["virtual_stage_ms"]], 4, "1f1b", pp=2,
                   p2p_ms=t["p2p_ms"])  # fmt: skip
    assert run.total_ms == pytest.approx(t["pipeline_ms"], abs=1e-3)
    assert run.bubble_ms == pytest.approx(t["bubble_ms"], abs=1e-3)
    fastest = min(out.parallel, key=lambda e: e["time"]["step_ms"])["gpu"]
    stem = f"hf_{str(path).replace(':', '_').replace('/', '_')}"
    assert out.plots == [str(tmp_path / "figs" / f"{stem}_layout_{fastest}.png")]
    assert Path(out.plots[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_group_across_a_node_boundary_runs_on_the_network() -> None:
    """A hunt: tp=4 on 6-GPU nodes was timed on NVLink, though its second group (ranks 4-7)
    spans two nodes, and dp's ranks {0, 4, 8} were said to span 3 nodes (they span 2). Where
    groups align with nodes, the placement is the one the old closed form gave."""
    from boom_ml.parallel.collectives import placement

    assert placement(4, 1, 12, 6) == (2, 2)  # tp: ranks 4, 5 | 6, 7
    assert placement(3, 4, 12, 6) == (2, 1)  # dp: ranks 0, 4 | 8
    for gpn in (2, 4, 8):
        for size in (1, 2, 4, 8, 16):
            for stride in (1, 2, 4, 8, 16):
                world = max(size * stride, gpn) * 2
                if size * stride <= gpn:
                    assert placement(size, stride, world, gpn)[0] == 1
                    continue
                members = min(max(1, gpn // stride) if stride < gpn else 1, size)
                assert placement(size, stride, world, gpn) == (-(-size // members), members)


def test_fsdp_under_autocast_names_its_weight_copies(tmp_path) -> None:
    """A hunt: Mixtral under fsdp + amp=bf16 held 86.7 GiB of autocast's weight copies with no
    word of it; FSDP2 users with a MixedPrecisionPolicy would read that as FSDP's own cost."""
    import json

    from boom_ml import api
    from tests.test_parallel import SYNTHETIC_TINY_LLAMA

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SYNTHETIC_TINY_LLAMA))
    kw = dict(gpu="h100-sxm", batch_size=2, seq_len=32, advice=False, max_batch="off")
    fsdp = api.predict(f"hf:{path}", amp="bf16", parallel={"dp": 2, "sharding": "fsdp"}, **kw)
    entry = fsdp.parallel[0]
    copies = entry["memory"]["breakdown"]["autocast_copy"]
    assert copies > 0 and len(entry["notes"]) == 1
    assert (
        f"keeps a bf16 copy of each weight it casts ({copies / 2**30:.2f} GiB" in entry["notes"][0]
    )
    for amp, sharding in (("bf16", "zero2"), ("none", "fsdp")):
        other = api.predict(f"hf:{path}", amp=amp, parallel={"dp": 2, "sharding": sharding}, **kw)
        assert other.parallel[0]["notes"] == []


def test_a_per_layer_config_list_follows_a_ranks_depth() -> None:
    """GPT-Neo lists its 12 layers' attention kinds (attention_layers, and attention_types as
    runs); its 1-layer rank config kept all 12 and transformers refused it, so no layout of
    this shipped model ran (a hunt)."""
    from transformers import GPTNeoConfig

    from boom_ml.parallel.shard import load_raw, rank_config

    raw = load_raw("hf:EleutherAI/gpt-neo-125M")
    for layers in (1, 2):
        config = rank_config(raw, 1, layers)
        assert config["attention_layers"] == ["global", "local"][:layers]
        built = GPTNeoConfig(**{k: v for k, v in config.items() if k != "model_type"})
        assert built.attention_layers == ["global", "local"][:layers]
    layer_types = {**raw, "layer_types": ["full_attention"] * 12}
    assert rank_config(layer_types, 1, 2)["layer_types"] == ["full_attention"] * 2
