"""CPU autocast made to follow CUDA autocast's op policy (boom_ml.trace.autocast_policy)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError, checkpoint

from boom_ml.trace import autocast_policy as ap

LOW = [torch.bfloat16, torch.float16]
Make = Callable[..., torch.Tensor]


def _cases(low: torch.dtype) -> dict[str, Callable[[Make], object]]:
    """Op calls whose output dtypes are compared; ``t(*shape, dtype=fp32)`` makes inputs."""

    def idx(n: int) -> Callable[[Make], torch.Tensor]:
        return lambda t: t(n, dtype=torch.long)

    return {
        "mm": lambda t: t(4, 4) @ t(4, 4),
        "linear": lambda t: F.linear(t(2, 4), t(3, 4), t(3)),
        "conv2d": lambda t: F.conv2d(t(1, 2, 5, 5), t(3, 2, 3, 3), t(3)),
        "conv2d_same": lambda t: F.conv2d(t(1, 2, 5, 5), t(3, 2, 3, 3), padding="same"),
        "bmm": lambda t: torch.bmm(t(2, 3, 4), t(2, 4, 5)),
        "matmul": lambda t: torch.matmul(t(2, 3, 4), t(4, 5)),
        "einsum": lambda t: torch.einsum("ij,jk->ik", t(3, 4), t(4, 5)),
        "addmv": lambda t: torch.addmv(t(3), t(3, 4), t(4)),
        "mv": lambda t: torch.mv(t(3, 4), t(4)),
        "addr": lambda t: torch.addr(t(3, 4), t(3), t(4)),
        "chain_matmul": lambda t: torch.linalg.multi_dot([t(2, 3), t(3, 4), t(4, 2)]),
        "prelu": lambda t: F.prelu(t(2, 3), t(3)),
        # rnn_tanh_cell, not gru/lstm: their fused CUDA kernels need a driver even when fake.
        "rnn_tanh_cell": lambda t: torch.rnn_tanh_cell(t(2, 3), t(2, 4), t(4, 3), t(4, 4)),
        "softmax": lambda t: torch.softmax(t(2, 5, dtype=low), -1),
        "softmax_dtype": lambda t: torch.softmax(t(2, 5, dtype=low), -1, dtype=low),
        "log_softmax": lambda t: F.log_softmax(t(2, 5, dtype=low), -1),
        "layer_norm": lambda t: F.layer_norm(t(2, 5, dtype=low), [5], t(5), t(5)),
        "group_norm": lambda t: F.group_norm(t(2, 4, 3, dtype=low), 2),
        "rms_norm": lambda t: F.rms_norm(t(2, 5, dtype=low), [5]),
        "pow": lambda t: t(3, dtype=low).pow(2),
        "pow_tensor": lambda t: torch.pow(t(3, dtype=low), t(3, dtype=low)),
        "exp": lambda t: t(3, dtype=low).exp(),
        "log": lambda t: t(3, dtype=low).log(),
        "rsqrt": lambda t: t(3, dtype=low).rsqrt(),
        "softplus": lambda t: F.softplus(t(3, dtype=low)),
        "gelu_tanh_parts": lambda t: 0.5 * t(3, dtype=low) * torch.tanh(t(3, dtype=low).pow(3)),
        "sum": lambda t: t(3, dtype=low).sum(),
        "sum_dim": lambda t: t(2, 3, dtype=low).sum(-1),
        "sum_dtype": lambda t: t(3, dtype=low).sum(dtype=low),
        "sum_int": lambda t: idx(3)(t).sum(),
        "mean": lambda t: t(3, dtype=low).mean(),
        "cumsum": lambda t: t(3, dtype=low).cumsum(0),
        "prod": lambda t: t(3, dtype=low).prod(),
        "prod_dtype": lambda t: t(3, dtype=low).prod(dtype=low),
        "norm_scalar": lambda t: torch.ops.aten.norm.Scalar(t(3, dtype=low)),
        "norm_dim": lambda t: torch.ops.aten.norm.ScalarOpt_dim(t(2, 3, dtype=low), 2, [1]),
        "vector_norm": lambda t: torch.linalg.vector_norm(t(3, dtype=low)),
        "logsumexp": lambda t: t(2, 3, dtype=low).logsumexp(-1),
        "nll_loss": lambda t: F.nll_loss(t(4, 5, dtype=low), idx(4)(t)),
        "cross_entropy": lambda t: F.cross_entropy(t(4, 5, dtype=low), idx(4)(t)),
        "mse_loss": lambda t: F.mse_loss(t(4, dtype=low), t(4, dtype=low)),
        "bce_logits": lambda t: F.binary_cross_entropy_with_logits(t(4, dtype=low), t(4)),
        "bce": lambda t: F.binary_cross_entropy(t(4, dtype=low).sigmoid(), t(4, dtype=low)),
        "addcmul_mixed": lambda t: torch.addcmul(t(3, dtype=low), t(3, dtype=low), t(3)),
        "addcmul_low": lambda t: torch.addcmul(t(3, dtype=low), t(3, dtype=low), t(3, dtype=low)),
        "dot_mixed": lambda t: torch.dot(t(3, dtype=low), t(3)),
        "atan2": lambda t: torch.atan2(t(3, dtype=low), t(3)),
        "index_put": lambda t: t(5, dtype=low).index_put((idx(2)(t),), t(2)),
        "cat_mixed": lambda t: torch.cat([t(2, dtype=low), t(2)]),
        "stack_low": lambda t: torch.stack([t(2, dtype=low), t(2, dtype=low)]),
        "reflection_pad": lambda t: F.pad(t(1, 2, 4, 4, dtype=low), (1, 1, 1, 1), mode="reflect"),
        "max_pool3d": lambda t: F.max_pool3d(t(1, 1, 4, 4, 4, dtype=low), 2),
        "upsample": lambda t: F.interpolate(t(1, 1, 4, 4, dtype=low), scale_factor=2.0),
        "cdist": lambda t: torch.cdist(t(3, 2, dtype=low), t(4, 2, dtype=low)),
    }


def _dtypes(out: object) -> list[str]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [str(o.dtype) for o in outs if isinstance(o, torch.Tensor)]


def _run(fn: Callable[[Make], object], device: str) -> list[str] | str:
    def make(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    try:
        return _dtypes(fn(make))
    except RuntimeError:
        return "error"


@contextlib.contextmanager
def _fake_cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    # The build's real AutocastCUDA kernels run on fake CUDA tensors: the oracle.
    prev = torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", prev)
        torch.clear_autocast_cache()


def cpu_outcomes(low: torch.dtype, policy: bool) -> dict[str, list[str] | str]:
    """Each case's output dtypes under CPU autocast on fake tensors (importable in a child)."""
    ctx = ap.cuda_autocast_policy() if policy else contextlib.nullcontext()
    with FakeTensorMode(), ctx, torch.autocast("cpu", dtype=low):
        return {name: _run(fn, "cpu") for name, fn in _cases(low).items()}


