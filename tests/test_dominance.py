"""No step is timed slower on a GPU than on a packaged GPU it beats on every spec number
(``boom_ml/timing/dominance.py``)."""

from __future__ import annotations

import pytest

import boom_ml
from boom_ml.estimates import TimeEstimate
from boom_ml.gpus import all_gpus, get_gpu
from boom_ml.timing.anchors import dominates
from boom_ml.timing.dominance import dominated_extra, no_slower_than_dominated


def test_a_gpu_takes_the_fastest_estimate_of_those_it_dominates() -> None:
    """Synthetic times: the A100 SXM beats the A100 PCIe and the A30 on every spec number,
    and the T4 beats none of them."""
    a100, pcie, a30, t4 = (get_gpu(g) for g in ("a100-80gb-sxm", "a100-80gb-pcie", "a30", "t4"))
    assert dominates(a100, pcie) and dominates(a100, a30) and not dominates(t4, a30)
    times = [TimeEstimate(ms, "synthetic") for ms in (50.0, 45.0, 40.0, 400.0)]
    out = no_slower_than_dominated([a100, pcie, a30, t4], times)
    assert [(e.step_ms, e.timed_as) for e in out] == [
        (40.0, "a30"),  # the fastest of the two it beats, not the first
        (40.0, "a30"),  # the PCIe card beats the A30 too
        (40.0, ""),
        (400.0, ""),
    ]
    assert out[0] is not times[2] and times[2].timed_as == ""  # a copy, the A30's untouched
    # faster than all it beats: its own estimate
    assert no_slower_than_dominated([a100, a30], [times[2], times[0]])[0] is times[2]


def test_the_same_spec_sheet_but_memory_takes_the_same_time() -> None:
    small, big = get_gpu("v100-sxm2-16gb"), get_gpu("v100-sxm2-32gb")
    assert dominates(small, big) and dominates(big, small)
    out = no_slower_than_dominated(
        [small, big], [TimeEstimate(30.0, "synthetic"), TimeEstimate(29.0, "synthetic")]
    )
    assert [(e.step_ms, e.timed_as) for e in out] == [(29.0, "v100-sxm2-32gb"), (29.0, "")]


def test_the_packaged_gpus_it_beats_are_timed_too() -> None:
    a100 = get_gpu("a100-80gb-sxm")
    extra = dominated_extra([a100])
    assert {g.id for g in extra} == {g.id for g in all_gpus() if dominates(a100, g)}
    assert "a30" in {g.id for g in extra} and "h100-sxm" not in {g.id for g in extra}
    assert dominated_extra([a100, *extra]) == []  # asked already: none more
    assert dominated_extra([get_gpu("t4")]) == []  # the T4 beats none on every number


@pytest.mark.parametrize(
    "kw",
    [
        {"model": "torchvision:resnet50", "batch_size": 64},  # timed by the GNN
        {"model": "torchvision:resnet50", "batch_size": 64, "amp": "fp16"},  # per-op
    ],
)
def test_no_gpu_is_slower_than_one_it_beats_on_every_number(kw) -> None:
    """The GNN had put resnet50 fp32 at batch 64 14 % slower on an RTX 4090 than on an A30,
    and the per-op sum fp16 on an L40S 7 % slower than on an L40."""
    found = boom_ml.predict(gpu="all", advice=False, max_batch="off", **kw).gpus
    spec = {g.id: g for g in all_gpus()}
    times = {g.gpu: g.time.step_ms for g in found}
    for a in times:
        for b in times:
            if dominates(spec[a], spec[b]):
                assert times[a] <= times[b], (a, b)
    taken = {g.gpu: g.time.timed_as for g in found if g.time.timed_as}
    assert ("rtx-4090", "a30") in taken.items() or ("l40s", "l40") in taken.items()


def test_a_gpus_time_does_not_depend_on_the_others_asked() -> None:
    kw = {"model": "torchvision:resnet50", "batch_size": 64, "advice": False, "max_batch": "off"}
    alone = boom_ml.predict(gpu="rtx-4090", **kw).gpus[0].time
    beside = boom_ml.predict(gpu=["a30", "rtx-4090"], **kw).gpus[1].time
    assert alone.timed_as == beside.timed_as == "a30"
    assert alone.step_ms == pytest.approx(beside.step_ms, rel=1e-9)
    a30 = boom_ml.predict(gpu="a30", **kw).gpus[0].time
    assert a30.step_ms == pytest.approx(alone.step_ms, rel=1e-9)
    assert a30.by_family == pytest.approx(alone.by_family)  # the A30's whole estimate
    # as the models give it (the advisor's candidates): the RTX 4090 slower than the A30
    raw = boom_ml.Session("torchvision:resnet50").evaluate(
        boom_ml.StepSpec(batch_size=64), ["rtx-4090"], dominance=False
    )
    assert raw[0].time.step_ms > a30.step_ms and raw[0].time.timed_as == ""


def test_a_copy_better_in_one_field_is_no_slower_than_the_packaged_gpu() -> None:
    """A user's A100 with a larger L2 under the packaged id: the GNN had put resnet18 at 13.50
    ms there against the A100's own 13.22; it takes the packaged A100's estimate."""
    from dataclasses import replace

    a100 = get_gpu("a100-80gb-sxm")
    kw = {"batch_size": 32, "advice": False, "max_batch": "off"}
    own = boom_ml.predict("torchvision:resnet18", gpu=[a100], **kw).gpus[0].time
    bigger = replace(a100, l2_cache_mb=4 * a100.l2_cache_mb)
    found = boom_ml.predict("torchvision:resnet18", gpu=[bigger], **kw).gpus[0].time
    assert found.timed_as == "a100-80gb-sxm" and own.timed_as == ""
    assert found.step_ms == own.step_ms
    assert found.by_family == own.by_family  # taken whole, in full
