"""Pipeline-parallel steps for the multi-GPU harness (``parallel.pp > 1``).

The model is cut with PyTorch's own ``torch.distributed.pipelining``: every rank builds the
whole model on its device (the constructors' initialisation, as the other layouts), keeps the
layers of its stages and drops the rest, so the whole fp32 model must fit one device.
The ``pp * virtual_stages`` stages split the decoder layers as ``boom_ml.parallel`` does
(:func:`boom_ml.parallel.shard.stage_layers`: as even as possible, the remainder on the first
stages); stage ``s`` runs on pipeline rank ``s % pp`` (Megatron's loop order, what
``ScheduleInterleaved1F1B`` expects). Stage 0 also holds the embedding, the last stage the
final norm, the LM head and the loss (the HF model's own ``loss_function``).

A stage runs its layers through the HF base model's own ``forward`` (a shallow copy holding
only the stage's layers, fed ``inputs_embeds`` after the first stage), so position ids, the
causal mask and the rotary embeddings are recomputed per stage exactly as the whole model
computes them. That holds for the decoders in :data:`DECODER_TYPES`, whose base forward
does nothing to ``inputs_embeds`` before the first layer and whose causal-LM head is the
``lm_head`` alone; others (GPT-2 adds learned positions to ``inputs_embeds``, Gemma 2
soft-caps the logits) are refused in one line before any process starts.
A tied embedding / LM-head weight lives on two ranks; its gradients are not all-reduced
between the first and last stage (Megatron does that; one vocab x hidden collective).

Ranks: a (pp, dp) mesh, pp outermost (Megatron's order), so the pipeline rank is
``rank // dp``. dp > 1 wraps every stage module in DDP (``none`` / ``zero1``, the latter with
``ZeroRedundancyOptimizer`` over the data-parallel group) or FSDP2 (``zero2`` / ``zero3`` /
``fsdp``); the stage runtime switches their gradient sync to the last micro-batch itself.
Schedules: ``1f1b`` -> Schedule1F1B, ``gpipe`` -> ScheduleGPipe, ``interleaved`` ->
ScheduleInterleaved1F1B with ``virtual_stages`` stages per rank; ``microbatches`` are the
pipeline micro-batches of ``batch_size`` each, gradients averaged over them. Stages get
static shapes (:meth:`PipelineStepRunner._example`), not the runtime's shape inference.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.layout import Layout
from boom_ml.parallel.shard import stage_layers
from boom_ml.specs import ModelSpec
from boom_ml.trace.optimizers import make_optimizer
from boom_ml.zoo import build_model
from data_collection.step_runner import StepRunner

PIPELINE_KEYS = ("schedule", "virtual_stages")
# Decoders whose base model's forward runs on inputs_embeds unchanged (tests check each one
# stage by stage against the whole model).
DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3")


def check_layout(lay: Mapping[str, Any]) -> None:
    """Raise a one-line ValueError for a schedule / pipeline layout the harness cannot run."""
    try:  # the prediction side's own rules for schedule and virtual_stages
        Layout(**{k: lay[k] for k in ("dp", "tp", "pp", "sharding", "microbatches",
                                      *PIPELINE_KEYS)})  # fmt: skip
    except InvalidInputError as err:
        raise ValueError(str(err)) from None
    pp, m = lay["pp"], lay["microbatches"]
    if pp == 1 and (lay["schedule"], lay["virtual_stages"]) != ("1f1b", 1):
        raise ValueError("parallel.schedule and parallel.virtual_stages need parallel.pp>1 "
                         f"(got schedule={lay['schedule']}, pp=1)")  # fmt: skip
    if pp == 1:
        return
    if lay["tp"] > 1:
        raise ValueError("parallel.pp>1 with parallel.tp>1 is not supported by the harness "
                         "(pp runs alone or with dp)")  # fmt: skip
    if lay["dp"] == 1 and lay["sharding"] != "none":
        raise ValueError(f"parallel.sharding={lay['sharding']!r} shards over data-parallel "
                         "ranks; with parallel.dp=1 and parallel.pp>1 use parallel.sharding=none")  # fmt: skip
    if lay["schedule"] == "1f1b" and m < pp:  # torch's Schedule1F1B requires it
        raise ValueError(f"parallel.schedule=1f1b needs parallel.microbatches >= parallel.pp "
                         f"(got microbatches={m}, pp={pp})")  # fmt: skip
    # torch's interleaved schedule takes more, but the rows should be what boom_ml predicts:
    # Megatron's rule (micro-batches in groups of pp)
    if lay["schedule"] == "interleaved" and m % pp:
        raise ValueError(f"parallel.schedule=interleaved needs parallel.microbatches to be a "
                         f"multiple of parallel.pp (got microbatches={m}, pp={pp})")  # fmt: skip


def _decoder(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(base model, LM head) of an HF causal LM this module can cut, else None."""
    base, head = getattr(module, "base_model", None), getattr(module, "lm_head", None)
    kind = getattr(getattr(module, "config", None), "model_type", None)
    parts = ("embed_tokens", "layers", "norm")
    if base is None or head is None or kind not in DECODER_TYPES:
        return None
    return (base, head) if all(hasattr(base, p) for p in parts) else None


