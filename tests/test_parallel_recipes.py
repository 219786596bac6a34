"""Parallel layouts with training recipes: 16-bit parameters, master weights, LoRA, QLoRA.

Sharding divides what each parameter carries: its bytes in ``params_dtype``, and, for the
trainable ones only, a gradient and optimizer state. Data parallelism reduces only the
trainable parameters' gradients. The model is test_parallel's synthetic tiny Llama (2 layers,
hidden 64); peft's default LoRA targets for Llama are q_proj and v_proj, each H -> H here, so
an r = 8 adapter pair adds r * (H + H) parameters per projection.
"""

from __future__ import annotations

import json

import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.layout import Cluster, Layout, validate
from boom_ml.parallel.time import Shape, step_time
from tests.test_parallel import LAYERS, SYNTHETIC_TINY_LLAMA, VOCAB, H, _groups, _profile
from tests.test_parallel import layer_params as base_layer_params

R = 8
LORA_LAYER = 2 * R * (H + H)  # q_proj and v_proj adapters of one layer
HELD = LAYERS * base_layer_params(1) + 2 * VOCAB * H + H  # embedding, layers, head, norm


def _memory(**step_fields):
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.memory_profile import memory_profile
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, seq_len=32, optimizer="adamw", grad_accum=2, **step_fields)
    return memory_profile(SYNTHETIC_TINY_LLAMA, 1, step, get_gpu("h100-sxm"))


@pytest.fixture(scope="module")
def lora_memory():
    return _memory(amp="bf16", finetune_method="lora", lora_r=R)


@pytest.fixture(scope="module")
def bf16_memory():
    return _memory(params_dtype="bf16")


def test_lora_split_counts_adapters_as_the_only_trainable_parameters(lora_memory):
    assert lora_memory.params["layers"] == base_layer_params(1) + LORA_LAYER
    assert lora_memory.trainable == {"layers": LORA_LAYER, "first": 0, "last": 0, "tied": 0}
    assert lora_memory.param_bytes == 4.0 and lora_memory.optimizer_bytes == 8.0


def test_bf16_parameters_carry_two_bytes_and_bf16_adam_state(bf16_memory):
    assert bf16_memory.params["layers"] == base_layer_params(1)
    assert bf16_memory.param_bytes == 2.0 and bf16_memory.optimizer_bytes == 4.0  # m, v in bf16


@pytest.mark.parametrize("sharding", ["zero1", "zero2", "fsdp"])
def test_lora_shards_only_the_adapters_state(lora_memory, sharding):
    from boom_ml.parallel.memory import stage_memory

    dp = 4
    out = stage_memory(lora_memory, Layout(dp=dp, sharding=sharding, microbatches=2), 0,
                       LAYERS, 2)  # fmt: skip
    terms = out["parallel_terms"]
    adapters = LAYERS * LORA_LAYER
    assert terms["zero_optimizer_state"] == pytest.approx(-8 * adapters * (dp - 1) / dp, abs=1)
    grads = lora_memory.breakdowns[1]["gradient"]  # every adapter's gradient (accumulation)
    assert 4 * adapters <= grads <= 4 * adapters + 512 * 4 * LAYERS  # allocator rounding
    if sharding == "fsdp":  # every parameter is sharded, frozen or not
        assert terms["zero_parameters"] == pytest.approx(
            -4 * (HELD + adapters) * (dp - 1) / dp, abs=1
        )
    # nothing goes below zero: the state that ZeRO removes is the state the trace holds
    assert all(v >= 0 for v in out["breakdown"].values())


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_bf16_shards_two_byte_parameters(bf16_memory, sharding):
    from boom_ml.parallel.memory import stage_memory

    dp = 4
    out = stage_memory(bf16_memory, Layout(dp=dp, sharding=sharding, microbatches=2), 0,
                       LAYERS, 2)  # fmt: skip
    terms = out["parallel_terms"]
    assert terms["zero_optimizer_state"] == pytest.approx(-4 * HELD * (dp - 1) / dp, abs=1)
    if sharding == "fsdp":
        assert terms["zero_parameters"] == pytest.approx(-2 * HELD * (dp - 1) / dp, abs=1)
        assert terms["fsdp_allgather_buffers"] == 2 * (2 * base_layer_params(1) + HELD
                                                       - LAYERS * base_layer_params(1))  # fmt: skip
    assert all(v >= 0 for v in out["breakdown"].values())


