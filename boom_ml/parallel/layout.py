"""How a training job is spread over GPUs: the parallel layout and the cluster it runs on.

Torch-free on purpose: the CLI validates a layout before it imports torch, so a bad layout
fails in milliseconds with one line (``InvalidInputError``, exit 2).

Conventions (issue #14): ``batch_size`` of the StepSpec stays the micro-batch of one model
replica; the global batch is ``batch_size * microbatches * dp``. ``fsdp`` means FSDP2 full
sharding, which shards what ZeRO-3 shards, so it is modelled as ``zero3``. With ``pp > 1``,
where DeepSpeed refuses ZeRO-2 and -3 and Megatron-LM has ZeRO-1 only, ``zero2`` / ``zero3``
/ ``fsdp`` are FSDP2 under ``torch.distributed.pipelining`` (``zero2``: not resharded after
forward, torchtitan's default there), as ``data_collection/pipeline_steps.py`` runs them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from boom_ml.errors import InvalidInputError, suggest

SHARDING_MODES = ("none", "zero1", "zero2", "zero3", "fsdp")
# Pipeline schedules: 1F1B (PipeDream-Flush, Megatron's default), GPipe (all forwards, then all
# backwards) and interleaved 1F1B (each rank holds ``virtual_stages`` chunks of layers).
SCHEDULES = ("1f1b", "gpipe", "interleaved")
SCHEDULE_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "interleaved 1F1B"}
# How micro-batches 2..N of a step reach the kept gradients: "add", autograd's one in-place
# add per gradient (PyTorch DDP's no_sync, FSDP2, DeepSpeed); "fused", inside the weight-
# gradient GEMMs (Megatron-LM's gradient accumulation fusion into ``main_grad``): no add kernels.
GRAD_ACCUMULATION = ("add", "fused")
INTRA_LINKS = ("auto", "nvlink", "pcie")
INTER_LINKS = ("auto", "ib-ndr400", "ib-hdr200", "roce-100g", "eth-25g")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{name} must be an integer >= 1, got {value!r}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = suggest(str(value), choices)
        raise InvalidInputError(
            f"unknown {name} {value!r}{hint}; choose one of: {', '.join(choices)}"
        )


@dataclass(frozen=True)
class Layout:
    """Data (dp), tensor (tp) and pipeline (pp) parallel degrees, sharding and micro-batches."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sharding: str = "none"  # none | zero1 | zero2 | zero3 | fsdp (= zero3)
    microbatches: int = 1  # per optimizer step: pipeline micro-batches / accumulation steps
    schedule: str = "1f1b"  # 1f1b | gpipe | interleaved (pipeline schedule when pp > 1)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved only)
    grad_accumulation: str = "add"  # add | fused (GRAD_ACCUMULATION): micro-batches 2..N
    # DDP's gradient_as_bucket_view (PyTorch's default False: its buckets copy every gradient)
    bucket_view: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "virtual_stages"):
            _positive(f"parallel.{name}", getattr(self, name))
        _choice("parallel.sharding", self.sharding, SHARDING_MODES)
        _choice("parallel.schedule", self.schedule, SCHEDULES)
        _choice("parallel.grad_accumulation", self.grad_accumulation, GRAD_ACCUMULATION)
        if not isinstance(self.bucket_view, bool):
            raise InvalidInputError(
                f"parallel.bucket_view must be true or false, got {self.bucket_view!r}"
            )
        if (self.schedule == "interleaved") != (self.virtual_stages > 1):
            raise InvalidInputError(
                "parallel.schedule=interleaved needs parallel.virtual_stages >= 2, and"
                " parallel.virtual_stages > 1 needs parallel.schedule=interleaved (got"
                f" schedule={self.schedule}, virtual_stages={self.virtual_stages})"
            )

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def zero_stage(self) -> int:
        """0 (none), 1, 2 or 3 (zero3 and fsdp)."""
        return {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[self.sharding]

    @property
    def fsdp2(self) -> bool:
        """Whether dp ranks run FSDP2: zero3 / fsdp, and under a pipeline zero2 too (FSDP2
        without resharding after forward, as the module docstring says)."""
        return self.zero_stage >= 3 or (self.zero_stage == 2 and self.pp > 1)

    @property
    def shards_microbatch_gradients(self) -> bool:
        """Whether each micro-batch's gradients are reduce-scattered into 1/dp shards (ZeRO-2,
        FSDP without a pipeline); FSDP2 under one keeps them whole until the last."""
        return self.zero_stage >= 2 and self.pp == 1

    @property
    def is_single(self) -> bool:
        return self.world == 1 and self.microbatches == 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "world": self.world}