def check_models(
    models: Iterable[tuple[str, Mapping[str, Any]]], stages: int, equal: bool = False
) -> None:
    """Raise a one-line ValueError unless every (model, options) cuts into ``stages`` stages.

    Meta builds (no memory): the model must be an HF decoder of :data:`DECODER_TYPES` with at
    least one layer per stage; ``equal`` (the interleaved schedule, as Megatron-LM and
    ``boom_ml.parallel`` want it): as many layers in every stage.
    """
    unique = {(n, json.dumps(o, sort_keys=True, default=str)): (n, o) for n, o in models}
    for name, options in unique.values():
        module = build_model(ModelSpec(name, dict(options))).module
        if _decoder(module) is None:
            kind = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
            raise ValueError(f"parallel.pp>1 supports HF decoders of model_type "
                             f"{', '.join(DECODER_TYPES)}; {name} is {kind}")  # fmt: skip
        layers = len(module.base_model.layers)
        if stages > layers:
            raise ValueError(f"parallel.pp x virtual_stages = {stages} stages exceed {name}'s "
                             f"{layers} layers (one layer per stage at least)")  # fmt: skip
        if equal and layers % stages:
            raise ValueError(f"parallel.schedule=interleaved needs {name}'s {layers} layers to "
                             f"split into pp x virtual_stages = {stages} equal stages")  # fmt: skip


