"""The advisor's multi-GPU layouts: proposed only where nothing fits on one GPU, each fitting
(per its own prediction), ranked by $ per step of the requested batch.

The model is a synthetic small Llama config (not a published model) and the GPU an A100 whose
capacity is forced down to 640 MiB, so that no single-GPU change fits and sharding helps (at
680 MiB Adafactor fits since it is traced with its own for-loop, not AdamW's foreach).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from boom_ml import api
from boom_ml.gpus import get_gpu
from boom_ml.parallel.layout import Cluster, Layout, validate
from boom_ml.parallel.predict import predict_raw
from boom_ml.parallel.search import (
    NEAR_TIE,
    candidate_layouts,
    distinct_choices,
    ranked_layouts,
    search_layouts,
    search_layouts_many,
)
from boom_ml.parallel.shard import load_raw, model_facts
from boom_ml.report.advice_text import advice_lines, layout_lines
from boom_ml.report.advisor import Advice, advise, advise_layouts, lower_bound
from boom_ml.specs import MAX_BATCH_AUTO_GPUS, StepSpec
from tests.tiny_models import tiny_llama_config

MIB = 2**20
STEP = {"batch_size": 1, "seq_len": 64}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = tiny_llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                            tie_word_embeddings=False)  # fmt: skip
    path = tmp_path_factory.mktemp("advisor") / "small_llama.json"
    path.write_text(json.dumps(cfg))
    return f"hf:{path}"


def small_gpu(mib: int = 640):
    a100 = get_gpu("a100-80gb-sxm")
    return replace(a100, id="a100-small", memory_bytes=mib * MIB, total_memory_bytes=mib * MIB)


def test_fitting_model_gets_no_layouts(model: str) -> None:
    p = api.predict(model, gpu="a100-80gb-sxm", **STEP)
    assert p.gpus[0].fits and p.advice == {} and p.layout_advice == {}
    assert p.to_dict()["layout_advice"] == {}


def test_nothing_fits_on_one_gpu_proposes_cheapest_fitting_layouts(model: str) -> None:
    gpu = small_gpu()
    p = api.predict(model, gpu=gpu, **STEP)
    assert not p.gpus[0].fits and not p.advice[gpu.id][0].fits  # nothing tried fits
    found = p.to_dict()["layout_advice"][gpu.id]
    layouts = found["layouts"]
    assert 1 <= len(layouts) <= 3 and found["fitting"] >= len(layouts)
    for prop in layouts:
        assert prop["fits"] and prop["p90_bytes"] <= prop["capacity_bytes"] == gpu.capacity_bytes
        assert prop["gpus"] == prop["layout"]["dp"] * prop["layout"]["tp"] * prop["layout"]["pp"]
        assert prop["usd_per_step"] == pytest.approx(
            gpu.price_usd_per_hour * prop["gpus"] * prop["step_ms"] / 3.6e6
            * STEP["batch_size"] / prop["global_batch"]
        )  # fmt: skip
    costs = [prop["usd_per_step"] for prop in layouts]
    assert all(a <= b * (1 + NEAR_TIE) for i, a in enumerate(costs) for b in costs[i + 1 :])
    text = "\n".join(advice_lines(p))
    assert "cheapest layouts that fit" in text and "consider sharding" not in text
    assert (
        f"$ per step of the requested batch; cheapest first, within {NEAR_TIE:.0%} of each other fewest GPUs first):"
        in text
    )


def test_search_is_valid_ranked_and_cheap_once_profiled(model: str, monkeypatch) -> None:
    from tests.test_attention_backend import _count_traces

    gpu, step, cluster = small_gpu(), StepSpec(**STEP), Cluster()
    raw = load_raw(model)
    facts = model_facts(raw)
    for layout in candidate_layouts(raw, step, cluster):
        assert layout.world <= 64 and layout.tp <= cluster.gpus_per_node
        assert layout.microbatches >= (2 * layout.pp if layout.pp > 1 else 1)
    search_layouts(model, gpu, step)  # profiles every tp degree once (cached)
    traces = _count_traces(monkeypatch)
    replays, timings = [], []
    import boom_ml.memory.estimate as memory_estimate
    import boom_ml.parallel.profile as profile

    for module, name, calls in ((memory_estimate, "estimate_memory", replays),
                                (profile, "_time_parts", timings)):  # fmt: skip
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _r=real, _c=calls, **k: _c.append(1) or _r(*a, **k)
        )
    found = search_layouts(model, gpu, step, top=100)
    assert traces == replays == timings == []  # arithmetic on the cached profiles
    assert found["layouts"] and found["fitting"] >= len(found["layouts"])
    assert found["layouts"] == ranked_layouts(found["layouts"])
    for prop in found["layouts"]:  # every proposal passes the CLI's own layout rules
        lay = prop["layout"]
        validate(Layout(**lay), cluster, heads=facts["heads"], kv_heads=facts["kv_heads"],
                 hidden=facts["hidden"], layers=facts["layers"])  # fmt: skip


def test_model_the_search_cannot_model_keeps_the_old_hint() -> None:
    gpu = small_gpu()
    closest = Advice("amp=bf16", {"amp": "bf16"}, 1, False, 2 * 2**30, 2**30, float("nan"), 0.0)
    out = advise_layouts({gpu.id: [closest]}, [gpu],
                         lambda gs: search_layouts_many("torchvision:resnet18", gs, StepSpec()))  # fmt: skip
    assert out[gpu.id]["layouts"] == [] and "hf: models" in out[gpu.id]["reason"]
    assert advise_layouts({gpu.id: [replace(closest, fits=True)]}, [gpu], lambda g: {}) == {}


def test_one_search_for_many_gpus_equals_a_search_per_gpu(model: str) -> None:
    step = StepSpec(**STEP)
    gpus = [small_gpu(), replace(small_gpu(), id="small-l4", total_memory_bytes=3 * 2**30)]
    together = search_layouts_many(model, gpus, step)
    for gpu in gpus:
        alone = search_layouts(model, gpu, step)
        assert {**together[gpu.id], "seconds": 0} == {**alone, "seconds": 0}


def test_nothing_fits_also_lists_fitting_finetuning_recipes_apart(model: str) -> None:
    gpu = small_gpu()
    p = api.predict(model, gpu=gpu, **STEP)
    items = p.advice[gpu.id]
    recipes = [a for a in items if a.recipe]
    assert not items[0].fits and not items[0].recipe  # the closest full-training change first
    assert recipes and all(a.fits and a.total_bytes <= a.capacity_bytes for a in recipes)
    # every weight in bf16 (no finetune_method: all are trained) or adapters
    assert {a.settings.get("finetune_method", "full") for a in recipes} <= {"full", "lora", "qlora"}
    assert any(a.settings.get("finetune_method") for a in recipes)
    assert all(a.settings["checkpointing"] == "full" for a in recipes)
    assert all(a.settings["params_dtype"] == "bf16" for a in recipes)  # an A100 runs bf16
    text = advice_lines(p)
    at = text.index("    or fine-tune adapters instead of training every weight:")
    assert text[at + 1].startswith("      finetune.method=")
    # recipes change what is trained: the layouts of full training are still searched
    assert p.layout_advice[gpu.id]["layouts"]


def test_a_model_without_adapter_targets_gets_no_recipe_advice() -> None:
    gpu = replace(small_gpu(), id="a100-tiny", memory_bytes=300 * MIB, total_memory_bytes=300 * MIB)
    p = api.predict("torchvision:resnet18", gpu=gpu, batch_size=2, image_size=64)
    assert not p.gpus[0].fits and not p.advice[gpu.id][0].fits  # so recipes were tried
    assert not any(a.recipe for a in p.advice[gpu.id])  # peft names no target in a ResNet


def test_no_layout_of_the_step_fits_asks_the_search_with_checkpointing(model: str) -> None:
    gpu, other = small_gpu(), replace(small_gpu(), id="a100-other")
    closest = Advice("amp=bf16", {"amp": "bf16"}, 1, False, 2 * 2**30, 2**30, float("nan"), 0.0)
    step = StepSpec(**STEP)
    plain = search_layouts_many(model, [gpu, other], step)
    checkpointed = search_layouts_many(model, [gpu], replace(step, checkpointing="full"))
    assert checkpointed[gpu.id]["layouts"]
    asked: list[list[str]] = []

    def none_fit(gpus: list) -> dict:  # the plain search, told that nothing fits on ``gpu``
        asked.append([g.id for g in gpus])
        return {g.id: ({**plain[g.id], "layouts": []} if g.id == gpu.id else plain[g.id])
                for g in gpus}  # fmt: skip

    def with_ckpt(gpus: list) -> dict:
        asked.append([g.id for g in gpus])
        return checkpointed

    advised = {gpu.id: [closest], other.id: [closest]}
    out = advise_layouts(advised, [gpu, other], none_fit, with_ckpt)
    assert asked == [[gpu.id, other.id], [gpu.id]]  # only the GPU with no layout is asked again
    assert out[gpu.id]["layouts"] == checkpointed[gpu.id]["layouts"]
    assert out[gpu.id]["settings"] == {"checkpointing": "full"} and "settings" not in out[other.id]
    text = layout_lines(out[gpu.id])
    assert text[0].startswith("    cheapest layouts that fit with checkpointing=full (")


def test_recipes_follow_max_batch_auto_and_the_table_says_so(model: str) -> None:
    gpus = [replace(small_gpu(), id=f"a100-small-{i}") for i in range(MAX_BATCH_AUTO_GPUS + 1)]
    p = api.predict(model, gpu=gpus, **STEP)
    assert all(not p.advice[g.id][0].fits for g in gpus)
    assert not any(a.recipe for items in p.advice.values() for a in items)
    assert advice_lines(p)[-1] == (
        f"Recipes (bf16-true, LoRA, QLoRA) were not tried for {len(gpus)} GPUs; "
        f"ask at most {MAX_BATCH_AUTO_GPUS} to see which fit where nothing else does."
    )


def test_a_gpu_below_parameters_and_gradients_gets_the_floor_and_no_traces(model: str) -> None:
    gpu = replace(small_gpu(), id="a100-300", memory_bytes=300 * MIB, total_memory_bytes=300 * MIB)
    p = api.predict(model, gpu=[gpu, "a100-80gb-sxm"], advice=False, **STEP)
    small, big = p.gpus
    grads = p.graph["recipe"]["bytes"]["trainable_parameters"]
    step = StepSpec(**p.step)
    floor = lower_bound(small, step, grads)
    m = small.memory
    assert (
        floor.total_bytes
        == m.breakdown["parameter"] + grads + m.total_bytes - m.peak_reserved_bytes
    )
    assert floor.total_bytes > floor.capacity_bytes and floor.lower_bound and not floor.fits
    # a floor: the step itself, on a GPU where it fits, holds at least that much
    assert big.memory.total_bytes >= lower_bound(big, step, grads).total_bytes
    # LoRA over fp32 weights is offered them in 16 bits: the floor is half the tensors'
    lora = lower_bound(small, replace(step, finetune_method="lora"), grads)
    outside = m.total_bytes - m.peak_reserved_bytes
    assert lora.total_bytes == (m.breakdown["parameter"] + grads) // 2 + outside
    assert lora.change == "parameters and gradients alone (in 16 bits)"

    def evaluate(changed: StepSpec, gpus: list) -> list:
        raise AssertionError(f"traced {changed} where nothing can fit")

    advised = advise(step, [(gpu, small)], evaluate, recipes_too=False, gradient_bytes=grads)
    (got,) = advised[gpu.id]  # NaN times: compare the fields that are numbers
    assert (got.change, got.total_bytes, got.lower_bound) == (floor.change, floor.total_bytes, True)
    line = advice_lines(replace(p, advice=advised, gpus=[small]))[0]
    assert line.startswith(
        f"{gpu.id}: no single-GPU change that keeps the weights' dtype fits: parameters and"
        " gradients alone"
    )


def test_a_lora_step_is_offered_4_bit_base_weights_not_a_lighter_optimizer() -> None:
    from boom_ml.gpus import get_gpu
    from boom_ml.report.levers import RECIPE_LEVELS, recipe_changes, single_changes
    from boom_ml.specs import StepSpec

    gpu = get_gpu("rtx-4090")
    lora = StepSpec(batch_size=8, params_dtype="bf16", finetune_method="lora")
    offered = [[c.finetune_method for _, c, _ in recipe_changes(lora, gpu, lv)]
               for lv in RECIPE_LEVELS]  # fmt: skip
    assert offered == [[], ["qlora"], ["qlora"]]  # the last at one sample per micro-batch
    # bf16-true trains every weight: not a LoRA step's recipe
    from boom_ml.report.levers import BF16_TRUE_LEVELS, bf16_true_changes

    assert [bf16_true_changes(lora, gpu, lighter) for lighter in BF16_TRUE_LEVELS] == [[], []]
    assert recipe_changes(replace(lora, finetune_method="qlora"), gpu, RECIPE_LEVELS[1]) == []
    labels = [label for label, _, _ in single_changes(lora, gpu)]
    assert not [x for x in labels if x.startswith("optimizer=")]
    full = [label for label, _, _ in single_changes(replace(lora, finetune_method="full"), gpu)]
    assert [x for x in full if x.startswith("optimizer=adafactor")]


def _proposal(sharding: str, gib: float, ms: float, dp: int = 2) -> dict:
    layout = {"dp": dp, "tp": 8, "pp": 1, "sharding": sharding, "microbatches": 1}
    return {"layout": layout, "total_bytes": int(gib * 2**30), "step_ms": ms}


def test_near_ties_in_cost_name_the_fewest_gpus_first() -> None:
    """Llama-3.2-3B on A100s, 8 samples per step asked of 2 GPUs: dp=64, 32 and 16 cost
    $0.000751, 0.000752 and 0.000755 per requested step, and the advice listed the three
    largest clusters. Within NEAR_TIE of the cheapest the fewest GPUs come first."""
    assert 0.000755 / 0.000751 - 1 < NEAR_TIE

    def proposal(gpus: int, usd: float | None, gpu_seconds: float = 1.0) -> dict:
        return {"gpus": gpus, "usd_per_step": usd, "gpu_seconds_per_step": gpu_seconds}

    p64, p32, p16 = proposal(64, 0.000751), proposal(32, 0.000752), proposal(16, 0.000755)
    p8 = proposal(8, 0.000751 * (1 + NEAR_TIE) * 1.001)  # beyond the tie: after them
    assert ranked_layouts([p64, p8, p32, p16]) == [p16, p32, p64, p8]
    # without a price, GPU-seconds rank, with the same tie
    u64, u16, u4 = proposal(64, None, 10.0), proposal(16, None, 10.05), proposal(4, None, 11.0)
    assert ranked_layouts([u4, u64, u16]) == [u16, u64, u4]


def test_sharding_that_changes_nothing_printed_is_not_a_second_choice() -> None:
    # LoRA on Llama-3-8B (rtx-4090, tp=8): ZeRO-2 shards a few MiB of adapter gradients more
    # than ZeRO-1, the same 20.9 GiB and 7754 ms printed; the simpler layout is named
    zero1, zero2 = _proposal("zero1", 20.91, 7754.2), _proposal("zero2", 20.90, 7754.4)
    fsdp = _proposal("fsdp", 12.3, 7790.0)  # sharding that buys memory stays
    other_shape = _proposal("zero2", 20.9, 7754.0, dp=4)
    ranked = [zero2, zero1, fsdp, other_shape]
    assert distinct_choices(ranked) == [zero1, fsdp, other_shape]
    slower = _proposal("zero2", 20.9, 7756.0)  # a different printed time: a different choice
    assert distinct_choices([zero1, slower]) == [zero1, slower]


def test_each_gpu_is_searched_with_its_own_attention_kernels(
    model: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank's model is traced per attention group (a T4 runs memory-efficient attention,
    an A100 flash, an H100 cuDNN, re-expressed from the flash trace), whatever group the
    step names (the advisor's step carries its first GPU's) and wherever a GPU is listed."""
    from tests.test_attention_backend import _count_traces

    monkeypatch.setenv("BOOM_CACHE_DIR", str(tmp_path))
    calls = _count_traces(monkeypatch)
    step = StepSpec(batch_size=1, seq_len=48, amp="fp16")
    gpus = [get_gpu("t4"), get_gpu("h100-sxm"), get_gpu("a100-80gb-sxm")]
    together = search_layouts_many(model, gpus, replace(step, sdpa_group="sm50"), max_gpus=8)
    assert {c.sdpa_group for c in calls} == {"sm70", "sm80"}  # 1 and 2 layers, each tp
    for gpu in gpus:
        alone = search_layouts(model, gpu, step, max_gpus=8)
        assert {**together[gpu.id], "seconds": 0} == {**alone, "seconds": 0}


