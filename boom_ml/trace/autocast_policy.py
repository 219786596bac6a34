"""Make CPU autocast follow CUDA autocast's per-op cast policy while tracing.

boom-ml traces a CUDA step on fake CPU tensors under ``torch.autocast("cpu")``, but the
``AutocastCPU`` and ``AutocastCUDA`` dispatch keys register different op lists. CUDA runs
pow/exp/log/softmax/layer_norm/sum/losses in fp32 and lowers einsum/addmv/mv/RNN cells;
CPU does neither, and instead runs cat/stack/fft/linalg/padding ops in fp32 or promoted
where CUDA leaves them in their input dtype. While :func:`cuda_autocast_policy` is open,
Python kernels registered on ``AutocastCPU`` apply the CUDA policy to every op whose two
policies differ. They are registered when the first such context opens and removed when
the last one closes (on any thread), so a process that imports boom_ml, e.g. a notebook,
runs PyTorch's own kernels outside a trace. Other threads that autocast while a trace is
running meet our kernels, which reproduce the CPU policy for them.

Contract: keep the context open over forward *and* backward. Non-reentrant checkpointing
recomputes the forward inside ``backward()`` (re-entering CPU autocast with the forward's
settings); if the policy is off by then, recomputed saved tensors get other dtypes than
the forward's and checkpoint raises ``CheckpointError``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from boom_ml.trace.autocast_lists import (  # noqa: F401 - re-exported: the policy names
    BANNED,
    CPU_POLICY,
    CUDA_BANNED,
    CUDA_POLICY,
    FP32,
    FP32_APPEND_DTYPE,
    FP32_SET_OPT_DTYPE,
    LOWER,
    NONE,
    PROMOTE,
)

# fp32_append_dtype redispatches to the overload that takes an output dtype.
_APPEND_TARGETS = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_BELOW_AUTOCAST_CPU = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.AutocastCPU)


def cpu_policy(op: str) -> str:
    return CPU_POLICY.get(op, NONE)


def cuda_policy(op: str) -> str:
    return BANNED if op in CUDA_BANNED else CUDA_POLICY.get(op, NONE)


def _resolve(op: str) -> torch._ops.OpOverload | None:
    """The installed build's overload for ``name[.overload]``, or None if it has none."""
    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    overload = overload or "default"
    if packet is None or overload not in packet.overloads():
        return None
    return getattr(packet, overload)


def policy_differences() -> list[tuple[str, str, str]]:
    """(op, cpu policy, cuda policy) for each op of this build whose two policies differ."""
    names = sorted(set(CUDA_POLICY) | set(CPU_POLICY) | CUDA_BANNED)
    return [
        (op, cpu_policy(op), cuda_policy(op))
        for op in names
        if cpu_policy(op) != cuda_policy(op) and _resolve(op) is not None
    ]


# -- per-thread state ------------------------------------------------------------------
class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        # id(fp32 leaf) → (weakref to it, its _version, its low-precision copy)
        self.cache: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


_STATE = _State()


def _eligible(t: object) -> bool:
    # at::autocast::is_eligible for the CPU key: a defined floating CPU tensor, not double.
    return (
        isinstance(t, torch.Tensor)
        and (t.is_cpu or t.is_mkldnn)
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


def _cast(t: torch.Tensor, dtype: torch.dtype, use_cache: bool) -> torch.Tensor:
    """at::autocast::cached_cast: reuse one low-precision copy of each fp32 weight."""
    if not _eligible(t) or t.dtype == dtype:
        return t
    cacheable = (
        use_cache
        and dtype == torch.get_autocast_dtype("cpu")
        and t.dtype == torch.float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_autocast_cache_enabled()
    )
    if not cacheable:
        return t.to(dtype)
    hit = _STATE.cache.get(id(t))
    # The version check keeps a copy from outliving an in-place update of its weight.
    if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2].dtype == dtype:
        return hit[2]
    casted = t.to(dtype)
    _STATE.cache[id(t)] = (weakref.ref(t), t._version, casted)
    return casted


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        yield from (t for t in items if isinstance(t, torch.Tensor))