@dataclass(frozen=True)
class Cluster:
    """GPUs per node and the links inside (intra) and between (inter) nodes."""

    gpus_per_node: int = 8
    intra: str = "auto"  # auto (the GPU's own link) | nvlink | pcie
    inter: str = "auto"  # auto (ib-ndr400 for Hopper and later, else ib-hdr200) | ...

    def __post_init__(self) -> None:
        _positive("cluster.gpus_per_node", self.gpus_per_node)
        _choice("cluster.intra", self.intra, INTRA_LINKS)
        _choice("cluster.inter", self.inter, INTER_LINKS)

    def nodes(self, layout: Layout) -> int:
        return -(-layout.world // self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_checkpoint_every(checkpointing: str, every: int) -> None:
    """One line for ``checkpointing.every`` > 1 with a multi-GPU layout: a rank's time and
    memory are lines through its model traced with 1 and 2 layers, which checkpoint layer 0
    in both, so their difference is a layer without checkpointing (every layer but the first
    came out uncheckpointed: 40.2 GiB where one GPU's step saves 5.7 GiB)."""
    if checkpointing != "none" and every != 1:
        raise InvalidInputError(
            f"checkpointing.every={every} with a multi-GPU layout: a rank is predicted from its"
            f" model traced with 1 and 2 layers, which cannot hold one layer in {every}"
            " checkpointed; use checkpointing.every=1 (every layer) there"
        )


def unread_keys(layout: Layout) -> str:
    """One line naming the ``parallel.*`` keys ``layout`` was given and does not read ('' if
    none): on one GPU, the layout-only keys; in a layout, a schedule without a pipeline, DDP's
    bucket option under ZeRO/FSDP, fused accumulation of one micro-batch (gpipe at pp=1 had
    run as 1F1B with exit 0)."""
    given = [(f"parallel.{k}={v}", v != default) for k, v, default in (
        ("schedule", layout.schedule, "1f1b"), ("grad_accumulation", layout.grad_accumulation, "add"),
        ("bucket_view", str(layout.bucket_view).lower(), "false"))]  # fmt: skip
    if layout.world == 1:  # one GPU's micro-batches are its grad_accum, traced whole
        keys = [key for key, set_ in given if set_]
        micro = (f" (parallel.microbatches={layout.microbatches} there is grad_accum="
                 f"{layout.microbatches})" if layout.microbatches > 1 else "")  # fmt: skip
        return (f"{', '.join(keys)}: for a multi-GPU layout (parallel.dp, tp or pp above 1); "
                f"one GPU's step does not read it{micro}") if keys else ""  # fmt: skip
    reasons = (
        "a schedule of pipeline stages, and parallel.pp=1 has none" if layout.pp == 1 else "",
        "how micro-batches 2..N accumulate, and parallel.microbatches=1 has one"
        if layout.microbatches == 1 else "",
        f"it sets DDP's buckets, which parallel.sharding={layout.sharding} does not use"
        if layout.sharding != "none"
        else "it sets DDP's buckets, and parallel.dp=1 runs no DDP" if layout.dp == 1 else "",
    )  # fmt: skip
    for (key, set_), why in zip(given, reasons, strict=True):
        if set_ and why:
            return f"{key}: this layout does not read it ({why})"
    return ""


def unread_cluster_keys(layout: Layout, cluster: Cluster) -> tuple[dict[str, Any], str]:
    """The ``cluster.*`` keys set away from their defaults that a prediction reads only in a
    layout search (``{"cluster.inter": "eth-25g"}``), and why: one GPU's step reads none, and
    a layout within one node crosses no inter-node link."""
    default = Cluster()
    changed = {f"cluster.{k}": v for k, v in asdict(cluster).items() if v != getattr(default, k)}
    if layout.is_single:
        return changed, "one GPU's step does not read it"
    if cluster.inter != default.inter and layout.world <= cluster.gpus_per_node:
        return {"cluster.inter": cluster.inter}, (
            f"this layout does not read it (its {layout.world} GPUs fit in one node of"
            f" cluster.gpus_per_node={cluster.gpus_per_node})"
        )
    return {}, ""


def check_cluster_keys(layout: Layout, cluster: Cluster, advice: bool) -> None:
    """One line naming the ``cluster.*`` keys nothing reads without ``advice``, whose layout
    search reads them (with it, the prediction says so where no search ran). (Not in
    :func:`validate`, which the layout search calls with the user's cluster on every
    candidate.)"""
    if advice:
        return
    keys, why = unread_cluster_keys(layout, cluster)
    given = ", ".join(f"{k}={v}" for k, v in keys.items())
    if keys and layout.is_single:
        raise InvalidInputError(
            f"{given}: for a multi-GPU layout, or advice=true (which searches layouts); {why}"
        )
    if keys:
        raise InvalidInputError(f"{given}: {why}")


def validate(
    layout: Layout,
    cluster: Cluster,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    hidden: int | None = None,
    layers: int | None = None,
    global_batch: int | None = None,
    batch_size: int | None = None,
    finetune_method: str | None = None,
    optimizer: str | None = None,
) -> None:
    """Raise one-line ``InvalidInputError`` for a layout the model or cluster cannot run.

    Model facts are optional so the CLI can check the cluster before it knows the model.
    Ranks are placed tp-innermost (Megatron's order) and a job on more than one node fills
    whole nodes; a tensor-parallel group larger than a node is allowed (its all-reduces then
    run at the inter-node rate, as vTrain's tp=16 runs did).

    The interleaved schedule follows Megatron-LM's rules: the layers split into pp * v equal
    chunks (``megatron/training/arguments.py``: num_layers divisible by pp, and the layers per
    stage by the layers per virtual stage), and the micro-batches are a multiple of pp (they go
    round in groups of ``microbatch_group_size_per_vp_stage``, default pp, and a last group
    smaller than pp is refused in ``forward_backward_pipelining_with_interleaving``). Megatron
    also wants pp > 2 unless ``--overlap-p2p-comm`` is on; pp = 2 is accepted here (as with
    that flag) and its sends are charged as blocking anyway (``schedule.py``).
    """
    if layout.sharding != "none" and layout.dp == 1:
        raise InvalidInputError(
            f"parallel.sharding={layout.sharding} shards over data-parallel ranks: it needs"
            " parallel.dp >= 2 (got parallel.dp=1)"
        )
    if layout.grad_accumulation == "fused" and layout.zero_stage >= 2:
        # the fusion writes each micro-batch's weight gradient into a whole fp32 main_grad
        # inside its GEMM; these keep 1/dp shards (or FSDP2's own gradients), so the adds stay
        # (it had dropped them without a word: a hunt)
        raise InvalidInputError(
            "parallel.grad_accumulation=fused is Megatron-LM's gradient accumulation fusion,"
            " which adds into whole gradient buffers; parallel.sharding="
            f"{layout.sharding} keeps sharded gradients (ZeRO-2 / FSDP2): use"
            " parallel.grad_accumulation=add, or parallel.sharding=none or zero1"
        )
    if optimizer == "none" and layout.zero_stage in (1, 2) and not layout.fsdp2:
        # ZeRO-1/2 shard the optimizer's state and gather the parameters it updated: with no
        # optimizer the gather of 4.7 GB had been charged all the same (a hunt)
        raise InvalidInputError(
            f"parallel.sharding={layout.sharding} shards the optimizer's state, and optimizer="
            "none has none: use parallel.sharding=none (or zero3/fsdp, which shard parameters)"
        )
    if layers is not None and layout.pp > layers:
        raise InvalidInputError(
            f"parallel.pp={layout.pp} exceeds the model's {layers} layer{'s' if layers > 1 else ''}"
            " (one stage per layer at most)"
        )
    if layout.schedule == "interleaved":
        if layout.pp == 1:
            raise InvalidInputError(
                "parallel.schedule=interleaved needs parallel.pp >= 2 (it interleaves model"
                " chunks over the pipeline ranks)"
            )
        if layout.microbatches % layout.pp:
            raise InvalidInputError(
                f"parallel.microbatches={layout.microbatches} is not a multiple of parallel.pp="
                f"{layout.pp}: the interleaved schedule runs micro-batches in groups of pp"
                " (Megatron-LM)"
            )
    unread = unread_keys(layout)
    if unread:
        raise InvalidInputError(unread)
    if finetune_method == "qlora" and (layout.pp > 1 or layout.zero_stage >= 3):
        raise InvalidInputError(
            "finetune.method=qlora is modelled with data and tensor parallelism (sharding up to"
            " zero2), not with parallel.pp > 1 or parallel.sharding=zero3/fsdp: its 4-bit base"
            " weights are buffers that the stage and sharding terms do not move"
        )
    world = layout.world
    if world > cluster.gpus_per_node and world % cluster.gpus_per_node:
        raise InvalidInputError(
            f"dp*tp*pp = {world} GPUs is not a multiple of cluster.gpus_per_node="
            f"{cluster.gpus_per_node} (a job on more than one node fills whole nodes)"
        )
    if heads is not None and heads % layout.tp:
        raise InvalidInputError(
            f"parallel.tp={layout.tp} does not divide the model's {heads} attention heads"
        )
    if kv_heads is not None and kv_heads % layout.tp:
        # Megatron-core's Attention: num_query_groups_per_partition = divide(num_query_groups,
        # tp), which asserts; torchtitan's column-wise k/v would cut a head in parts.
        raise InvalidInputError(
            f"parallel.tp={layout.tp} does not divide the model's {kv_heads} key/value heads"
            " (each tensor-parallel rank holds whole key/value heads, as Megatron-core splits"
            " them)"
        )
    if hidden is not None and hidden % layout.tp:
        raise InvalidInputError(
            f"parallel.tp={layout.tp} does not divide the model's hidden size {hidden}"
        )
    chunks = layout.pp * layout.virtual_stages
    if layout.schedule == "interleaved" and layers is not None and layers % chunks:
        raise InvalidInputError(
            f"the model's {layers} layers do not split into parallel.pp x"
            f" parallel.virtual_stages = {chunks} equal chunks (the interleaved schedule"
            " needs the layers divisible by pp x virtual_stages, as Megatron-LM does)"
        )
    if global_batch is not None and batch_size is not None:
        if global_batch % (batch_size * layout.dp):
            raise InvalidInputError(
                f"global batch {global_batch} is not divisible by batch_size={batch_size} x "
                f"parallel.dp={layout.dp}"
            )


def as_one_gpu(layout: Layout, grad_accum: int) -> tuple[Layout, int]:
    """A layout of one GPU that sets nothing but its micro-batches is one GPU's step with
    gradient accumulation: (the single-GPU layout, micro-batches as ``grad_accum``), so that
    it is traced whole like ``grad_accum=N`` (the layout model extrapolates from 1- and
    2-layer traces, whose fragmentation differs); any other layout as it is."""
    # grad_accum beside it too: for_parallel_step says to give one of them
    one_gpu = layout.world == 1 and replace(layout, microbatches=1) == Layout()
    if not one_gpu or layout.microbatches == 1 or grad_accum > 1:
        return layout, grad_accum
    return Layout(), layout.microbatches


def for_parallel_step(
    layout: Layout,
    *,
    grad_accum: int = 1,
    max_batch_on: bool = False,
) -> Layout:
    """``layout`` with ``grad_accum`` folded in as its micro-batches (the same thing under a
    layout: micro-batches per optimizer step), and a one-line error for the max-batch search
    a layout prediction does not run. A single-GPU layout is returned as it is."""
    if layout.is_single:
        return layout
    if max_batch_on:
        raise InvalidInputError(
            "max_batch=on: searched for one GPU only, not for parallel layouts yet (a layout"
            " prints its worst rank, step time and top collectives; advice=true proposes"
            " layouts that fit)"
        )
    if grad_accum > 1:
        if layout.microbatches > 1:
            raise InvalidInputError(
                f"grad_accum={grad_accum} and parallel.microbatches={layout.microbatches}: with a"
                " parallel layout the micro-batches per optimizer step are parallel.microbatches"
                " (grad_accum is its one-GPU name); give one of them"
            )
        layout = replace(layout, microbatches=grad_accum)
    return layout