def rank_stages(pp: int, virtual_stages: int, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds (loop order: r, r + pp, ...)."""
    return [c * pp + pp_rank for c in range(virtual_stages)]


def layer_ranges(layers: int, stages: int) -> list[range]:
    """The decoder layers of each stage, in order."""
    counts, start, out = stage_layers(layers, stages), 0, []
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


class DecoderStage(nn.Module):
    """One pipeline stage of an HF decoder: the base model's forward over the stage's layers."""

    def __init__(self, base: nn.Module, head: nn.Module | None, first: bool) -> None:
        super().__init__()
        self.base, self.head, self.first = base, head, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ids into the first stage, hidden states into the others
        out = self.base(**{"input_ids" if self.first else "inputs_embeds": x}).last_hidden_state
        return self.head(out) if self.head is not None else out


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing every submodule and tensor but with its own tables to edit."""
    clone = copy.copy(module)
    for table in ("_modules", "_parameters", "_buffers"):
        clone.__dict__[table] = dict(module.__dict__[table])
    return clone


def split_decoder(model: nn.Module, stages: list[int], num_stages: int) -> list[DecoderStage]:
    """The stage modules ``stages`` (indices out of ``num_stages``) of an HF causal LM."""
    found = _decoder(model)
    if found is None:
        raise ValueError(f"parallel.pp>1: cannot cut {type(model).__name__} into stages")
    base, head = found
    config, layers = base.config, list(base.layers)
    ranges = layer_ranges(len(layers), num_stages)
    out = []
    for s in stages:
        part = _shallow(base)
        part.layers = nn.ModuleList(layers[i] for i in ranges[s])
        if s > 0:
            part.embed_tokens = None
        if s < num_stages - 1:
            part.norm = nn.Identity()  # the final norm belongs to the last stage
        if getattr(config, "layer_types", None):  # per-layer masks (sliding or full) indexed 0..
            part.config = copy.deepcopy(config)
            part.config.layer_types = [config.layer_types[i] for i in ranges[s]]
        out.append(DecoderStage(part, head if s == num_stages - 1 else None, first=s == 0))
    return out


class PipelineStepRunner(StepRunner):
    """One optimizer step of a pipeline schedule over this rank's stages (see module doc)."""

    def __init__(self, config: Mapping[str, Any], dev: torch.device,
                 report: dict[str, Any] | None = None) -> None:  # fmt: skip
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        lay = config["parallel"]
        pp, dp, v, sharding = lay["pp"], lay["dp"], lay["virtual_stages"], lay["sharding"]
        mesh = init_device_mesh(dev.type, (pp, dp), mesh_dim_names=("pp", "dp"))
        self.pp_rank = mesh["pp"].get_local_rank()
        self.report = report if report is not None else {}
        self.report["stage"] = self.pp_rank  # the row's stage, even if the build runs out of memory
        super().__init__(config, dev)  # the whole model, checkpointing switched on
        self.microbatches = int(lay["microbatches"])
        if self.scaler is not None:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # fp16: only the last stage scales a loss, yet every rank unscales its gradients by
            # the same scale; an inf anywhere skips the step on every rank (as Megatron does)
            self.scaler = ShardedGradScaler(dev.type)  # found inf all-reduced over the world
            self.scaler.scale(torch.zeros((), device=dev))  # sets the scale on every rank
        whole = self.module
        self.loss_function = whole.loss_function  # type: ignore[union-attr]
        self.vocab = int(whole.config.vocab_size)  # type: ignore[union-attr]
        indices = rank_stages(pp, v, self.pp_rank)
        modules: list[nn.Module] = list(split_decoder(whole, indices, pp * v))
        # drop the whole model: only this rank's stages stay referenced
        del whole
        self.module = self.built.module = nn.ModuleList(modules)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the dropped layers' blocks: not part of reserved memory
        examples = [self._example(m, s, pp * v) for m, s in zip(modules, indices, strict=True)]
        self.fsdp = sharding in ("zero2", "zero3", "fsdp")
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            reshard = sharding != "zero2"
            for part in modules:
                for block in part.base.layers:  # type: ignore[union-attr]
                    fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
            modules = [fully_shard(m, mesh=mesh["dp"], reshard_after_forward=reshard)
                       for m in modules]  # fmt: skip
        elif dp > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [dev.index] if dev.type == "cuda" else None
            group = mesh["dp"].get_group()
            modules = [DistributedDataParallel(m, device_ids=ids, process_group=group)
                       for m in modules]  # fmt: skip
        group = mesh["pp"].get_group()
        self.stages = [PipelineStage(m, s, pp * v, dev, *example, group=group)
                       for m, s, example in zip(modules, indices, examples, strict=True)]  # fmt: skip
        self.first = any(st.is_first for st in self.stages)
        self.last = any(st.is_last for st in self.stages)
        if lay["schedule"] == "interleaved":
            self.schedule: Any = ScheduleInterleaved1F1B(self.stages, self.microbatches,
                                                         loss_fn=self._loss)  # fmt: skip
        else:
            cls = Schedule1F1B if lay["schedule"] == "1f1b" else ScheduleGPipe
            self.schedule = cls(self.stages[0], self.microbatches, loss_fn=self._loss)
        if self.optimizer is not None:
            params = [p for m in modules for p in m.parameters()]
            self.optimizer = make_optimizer(config["optimizer"], params)
            if sharding == "zero1":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                cls_opt = type(self.optimizer)
                takes = inspect.signature(cls_opt.__init__).parameters
                kwargs = {k: val for k, val in self.optimizer.defaults.items() if k in takes}
                self.optimizer = ZeroRedundancyOptimizer(
                    params, optimizer_class=cls_opt, process_group=mesh["dp"].get_group(), **kwargs
                )

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dev.type, dtype=self.amp_dtype)

    def _example(self, stage: nn.Module, index: int, stages: int) -> tuple[Any, Any]:
        """A stage's (input, output) example: static shapes for ``PipelineStage``.

        Without them the stage infers shapes in its first step by running the wrapped module
        outside DDP's ``no_sync``, which breaks DDP's bucket rebuild (torch 2.14). One local
        micro-batch forward gives the output's dtype (the logits' under autocast); the hidden
        states between stages stay in the parameters' dtype (the residual stream), which the
        output of every stage but the last is checked against.
        """
        ids = self.built.make_inputs(self.step, self.dev)["input_ids"]
        param = next(stage.parameters())
        hidden = (*ids.shape, int(stage.base.config.hidden_size))  # type: ignore[union-attr]
        x = ids if index == 0 else torch.zeros(hidden, dtype=param.dtype, device=self.dev,
                                               requires_grad=True)  # fmt: skip
        with self._autocast():
            out = stage(x)
        if index < stages - 1 and (out.shape, out.dtype) != (hidden, param.dtype):
            raise ValueError(f"stage {index} sends {out.dtype}{list(out.shape)}, not the "
                             f"{param.dtype}{list(hidden)} hidden states the next stage takes")  # fmt: skip
        example = out.detach().requires_grad_(out.requires_grad)
        del out
        return x.detach().requires_grad_(x.requires_grad), example

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The HF model's own causal-LM loss of one micro-batch (scaled under fp16)."""
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab)
        self.report["loss"] = loss.detach()  # read after the timed steps: no sync in the step
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def __call__(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.module.zero_grad(set_to_none=True)
        inputs: dict[str, Any] = {}
        if self.first or self.last:
            batches = [self.built.make_inputs(self.step, self.dev)
                       for _ in range(self.microbatches)]  # fmt: skip
            if self.first:
                inputs["arg_mbs"] = [(b["input_ids"],) for b in batches]
            if self.last:
                inputs["target_mbs"] = [b["labels"] for b in batches]
                inputs["losses"] = []
            del batches
        with self._autocast():
            self.schedule.step(return_outputs=False, **inputs)
        del inputs
        optimizer_step(self.optimizer, self.scaler)


def optimizer_step(optimizer: Any, scaler: Any) -> None:
    """One optimizer step, through the gradient scaler when there is one (fp16)."""
    if optimizer is None:
        return
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
