"""Parallel layouts (issue #14): validation, links, sharded memory, 1F1B (collective sizes:
test_parallel_bytes.py).

The model is a synthetic tiny Llama config (2 layers, hidden 64, 4 heads, MLP 128, vocab 256),
written to a temporary file; its parameter counts are computed here from the config by hand.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.collectives import GroupLink
from boom_ml.parallel.layout import Cluster, Layout, validate
from boom_ml.parallel.links import intra_link, links, own_links
from boom_ml.parallel.time import Shape, step_time
from tests.test_parallel_schedule import schedule_1f1b

H, HEADS, INTER, VOCAB, LAYERS = 64, 4, 128, 256, 2
SYNTHETIC_TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": H,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "bos_token_id": None,
    "eos_token_id": None,
}


def layer_params(tp: int) -> int:
    """q, k, v, o (heads/tp of width H/heads) + gate, up, down (INTER/tp) + two RMSNorms."""
    return 4 * H * (H // tp) + 3 * H * (INTER // tp) + 2 * H


def tiny_memory_profile():
    """The tiny Llama's memory profile: AdamW, 2 x 32 tokens, two micro-batches, an H100."""
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.memory_profile import memory_profile
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, seq_len=32, optimizer="adamw", grad_accum=2)
    return memory_profile(SYNTHETIC_TINY_LLAMA, 1, step, get_gpu("h100-sxm"))


@pytest.fixture(scope="module")
def tiny_memory():
    return tiny_memory_profile()


# --- layout validation: one line each ---------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "cluster", "facts", "words"),
    [
        (Layout(tp=3), Cluster(), {"heads": 4}, "does not divide the model's 4 attention heads"),
        (Layout(tp=4), Cluster(), {"heads": 8, "hidden": 66}, "hidden size 66"),
        (
            Layout(tp=16),
            Cluster(gpus_per_node=16),
            {"heads": 32, "kv_heads": 8},
            "does not divide the model's 8 key/value heads",
        ),
        (Layout(pp=4), Cluster(), {"layers": 2}, "exceeds the model's 2 layers"),
        (Layout(dp=12), Cluster(gpus_per_node=8), {}, "not a multiple of cluster.gpus_per_node=8"),
        (Layout(dp=2), Cluster(), {"global_batch": 7, "batch_size": 1}, "not divisible"),
        (Layout(tp=2, sharding="fsdp"), Cluster(), {}, "fsdp shards over data-parallel ranks"),
        (Layout(sharding="zero2"), Cluster(), {}, "needs parallel.dp >= 2 (got parallel.dp=1)"),
        (
            Layout(grad_accumulation="fused", bucket_view=True),
            Cluster(),
            {},
            "parallel.grad_accumulation=fused, parallel.bucket_view=true: for a multi-GPU layout",
        ),
    ],
)
def test_bad_layouts_raise_one_line(layout, cluster, facts, words):
    with pytest.raises(InvalidInputError) as err:
        validate(layout, cluster, **facts)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Cluster(inter="ib-xdr"), "unknown cluster.inter 'ib-xdr'"),
        (lambda: Cluster(intra="nvswitch"), "unknown cluster.intra 'nvswitch'"),
        (lambda: Layout(sharding="zero4"), "unknown parallel.sharding 'zero4'"),
        (lambda: Layout(dp=0), "parallel.dp must be an integer >= 1"),
        (lambda: Layout(bucket_view="yes"), "parallel.bucket_view must be true or false"),
    ],
)
def test_bad_values_raise_one_line(make, words):
    with pytest.raises(InvalidInputError) as err:
        make()
    assert words in str(err.value) and "\n" not in str(err.value)


def test_good_layouts_pass_and_fsdp_is_zero3():
    validate(Layout(dp=4, tp=8, pp=2), Cluster(gpus_per_node=8), heads=64, hidden=8192, layers=80)
    validate(Layout(dp=3), Cluster(gpus_per_node=8))  # 3 GPUs on one node
    validate(Layout(tp=8), Cluster(gpus_per_node=8), heads=32, kv_heads=8)  # one KV head each
    assert Layout(sharding="fsdp").zero_stage == Layout(sharding="zero3").zero_stage == 3


