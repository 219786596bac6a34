"""The advisor's levers: which changes it offers a step, alone and stacked, and that each is a
step the CLI accepts (a candidate the step check refuses once ended the whole prediction)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from boom_ml.gpus import get_gpu
from boom_ml.report.levers import RECIPE_LEVELS, recipe_changes, single_changes, stacked_changes
from boom_ml.specs import StepSpec


@pytest.mark.parametrize(("adapter_dtype", "amp"), [("params", "none"), ("fp32", "fp16")])
def test_recipes_under_fp16_autocast_on_a_gpu_without_bf16(adapter_dtype, amp) -> None:
    """T4: the recipes put the frozen weights in fp16. GradScaler cannot unscale the gradients
    of fp16 adapters, so with adapters in the weights' dtype they run without the autocast
    and say so; peft's default fp32 adapters keep it."""
    step = StepSpec(batch_size=4, seq_len=2048, amp="fp16", adapter_dtype=adapter_dtype)
    offered = [c for level in RECIPE_LEVELS for c in recipe_changes(step, get_gpu("t4"), level)]
    assert len(offered) == 4
    for label, changed, _ in offered:
        assert (changed.params_dtype, changed.amp) == ("fp16", amp)
        dropped = " + amp=none" if amp == "none" else ""
        assert f" + params_dtype=fp16{dropped} + checkpointing=full" in label
    # a bf16 GPU's recipes keep the autocast asked for (bf16 weights under fp16 autocast run)
    ((_, kept, _),) = recipe_changes(step, get_gpu("rtx-3090"))
    assert (kept.params_dtype, kept.amp) == ("bf16", "fp16")


def test_stacked_16_bit_weights_replace_the_autocast_stacked_before_them() -> None:
    """LoRA: the first lever is autocast, the second 16-bit frozen weights, which compute in
    16 bits themselves. On a T4 both are fp16 (refused together: the stack used to skip the
    weights, its biggest saving); on a bf16 GPU the autocast was named and changed nothing."""
    lora = StepSpec(batch_size=8, seq_len=2048, finetune_method="lora")
    for gpu, dtype in (("t4", "fp16"), ("rtx-3090", "bf16")):
        stacks = stacked_changes(lora, get_gpu(gpu))
        label, first, _ = stacks[0]
        assert label == f"params_dtype={dtype} + checkpointing=full"
        assert (first.params_dtype, first.amp, first.checkpointing) == (dtype, "none", "full")
        assert all(c.params_dtype == dtype and c.amp == "none" for _, c, _ in stacks)
        assert not [x for x, _, _ in stacks if "amp=" in x]


def test_partial_checkpointing_is_offered_full_checkpointing() -> None:
    gpu = get_gpu("a100-40gb-sxm")
    cases = {
        ("selective", 1): "checkpointing=full",
        ("full", 2): "checkpointing.every=1",
        ("selective", 3): "checkpointing=full + checkpointing.every=1",
    }
    for (mode, every), want in cases.items():
        step = StepSpec(batch_size=8, seq_len=1024, checkpointing=mode, checkpointing_every=every)
        offered = {label: c for label, c, _ in single_changes(step, gpu)}
        assert (offered[want].checkpointing, offered[want].checkpointing_every) == ("full", 1)
    done = StepSpec(batch_size=8, seq_len=1024, checkpointing="full")
    assert not [x for x, _, _ in single_changes(done, gpu) if x.startswith("checkpointing")]


def test_every_advice_says_its_change_as_command_line_keys() -> None:
    """``settings`` are StepSpec fields (finetune_method); ``options`` are what the command
    takes (finetune.method=), so an advice can be run as it is printed."""
    from dataclasses import fields

    from boom_ml.predict import KEY_ALIASES, config_keys
    from boom_ml.report.advisor import command_options

    step = StepSpec(batch_size=8, seq_len=2048, checkpointing="selective", checkpointing_every=2)
    gpu = get_gpu("t4")
    from boom_ml.report.levers import bf16_true_changes

    offered = single_changes(step, gpu) + stacked_changes(step, gpu) + recipe_changes(step, gpu)
    offered += bf16_true_changes(step, get_gpu("a100-40gb-sxm"), lighter=True)
    names = {f.name for f in fields(StepSpec)}
    for _, changed, _ in offered:
        settings = {
            f: getattr(changed, f) for f in names if getattr(changed, f) != getattr(step, f)
        }
        for key in command_options(settings):
            assert key in config_keys() or key in KEY_ALIASES, key
    assert command_options({"finetune_method": "qlora", "lora_r": 16, "checkpointing_every": 1,
                            "amp": "none"}) == {"finetune.method": "qlora", "finetune.r": 16,
                                                "checkpointing.every": 1, "amp": "none"}  # fmt: skip
    # a hunt: the lighter optimizer's options said optimizer_impl, --help's key is optimizer.impl
    assert command_options({"optimizer_impl": "auto"}) == {"optimizer.impl": "auto"}


