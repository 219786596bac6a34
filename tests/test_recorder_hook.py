"""The recorder's gradient-sum hook: the recorder asks it, and records what it answers."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from boom_ml.trace.accumulation import Blocks
from boom_ml.trace.recorder import GradientSums, OpRecorder

H_BYTES = 4 * 16 * 4  # h and its gradients: 4 x 16 float32


class NeverFold:
    """A hook that sees every backward op and folds nothing: the traced engine's own sums."""

    def __init__(self) -> None:
        self.noted: list[str] = []

    def note(
        self, func: Any, args: tuple, kwargs: dict, out: Any, new_blocks: list[int], blocks: Blocks
    ) -> bool:
        self.noted.append(str(func))
        return False

    def settle(self, freed: Collection[int]) -> int | None:
        raise AssertionError("settle without a pending sum")


def _trace(sums: GradientSums | None) -> OpRecorder:
    with FakeTensorMode():
        x = torch.randn(4, 16, requires_grad=True)
        recorder = OpRecorder(sums=sums)
        with recorder:
            recorder.phase = "forward"
            h = x * 3.0
            loss = (h.sin() + h.cos()).sum()  # two gradients meet at h
            recorder.phase = "backward"
            loss.backward()
            recorder.recording = False
    return recorder


def _backward_allocs(recorder: OpRecorder) -> tuple[int, int]:
    """(gradient-sized allocations in backward, of which by the engine's sum)."""
    (add,) = [n["id"] for n in recorder.nodes if n["phase"] == "backward" and n["op"] == "add"]
    allocs = [
        e
        for e in recorder.events
        if e["phase"] == "backward" and e["action"] == "alloc" and e["bytes"] == H_BYTES
    ]
    return len(allocs), sum(e["node_id"] == add for e in allocs)


def test_default_hook_sums_gradients_in_place() -> None:
    recorder = _trace(None)
    assert _backward_allocs(recorder) == (6, 0)  # the sum writes into a gradient's block
    assert [e["seq"] for e in recorder.events] == list(range(len(recorder.events)))


def test_a_hook_that_never_folds_keeps_the_out_of_place_sum() -> None:
    hook = NeverFold()
    recorder = _trace(hook)
    assert _backward_allocs(recorder) == (7, 1)  # the traced engine's own block for the sum
    assert hook.noted.count("aten.add.Tensor") == 1
    assert [e["seq"] for e in recorder.events] == list(range(len(recorder.events)))