def test_layout_module_is_torch_free():
    code = (
        "import sys, boom_ml.parallel.layout, boom_ml.parallel.links; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- links ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_id", "link"),
    [("a100-80gb-sxm", "nvlink3"), ("a100-80gb-pcie", "pcie4"), ("h100-sxm", "nvlink4"),
     ("h100-pcie", "pcie5"), ("v100-sxm2-32gb", "nvlink2"), ("l4", "pcie4"), ("t4", "pcie3"),
     ("h200", "nvlink4"), ("b200", "nvlink5")],
)  # fmt: skip
def test_auto_link_is_the_gpus_own(gpu_id, link):
    from boom_ml.gpus import get_gpu

    gpu = get_gpu(gpu_id)
    assert own_links(gpu.id, gpu.name, gpu.architecture)[0] == link
    assert intra_link(Cluster(), gpu.id, gpu.name, gpu.architecture).name == link


def test_nvlink_on_a_pcie_card_is_an_error_and_every_link_is_sourced():
    with pytest.raises(InvalidInputError, match="l4 has no NVLink"):
        intra_link(Cluster(intra="nvlink"), "l4", "NVIDIA L4", "ada")
    assert len(links()) == 13
    assert all(link.source and link.busbw_gbs <= link.line_gbs for link in links().values())


# --- memory: shard sizes under each sharding mode --------------------------------------


def test_tiny_model_parameter_split_matches_the_config(tiny_memory):
    p = tiny_memory.params
    assert p["layers"] == layer_params(1)
    assert p["first"] == VOCAB * H  # embed_tokens
    assert p["last"] == VOCAB * H + H  # lm_head + final norm
    assert tiny_memory.param_bytes == 4.0 and tiny_memory.optimizer_bytes == 8.0  # AdamW fp32


def test_pipeline_first_stage_holds_in_flight_activations(tiny_memory):
    from boom_ml.parallel.memory import rank_memory

    out = rank_memory(tiny_memory, Layout(pp=2, microbatches=4), [1, 1])
    first, last = out["per_stage"]
    # one layer per stage: a layer's share of what the forward leaves for its backward
    one, two = tiny_memory.held
    assert 0 < two - one < one  # the 1-layer trace also holds the head's logits and loss
    assert first["in_flight_microbatches"] == 2 and last["in_flight_microbatches"] == 1
    assert first["parallel_terms"]["pipeline_activations"] == two - one
    assert "pipeline_activations" not in last["parallel_terms"]
    # the first stage lacks the head and final norm, the last lacks the embedding
    assert first["parameters"] == layer_params(1) + VOCAB * H
    assert last["parameters"] == layer_params(1) + VOCAB * H + H


def test_a_stage_without_the_head_holds_none_of_its_tensors(tiny_memory):
    from boom_ml.parallel.memory import rank_memory
    from boom_ml.parallel.memory_profile import head_modules
    from boom_ml.parallel.profile import rank_graphs
    from boom_ml.specs import StepSpec

    # what runs after the last layer: the final norm, the head, the root's loss; the rotary
    # tables run before the layers, on every stage
    graph = rank_graphs(SYNTHETIC_TINY_LLAMA, 1, StepSpec(batch_size=2, seq_len=32))[0][0]
    assert head_modules(graph) == {"LlamaForCausalLM", "LlamaForCausalLM.lm_head",
                                   "LlamaForCausalLM.model.norm"}  # fmt: skip
    first, last = rank_memory(tiny_memory, Layout(pp=2), [1, 1])["per_stage"]
    # the head's share at some part's peak (the forward's: HF models compute the loss inside
    # it): at least the logits (2 x 32 tokens x 256, fp32)
    heads = [view["head"][1].get("activation", 0) for view in tiny_memory.windows.values()]
    assert max(heads) >= 2 * 32 * VOCAB * 4
    assert "no_head_tensors" not in last["parallel_terms"]
    removed = -first["parallel_terms"]["no_head_tensors"]
    # the 2-layer trace's head share at the part of the step that is the stage's peak
    shares = {sum(view["head"][1].values()) for view in tiny_memory.windows.values()}
    assert removed in shares and removed > 0
    # without the head the first stage needs less than the last, which also holds the embedding
    assert first["total_bytes"] + removed // 2 < last["total_bytes"]


# --- step_time helpers (test_parallel_bytes.py and the other parallel tests import them) --


def _profile(layer_ms: float = 1.0):
    from boom_ml.parallel.profile import TimeProfile

    return TimeProfile(layer_ms=layer_ms, first_ms=0.0, last_ms=0.0, opt_layer_ms=0.0,
                       opt_ends_ms=0.0, backward_fraction=0.5, method="synthetic")  # fmt: skip