def _lora_shape() -> Shape:
    return Shape(batch_size=2, seq_len=32, hidden=H, act_bytes=2, checkpointing=False,
                 params_layer=base_layer_params(1) + LORA_LAYER, params_first=VOCAB * H,
                 params_last=VOCAB * H + H, trainable_layer=LORA_LAYER, trainable_first=0,
                 trainable_last=0)  # fmt: skip


def test_ddp_reduces_only_the_adapters_gradients():
    out = step_time(_profile(), _lora_shape(), Layout(dp=4), [LAYERS], _groups(dp=4))
    (ddp,) = [c for c in out["collectives"] if c["group"] == "dp"]
    assert (ddp["op"], ddp["bytes"]) == ("all_reduce", 4 * LAYERS * LORA_LAYER)


def test_fsdp_gathers_every_parameter_and_reduces_the_adapters():
    m = 2
    out = step_time(_profile(), _lora_shape(), Layout(dp=4, sharding="fsdp", microbatches=m),
                    [LAYERS], _groups(dp=4))  # fmt: skip
    got = {(c["op"], c["what"].split()[0]): (c["bytes"], c["calls"]) for c in out["collectives"]}
    assert got == {
        ("all_gather", "layer"): (4 * (base_layer_params(1) + LORA_LAYER), 2 * LAYERS * m),
        ("all_gather", "root"): (4 * (2 * VOCAB * H + H), m),
        ("reduce_scatter", "layer"): (4 * LORA_LAYER, LAYERS * m),  # no frozen root gradient
    }


def test_traced_counts_follow_the_recipe():
    from boom_ml.parallel.profile import param_counts
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, seq_len=32, finetune_method="lora", lora_r=R)
    counts = param_counts(SYNTHETIC_TINY_LLAMA, 2, step)
    assert counts["layers"] == base_layer_params(2) + 2 * R * (H + H // 2)  # q, v: H -> H / 2
    assert counts["trainable_layers"] == 2 * R * (H + H // 2)
    assert counts["trainable_first"] == counts["trainable_last"] == 0
    assert param_counts(SYNTHETIC_TINY_LLAMA, 2, StepSpec(params_dtype="fp16"))["bytes"] == 2


@pytest.mark.parametrize("layout", [Layout(dp=2, sharding="fsdp"), Layout(pp=2)])
def test_qlora_with_sharded_or_staged_weights_is_one_line(layout):
    with pytest.raises(InvalidInputError) as err:
        validate(layout, Cluster(), finetune_method="qlora")
    assert "finetune.method=qlora" in str(err.value) and "\n" not in str(err.value)
    validate(Layout(dp=2, sharding="zero2"), Cluster(), finetune_method="qlora")  # modelled


def test_checkpointing_every_k_is_refused_with_a_layout(tmp_path):
    """The rank models' 1- and 2-layer traces both checkpoint layer 0, so their difference is
    an uncheckpointed layer: a layout with checkpointing.every=2 was predicted as if every
    layer but the first ran without checkpointing. It is refused in one line, and the layout
    search (the advice's) gives that line as its reason."""
    from boom_ml import api
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.search import search_layouts_many
    from boom_ml.specs import StepSpec

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SYNTHETIC_TINY_LLAMA))
    words = "checkpointing.every=2 with a multi-GPU layout"
    with pytest.raises(InvalidInputError, match=words):
        api.predict(f"hf:{path}", gpu="h100-sxm", batch_size=2, seq_len=32,
                    checkpointing="full", checkpointing_every=2, parallel={"dp": 2})  # fmt: skip
    step = StepSpec(batch_size=2, seq_len=32, checkpointing="full", checkpointing_every=2)
    with pytest.raises(InvalidInputError, match=words):
        search_layouts_many(f"hf:{path}", [get_gpu("h100-sxm")], step)


