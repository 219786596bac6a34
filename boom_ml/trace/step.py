"""Trace one steady-state training step on fake CPU tensors into an OpGraph.

Two steps run: the first creates gradients and optimizer state (unrecorded), the second is
recorded. The recorded step therefore starts the way every later step does on a GPU:
parameters, last step's gradients and optimizer state already allocated.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from boom_ml import progress
from boom_ml.errors import BoomError, InvalidInputError, TraceError
from boom_ml.specs import StepSpec
from boom_ml.stack import step_optimizer_impl
from boom_ml.trace.attention import cuda_attention
from boom_ml.trace.autocast_policy import cuda_autocast_policy
from boom_ml.trace.categories import assign_categories
from boom_ml.trace.dropout import cuda_dropout
from boom_ml.trace.failures import describe_failure, quiet_fake_tensor_log
from boom_ml.trace.graph import OpGraph, canonical_free_order
from boom_ml.trace.modules import ModuleOf
from boom_ml.trace.ops import EXTRA_FLOP_SHAPE_FORMULAS
from boom_ml.trace.optimizers import make_optimizer
from boom_ml.trace.recorder import BlockNotes, OpRecorder
from boom_ml.trace.rnn import cuda_rnn
from boom_ml.trace.sdpa_select import DEFAULT_GROUP
from boom_ml.zoo.base import BuiltModel
from boom_ml.zoo.checkpoint_policy import SelectiveSaves
from boom_ml.zoo.checkpoint_policy import configure as configure_checkpointing
from boom_ml.zoo.common import own_dtype_note
from boom_ml.zoo.finetune import DTYPES, apply_recipe, logical_parameters
from boom_ml.zoo.nf4 import NF4Linear

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class _HostScalars(TorchDispatchMode):
    """Answers ``tensor.item()`` with 1.0 inside the optimizer step.

    Some optimizers read a scalar off the device to scale their update (Adafactor's
    parameter RMS). Fake tensors have no values; the scalar only scales the update and
    changes no shape or kernel, so any value traces the same step. Model code outside the
    optimizer still fails on ``.item()``, as it should: there a value can change shapes.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].is_floating_point() else 1
        return func(*args, **(kwargs or {}))