def test_a_fit_without_checkpointing_is_found_beside_the_stacked_one() -> None:
    """The stack adds checkpointing before the splits; the walk without it reaches a smaller
    micro-batch instead, and the faster of the two fits is advised first. A synthetic GPU
    where autocast + Adafactor fit at micro-batch 2, every lever at micro-batch 4; a
    checkpointed step costs a third more, a halved micro-batch 5 % (numbers made up here)."""
    from boom_ml.estimates import GpuPrediction, MemoryEstimate, TimeEstimate
    from boom_ml.report.advisor import advise

    step = StepSpec(batch_size=8, seq_len=1024)
    gpu = get_gpu("rtx-3090")
    asked: list[StepSpec] = []

    def evaluate(changed: StepSpec, gpus: list) -> list:
        asked.append(changed)
        light = changed.amp != "none" and changed.optimizer == "adafactor"
        ckpt = changed.checkpointing == "full"
        fits = light and changed.batch_size <= (4 if ckpt else 2)
        ms = 100.0 * (4 / 3 if ckpt else 1.0) * 1.05 ** (8 // changed.batch_size - 1)
        memory = MemoryEstimate(0, 0, 10 if fits else 30, 20, fits, "synthetic")
        return [GpuPrediction(g.id, g.name, memory, TimeEstimate(ms, "synthetic")) for g in gpus]

    failing = evaluate(step, [gpu])[0]
    advised = advise(step, [(gpu, failing)], evaluate, recipes_too=False)[gpu.id]
    # the checkpointed fit (4 x 2) is found too, and left out: it changes a strict superset of
    # the settings of one that is faster and holds no more (advisor._undominated)
    assert [a.change for a in advised] == [
        "amp=bf16 + optimizer=adafactor + batch_size=2 x 4 accumulation steps",
    ]
    assert len(asked) == len(set(asked))  # no candidate evaluated twice
    # without checkpointing, nothing above the micro-batch that fitted with it (4) is asked
    light = [c.batch_size for c in asked
             if c.amp != "none" and c.optimizer == "adafactor" and c.checkpointing == "none"]  # fmt: skip
    assert light == [4, 2]


def _synthetic(fits, asked: list[StepSpec], refuse=lambda changed: False):
    """An evaluate() over synthetic predictions: ``fits(step)`` says which fit."""
    from boom_ml.errors import InvalidInputError
    from boom_ml.estimates import GpuPrediction, MemoryEstimate, TimeEstimate

    def evaluate(changed: StepSpec, gpus: list) -> list:
        if refuse(changed):
            raise InvalidInputError("synthetic: this model cannot take that")
        asked.append(changed)
        memory = MemoryEstimate(0, 0, 10 if fits(changed) else 30, 20, fits(changed), "synthetic")
        return [GpuPrediction(g.id, g.name, memory, TimeEstimate(100.0 / changed.batch_size,
                                                                 "synthetic")) for g in gpus]  # fmt: skip

    return evaluate


def test_a_step_with_checkpointing_is_not_walked_twice() -> None:
    """Checkpointed already (and on SGD: no lighter optimizer), the walk without
    checkpointing is the first walk again: nothing is evaluated twice."""
    from boom_ml.report.advisor import advise

    step = StepSpec(batch_size=8, seq_len=1024, checkpointing="full", optimizer="sgd")
    gpu, asked = get_gpu("t4"), []
    evaluate = _synthetic(lambda c: c.amp != "none" and c.batch_size <= 2, asked)
    advised = advise(step, [(gpu, evaluate(step, [gpu])[0])], evaluate, recipes_too=False)
    assert [a.change for a in advised[gpu.id]] == ["amp=fp16 + batch_size=2 x 4 accumulation steps"]
    assert len(asked) == len(set(asked)) == 7  # the step, 4 singles, 2 stacked


def test_a_model_that_cannot_be_checkpointed_is_walked_without_it() -> None:
    """Every stack of the first walk holds checkpointing, which this model refuses (no blocks,
    an HF class without it): nothing was evaluated there, and the walk without it finds the
    fit (it was skipped: it asked only where the first walk fitted)."""
    from boom_ml.report.advisor import advise

    step, gpu, asked = StepSpec(batch_size=8, seq_len=1024), get_gpu("rtx-3090"), []
    evaluate = _synthetic(lambda c: c.amp != "none" and c.optimizer == "adafactor"
                          and c.batch_size <= 2, asked,
                          refuse=lambda c: c.checkpointing == "full")  # fmt: skip
    advised = advise(step, [(gpu, evaluate(step, [gpu])[0])], evaluate, recipes_too=False)
    assert [a.change for a in advised[gpu.id]] == [
        "amp=bf16 + optimizer=adafactor + batch_size=2 x 4 accumulation steps"
    ]


def test_an_advice_line_names_its_p90_where_it_prints_otherwise() -> None:
    from boom_ml.report.advice_text import _advice_line
    from boom_ml.report.advisor import Advice

    gib = 2**30
    tight = Advice("optimizer=adafactor", {}, 1, True, int(21.9 * gib), 22 * gib, 1349.5, 191.9,
                   p90_bytes=int(21.96 * gib))  # fmt: skip
    assert _advice_line(tight) == (
        "    optimizer=adafactor: 21.9 (p90 22.0) / 22.0 GiB, 1349.5 ms per step, 191.9 samples/s"
    )
    same = replace(tight, p90_bytes=int(21.91 * gib))  # prints as the central figure does
    assert _advice_line(same).startswith("    optimizer=adafactor: 21.9 / 22.0 GiB")
    assert _advice_line(replace(tight, p90_bytes=None)) == _advice_line(same)


def test_the_closest_advice_names_its_p90_too() -> None:
    from boom_ml.estimates import Prediction
    from boom_ml.report.advice_text import advice_lines
    from boom_ml.report.advisor import Advice

    gib = 2**30
    closest = Advice("batch_size=8", {}, 1, False, int(21.8 * gib), 22 * gib, float("nan"),
                     float("nan"), p90_bytes=int(22.3 * gib))  # fmt: skip
    p = Prediction("m", 8, {}, {}, [], advice={"l4": [closest]})
    assert advice_lines(p)[0] == (
        "l4: nothing tried fits on one GPU; closest: batch_size=8 needs 21.8 (p90 22.3) of "
        "22.0 GiB (consider sharding the model over GPUs, e.g. FSDP/ZeRO)"
    )
    # a model no layout models (a torchvision one) has its reason on the next line instead
    reason = "parallel layouts support hf: models for now, got 'torchvision:resnet18'"
    p = Prediction("m", 8, {}, {}, [], advice={"l4": [closest]},
                   layout_advice={"l4": {"reason": reason}})  # fmt: skip
    assert advice_lines(p)[:2] == [
        "l4: nothing tried fits on one GPU; closest: batch_size=8 needs 21.8 (p90 22.3) of 22.0 GiB",
        f"    no multi-GPU layout searched: {reason}",
    ]


def test_autocast_is_tried_on_the_split_that_fits_alone() -> None:
    """A split fits alone and autocast does not: the stacked walk never runs, and the pair
    (autocast on that split and on the next larger one) was never asked, though it halves
    the time (an advisor hunt: resnet152 at 256 on a T4, 128 x 2 in fp16 at 2027.9 ms beside
    64 x 4 in fp32 at 4012.4). Synthetic GPU: a 64-sample micro-batch fits in fp32, 128 in
    16-bit autocast; a step takes 100 ms / micro-batch size (numbers made up here)."""
    from boom_ml.report.advisor import advise
    from boom_ml.report.levers import half_precision_splits

    step, gpu, asked = StepSpec(batch_size=256), get_gpu("t4"), []
    assert [label for label, _, _ in half_precision_splits(step, gpu, 64)] == [
        "amp=fp16 + batch_size=128 x 2 accumulation steps",
        "amp=fp16 + batch_size=64 x 4 accumulation steps",
    ]
    # a bf16 step where no tensor core takes bf16 is offered fp16 on the split as well (a
    # hunt: gpt2 on a T4 was advised bf16 2 x 8 at 3.4x the time of fp16 4 x 4); where bf16
    # runs on tensor cores, autocast has nothing to add
    bf16 = StepSpec(batch_size=256, amp="bf16")
    assert [label for label, _, _ in half_precision_splits(bf16, gpu, 64)] == [
        "amp=fp16 + batch_size=128 x 2 accumulation steps",
        "amp=fp16 + batch_size=64 x 4 accumulation steps",
    ]
    assert half_precision_splits(bf16, get_gpu("a100-80gb-sxm"), 64) == []
    evaluate = _synthetic(lambda c: c.batch_size <= (128 if c.amp != "none" else 64), asked)
    advised = advise(step, [(gpu, evaluate(step, [gpu])[0])], evaluate, recipes_too=False)
    # fastest first (100 / micro-batch ms); amp=fp16 + 64 x 4 is asked and left out: no
    # faster than 64 x 4 alone here, and no smaller (advisor._undominated)
    assert [a.change for a in advised[gpu.id]] == [
        "amp=fp16 + batch_size=128 x 2 accumulation steps",
        "batch_size=64 x 4 accumulation steps",
        "batch_size=32 x 8 accumulation steps",
    ]
    assert any(c.amp == "fp16" and c.batch_size == 64 for c in asked)
    assert len(asked) == len(set(asked))


def test_bf16_true_is_offered_to_full_fp32_training_on_bf16_gpus() -> None:
    """A hunt: Llama-3-8B at 1 x 4096 on an A100-40GB was told no single-GPU change fits and
    sent to 64 GPUs, where every weight in bf16 with Adafactor and checkpointing fits on one
    (33.4 GiB). The recipe: params_dtype=bf16 without autocast or master weights, checkpointing
    full, then with the lighter optimizer; never before Ampere, never for adapters."""
    from boom_ml.report.levers import BF16_TRUE_LEVELS, bf16_true_changes

    step = StepSpec(batch_size=1, seq_len=4096, amp="bf16")
    a100 = get_gpu("a100-40gb-sxm")
    (plain,), (light,) = (bf16_true_changes(step, a100, lighter) for lighter in BF16_TRUE_LEVELS)
    assert plain[0] == "params_dtype=bf16 + amp=none + checkpointing=full"
    assert light[0] == "params_dtype=bf16 + amp=none + checkpointing=full + optimizer=adafactor"
    for _, changed, accumulation in (plain, light):
        assert (changed.params_dtype, changed.amp, changed.master_weights) == (
            "bf16",
            "none",
            False,
        )
        assert (changed.checkpointing, changed.checkpointing_every, accumulation) == ("full", 1, 1)
    assert (plain[1].optimizer, light[1].optimizer) == ("adamw", "adafactor")
    assert bf16_true_changes(step, get_gpu("t4")) == []  # no bf16 tensor cores
    assert bf16_true_changes(replace(step, optimizer="sgd"), a100, lighter=True) == []
    assert bf16_true_changes(replace(step, params_dtype="bf16", amp="none"), a100) == []


def test_a_stacked_fits_split_is_also_tried_alone() -> None:
    """Past 8 micro-batches a split is only tried on top of the stacked levers: resnet50 at
    batch 5000 on an RTX 3090 was told adafactor + 250 x 20 where 250 x 20 with AdamW fits too
    (a helper's hunt). A synthetic GPU where any step of micro-batch 4 or less fits."""
    from boom_ml.report.advisor import advise

    step, gpu, asked = StepSpec(batch_size=64, seq_len=1024), get_gpu("rtx-3090"), []
    evaluate = _synthetic(lambda c: c.batch_size <= 4, asked)
    advised = advise(step, [(gpu, evaluate(step, [gpu])[0])], evaluate, recipes_too=False)
    # the stacked fits (bf16 + Adafactor + 4 x 16, and with checkpointing) and the split under
    # each single lever are asked; none is faster or smaller here than 4 x 16 alone, which
    # changes fewer settings (advisor._undominated)
    assert [a.change for a in advised[gpu.id]] == ["batch_size=4 x 16 accumulation steps"]
    assert len(asked) == len(set(asked))  # each candidate asked once
    under_one = {
        (c.amp, c.optimizer) for c in asked if c.batch_size == 4 and c.checkpointing == "none"
    }
    assert {("none", "adamw"), ("bf16", "adamw"), ("none", "adafactor")} <= under_one


def test_16_bit_advice_on_an_architecture_without_its_fp16_kernels_is_said() -> None:
    """amp=bf16 advised on an RTX 4090 runs fp16/bf16 GEMMs and convolutions no Ada GPU had
    measured; the fp32 step asked has none, so the table's own line says nothing of them."""
    from boom_ml import api
    from boom_ml.report.table import render_table

    p = api.predict("torchvision:resnet18", gpu=["rtx-4090"], batch_size=1536, image_size=224,
                    cache=False, max_batch=False)  # fmt: skip
    advised = [a for a in p.advice["rtx-4090"] if a.fits]
    assert any(a.unmeasured_kernels for a in advised) and p.gpus[0].time.unmeasured_kernels == []
    text = render_table(p)
    assert "(the 16-bit advice runs fp16/bf16 GEMMs and convolutions no GPU of rtx-4090's" in text


def test_a_split_grows_to_the_largest_divisor_below_the_halving_that_failed() -> None:
    """resnet50 at batch 5000 on an RTX 3090 was told 250 x 20 (the halvings 625, 250) where
    its largest batch, 540, holds 500 x 10 (a helper's hunt). A synthetic GPU where any step of
    micro-batch 540 or less fits: 500 is the one divisor of 5000 between 250 and 625, and it
    is asked once."""
    from boom_ml.report.advisor import advise

    step, gpu, asked = StepSpec(batch_size=5000), get_gpu("rtx-3090"), []
    evaluate = _synthetic(lambda c: c.batch_size <= 540, asked)
    advised = advise(step, [(gpu, evaluate(step, [gpu])[0])], evaluate, recipes_too=False)
    # the split it grew from stays behind it (more room, in a real step)
    assert [a.change for a in advised[gpu.id]] == [
        "batch_size=500 x 10 accumulation steps",
        "batch_size=250 x 20 accumulation steps",
    ]
    assert advised[gpu.id][0].options == {"batch_size": 500, "grad_accum": 10}
    assert len(asked) == len(set(asked))
    # told the step's largest batch, the advisor traces no plain split above it (2500, 1250,
    # 625 had each been traced to find they do not fit) and asks the largest divisor it
    # holds at once, which fits alone: no lever is stacked
    failing = evaluate(step, [gpu])[0]
    failing.memory.max_batch_size = 540
    asked.clear()
    again = advise(step, [(gpu, failing)], evaluate, recipes_too=False)
    assert [a.change for a in again[gpu.id]] == ["batch_size=500 x 10 accumulation steps"]
    plain = [c.batch_size for c in asked if c == replace(step, batch_size=c.batch_size,
                                                         grad_accum=c.grad_accum)]  # fmt: skip
    assert plain == [500]


def test_a_split_that_grows_bisects_the_divisors_between() -> None:
    """Batch 96 where micro-batches of 40 or less fit: the halvings give 48 (no) and 24 (yes);
    32 lies between, fits, and leads, 24 x 4 and 12 x 8 behind it. Where only 24 fits, 32 is
    asked, does not fit, and is not listed."""
    from boom_ml.report.advisor import advise
    from boom_ml.report.splits import between

    assert between(96, 24) == [32]
    assert between(5000, 250) == [500]
    assert between(360, 45) == [60, 72]  # halvings 180, 90, 45: 60 and 72 lie below 90
    assert between(256, 64) == []  # a power of two: nothing between its halvings
    assert between(100, 50) == []  # the first halving: only divisors below the batch itself
    step, gpu = StepSpec(batch_size=96), get_gpu("rtx-3090")
    for limit, grown in ((40, ["batch_size=32 x 3 accumulation steps"]), (31, [])):
        asked: list[StepSpec] = []
        evaluate = _synthetic(lambda c, limit=limit: c.batch_size <= limit, asked)
        advised = advise(step, [(gpu, evaluate(step, [gpu])[0])], evaluate, recipes_too=False)
        assert [a.change for a in advised[gpu.id]] == [
            *grown,
            "batch_size=24 x 4 accumulation steps",
            "batch_size=12 x 8 accumulation steps",
        ]
        assert sum(c.batch_size == 32 for c in asked) == 1


def test_a_split_bisection_asks_the_larger_divisor_first() -> None:
    """Batch 360 where micro-batches of 65 or less fit: 90 does not, 45 does; of 60 and 72
    between, 72 is asked first and does not fit, then 60, which does."""
    from boom_ml.report.advisor import advise

    step, gpu, asked = StepSpec(batch_size=360), get_gpu("rtx-3090"), []
    evaluate = _synthetic(lambda c: c.batch_size <= 65, asked)
    advised = advise(step, [(gpu, evaluate(step, [gpu])[0])], evaluate, recipes_too=False)
    assert advised[gpu.id][0].change == "batch_size=60 x 6 accumulation steps"
    probes = [c.batch_size for c in asked if c.batch_size in (60, 72)]
    assert probes == [72, 60]


def test_a_candidate_two_levels_reach_is_asked_and_listed_once() -> None:
    """A hunt: Llama-3-8B LoRA at 2 x 512 on an L4 listed 'params_dtype=bf16 + batch_size=1 x
    2' twice, the stacked walk and the split under fewer levers both reaching it. Synthetic
    fits: bf16 weights at micro-batch 1, or checkpointed."""
    from boom_ml.report.advisor import advise

    step = StepSpec(batch_size=2, seq_len=512, finetune_method="lora")
    gpu, asked = get_gpu("l4"), []
    evaluate = _synthetic(
        lambda c: c.params_dtype == "bf16" and (c.batch_size == 1 or c.checkpointing == "full"),
        asked,
    )
    advised = advise(step, [(gpu, evaluate(step, [gpu])[0])], evaluate, recipes_too=False)
    assert [a.change for a in advised[gpu.id]] == [
        "params_dtype=bf16 + checkpointing=full",
        "params_dtype=bf16 + batch_size=1 x 2 accumulation steps",
    ]
    assert len(asked) == len(set(asked)) == 7


def test_autocast_is_tried_on_the_largest_batchs_split_where_no_split_fits() -> None:
    """The gradients kept between micro-batches take the room the largest batch had, so no
    split fits alone, and checkpointing does: vit_l_16 at 256 on a T4 (largest batch 33) was
    told checkpointing=full alone (32.9 s) where fp16 autocast on 32 x 8 fits at 5.7 s (a
    hunt). Synthetic GPU: the step's largest batch is 33; with kept gradients an fp32
    micro-batch of 16 fits and one of 32 only under autocast; checkpointing fits (numbers
    made up here)."""
    from boom_ml.report.advisor import advise
    from boom_ml.report.splits import under_kept_gradients

    step, gpu, asked = StepSpec(batch_size=256), get_gpu("t4"), []
    assert [label for label, _, _ in under_kept_gradients(step, gpu, 33)] == [
        "amp=fp16 + batch_size=64 x 4 accumulation steps",
        "amp=fp16 + batch_size=32 x 8 accumulation steps",
        "batch_size=16 x 16 accumulation steps",
    ]
    assert under_kept_gradients(step, gpu, None) == under_kept_gradients(step, gpu, 0) == []

    def fits(c: StepSpec) -> bool:
        if c.checkpointing == "full":
            return True
        return c.grad_accum > 1 and c.batch_size <= (32 if c.amp != "none" else 16)

    evaluate = _synthetic(fits, asked)
    first = evaluate(step, [gpu])[0]
    first = replace(first, memory=replace(first.memory, max_batch_size=33))
    advised = advise(step, [(gpu, first)], evaluate, recipes_too=False)
    assert sorted(a.change for a in advised[gpu.id]) == [
        "amp=fp16 + batch_size=32 x 8 accumulation steps",
        "batch_size=16 x 16 accumulation steps",
        "checkpointing=full",
    ]
    assert len(asked) == len(set(asked))


def test_bf16_autocast_on_a_gpu_without_bf16_tensor_cores_is_offered_fp16() -> None:
    """A T4 runs bf16 at its fp32 rate and SDPA's math path (no fused bf16 kernel): the
    advice offers fp16 autocast, which fit GPT-2 medium at 4 x 512 alone, 2.8x faster than
    the best lever it had listed; a GPU with bf16 tensor cores is offered no such change."""
    step = StepSpec(batch_size=4, seq_len=512, amp="bf16")
    offered = {label: changed for label, changed, _ in single_changes(step, get_gpu("t4"))}
    assert offered["amp=fp16 (no bf16 tensor cores on this GPU)"] == replace(step, amp="fp16")
    assert not [x for x, _, _ in single_changes(step, get_gpu("rtx-3090")) if x.startswith("amp=")]
    # fp16 weights under fp16 autocast are refused (GradScaler): not offered, no crash (it had
    # ended the advice of params_dtype=fp16 amp=bf16 on a T4)
    fp16_weights = replace(step, params_dtype="fp16")
    assert not [
        x for x, _, _ in single_changes(fp16_weights, get_gpu("t4")) if x.startswith("amp=")
    ]