def test_zero1_over_master_weights_steps_the_ranks_fp32_shard_alone():
    """bf16 parameters with fp32 master weights: at the optimizer step's peak the gradients
    are fp32 (each 16-bit one cast and dropped); under ZeRO-1 a rank casts its shard alone,
    and the other shards' bf16 gradients stay (they were counted all in fp32)."""
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.memory import _stage_at
    from boom_ml.parallel.memory_profile import memory_profile
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, seq_len=32, params_dtype="bf16", master_weights=True)
    prof = memory_profile(SYNTHETIC_TINY_LLAMA, 1, step, get_gpu("h100-sxm"))
    assert prof.master_weights and prof.param_bytes == 2
    held = HELD
    view = prof.windows["optimizer"]
    alone = _stage_at(prof, view, Layout(), 0, LAYERS, 1, drained=True)
    fp32 = alone["breakdown"]["gradient"]
    assert 4 * held <= fp32 <= 4 * held + 512 * 40  # every gradient in fp32 (allocator rounding)
    dp = 4
    zero1 = _stage_at(prof, view, Layout(dp=dp, sharding="zero1"), 0, LAYERS, 1, drained=True)
    assert zero1["parallel_terms"]["zero_gradients"] == pytest.approx(
        -fp32 * (dp - 1) / dp + 2 * held * (dp - 1) / dp
    )
    # outside the optimizer step ZeRO-1 shards no gradient
    other = _stage_at(prof, prof.windows["backward"], Layout(dp=dp, sharding="zero1"), 0,
                      LAYERS, 1)  # fmt: skip
    assert "zero_gradients" not in other["parallel_terms"]


def test_the_last_steps_gradients_are_the_zero_grads_not_the_backwards():
    """The replay frees the last batch and the last step's gradients at the loop head; those
    frees had kept the phase of the traced rows they came from, so the backward's part of the
    step peaked there, before its zero_grad, holding the last step's fp32 master gradients
    unsharded (Llama-3-8B, bf16 with master weights, ZeRO-1 over 8 ranks: 32 GB of gradients
    on the worst rank where a rank holds 2.25 bytes a parameter, 18 GB). They are the
    zero_grad's now, which like the optimizer step holds the rank's fp32 shard alone."""
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.memory import DRAINED, stage_memory
    from boom_ml.parallel.memory_profile import memory_profile
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, seq_len=32, params_dtype="bf16", master_weights=True)
    prof = memory_profile(SYNTHETIC_TINY_LLAMA, 1, step, get_gpu("h100-sxm"))
    held = HELD
    # the backward holds its own bf16 gradients at most, never the fp32 ones
    for bd in prof.windows["backward"]["breakdowns"]:
        assert bd["gradient"] < 3 * bd["parameter"] // 2
    assert "zero_grad" in DRAINED and "optimizer" in DRAINED
    dp = 4
    rank = stage_memory(prof, Layout(dp=dp, sharding="zero1"), 0, LAYERS, 1)
    # its fp32 shard and the other shards' bf16 gradients, wherever the rank peaks
    assert rank["breakdown"]["gradient"] <= 4 * held / dp + 2 * held * (dp - 1) / dp + 512 * 40