@pytest.mark.parametrize("low", LOW)
def test_matches_cuda_autocast_kernels(low):
    with FakeTensorMode(), _fake_cuda_autocast(low):
        cuda = {name: _run(fn, "cuda") for name, fn in _cases(low).items()}
    assert cpu_outcomes(low, policy=True) == cuda


@pytest.mark.parametrize("low", LOW)
def test_expected_dtypes(low):
    got = cpu_outcomes(low, policy=True)
    name = str(low)
    for op in ["mm", "linear", "conv2d", "bmm", "matmul", "einsum", "addmv", "rnn_tanh_cell"]:
        assert got[op][0] == name, op
    for op in ["softmax", "log_softmax", "layer_norm", "pow", "exp", "nll_loss", "sum", "mse_loss"]:
        assert got[op] == ["torch.float32"], op
    assert got["cross_entropy"] == ["torch.float32"]
    assert got["softmax_dtype"] == got["sum_dtype"] == got["addcmul_low"] == [name]
    assert got["sum_int"] == ["torch.int64"]
    assert got["addcmul_mixed"] == got["cat_mixed"] == ["torch.float32"]
    assert got["reflection_pad"] == got["max_pool3d"] == [name]  # CPU alone runs them fp32
    assert got["bce"] == "error"  # banned under CUDA autocast