def test_where_no_layout_fits_the_closest_is_named(model: str) -> None:
    """A GPU with 100 MiB usable: no layout of up to 64 GPUs fits, with checkpointing or
    without (each rank's CUDA context alone is larger). The advice names the layout whose
    worst rank needs least instead of staying silent."""
    gpu = small_gpu(100)
    p = api.predict(model, gpu=gpu, **STEP)
    found = p.to_dict()["layout_advice"][gpu.id]
    assert found["layouts"] == [] and found["settings"] == {"checkpointing": "full"}
    near = found["closest"]
    assert not near["fits"] and near["p90_bytes"] > near["capacity_bytes"] == gpu.capacity_bytes
    raw, step = load_raw(model), StepSpec(**STEP, checkpointing="full")
    for lay in (Layout(dp=64, sharding="fsdp"), Layout(tp=4), Layout(dp=8, tp=4, sharding="fsdp"),
                Layout(dp=4, tp=4, pp=4, sharding="fsdp", microbatches=16)):  # fmt: skip
        other = predict_raw(raw, [gpu], step, lay, Cluster())[0]["memory"]["p90_bytes"]
        assert near["p90_bytes"] <= other
    # tp stops at the model's 4 key/value heads; sharding over dp saves this model less than
    # its 64 MiB of NCCL buffers per communicator costs: its embedding and head (16.4 M of its
    # 19 M parameters) are FSDP2's root, gathered through the backward with their gradients
    # whole until its end, and ZeRO-2 keeps the embedding's gradient whole
    assert near["layout"] == {"dp": 1, "tp": 4, "pp": 1, "sharding": "none", "microbatches": 1}
    # the search times a layout only where it fits, and then the nearest miss
    nearest = predict_raw(raw, [gpu], step, Layout(tp=4), Cluster())[0]
    assert near["step_ms"] == nearest["time"]["step_ms"] > 0
    (untimed,) = predict_raw(raw, [gpu], step, Layout(tp=4), Cluster(), time_if_fits=True)
    assert "time" not in untimed and untimed["fits"] is False
    text = advice_lines(p)
    at = next(i for i, line in enumerate(text) if "no layout of up to" in line)
    assert "consider sharding" not in text[at - 1]  # it was: no layout fits
    assert text[at] == (f"    no layout of up to 64 GPUs fits, with checkpointing=full or without "
                        f"({found['searched']} searched); the closest, with checkpointing=full:")  # fmt: skip
    assert text[at + 1] == (f"      tp=4: 4 GPUs, {near['p90_bytes'] / 2**30:.1f} GiB per GPU (p90) "
                            f"of 0.1 GiB usable")  # fmt: skip