class _StepRunner:
    """Runs forward, loss, backward and optimizer for one built model, phase by phase."""

    def __init__(self, built: BuiltModel, step: StepSpec) -> None:
        self.built = built
        self.step = step
        self.module = built.module
        self.optimizer = make_optimizer(
            step.optimizer,
            list(self.module.parameters()),
            step.optimizer_impl,
            master_weights=step.master_weights,
            loss_scaling=step.params_dtype == "fp16",
        )
        self.scaler = torch.amp.GradScaler("cpu") if step.amp == "fp16" else None
        self.recorder: OpRecorder | None = None
        self.recipe: dict = {}  # what zoo.finetune did (graph meta)
        self.grad_blocks: set[int] = set()
        self.state_blocks: set[int] = set()
        self.sdpa: dict = {}  # the SDPA calls' backends (attention.SdpaLog), graph meta "sdpa"
        self.with_grad: set[int] = set()  # ids of the parameters backward gave a gradient
        # those gradients per dtype (tensors, elements): what a further micro-batch adds into
        self.gradient_sizes: dict[str, dict[str, int]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.recorder is not None:
            self.recorder.phase = name
        yield

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.step.amp == "none":
            return contextlib.nullcontext()
        # CPU autocast stands in for CUDA autocast; cuda_autocast_policy() (active for the
        # whole step, so checkpoint recomputation in backward casts the same way) makes
        # every op whose CPU policy differs follow the CUDA one.
        return torch.autocast("cpu", dtype=AMP_DTYPES[self.step.amp])

    def warm_up(self) -> None:
        """Leave behind what a previous step would, without running one.

        A steady-state step starts with every trainable parameter's gradient and the
        optimizer's state allocated (optimizers create state lazily, in their first
        step). Creating them directly costs a fraction of a traced step; parameters that
        turn out to get no gradient are pruned after the recorded step (``trace_step``).
        """
        for p in self.module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        if self.optimizer is not None:
            with _HostScalars():
                self.optimizer.step()

    def blocks_of_param(self, p: torch.nn.Parameter) -> list[torch.Tensor]:
        """The gradient and optimizer-state tensors that belong to ``p``."""
        state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
        shared = getattr(self.optimizer, "shared_state_keys", ())  # one qmap for all params
        owned = [
            t
            for k, t in state.items()
            if isinstance(t, torch.Tensor) and k != "step" and k not in shared
        ]
        # a master-weight copy's gradient too (it is the copy's, and so the parameter's)
        grads = [t.grad for t in [p, *owned] if t.grad is not None]
        return owned + grads

    def run(self) -> None:
        device = torch.device("cpu")
        with self.phase("zero_grad"):
            # warm_up left every gradient allocated: set_to_none frees them, zero keeps them
            # (one fill kernel each) and backward then adds into them in place
            to_none = self.step.zero_grad == "set_to_none"
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=to_none)
            else:
                self.module.zero_grad(set_to_none=to_none)
        with self.phase("input"):
            inputs = self.built.make_inputs(self.step, device)
            if self.step.params_dtype != "fp32" and self.step.amp == "none":
                # pure low-precision training feeds the model its own dtype (images, ...)
                low = DTYPES[self.step.params_dtype]
                inputs = {
                    k: v.to(low) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                    for k, v in inputs.items()
                }
        with self.autocast():
            with self.phase("forward"):
                outputs = self.module(**self.built.forward_kwargs(inputs))
            with self.phase("loss"):
                loss = self.built.compute_loss(outputs, inputs)
            # Leaving autocast frees its cache of low-precision weight copies: a phase of
            # its own, so those frees are not mistaken for the outputs the loop releases.
            with self.phase("autocast_exit"):
                pass
        with self.phase("loss"):
            pass
        del outputs
        with self.phase("backward"):
            if self.scaler is not None:
                loss = self.scaler.scale(loss)
            elif self.step.master_weights:  # fp16: the master-weight optimizer's loss scale
                loss = self.optimizer.scale_loss(loss)
            loss.backward()
        del loss, inputs
        # parameters that got a gradient (a master-weight optimizer drops them in its step)
        self.with_grad = {id(p) for p in self.module.parameters() if p.grad is not None}
        self.gradient_sizes = _sizes_by_dtype(
            [p.grad for p in self.module.parameters() if p.grad is not None]
        )
        if self.recorder is not None:
            self.grad_blocks = {
                self.recorder.block_of(p.grad)
                for p in self.module.parameters()
                if p.grad is not None
            }
        if self.optimizer is None:
            return
        with self.phase("optimizer"), _HostScalars():
            if self.scaler is not None:
                # GradScaler.step() reads found_inf with .item(), impossible on fake
                # tensors; unscale_ + step + update launch the same kernels.
                self.scaler.unscale_(self.optimizer)
                self.optimizer.step()
                self.scaler.update()
            else:
                self.optimizer.step()
        if self.recorder is not None:
            self.state_blocks = {
                self.recorder.block_of(t)
                for state in self.optimizer.state.values()
                for key, t in state.items()
                if isinstance(t, torch.Tensor) and key != "step"
            }
            # master weights: the fp32 copies' gradients, made in the optimizer phase
            self.grad_blocks |= {self.recorder.block_of(g) for g in self.gradients()}

    def gradients(self) -> list[torch.Tensor]:
        """Gradients alive now: the parameters', and a master-weight optimizer's fp32 ones."""
        extra = getattr(self.optimizer, "gradients", None)
        own = [p.grad for p in self.module.parameters() if p.grad is not None]
        return own + (extra() if callable(extra) else [])

    def host_tensors(self) -> list[torch.Tensor]:
        """Tensors that live on the host in a CUDA run: the step counts of optimizers that
        are neither fused nor capturable (torch.optim makes those on the parameter's device),
        and a paged optimizer's state (bitsandbytes' unified memory, paged out)."""
        if self.optimizer is None:
            return []
        paged = getattr(self.optimizer, "host_tensors", None)
        # a wrapper (fp32 master weights) steps its copies with an inner torch.optim optimizer
        inner = getattr(self.optimizer, "inner", self.optimizer)
        on_device = {
            id(inner.state[p]["step"])
            for group in getattr(inner, "param_groups", [])
            if group.get("fused") or group.get("capturable")
            for p in group["params"]
            if "step" in inner.state.get(p, {})
        }
        return [
            t
            for state in self.optimizer.state.values()
            for key, t in state.items()
            if key == "step" and isinstance(t, torch.Tensor) and id(t) not in on_device
        ] + (paged() if callable(paged) else [])


