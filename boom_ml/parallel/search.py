"""The cheapest multi-GPU layouts that fit: a small search over dp x tp x pp x sharding.

Used by the advisor when no single-GPU change makes a step fit (``api`` passes it down, so
``report`` never imports the prediction stack). Every candidate is predicted with
:func:`boom_ml.parallel.predict.predict_raw`, which profiles a tensor-parallel rank from
1- and 2-layer traces cached per (tp, step, GPU): the whole search traces at most four small
models per tp degree, and every other layout is arithmetic on those profiles.

Layouts compared:

* dp, tp, pp are powers of two with dp * tp * pp <= ``max_gpus``, pp <= :data:`MAX_PP`; tp stays inside one node
  (a tensor-parallel group across nodes runs its per-layer all-reduces over the network,
  which no one would choose while a layout without it exists); the rules of
  :func:`boom_ml.parallel.layout.validate` (heads, hidden size, layers, whole nodes) apply.
* sharding: ``none`` for dp = 1; ``none``, ``zero1``, ``zero2``, ``fsdp`` for dp > 1
  (``zero3`` is modelled as ``fsdp``).
* micro-batches: the step's own ``grad_accum`` when pp = 1; a pipeline needs many micro-batches
  to keep its bubble small, so pp > 1 runs ``max(grad_accum, 2 * largest pp searched)``. One
  count for every pipeline keeps the number of traces independent of the pp degrees tried.

Ranking: $ per step of the *requested* batch (``batch_size * grad_accum`` samples). Layouts
differ in their global batch (``batch_size * microbatches * dp``), so a layout's own step is
scaled to the requested number of samples; otherwise the layout processing fewer samples per
step would always look cheapest. Without a price, GPU-seconds rank instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from boom_ml.errors import InvalidInputError
from boom_ml.gpus.spec import GpuSpec
from boom_ml.parallel.layout import Cluster, Layout, check_checkpoint_every, validate
from boom_ml.parallel.predict import attention_groups, predict_raw
from boom_ml.parallel.profile import prefetch
from boom_ml.parallel.shard import check_model, load_raw, model_facts, with_build_options
from boom_ml.specs import StepSpec

MAX_GPUS = 64
# Deeper pipelines need ever more micro-batches (a bigger global batch) to hide their bubble;
# 8 stages is where published large-model layouts stop (Llama-3-405B: pp=16 on 16k GPUs).
MAX_PP = 8
TOP = 3
SHARDING_SEARCHED = ("none", "zero1", "zero2", "fsdp")


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


def candidate_layouts(
    raw: dict[str, Any], step: StepSpec, cluster: Cluster, max_gpus: int = MAX_GPUS
) -> list[Layout]:
    """Every layout of the search (before validation against the model), single GPU excluded."""
    layers = model_facts(raw)["layers"] or 1
    pp_max = max(p for p in _powers(min(max_gpus, MAX_PP)) if p <= layers)
    pipeline_micro = max(step.grad_accum, 2 * pp_max)
    out = []
    for tp in _powers(min(max_gpus, cluster.gpus_per_node)):
        for pp in _powers(min(max_gpus // tp, pp_max)):
            for dp in _powers(max_gpus // (tp * pp)):
                if dp * tp * pp == 1:
                    continue
                micro = step.grad_accum if pp == 1 else pipeline_micro
                for sharding in SHARDING_SEARCHED if dp > 1 else ("none",):
                    out.append(Layout(dp=dp, tp=tp, pp=pp, sharding=sharding, microbatches=micro))
    return out


def _valid(raw: dict[str, Any], layout: Layout, cluster: Cluster, step: StepSpec) -> bool:
    """Whether ``predict_raw`` takes ``layout`` (heads, hidden size, layers, whole nodes, the
    recipe)."""
    try:
        validate(
            layout,
            cluster,
            **check_model(raw, layout),
            finetune_method=step.finetune_method,
            optimizer=step.optimizer,
        )
    except InvalidInputError:
        return False
    return True


def _proposal(entry: dict[str, Any], gpu: GpuSpec, requested: int) -> dict[str, Any]:
    par, mem, tim = entry["parallel"], entry["memory"], entry["time"]
    world = int(par["world"])
    step_ms = float(tim["step_ms"])
    scale = requested / int(tim["global_batch"])  # the requested samples' share of a step
    gpu_s = world * step_ms / 1e3
    price = gpu.price_usd_per_hour
    layout_usd = None if price is None else price * gpu_s / 3600
    return {
        "layout": {k: par[k] for k in ("dp", "tp", "pp", "sharding", "microbatches")},
        "gpus": world,
        "nodes": int(par["nodes"]),
        "fits": bool(entry["fits"]),
        "total_bytes": int(mem["total_bytes"]),
        "p90_bytes": int(mem["p90_bytes"]),
        "capacity_bytes": int(mem["capacity_bytes"]),
        "step_ms": step_ms,  # one optimizer step of the layout, over its global batch
        "global_batch": int(tim["global_batch"]),
        "samples_per_s": float(tim["samples_per_s"]),
        "bubble_ms": float(tim.get("bubble_ms") or 0.0),
        "exposed_comm_ms": float(tim.get("exposed_comm_ms") or 0.0),
        "usd_per_hour": None if price is None else price * world,
        "layout_usd_per_step": layout_usd,
        # the ranking key: what the requested batch (batch_size x grad_accum samples) costs
        "usd_per_step": None if layout_usd is None else layout_usd * scale,
        "gpu_seconds_per_step": gpu_s * scale,
    }


def _printed(proposal: dict[str, Any]) -> tuple[Any, ...]:
    """A proposal as the advice prints it, less its sharding: shape, GiB per GPU, ms."""
    lay = proposal["layout"]
    return (lay["dp"], lay["tp"], lay["pp"], lay["microbatches"],
            round(proposal["total_bytes"] / 2**30, 1), round(proposal["step_ms"]))  # fmt: skip


def distinct_choices(ranked: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ranked`` less each layout that prints the same numbers as a less sharded one of the
    same shape: ZeRO-2 over ZeRO-1 where the gradients are a LoRA adapter's few MiB, say.
    Sharding more is a choice only where it changes memory or time; the simpler is named."""
    order = {s: i for i, s in enumerate(SHARDING_SEARCHED)}
    simplest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for p in sorted(ranked, key=lambda p: order[p["layout"]["sharding"]]):
        simplest.setdefault(_printed(p), p)
    kept = {id(p) for p in simplest.values()}
    return [p for p in ranked if id(p) in kept]