def test_a_qlora_layout_counts_the_4bit_weights_as_parameters(tmp_path):
    """QLoRA holds its 4-bit weights as buffers: a layout's ``memory.parameters`` counts them as
    the weights they stand for, as one GPU's prediction does (it counted the rest alone)."""
    from boom_ml import api

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SYNTHETIC_TINY_LLAMA))
    kw = dict(gpu="h100-sxm", batch_size=2, seq_len=32, params_dtype="bf16",
              finetune={"method": "qlora"}, advice=False, max_batch="off")  # fmt: skip
    one = api.predict(f"hf:{path}", **kw).to_dict()
    ranks = api.predict(f"hf:{path}", parallel={"dp": 2}, **kw).to_dict()
    held = (
        LAYERS * base_layer_params(1) + 2 * VOCAB * H + H
    )  # every weight, the 4-bit ones included
    adapters = one["graph"]["num_trainable_parameters"]
    assert one["graph"]["num_parameters"] == held + adapters
    assert ranks["parallel"][0]["memory"]["parameters"] == held + adapters
    # the layout says what it trains, as one GPU's recipe line does (it had said nothing)
    assert ranks["parallel"][0]["memory"]["trainable_parameters"] == adapters
    from boom_ml.report.table import render_table

    text = render_table(api.predict(f"hf:{path}", parallel={"dp": 2}, **kw))
    assert "  ft=qlora  params=bf16  dp=2 tp=1 pp=1" in text
    # with the targets and dtype the rank's trace took, as one GPU's recipe line names them
    # (it had said "peft's defaults for the model"; the JSON had no word of them)
    assert ranks["parallel"][0]["recipe"] == {"lora_targets": one["graph"]["recipe"]["lora_targets"],
                                              "adapter_dtypes": ["fp32"]}  # fmt: skip
    targets = ",".join(one["graph"]["recipe"]["lora_targets"])
    assert (f"Recipe: qlora adapters r=8, alpha=16, targets {targets}, in fp32; the"
            f" worst rank trains {adapters / 1e6:.1f} M of its {(held + adapters) / 1e6:.1f} M"
            " parameters.") in text  # fmt: skip
    # and explain's stage line counts them too (it had counted the rest alone)
    (stage,) = ranks["parallel"][0]["time"]["per_stage"]
    assert stage["logical_params"] == held + adapters


def test_fsdp_holds_no_gathered_parameters_at_the_optimizer_step():
    """FSDP2 reshards every unit after its backward, the root too: the optimizer step's peak
    holds shards only; the backward's holds two layer units and the root gathered."""
    from boom_ml.parallel.memory import _stage_at

    prof = _memory()
    dp, layout = 4, Layout(dp=4, sharding="fsdp", microbatches=2)
    root = HELD - LAYERS * base_layer_params(1)
    backward = _stage_at(prof, prof.windows["backward"], layout, 0, LAYERS, 2)
    assert backward["parallel_terms"]["fsdp_allgather_buffers"] == 4 * (
        2 * base_layer_params(1) + root
    )
    step = _stage_at(prof, prof.windows["optimizer"], layout, 0, LAYERS, 2, drained=True)
    assert "fsdp_allgather_buffers" not in step["parallel_terms"]
    assert "fsdp_allgather_buffers" not in step["breakdown"]
    assert step["parallel_terms"]["zero_parameters"] == pytest.approx(
        -4 * HELD * (dp - 1) / dp, abs=1
    )


@pytest.mark.parametrize(("adapter_dtype", "width"), [("fp32", 4), ("params", 2)])
def test_ddp_buckets_take_the_gradients_width(tmp_path, adapter_dtype, width):
    """DDP's buckets (gradient_as_bucket_view off) copy every gradient in its dtype: peft's
    fp32 adapters beside bf16 weights fill fp32 buckets, as the all-reduce carries them. They
    had been counted in the weights' width, half the bytes (a hunt)."""
    from boom_ml import api

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SYNTHETIC_TINY_LLAMA))
    out = api.predict(f"hf:{path}", gpu="h100-sxm", batch_size=2, seq_len=32, advice=False,
                      params_dtype="bf16", finetune={"method": "lora", "adapter_dtype": adapter_dtype},
                      max_batch="off", parallel={"dp": 2}).to_dict()  # fmt: skip
    (entry,) = out["parallel"]
    adapters = LAYERS * LORA_LAYER
    assert entry["memory"]["trainable_parameters"] == adapters
    (reduce,) = [c for c in entry["time"]["collectives"] if c["op"] == "all_reduce"]
    assert reduce["bytes"] == adapters * width
    assert entry["memory"]["breakdown"]["ddp_bucket"] == adapters * width