@pytest.mark.parametrize("batch", [5, 6, 11, 12, 60, 64])
def test_accumulation_advice_keeps_every_sample(batch):
    """A micro-batch split trains the same samples per step (5 as 1 x 5, not 2 x 2)."""
    from boom_ml.report.levers import halving_micros, single_changes, stacked_changes

    gpu = get_gpu("t4")
    step = StepSpec(batch_size=batch)
    changes = single_changes(step, gpu) + stacked_changes(step, gpu)
    split = [s for label, s, acc in changes if acc > 1]
    assert split and all(s.batch_size * s.grad_accum == batch for s in split)
    assert halving_micros(batch)[-1] == 1


def test_advice_labels_name_the_accumulation_that_was_evaluated() -> None:
    """Under grad_accum=2, splitting batch 16 into 8s runs 4 accumulation steps: the label
    says 4 (it said 2, the factor, and `batch_size=8 grad_accum=2` ran half the samples)."""
    from boom_ml.report.levers import recipe_changes, single_changes, stacked_changes

    step = StepSpec(batch_size=16, grad_accum=2, amp="bf16")
    gpu = get_gpu("l4")
    changes = single_changes(step, gpu) + stacked_changes(step, gpu) + recipe_changes(step, gpu)
    split = [(label, s) for label, s, acc in changes if acc > 1]
    assert split
    for label, s in split:
        assert f"batch_size={s.batch_size} x {s.grad_accum} accumulation steps" in label
    assert "batch_size=8 x 4 accumulation steps" in [label for label, _ in split]


