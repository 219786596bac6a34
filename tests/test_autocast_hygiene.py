"""Process hygiene: boom_ml's autocast overrides exist only while a trace runs.

A user who imports boom_ml in a notebook and traces a model must get PyTorch's own CPU
autocast afterwards: the same dispatcher registrations and the same dtypes.
"""

from __future__ import annotations

import pytest
import torch

from boom_ml.specs import StepSpec
from boom_ml.trace import autocast_policy as ap
from boom_ml.trace.step import trace_step
from tests.tiny_models import tiny_transformer


def registrations() -> dict[str, str]:
    """The dispatcher's registration dump of every op whose policies differ."""
    return {op: torch._C._dispatch_dump(f"aten::{op}") for op, _, _ in ap.policy_differences()}


def cpu_autocast_dtypes() -> dict[str, torch.dtype]:
    """Real CPU tensors under CPU autocast: ops where the CUDA policy would differ."""
    x, v = torch.ones(4, 4), torch.ones(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = torch.mm(x, x)  # both policies: bfloat16
        return {
            "mm": low.dtype,
            "pow": low.pow(2).dtype,  # CPU: input dtype; CUDA: float32
            "softmax": torch.softmax(low, -1).dtype,  # CPU: input dtype; CUDA: float32
            "mv": torch.mv(x, v).dtype,  # CPU: no policy; CUDA: lowered
            "pad": torch.nn.functional.pad(low[None], (1, 1), mode="reflect").dtype,  # CPU: fp32
            "cat": torch.cat([low, x]).dtype,  # CPU: promote; CUDA: no policy (type promotion)
        }


CPU_DTYPES = {
    "mm": torch.bfloat16,
    "pow": torch.bfloat16,
    "softmax": torch.bfloat16,
    "mv": torch.float32,
    "pad": torch.float32,
    "cat": torch.float32,
}
CUDA_DTYPES = {**CPU_DTYPES, "pow": torch.float32, "softmax": torch.float32,
               "mv": torch.bfloat16, "pad": torch.bfloat16}  # fmt: skip


def test_a_trace_leaves_pytorch_as_it_found_it():
    before, clear = registrations(), torch.clear_autocast_cache
    assert cpu_autocast_dtypes() == CPU_DTYPES
    graph = trace_step(tiny_transformer(), StepSpec(batch_size=2, amp="bf16", checkpointing="full"))
    assert "recompute" in set(graph.nodes["phase"])  # the policy was on over backward too
    assert not ap.installed()
    assert registrations() == before
    assert torch.clear_autocast_cache is clear
    assert cpu_autocast_dtypes() == CPU_DTYPES


def test_the_overrides_are_visible_only_inside_the_context():
    before = registrations()
    with ap.cuda_autocast_policy():
        assert ap.installed() and ap.REGISTERED and not ap.SKIPPED
        inside = registrations()
        changed = {op for op in before if inside[op] != before[op]}
        assert changed == set(ap.REGISTERED)
        assert torch.clear_autocast_cache is not ap._ORIGINAL_CLEAR
        assert cpu_autocast_dtypes() == CUDA_DTYPES  # on this thread: the CUDA policy
    assert registrations() == before and not ap.installed()


def test_nested_contexts_and_errors_uninstall_once_at_the_outermost_exit():
    before = registrations()
    with pytest.raises(RuntimeError, match="inside"):
        with ap.cuda_autocast_policy():
            with ap.cuda_autocast_policy():
                pass
            assert ap.installed()  # the outer context still holds them
            raise RuntimeError("inside")
    assert not ap.installed() and ap._ACTIVE == 0
    assert registrations() == before
    assert cpu_autocast_dtypes() == CPU_DTYPES