def _promote_type(args: tuple, kwargs: dict) -> torch.dtype:
    """at::autocast::promote_type: fp32 if any eligible input is fp32, else low precision."""
    low = torch.get_autocast_dtype("cpu")
    current = low
    for t in _tensors(args, kwargs):
        if not (t.is_cpu or t.is_mkldnn) or not t.is_floating_point() or t.dtype == torch.float64:
            continue
        if torch.float32 in (current, t.dtype):
            current = torch.float32
        elif not current == t.dtype == low:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _positional(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[Any]:
    """All positional schema arguments, defaults filled in (boxed calls drop them)."""
    out = list(args)
    for arg in op._schema.arguments[len(args) :]:
        if arg.kwarg_only:
            break
        out.append(kwargs[arg.name] if arg.name in kwargs else arg.default_value)
    return out


def _set_opt_dtype(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """at::autocast::set_opt_dtype: an unset ``dtype`` argument becomes fp32."""
    schema = op._schema.arguments
    index = next(i for i, a in enumerate(schema) if a.name == "dtype")
    if schema[index].kwarg_only or "dtype" in kwargs:
        if kwargs.get("dtype") is None:
            kwargs = {**kwargs, "dtype": torch.float32}
        return args, kwargs
    full = _positional(op, args, {})
    if full[index] is None:
        full[index] = torch.float32
    return tuple(full), kwargs


def _apply(
    policy: str, op_name: str, op: torch._ops.OpOverload, args: tuple, kwargs: dict, cache: bool
) -> Any:
    """Run ``op`` under ``policy`` the way at::autocast::WrapFunction_ does."""
    if policy == BANNED:
        raise RuntimeError(
            f"torch.nn.functional.{op_name} and torch.nn.BCELoss are unsafe to autocast "
            "and raise under CUDA autocast; use binary_cross_entropy_with_logits."
        )
    # The C++ wrappers exclude their autocast key for the whole call, so ops this one
    # calls internally are not autocast again.
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
        if policy in (LOWER, FP32, PROMOTE):
            if policy == LOWER:
                dtype = torch.get_autocast_dtype("cpu")
            elif policy == FP32:
                dtype = torch.float32
            else:
                dtype = _promote_type(args, kwargs)

            def cast(t: torch.Tensor) -> torch.Tensor:
                return _cast(t, dtype, cache)

            return op(*_map_tensors(args, cast), **_map_tensors(kwargs, cast))
        first = args[0] if args else next(iter(kwargs.values()))
        if policy == FP32_SET_OPT_DTYPE:
            # An ineligible first argument (e.g. an integer sum) runs untouched, as in C++.
            if _eligible(first):
                args, kwargs = _set_opt_dtype(op, args, kwargs)
            return op(*args, **kwargs)
        if policy == FP32_APPEND_DTYPE:
            target = _resolve(_APPEND_TARGETS[op_name])
            assert target is not None
            out_dtype = torch.float32 if _eligible(first) else first.dtype
            return target(*_positional(op, args, kwargs), dtype=out_dtype)
    raise AssertionError(f"unknown autocast policy {policy!r} for {op_name}")


def _make_kernel(op_name: str, op: torch._ops.OpOverload) -> Callable[..., Any]:
    cpu, cuda = cpu_policy(op_name), cuda_policy(op_name)

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        on = _STATE.depth > 0
        policy = cuda if on else cpu
        if policy == NONE:
            # Same as the fallthrough this key has without a kernel: continue below it
            # for this call only, so ops called inside are still autocast.
            return op.redispatch(keyset & _BELOW_AUTOCAST_CPU, *args, **kwargs)
        # The cast cache is only cleared at autocast exit while the policy is on (see
        # _clear_autocast_cache), so the CPU emulation casts afresh each time.
        return _apply(policy, op_name, op, args, kwargs, cache=on)

    return kernel


# -- installation ----------------------------------------------------------------------
_LOCK = threading.Lock()
_ACTIVE = 0  # open cuda_autocast_policy contexts, all threads together
_LIB: torch.library.Library | None = None  # our AutocastCPU kernels while _ACTIVE > 0
REGISTERED: dict[str, tuple[str, str]] = {}  # op → (cpu, cuda) policy, at the last install
SKIPPED: dict[str, str] = {}  # op → why its policy is left to the build
# torch.autocast.__exit__ calls torch.clear_autocast_cache() when it leaves the outermost
# autocast region; wrapping it lets our cast cache live exactly as long as the C++ one.
_ORIGINAL_CLEAR: Callable[[], None] | None = None


def _register() -> torch.library.Library:
    """Our kernel on AutocastCPU for every op whose CPU and CUDA policies differ."""
    lib = torch.library.Library("aten", "IMPL")
    REGISTERED.clear()
    SKIPPED.clear()
    for op_name, cpu, cuda in policy_differences():
        op = _resolve(op_name)
        assert op is not None
        has_cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(
            f"aten::{op_name}", "AutocastCPU"
        )
        if has_cpu_kernel != (cpu != NONE):
            # Our CPU table disagrees with this build; emulating the wrong CPU policy for
            # other threads during a trace would change their results: leave the op alone.
            SKIPPED[op_name] = f"CPU_POLICY says {cpu}, build kernel={has_cpu_kernel}"
            continue
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel" for ops CPU autocast wraps.
            warnings.simplefilter("ignore")
            lib.impl(op_name, _make_kernel(op_name, op), "AutocastCPU", with_keyset=True)
        REGISTERED[op_name] = (cpu, cuda)
    return lib


def _clear_autocast_cache() -> None:
    _STATE.cache.clear()
    assert _ORIGINAL_CLEAR is not None
    _ORIGINAL_CLEAR()


def _install() -> None:
    global _ACTIVE, _LIB, _ORIGINAL_CLEAR
    with _LOCK:
        _ACTIVE += 1
        if _ACTIVE == 1:  # ~10 ms for ~170 ops: cheap next to any trace
            _LIB = _register()
            _ORIGINAL_CLEAR = torch.clear_autocast_cache
            torch.clear_autocast_cache = _clear_autocast_cache


def _uninstall() -> None:
    global _ACTIVE, _LIB, _ORIGINAL_CLEAR
    with _LOCK:
        _ACTIVE -= 1
        if _ACTIVE == 0:
            torch.clear_autocast_cache = _ORIGINAL_CLEAR
            _ORIGINAL_CLEAR = None
            assert _LIB is not None
            # Deregisters our kernels; the dispatcher falls back to the build's own
            # AutocastCPU kernel (or fallthrough) for each op.
            _LIB._destroy()
            _LIB = None


def installed() -> bool:
    """Whether our kernels are registered now (only while a policy context is open)."""
    return _LIB is not None


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """While active (on this thread), CPU autocast casts each op as CUDA autocast would.

    Has no effect unless CPU autocast is enabled as well; the low-precision dtype is
    ``torch.get_autocast_dtype("cpu")``. Wrap backward too (see the module docstring).
    """
    _install()
    _STATE.depth += 1
    try:
        yield
    finally:
        _STATE.depth -= 1
        if _STATE.depth == 0:
            _STATE.cache.clear()
        _uninstall()
