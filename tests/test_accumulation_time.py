"""Step time under gradient accumulation (session.accumulated): what runs once per optimizer step."""

from __future__ import annotations

from boom_ml.estimates import TimeEstimate
from boom_ml.session import accumulated


def test_zero_grad_and_optimizer_run_once_per_accumulated_step():
    one = TimeEstimate(step_ms=16.0, method="per-op", p10_ms=12.0, p90_ms=20.0,
                       by_phase={"zero_grad": 1.0, "forward": 5.0, "backward": 8.0,
                                 "optimizer": 2.0})  # fmt: skip
    four = accumulated(one, 4)
    assert four.step_ms == 4 * 13.0 + 3.0  # forward + backward four times, the rest once
    assert (four.p10_ms, four.p90_ms) == (4 * 9.0 + 3.0, 4 * 17.0 + 3.0)
    assert four.micro_step_ms == 13.0
    assert accumulated(one, 1).step_ms == 16.0 and accumulated(one, 1).micro_step_ms == 13.0
    # the phases are the step's: they add up to it, as without accumulation
    assert four.by_phase == {"zero_grad": 1.0, "forward": 20.0, "backward": 32.0, "optimizer": 2.0}
    assert sum(four.by_phase.values()) == four.step_ms