def test_a_lighter_optimizer_is_traced_with_its_own_implementation() -> None:
    """The step handed to the advisor carries AdamW's resolved foreach: the Adafactor
    candidate resolves its own (Adafactor's default for-loop, 4 GB less on an enlarged
    gpt2 than with AdamW's foreach temporaries)."""
    from boom_ml.report.levers import single_changes, stacked_changes

    step = StepSpec(batch_size=8, optimizer="adamw", optimizer_impl="foreach")
    gpu = get_gpu("t4")
    lighter = [changed for label, changed, _ in single_changes(step, gpu) + stacked_changes(step, gpu)
               if "optimizer=adafactor" in label]  # fmt: skip
    assert len(lighter) >= 2  # alone, and stacked under the others
    assert {(c.optimizer, c.optimizer_impl) for c in lighter} == {("adafactor", "auto")}


def test_cache_off_stores_no_layout_profile_and_the_dict_is_strict_json(
    model: str, tmp_path, monkeypatch
) -> None:
    """A hunt: the advice's layout search of a one-GPU step wrote rank profiles into the disk
    cache under cache=off, and ``to_dict()`` held NaN (an advice that does not fit has no
    time), which strict JSON refuses; it is None there, as in the CLI's JSON."""
    import json

    monkeypatch.setenv("BOOM_CACHE_DIR", str(tmp_path / "cache"))
    gpu = small_gpu()
    p = api.predict(model, gpu=gpu, cache=False, **STEP)
    assert p.layout_advice[gpu.id]["layouts"]  # the search ran
    assert not [f for f in (tmp_path / "cache").rglob("*") if f.is_file()]
    closest = p.advice[gpu.id][0]
    assert not closest.fits and closest.step_ms != closest.step_ms  # NaN on the object
    doc = p.to_dict()
    assert doc["advice"][gpu.id][0]["step_ms"] is None
    json.dumps(doc, allow_nan=False)
    doc["step"]["batch_size"] = 777  # a copy: the prediction is as it was
    assert p.step["batch_size"] == STEP["batch_size"]
    # the table's samples/s and $ / 1k steps are in the JSON too (a hunt found neither)
    (row,), (result,) = doc["gpus"], p.gpus
    assert row["samples_per_s"] == STEP["batch_size"] / result.time.step_ms * 1e3
    assert row["usd_per_1000_steps"] == result.usd_per_1000_steps
    # and both on the GPU's object, as the JSON has them beside each other (samples_per_s had
    # been the prediction's method alone: an API hunt)
    assert result.samples_per_s == row["samples_per_s"]


def test_a_gpu_without_a_price_ranks_its_layouts_by_gpu_seconds_and_says_so() -> None:
    """The header had said "$ per step" above lines that all read "no price" (a hunt)."""
    proposal = {"layout": {"dp": 8, "tp": 2, "pp": 1, "sharding": "fsdp", "microbatches": 1},
                "gpus": 16, "nodes": 2, "total_bytes": 30 * 2**30, "capacity_bytes": 39 * 2**30,
                "step_ms": 900.0, "global_batch": 16, "usd_per_step": None}  # fmt: skip
    found = {"layouts": [proposal], "fitting": 1, "searched": 9, "seconds": 1.0}
    head, line = layout_lines(found)
    assert head == ("    cheapest layouts that fit (1 of 9 fit, searched in 1.0 s; GPU-seconds per"
                    " step (no price for this GPU) of the requested batch):")  # fmt: skip
    assert line.endswith("900 ms per step of 16 samples, no price")
    priced = layout_lines({**found, "layouts": [{**proposal, "usd_per_step": 0.01}]})[0]
    assert "s; $ per step of the requested batch):" in priced