@contextlib.contextmanager
def _materialised(built: BuiltModel, step: StepSpec) -> Iterator[_StepRunner]:
    """Fake mode with the model's parameters materialised, CUDA kernels, and a runner."""
    lazy = sorted(
        {type(m).__name__ for m in built.module.modules() if isinstance(m, LazyModuleMixin)}
    )
    if lazy:
        raise InvalidInputError(
            f"{built.spec.text}: lazy modules ({', '.join(lazy)}) take their sizes from a first "
            "real forward, which a trace on fake tensors never runs; build them with their "
            "sizes (nn.Linear for nn.LazyLinear, nn.Conv2d for nn.LazyConv2d)"
        )
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    attention = cuda_attention(step.sdpa_group or DEFAULT_GROUP)  # the target GPUs' kernels
    try:
        recipe = apply_recipe(built.module, step)  # on the meta device: dtypes, LoRA, NF4
    except BoomError:
        raise
    except Exception as exc:  # noqa: BLE001 - peft or a quantiser failing on the user's model
        raise TraceError(describe_failure(built, exc, running=False)) from exc
    with (
        quiet_fake_tensor_log(),
        fake_mode,
        torch.device("cpu"),
        attention as sdpa,
        cuda_dropout(),
        cuda_rnn(),
        cuda_autocast_policy(),
    ):
        try:
            built.materialize("cpu")
            built.module.train()
            if step.checkpointing != "none":
                built.enable_checkpointing(built.module)
                recipe["checkpointed_blocks"] = configure_checkpointing(
                    built.module, step.checkpointing, step.checkpointing_every, built.spec.text
                )
            runner = _StepRunner(built, step)
            runner.recipe = recipe
            yield runner
            runner.sdpa = sdpa.to_dict()
        except BoomError:
            raise  # already says what went wrong (a seq_len beyond the positions, say)
        except Exception as exc:  # noqa: BLE001 - a failure inside a model is the user's model
            raise TraceError(describe_failure(built, exc, image_size=step.image_size)) from exc


def trace_step(built: BuiltModel, step: StepSpec) -> OpGraph:
    """Trace one steady-state training step of ``built`` under ``step`` into an OpGraph."""
    return trace_step_with_blocks(built, step, keep_blocks=False)[0]


def trace_step_with_blocks(
    built: BuiltModel, step: StepSpec, keep_blocks: bool = True
) -> tuple[OpGraph, BlockNotes]:
    """:func:`trace_step`, and (``keep_blocks``) which blocks each node read and wrote, and
    whose they are (``trace/repeat.py`` repeats one layer's nodes and blocks with them)."""
    step = built.resolve_step(step)
    step = replace(step, sdpa_group=step.sdpa_group or DEFAULT_GROUP)  # recorded as traced
    if step.optimizer_impl == "auto":  # recorded as the implementation that ran
        step = replace(step, optimizer_impl=step_optimizer_impl(step.optimizer, "auto"))
    started = time.perf_counter()
    with (
        progress.task(f"tracing {built.spec.shown}: {step.label()}"),
        _materialised(built, step) as runner,
    ):
        runner.warm_up()
        params = [p for p in built.module.parameters() if p.requires_grad]
        module_of = ModuleOf()
        recorder = OpRecorder(module_of=module_of, keep_blocks=keep_blocks)
        runner.recorder = recorder
        with recorder:
            recorder.recording = False
            recorder.adopt(
                list(built.module.parameters()) + list(built.module.buffers()), "parameter"
            )
            recorder.adopt(runner.gradients(), "gradient")
            host = {id(t.untyped_storage()) for t in runner.host_tensors()}
            recorder.adopt(_state_tensors(runner, host), "optimizer_state")
            recorder.adopt(runner.host_tensors(), "host")
            recorder.recording = True
            # block ids only: holding the tensors would keep the old gradients alive
            owned_blocks = {
                id(p): [recorder.block_of(t) for t in runner.blocks_of_param(p)] for p in params
            }
            with module_of.active():
                runner.run()
            recorder.recording = False
            notes = BlockNotes(recorder.node_blocks, recorder.block_module)
            if keep_blocks:
                notes.block_param = _param_blocks(recorder, runner, owned_blocks)
        # A parameter without a gradient after a real step (unused by this model's
        # forward) never had a gradient or optimizer state in a real run either.
        unused = {b for p in params if id(p) not in runner.with_grad for b in owned_blocks[id(p)]}
        recorder.events = canonical_free_order(
            [e for e in recorder.events if e["block"] not in unused]
        )
    events = assign_categories(recorder, runner.grad_blocks, runner.state_blocks)
    runner.recipe["bytes"] = _recipe_bytes(built, runner)
    graph = OpGraph.from_records(
        recorder.nodes,
        [{"src": s, "dst": d} for s, d in sorted(recorder.edges)],
        events,
        meta={
            "model": built.spec.text,
            "model_family": built.family,
            "step": step.to_dict(),
            "trace_seconds": round(time.perf_counter() - started, 3),
            "num_parameters": logical_parameters(built.module),
            "num_trainable_parameters": sum(
                p.numel() for p in built.module.parameters() if p.requires_grad
            ),
            "recipe": runner.recipe,
            "model_notes": list(built.info.get("notes", []))  # what the zoo built instead
            + _selective_note(step)
            + own_dtype_note(built.info, step.params_dtype),
            "attention": built.info.get("attn_implementation"),
            "gradients": runner.gradient_sizes,
            "method_notes": runner.recipe.get("method_notes", [])
            + getattr(runner.optimizer, "method_notes", []),
            "torch_version": torch.__version__,
            "sdpa": runner.sdpa,
        },
    )
    return graph, notes


