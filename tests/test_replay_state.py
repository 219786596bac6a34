"""When the replay makes the optimizer's state (memory/replay.py: build_replay): lazily, in
the first step, where its first optimizer.step() would (synthetic tiny model)."""

from __future__ import annotations

import numpy as np
from tiny_models import tiny_transformer

from boom_ml.memory.replay import build_replay
from boom_ml.specs import StepSpec
from boom_ml.trace.step import trace_step


def test_state_of_an_in_place_optimizer_comes_after_the_backward():
    """SGD with momentum steps in place: its optimizer phase records no event, and its state
    had been made before the step's last event (a backward free: gpt2's tied embedding's
    154 MB gradient term held at a peak named the optimizer's, a hunt). It comes after
    every event of step 1."""
    g = trace_step(tiny_transformer(), StepSpec(2, seq_len=16, optimizer="sgd-momentum"))
    ev = g.mem_events
    assert not (ev["phase"] == "optimizer").any()  # nothing allocated in the step itself
    replay = build_replay(g, steps=2, hold_outputs=False)
    phase = np.where(replay.src >= 0, ev["phase"].to_numpy()[np.maximum(replay.src, 0)], "")
    step1 = np.flatnonzero(replay.step == 1)
    state = np.flatnonzero(phase == "optimizer_state")
    assert len(state) and state.min() > np.flatnonzero(phase[step1] == "backward").max()
    assert state.max() == step1.max()  # the last events of step 1
