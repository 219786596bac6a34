"""One training step of a configuration, for real: the step harness's measuring core.

A configuration is model x batch size x AMP x checkpointing x optimizer (x TF32):
:func:`expand` lists a sweep's, :class:`StepRunner` runs one step of one on a device and
:func:`measure_step` times it and reads its memory counters into a ``steps`` row (and, when
the configuration asks, an ``op_profiles`` profile of one more step). ``steps`` (one GPU) and
``distributed_steps`` (torchrun ranks) drive these; nothing here starts a sweep.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import statistics
from collections.abc import Callable, Mapping
from typing import Any

import torch

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.optimizers import make_optimizer
from boom_ml.zoo import build_model
from data_collection import environment as env
from data_collection import schema
from data_collection.kernels import Timer, dry_run, spread
from data_collection.op_profiles import no_mark, profile_rows
from data_collection.shards import config_key

log = logging.getLogger(__name__)

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_KEYED = ("model", "options", "batch_size", "seq_len", "image_size", "amp", "checkpointing",
          "optimizer", "tf32", "channels_last", "gpu_id")  # fmt: skip


# A dry run's transformers: one narrow layer and a small vocabulary (standard config names;
# transformers maps them onto GPT-2's n_layer/n_embd/n_head). Same code path, tiny cost.
DRY_RUN_HF_OPTIONS = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2,
                      "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128,
                      "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


def expand(
    cfg: Mapping[str, Any], gpu_id: str, on_cuda: bool = True
) -> list[tuple[str, dict[str, Any]]]:
    """Every (key, config): each model entry crosses its batch sizes with the step options.

    A model entry may override the ``amp``, ``checkpointing``, ``optimizers`` and ``tf32``
    lists and ``profile_ops``: ``first`` profiles the entry's first batch size of every
    other combination, ``all`` every config, ``none`` none (it is not part of the key).

    A dry run (``dry_run``) runs the same code on toy sizes: batch <= ``dry_run_batch``,
    sequences and images <= 32, HF models shrunk to :data:`DRY_RUN_HF_OPTIONS`, an entry's
    ``dry_run_options`` applied (e.g. a ViT built for 32-pixel images). With
    ``dry_run_configs: per_model`` (the default) each model entry runs one configuration,
    the i-th entry the i-th combination of amp x checkpointing x optimizer x tf32 (cycling),
    so a handful of configurations still runs every option value; ``all`` runs every one.
    """
    dry = dry_run(cfg)
    one_per_model = dry and str(cfg.get("dry_run_configs", "per_model")) == "per_model"
    mode = str(cfg.get("profile_ops", "first"))
    seen: dict[str, dict[str, Any]] = {}
    for index, entry in enumerate(cfg["models"]):
        entry = dict(entry)
        sizes = [int(b) for b in entry["batch_sizes"]]
        seq, image = entry.get("seq_len"), entry.get("image_size")
        options = dict(entry.get("options") or {})
        if dry:  # the same path at toy sizes
            sizes = sorted({min(b, int(cfg.get("dry_run_batch", 2))) for b in sizes})
            seq = min(int(seq), 32) if seq else seq
            image = min(int(image), 32) if image else image
            if str(entry["name"]).startswith("hf:"):
                options.update(DRY_RUN_HF_OPTIONS)
            options.update(entry.get("dry_run_options") or {})
            image = options.get("image_size", image)  # a model built for a fixed size
        combos = [
            (amp, ckpt, opt, bool(tf32))
            for amp in entry.get("amp") or cfg["amp"]
            for ckpt in entry.get("checkpointing") or cfg["checkpointing"]
            for opt in entry.get("optimizers") or cfg["optimizers"]
            for tf32 in entry.get("tf32") or cfg["tf32"]
            if on_cuda or not tf32  # no TF32 on a CPU: it would be an fp32 row
        ]
        if one_per_model and combos:
            combos = [combos[index % len(combos)]]
        entry_mode = str(entry.get("profile_ops", mode))
        for i, batch in enumerate(sizes):
            for amp, ckpt, opt, tf32 in combos:
                config = {
                    "model": entry["name"], "options": dict(options),
                    "batch_size": batch, "seq_len": seq, "image_size": image,
                    "amp": amp, "checkpointing": ckpt, "optimizer": opt,
                    "tf32": tf32, "gpu_id": gpu_id,
                    "channels_last": bool(entry.get("channels_last", False)),
                }  # fmt: skip
                key = config_key({k: config[k] for k in _KEYED})
                config["profile"] = entry_mode == "all" or (entry_mode == "first" and i == 0)
                seen.setdefault(key, config)
    return list(seen.items())


class StepRunner:
    """A real training step of one configuration on ``dev`` (the tracer's step, for real)."""

    def __init__(self, config: Mapping[str, Any], dev: torch.device) -> None:
        self.dev = dev
        spec = ModelSpec(config["model"], dict(config["options"]))
        self.built = build_model(spec, device=dev)  # the constructors' own initialisation
        self.step = self.built.resolve_step(
            StepSpec(batch_size=config["batch_size"], seq_len=config["seq_len"],
                     image_size=config["image_size"], optimizer=config["optimizer"],
                     amp=config["amp"], checkpointing=config["checkpointing"],
                     tf32=config["tf32"])
        )  # fmt: skip
        self.module = self.built.module
        _check_initialised(self.module, config["model"])
        self.module.train()
        if config["channels_last"]:
            self.module.to(memory_format=torch.channels_last)
        if config["checkpointing"] == "full":
            self.built.enable_checkpointing(self.module)
        self.optimizer = make_optimizer(config["optimizer"], list(self.module.parameters()))
        amp = config["amp"]
        self.scaler = torch.amp.GradScaler(dev.type) if amp == "fp16" else None
        self.amp_dtype = AMP_DTYPES.get(amp)
        self.marks: Callable[[str], contextlib.AbstractContextManager] = no_mark

    def __call__(self) -> None:
        mark = self.marks
        with mark("zero_grad"):
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.module.zero_grad(set_to_none=True)
        with mark("input"):
            batch = self.built.make_inputs(self.step, self.dev)
        autocast = (torch.autocast(self.dev.type, dtype=self.amp_dtype)
                    if self.amp_dtype else contextlib.nullcontext())  # fmt: skip
        with mark("forward"), autocast:
            outputs = self.module(**self.built.forward_kwargs(batch))
            loss = self.built.compute_loss(outputs, batch)
        del outputs
        with mark("backward"):
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        del loss, batch
        if self.optimizer is None:
            return
        with mark("optimizer"):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()


def _check_initialised(module: torch.nn.Module, what: str) -> None:
    """Re-initialise parameters holding NaN/inf (N(0, 0.02), the usual transformer init).

    The zoo's real-device build runs the constructors' own initialisation; this guard
    only makes sure no garbage reaches a timed step, where NaNs run on slow paths.
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                log.warning("%s: %s was not finite; re-initialised", what, name)
                p.normal_(0.0, 0.02)


def measure_step(
    config: dict[str, Any], key: str, dev: torch.device, base: dict[str, Any],
    nvml: env.NvmlMemory, warmup: int, iterations: int,
    runner: Callable[[Mapping[str, Any], torch.device], StepRunner] = StepRunner,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """The steps row (and op-profile rows) of one configuration; ``{}`` if it cannot run.

    ``runner`` builds the step (the multi-GPU harness passes one that wraps the model).
    """
    env.set_tf32(bool(config["tf32"]))
    cuda = dev.type == "cuda"
    _release(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    row: dict[str, Any] = {c: None for c in schema.columns("steps")}
    row.update(base)
    row.update(
        num_gpus=1, model=config["model"], batch_size=config["batch_size"],
        global_batch_size=config["batch_size"], precision="float32", amp=config["amp"],
        checkpointing=config["checkpointing"], optimizer=config["optimizer"],
        tf32=bool(config["tf32"]), channels_last=bool(config["channels_last"]),
        phase_scope="fwd+bwd" if config["optimizer"] == "none" else "fwd+bwd+opt",
        variant=json.dumps(config["options"], sort_keys=True) if config["options"] else "",
        run_id=key, oom=False,
    )  # fmt: skip
    profile: list[dict[str, Any]] = []
    make_runner, runner = runner, None
    oom_at, stage = None, "setup"
    try:
        # A meta build (no memory) names the family and default sizes even if the real
        # build runs out of memory.
        meta = build_model(ModelSpec(config["model"], dict(config["options"])))
        resolved = meta.resolve_step(StepSpec(batch_size=config["batch_size"], seq_len=config["seq_len"],
                                              image_size=config["image_size"]))  # fmt: skip
        row.update(model_family=_family(meta.family), seq_len=resolved.seq_len,
                   image_size=resolved.image_size)  # fmt: skip
        stage = "build"
        runner = make_runner(config, dev)
        stage = "warm-up"
        for _ in range(warmup):
            runner()
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)  # steady state: what the tracer models
        stage = "timed steps"
        times = Timer(dev, warmup=0, repeats=iterations, l2_flush=False)(runner)
        row.update(step_time_ms=max(statistics.median(times), 1e-6), step_time_stat="median",
                   step_time_spread_ms=spread(times), step_time_spread_stat="iqr",
                   n_iterations=len(times))  # fmt: skip
        if cuda:
            row.update(peak_allocated_bytes=int(torch.cuda.max_memory_allocated(dev)),
                       peak_reserved_bytes=int(torch.cuda.max_memory_reserved(dev)),
                       peak_nvml_bytes=nvml.read())  # fmt: skip
        notes = [f"nvml={nvml.method}"] if cuda else []
        if config.get("profile"):
            stage = "profile"
            try:
                profile, coverage = profile_rows(runner, config, key, dev, base, row)
            except Exception as err:  # noqa: BLE001 - the step row is measured (OOM too); keep it
                log.warning("op profile of %s failed: %s", config["model"], err)
                profile, coverage = [], f"op_profile failed: {type(err).__name__}"
            notes.append(coverage)
        row["notes"] = "; ".join(notes) or None
    except torch.cuda.OutOfMemoryError as err:
        oom_at = f"oom during {stage}: {str(err).splitlines()[0][:160]}"
    except Exception as err:  # noqa: BLE001 - a model that cannot run here: log, no row
        log.warning("skip %s bs=%s: %s: %s", config["model"], config["batch_size"],
                    type(err).__name__, str(err)[:300])  # fmt: skip
        return {}
    finally:
        runner = None
        _release(dev)
    if oom_at is not None:
        # The OOM is the measurement: this config does not fit. Peaks stay null (no step
        # completed, so there is no steady-state peak to report).
        row.update(oom=True, notes=oom_at, step_time_ms=None)
        profile = []
    return {"steps": [row], "op_profiles": profile}


def _family(family: str) -> str:
    return family if family in schema.MODEL_FAMILIES else "other"


def _release(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def sweep_settings(cfg: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(warm-up steps, timed steps, shards, shard index); a dry run caps the steps at 1 and 2."""
    dry = dry_run(cfg)
    warmup = min(int(cfg["warmup"]), 1) if dry else int(cfg["warmup"])
    iterations = min(int(cfg["iterations"]), 2) if dry else int(cfg["iterations"])
    return warmup, iterations, int(cfg.get("num_shards", 1)), int(cfg.get("shard_index", 0))


def step_key(config: Mapping[str, Any]) -> str:
    """The shard key of a configuration; a multi-GPU one's layout is part of it."""
    keyed = {k: config[k] for k in _KEYED}
    if "parallel" in config:  # absent for single-GPU configs, whose keys stay as they were
        keyed["parallel"] = config["parallel"]
    return config_key(keyed)