@pytest.mark.parametrize("low", LOW)
def test_outside_the_context_cpu_behaviour_is_unchanged(low):
    with ap.cuda_autocast_policy():
        pass  # registers the kernels
    assert ap.REGISTERED and not ap.SKIPPED
    got = cpu_outcomes(low, policy=False)
    assert got["pow"] == got["softmax"] == got["sum"] == [str(low)]
    assert got["reflection_pad"] == ["torch.float32"]
    # Same as a fresh interpreter in which nothing was ever registered.
    script = (
        f"import sys, json, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_autocast_policy as t; "
        f"print(json.dumps(t.cpu_outcomes(torch.{str(low)[6:]}, policy=False)))"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout.strip().splitlines()[-1]) == got


def test_tables_match_the_installed_build():
    script = (
        "import json, torch; n = torch._C._dispatch_get_all_op_names(); "
        "has = torch._C._dispatch_has_kernel_for_dispatch_key; "
        "print(json.dumps({k: sorted(o[6:] for o in n if o.startswith('aten::') and has(o, k))"
        " for k in ('AutocastCPU', 'AutocastCUDA')}))"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    live = json.loads(child.stdout)
    cuda = set(ap.CUDA_POLICY) | ap.CUDA_BANNED
    assert {op for op in cuda if ap._resolve(op)} == set(live["AutocastCUDA"])
    assert {op for op in ap.CPU_POLICY if ap._resolve(op)} == set(live["AutocastCPU"])
    diffs = {op: (cpu, cuda) for op, cpu, cuda in ap.policy_differences()}
    assert diffs["pow.Tensor_Scalar"] == ("none", "fp32")
    assert diffs["cat"] == ("promote", "none")
    assert diffs["einsum"] == ("none", "lower_precision_fp")
    assert "mm" not in diffs and "nll_loss" not in diffs


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.__name__, args))
        return func(*args, **(kwargs or {}))


def test_cat_is_not_cast_and_weights_are_cast_once_per_autocast_region():
    with FakeTensorMode(), ap.cuda_autocast_policy():
        cell = torch.nn.GRUCell(3, 4)  # gru_cell: lowered only by CUDA autocast
        with torch.autocast("cpu", torch.bfloat16):
            a, b = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)
            with _Ops() as ops:
                torch.cat([a, b])
            assert [name for name, _ in ops.calls] == ["cat.default"]  # CPU casts a first
            h = torch.zeros(2, 4)
            with _Ops() as ops:
                for _ in range(3):
                    h = cell(torch.zeros(2, 3), h)
            casts = [args[0] for name, args in ops.calls if name == "_to_copy.default"]
            assert all(sum(c is w for c in casts) == 1 for w in cell.parameters())
            assert len(ap._STATE.cache) == 4
        # Like the C++ cache, ours is dropped when the outermost autocast region exits.
        assert not ap._STATE.cache


@pytest.mark.parametrize("low", LOW)
def test_backward(low):
    with FakeTensorMode(), ap.cuda_autocast_policy():
        lin, norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
        x = torch.zeros(4, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=low):
            h = lin(x)
            assert h.dtype == low
            y = norm(h.pow(2).exp())
            assert y.dtype == torch.float32
            loss = torch.softmax(y @ y.T, -1).sum()
        loss.backward()
        assert x.grad is not None and x.grad.dtype == torch.float32
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lin.parameters())


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.tanh(0.5 * (h + 0.044715 * h.pow(3))) * torch.softmax(h, -1)


def _checkpointed_step(low: torch.dtype, policy_over_backward: bool) -> torch.Tensor:
    with FakeTensorMode():
        block = _Block()
        x = torch.zeros(4, 8, requires_grad=True)
        policy = ap.cuda_autocast_policy()
        with policy if policy_over_backward else contextlib.nullcontext():
            # As in boom_ml.trace.step: autocast over forward and loss, not backward.
            with contextlib.nullcontext() if policy_over_backward else policy:
                with torch.autocast("cpu", dtype=low):
                    out = checkpoint(block, x, use_reentrant=False)
                    loss = out.float().sum()
            loss.backward()
        return block.lin.weight.grad


@pytest.mark.parametrize("low", LOW)
def test_checkpoint_recompute_follows_the_policy(low):
    grad = _checkpointed_step(low, policy_over_backward=True)
    assert grad is not None and grad.dtype == torch.float32


def test_checkpoint_needs_the_policy_over_backward():
    # The documented contract: recomputation outside the policy saves bf16 for pow.
    with pytest.raises(CheckpointError):
        _checkpointed_step(torch.bfloat16, policy_over_backward=False)