def _groups(tp: int = 1, dp: int = 1, pp: int = 1) -> dict[str, GroupLink]:
    sizes = (("tp", tp), ("dp", dp), ("pp", pp), ("embedding", min(pp, 2)))
    return {name: GroupLink(name, n, "nvlink4", 370.0, 3.4, 8.4) for name, n in sizes}


def _shape(tp: int, checkpointing: bool = False) -> Shape:
    return Shape(batch_size=2, seq_len=32, hidden=H, act_bytes=2, checkpointing=checkpointing,
                 params_layer=layer_params(tp), params_first=VOCAB // tp * H,
                 params_last=VOCAB // tp * H + H)  # fmt: skip


# --- pipeline schedule -------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 8), (4, 4), (4, 16), (8, 3)])
def test_1f1b_bubble_fraction_for_equal_stages(pp, m):
    total, bubble = schedule_1f1b([2.5] * pp, m)
    assert total == pytest.approx(2.5 * (m + pp - 1))
    assert bubble / total == pytest.approx((pp - 1) / (m + pp - 1))


def test_step_bubble_for_equal_stages():
    pp, m = 2, 6
    out = step_time(_profile(3.0), _shape(1), Layout(pp=pp, microbatches=m), [1, 1],
                    _groups(pp=pp))  # fmt: skip
    assert out["bubble_ms"] / out["step_ms"] == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-4)


def test_predict_parallel_is_json(tmp_path):
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.predict import predict_parallel
    from boom_ml.specs import StepSpec

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SYNTHETIC_TINY_LLAMA))
    out = predict_parallel(f"hf:{path}", [get_gpu("h100-sxm")], StepSpec(batch_size=2, seq_len=32),
                           Layout(dp=2, pp=2, microbatches=2), Cluster())  # fmt: skip
    doc = json.loads(json.dumps(out))
    assert doc[0]["time"]["global_batch"] == 8
    assert len(doc[0]["memory"]["per_stage"]) == 2
    assert doc[0]["time"]["basis"] == "architecture not measured"  # no Hopper kernels trained
    # NCCL's buffers are one more memory term, with every key the single-GPU terms have
    keys = {"term", "library", "bytes", "where", "source"}
    assert all(set(t) == keys for t in doc[0]["memory"]["terms"])
    assert doc[0]["memory"]["terms"][-1]["term"] == "nccl_buffers"


def test_host_dispatch_floor_bounds_tiny_stages():
    from boom_ml.parallel.profile import TimeProfile
    from boom_ml.parallel.time import DISPATCH_US

    prof = TimeProfile(layer_ms=0.01, first_ms=0.0, last_ms=0.0, opt_layer_ms=0.0,
                       opt_ends_ms=0.0, backward_fraction=0.5, method="synthetic",
                       layer_ops=200)  # fmt: skip
    out = step_time(prof, _shape(1), Layout(microbatches=3), [LAYERS], _groups())
    assert out["compute_ms"] == pytest.approx(3 * LAYERS * 200 * DISPATCH_US * 1e-3)
    # without a pipeline the method names no schedule; with one it names the one simulated
    assert "pipeline schedule" not in out["method"]
    piped = step_time(prof, _shape(1), Layout(pp=2, microbatches=4), [1, 1], _groups(pp=2))
    assert "+ 1F1B pipeline schedule (event simulation" in piped["method"]