def _selective_note(step: StepSpec) -> list[str]:
    """Selective checkpointing of blocks without a matmul or attention saves nothing."""
    if step.checkpointing != "selective" or SelectiveSaves.count:
        return []
    return [
        "checkpointing=selective saves matmul and attention outputs, and this model's"
        " checkpointed blocks have none (convolutions are recomputed), so it is"
        " checkpointing=full here"
    ]


def _param_blocks(
    recorder: OpRecorder, runner: _StepRunner, owned: dict[int, list[int]]
) -> dict[int, str]:
    """Block -> name of the parameter or buffer it is, or whose gradient or state it holds
    (before the recorded step and after it)."""
    out: dict[int, str] = {}
    module, optimizer = runner.module, runner.optimizer
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        now = [t]
        if isinstance(t, torch.nn.Parameter):
            # its gradient and own state (not the maps all parameters share), and its step
            # count, a host tensor without memory events yet an entry of foreach lists
            state = optimizer.state.get(t, {}) if optimizer is not None else {}
            now += [*runner.blocks_of_param(t), state.get("step")]
        blocks = [recorder.known_block(x) for x in now if isinstance(x, torch.Tensor)]
        out.update((b, name) for b in blocks + owned.get(id(t), []) if b is not None)
    return out


def reference_flops(built: BuiltModel, step: StepSpec) -> int:
    """FLOPs of the same steady-state step counted by PyTorch's own FlopCounterMode.

    Our counter's cross-check: the extra formulas we register are passed to it too.
    """
    step = built.resolve_step(step)
    with _materialised(built, step) as runner:
        runner.warm_up()
        counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_SHAPE_FORMULAS)
        with counter:
            runner.run()
    return int(counter.get_total_flops())


def _state_tensors(runner: _StepRunner, host: set[int]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    if runner.optimizer is not None:
        for state in runner.optimizer.state.values():
            tensors += [
                t
                for t in state.values()
                if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in host
            ]
    if runner.scaler is not None:
        tensors += [
            t for t in (runner.scaler._scale, runner.scaler._growth_tracker) if t is not None
        ]
    loose = getattr(runner.optimizer, "loose_tensors", None)  # a master-weight loss scale
    return tensors + (loose() if callable(loose) else [])


def _sizes_by_dtype(tensors: list[torch.Tensor]) -> dict[str, dict[str, int]]:
    """{dtype: {"tensors": count, "numel": elements}}: counts only, so that a deep model's
    meta extends from its shallow traces' by a layer's share (trace/repeat.py)."""
    out: dict[str, dict[str, int]] = {}
    for t in tensors:
        entry = out.setdefault(str(t.dtype).removeprefix("torch."), {"tensors": 0, "numel": 0})
        entry["tensors"] += 1
        entry["numel"] += t.numel()
    return out


def _recipe_bytes(built: BuiltModel, runner: _StepRunner) -> dict[str, int]:
    """Where a recipe puts its bytes: 4-bit base weights, trainable parameters, host state."""
    module = built.module
    return {
        "base_weights_4bit": sum(
            b.nbytes for m in module.modules() if isinstance(m, NF4Linear) for b in m.buffers()
        ),
        "trainable_parameters": sum(
            p.numel() * p.element_size() for p in module.parameters() if p.requires_grad
        ),
        "optimizer_state_on_host": sum(t.nbytes for t in runner.host_tensors()),
    }