def rank_key(proposal: dict[str, Any]) -> tuple[float, float]:
    """$ per requested step, then GPU-seconds (the order when a GPU has no price)."""
    usd = proposal["usd_per_step"]
    return (math.inf if usd is None else usd, proposal["gpu_seconds_per_step"])


# Layouts whose costs differ by less than this share are one price to the advice: the cost of
# a sample is nearly flat in data parallelism, so by cost alone the largest clusters came
# first by a fraction of a percent (64, 32, 16 GPUs for a step asked of 2). Repeated runs of
# one configuration on one GPU model differ by more than this (README, `python -m
# training.step_spread`: 7.5 % over the RTX 2080 Ti's four runs), so no measurement could
# tell such layouts apart; the step time's own p10-p90 is tens of percent wide.
NEAR_TIE = 0.05


def ranked_layouts(proposals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``proposals`` by :func:`rank_key`, those within :data:`NEAR_TIE` of the cheapest of
    their run in fewer GPUs first (GPU-seconds where no GPU has a price)."""
    by_cost = sorted(proposals, key=rank_key)

    def cost(p: dict[str, Any]) -> float:
        key = rank_key(p)
        return key[0] if math.isfinite(key[0]) else key[1]

    out: list[dict[str, Any]] = []
    while by_cost:
        limit = cost(by_cost[0]) * (1 + NEAR_TIE)
        n = next((i for i, p in enumerate(by_cost) if cost(p) > limit), len(by_cost))
        out += sorted(by_cost[:n], key=lambda p: (p["gpus"], rank_key(p)))
        by_cost = by_cost[n:]
    return out


def search_layouts(
    model: str | dict[str, Any],
    gpu: GpuSpec,
    step: StepSpec,
    cluster: Cluster | None = None,
    stack: Any = None,
    max_gpus: int = MAX_GPUS,
    top: int = TOP,
) -> dict[str, Any]:
    """The ``top`` cheapest layouts of ``model`` on ``gpu`` whose worst rank fits (p90).

    ``model`` is ``hf:<id or config path>`` or an HF config dict. Returns ``layouts`` (ranked
    by :func:`ranked_layouts`, less sharding that changes nothing printed: :func:`distinct_choices`),
    ``searched`` (layouts predicted), ``valid``, ``fitting`` (layouts that fit), ``seconds``,
    ``max_gpus`` and, where none fits, ``closest`` (the layout whose worst rank needs least);
    raises ``InvalidInputError`` for a model the parallel predictor cannot model (not an HF
    config).
    """
    return search_layouts_many(model, [gpu], step, cluster, stack, max_gpus, top)[gpu.id]


def search_layouts_many(
    model: str | dict[str, Any],
    gpus: list[GpuSpec],
    step: StepSpec,
    cluster: Cluster | None = None,
    stack: Any = None,
    max_gpus: int = MAX_GPUS,
    top: int = TOP,
    options: dict[str, Any] | None = None,
    requested: int | None = None,
) -> dict[str, dict[str, Any]]:
    """:func:`search_layouts` for each GPU (by id): every layout is predicted for all GPUs
    in one call, so the per-op timing of the profiles runs once for all of them. ``options``:
    the zoo's build options of the model (attention implementation, MoE imbalance).
    ``requested``: the samples a step must process, which prices it (default ``batch_size *
    grad_accum``; a layout that does not fit asks for its own global batch, its dp's too)."""
    started = time.perf_counter()
    cluster = cluster or Cluster()
    raw = with_build_options(load_raw(model) if isinstance(model, str) else model, options)
    check_model(raw, Layout(dp=2))  # a model no layout can cut: one line, the advice's reason
    check_checkpoint_every(step.checkpointing, step.checkpointing_every)  # the same
    requested = requested or step.batch_size * step.grad_accum
    fitting: dict[str, list[dict[str, Any]]] = {gpu.id: [] for gpu in gpus}
    # the layout whose worst rank needs least (p90) where none fits, and that p90
    closest: dict[str, tuple[Layout, int]] = {}
    layouts = candidate_layouts(raw, step, cluster, max_gpus)
    searched, valid = len(layouts), 0
    layouts = [lay for lay in layouts if _valid(raw, lay, cluster, step)]
    if gpus:  # the small traces every layout is arithmetic on, side by side in workers
        group, members = next(iter(attention_groups(gpus, stack).items()))  # traced first
        tps = sorted({lay.tp for lay in layouts})
        prefetch(raw, tps, replace(step, sdpa_group=group), members[0])
    one_step = replace(step, grad_accum=1)
    for layout in layouts:
        try:  # a model the trace cannot split this way
            # a layout is timed only on the GPUs it fits (a step time per layout and GPU was
            # a third of a Llama-3-8B gpu=all search, most of it on GPUs it did not fit)
            entries = predict_raw(raw, gpus, one_step, layout, cluster, stack=stack,
                                  time_if_fits=True)  # fmt: skip
        except InvalidInputError:
            continue
        valid += 1
        for gpu, entry in zip(gpus, entries, strict=True):
            if entry["fits"]:
                fitting[gpu.id].append(_proposal(entry, gpu, requested))
            elif not fitting[gpu.id]:
                need = int(entry["memory"]["p90_bytes"])
                if gpu.id not in closest or need < closest[gpu.id][1]:
                    closest[gpu.id] = (layout, need)
    out = {}
    for gpu in gpus:
        ranked = distinct_choices(ranked_layouts(fitting[gpu.id]))
        out[gpu.id] = {"layouts": ranked[:top], "searched": searched, "valid": valid,
                       "fitting": len(fitting[gpu.id]), "max_gpus": max_gpus,
                       "near_tie": NEAR_TIE}  # fmt: skip
        if not ranked and gpu.id in closest:  # what it would take: the nearest miss, timed
            (entry,) = predict_raw(raw, [gpu], one_step, closest[gpu.id][0], cluster, stack=stack)
            out[gpu.id]["closest"] = _proposal(entry, gpu, requested)
    seconds = round(time.perf_counter() - started, 3)
    for found in out.values():
        found["seconds"] = seconds
    return out