def test_rank_config_divides_heads_mlp_vocab_and_drops_ids_outside_the_shard():
    from boom_ml.parallel.shard import rank_config

    raw = dict(SYNTHETIC_TINY_LLAMA, pad_token_id=200, bos_token_id=1)
    out = rank_config(raw, 2, 5)
    assert (out["num_attention_heads"], out["num_key_value_heads"]) == (HEADS // 2, HEADS // 2)
    assert (out["head_dim"], out["hidden_size"]) == (H // HEADS, H)
    assert (out["intermediate_size"], out["vocab_size"]) == (INTER // 2, VOCAB // 2)
    assert (out["num_hidden_layers"], out["pad_token_id"], out["bos_token_id"]) == (5, None, 1)
    with pytest.raises(InvalidInputError, match="ties its head width"):
        rank_config({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64}, 2, 1)


def test_predict_cli_runs_a_layout_and_rejects_a_bad_one():
    """The CLI contract of issue #14: parallel.* and cluster.* keys reach predict_parallel;
    a layout the model cannot run is one line (exit status 2 in the CLI)."""
    import json as _json

    from boom_ml.errors import InvalidInputError as _Invalid
    from boom_ml.predict import run

    base = {"model": "hf:HuggingFaceTB/SmolLM2-135M", "gpu": "a100-80gb-sxm", "batch_size": 1,
            "seq_len": 128, "advice": False, "cache": False}  # fmt: skip
    out = _json.loads(run({**base, "output": "json", "parallel": {"dp": 2, "sharding": "zero1"}}))
    (entry,) = out["parallel"]
    assert entry["parallel"]["world"] == 2 and entry["parallel"]["sharding"] == "zero1"
    assert entry["time"]["global_batch"] == 2 and entry["memory"]["fit"] in ("yes", "tight", "no")
    assert entry["time"]["basis"] == "architecture measured"  # the A100-80GB PCIe was
    with pytest.raises(_Invalid, match="does not divide"):
        run({**base, "parallel": {"tp": 7}})
    with pytest.raises(_Invalid, match="gpus_per_node"):
        run({**base, "parallel": {"dp": 12}})
    for group, value, child in (("parallel", 4, "dp"), ("cluster", 4, "gpus_per_node")):
        with pytest.raises(_Invalid, match=rf"^{group} takes keys \({group}\.{child}=\.\.\., "):
            run({**base, group: value})
    from boom_ml.predict import check_override_keys

    with pytest.raises(_Invalid, match=r"^parallel takes keys \(parallel\.dp=\.\.\., .*\[1,2\]"):
        check_override_keys(["model=gpt2", "parallel=[1,2]"])  # before Hydra's own lines
    check_override_keys(["parallel.dp=2", "parallel={dp: 2}", "cluster=null"])


def test_fragmentation_stays_within_the_traced_values(tiny_memory):
    """Linear in layers everything else, the allocator's waste is kept between the 1- and
    2-layer traces' (a line through the two went negative for Llama-3-8B)."""
    import dataclasses

    from boom_ml.parallel.memory import stage_memory

    gib = 2**30
    bds = [{**b, "fragmentation": f} for b, f in zip(tiny_memory.breakdowns, (gib, gib // 2),
                                                      strict=True)]  # fmt: skip
    shrinking = dataclasses.replace(tiny_memory, breakdowns=bds, windows={})  # one peak
    out = stage_memory(shrinking, Layout(), 0, 12, 1)
    assert out["breakdown"]["fragmentation"] == gib // 2  # the line gives 1 - 11/2 GiB
    linear = tiny_memory.totals[0] + (tiny_memory.totals[1] - tiny_memory.totals[0]) * 11
    lin_frag = gib - (gib // 2) * 11
    nccl = out["parallel_terms"]["nccl_buffers"]
    assert out["total_bytes"] == int(linear + gib // 2 - lin_frag + nccl)


def test_a_line_through_two_moments_leaves_no_category_below_zero():
    """Llama-3.2-1B at tp=8 had printed gradient -0.27 GiB and temporary -0.73 GiB at its
    worst rank (its 1- and 2-layer backward peaks fall at different moments): the moment
    categories share what the line gives them together; the state categories are kept."""
    from boom_ml.parallel.memory import _moment_categories

    line = {"activation": 2355, "gradient": -281, "temporary": -735, "parameter": 589}
    assert _moment_categories(line) == {"activation": 1339, "gradient": 0, "temporary": 0,
                                        "parameter": 589}  # fmt: skip
    two = {"activation": 301, "temporary": 100, "gradient": -100, "optimizer_state": 7}
    assert _moment_categories(two) == {"activation": 226, "temporary": 75, "gradient": 0,
                                       "optimizer_state": 7}  # fmt: skip
    fine = {"activation": 5, "gradient": 0, "parameter": 3}
    assert _moment_categories(fine) is fine


def test_time_profiles_read_the_steps_tf32_switches():
    """A layout's ranks time their fp32 matmuls as one GPU would with the step's TF32
    switches (they were timed with both off, whatever was asked: tf32=true changed nothing)."""
    from dataclasses import replace

    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.profile import rank_graphs, time_profiles
    from boom_ml.specs import StepSpec
    from boom_ml.timing.estimate import estimate_times
    from boom_ml.timing.tf32 import Tf32

    gpu = get_gpu("a100-80gb-sxm")
    off = StepSpec(batch_size=2, seq_len=32)
    on = replace(off, tf32=True)
    prof_off, prof_on = (time_profiles(SYNTHETIC_TINY_LLAMA, 1, s, [gpu])[0] for s in (off, on))
    assert prof_on.layer_matrix_ms < prof_off.layer_matrix_ms
    (one, _), (two, _) = rank_graphs(SYNTHETIC_TINY_LLAMA, 1, on)
    t1, t2 = (estimate_times(g, [gpu], tf32=Tf32(True, True))[0] for g in (one, two))
    nonopt = [t.step_ms - t.by_phase.get("optimizer", 0.0) for t in (t1, t2)]
    assert prof_on.layer_ms == pytest.approx(nonopt[1] - nonopt[0], rel=1e-9)


@pytest.mark.parametrize("sharding", ["zero2", "fsdp"])
def test_fsdp_under_a_pipeline_keeps_its_gradients_whole(tiny_memory, sharding):
    """Under torch.distributed.pipelining a stage's FSDP2 units sync no gradient before the
    last micro-batch: at the pipeline's peak no gradient is sharded; the parameters' own
    shards and the optimizer state are. zero2 (not resharded after forward) keeps the whole
    stage gathered; fsdp the units in use and prefetched and the root, as without a pipeline."""
    from boom_ml.parallel.memory import _peak_view, _stage_at

    dp, layout = 4, Layout(dp=4, pp=2, sharding=sharding, microbatches=4)
    view = _peak_view(tiny_memory)
    terms = _stage_at(tiny_memory, view, layout, 1, 1, 4)["parallel_terms"]
    held = layer_params(1) + VOCAB * H + H  # the last stage: a layer, the head, the final norm
    gathered = held if sharding == "zero2" else 2 * layer_params(1) + VOCAB * H + H
    assert terms["fsdp_allgather_buffers"] == 4 * gathered
    assert terms["zero_parameters"] == pytest.approx(-4 * held * (dp - 1) / dp, abs=1)
    assert terms["zero_optimizer_state"] == pytest.approx(-8 * held * (dp - 1) / dp, abs=1)
    assert "zero_gradients" not in terms
    # in the optimizer step the gradients are reduced to their shards and the units resharded
    drained = _stage_at(tiny_memory, view, layout, 1, 1, 4, drained=True)["parallel_terms"]
    assert drained["zero_gradients"] < 0 and "fsdp_allgather_buffers" not in drained
    assert drained["zero_parameters"] == terms["zero_parameters"]


def test_fsdp_under_a_pipeline_peaks_at_a_backward_s_end_where_that_holds_more(tiny_memory):
    """zero3 / fsdp under torch's pipelining keeps each unit gathered after its backward, so a
    backward's end holds every unit of the stage, with one micro-batch fewer in flight: where
    that is more than the backward's peak (two units and the root gathered), it is the part's
    (stage 1 of 8 tiny layers)."""
    from boom_ml.parallel.memory import _peak_view, _stage_at

    layout, replace = Layout(dp=4, pp=2, sharding="fsdp", microbatches=4), dataclasses.replace
    whole = 4 * (8 * layer_params(1) + VOCAB * H + H)  # 1,380,608 bytes
    two_and_root = 4 * (2 * layer_params(1) + VOCAB * H + H)  # 394,496 bytes
    one, two = tiny_memory.held
    assert (whole, two_and_root, 8 * (two - one)) == (1380608, 394496, 2383872)
    # the tiny model's activations (298 KB a layer) outweigh its 8 layers' weights (164 KB
    # each): the backward's peak stays the part's
    view = _peak_view(tiny_memory)
    terms = _stage_at(tiny_memory, view, layout, 1, 8, 4)["parallel_terms"]
    assert terms["fsdp_allgather_buffers"] == two_and_root
    assert "backward_end_activations" not in terms
    # with a tenth of the activations, a backward's end: the whole stage gathered, one
    # micro-batch's 238,384 bytes fewer
    prof = replace(tiny_memory, held=[one, one + (two - one) // 10])
    out = _stage_at(prof, _peak_view(prof), layout, 1, 8, 4)
    assert out["parallel_terms"]["fsdp_allgather_buffers"] == whole
    assert out["parallel_terms"]["backward_end_activations"] == -238384
    assert out["breakdown"]["activation"] >= 0
    # not where no backward ends (the forward's part), nor under zero2, whose stage is
    # gathered at every moment
    forward = _stage_at(prof, _peak_view(prof), layout, 1, 8, 4, ends_backward=False)
    zero2 = _stage_at(prof, _peak_view(prof), replace(layout, sharding="zero2"), 1, 8, 4)
    assert "backward_end_activations" not in forward["parallel_terms"] | zero2["parallel_terms"]
