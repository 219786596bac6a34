"""Step time under gradient accumulation (session.accumulated): what runs once per optimizer step."""

from __future__ import annotations

import pytest

from boom_ml.estimates import TimeEstimate
from boom_ml.session import accumulated


def test_zero_grad_and_optimizer_run_once_per_accumulated_step():
    one = TimeEstimate(step_ms=16.0, method="per-op", p10_ms=12.0, p90_ms=20.0,
                       by_phase={"zero_grad": 1.0, "forward": 5.0, "backward": 8.0,
                                 "optimizer": 2.0})  # fmt: skip
    four = accumulated(one, 4)
    assert four.step_ms == 4 * 13.0 + 3.0  # forward + backward four times, the rest once
    # the interval keeps its ratio to the step (it is calibrated as one)
    assert (four.p10_ms, four.p90_ms) == (55.0 * 12 / 16, 55.0 * 20 / 16)
    assert four.micro_step_ms == 13.0
    assert accumulated(one, 1).step_ms == 16.0 and accumulated(one, 1).micro_step_ms == 13.0
    # the phases are the step's: they add up to it, as without accumulation
    assert four.by_phase == {"zero_grad": 1.0, "forward": 20.0, "backward": 32.0, "optimizer": 2.0}
    assert sum(four.by_phase.values()) == four.step_ms


def test_later_micro_batches_add_into_the_kept_gradients():
    one = TimeEstimate(step_ms=16.0, method="per-op", p10_ms=12.0, p90_ms=20.0,
                       by_phase={"forward": 5.0, "backward": 8.0, "optimizer": 3.0},
                       accumulate_ms=0.5)  # fmt: skip
    four = accumulated(one, 4)
    assert four.step_ms == 4 * 13.0 + 3 * 0.5 + 3.0
    assert four.by_phase == {"forward": 20.0, "backward": 32.0 + 1.5, "optimizer": 3.0}
    assert accumulated(one, 1).step_ms == 16.0  # one micro-batch adds nothing


def test_the_trace_records_its_gradients_and_accumulation_times_their_adds():
    """resnet18 has 62 parameter tensors, 11,689,512 elements, all fp32 (torchvision's
    published count); a set_to_none step of 4 micro-batches adds into them 3 times, a
    zero_grad=zero trace already holds an add per gradient in every backward."""
    import boom_ml

    kw = dict(model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=64,
              advice=False, max_batch="off")  # fmt: skip
    four = boom_ml.predict(**kw, grad_accum=4).gpus[0].time
    one = boom_ml.predict(**kw).gpus[0].time
    assert four.accumulate_ms > 0 and one.accumulate_ms == 0.0
    once = one.by_phase["optimizer"]
    assert four.step_ms == pytest.approx(4 * (one.step_ms - once) + 3 * four.accumulate_ms + once)
    zeroed = boom_ml.predict(**kw, grad_accum=4, zero_grad="zero").gpus[0].time
    assert zeroed.accumulate_ms == 0.0


def test_gradient_sizes_in_the_trace_meta():
    from boom_ml.specs import ModelSpec, StepSpec
    from boom_ml.trace.step import trace_step
    from boom_ml.zoo import build_model

    built = build_model(ModelSpec("torchvision:resnet18"))
    graph = trace_step(built, StepSpec(batch_size=2, image_size=64))
    assert graph.meta["gradients"] == {"float32": {"tensors": 62, "numel": 11_689_512}}
