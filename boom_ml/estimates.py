"""Result types: what one prediction says about one GPU. The JSON output serialises these."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class MemoryEstimate:
    peak_allocated_bytes: int  # torch.cuda.max_memory_allocated
    peak_reserved_bytes: int  # torch.cuda.max_memory_reserved
    total_bytes: int  # what nvidia-smi would show for the process at the peak
    capacity_bytes: int  # usable memory: torch.cuda.get_device_properties(i).total_memory
    fits: bool
    method: str  # how peak_* were obtained, e.g. "allocator-sim" or "live-bytes"
    breakdown: dict[str, int] = field(default_factory=dict)  # category → bytes at the peak
    overheads: dict[str, int] = field(default_factory=dict)  # context, workspaces, ...
    peak_op: str = ""  # op running when the peak was reached
    peak_phase: str = ""
    # op running when the reserved memory last grew (a segment added): the reserved peak's
    # moment, which is not the allocated peak's where cached segments sit idle at the latter
    reserved_peak_op: str = ""
    reserved_peak_phase: str = ""
    # (reserved - allocated) / reserved at the peak: the share of the allocator's blocks
    # holding no tensor (allocated counts whole 512-byte blocks, so a tensor's rounding is
    # not in it); breakdown["fragmentation"] is the bytes reserved beyond the tensors'
    # requested sizes, so it holds that rounding too
    fragmentation: float = 0.0
    max_batch_size: int | None = None
    # True: the search stopped at its cap (max_batch.MAX_BATCH) with the step still fitting,
    # so max_batch_size is a lower bound
    max_batch_lower_bound: bool = False
    # why the max-batch search gave no answer ("" when it did, or was not asked)
    max_batch_error: str = ""
    by_module: list[dict[str, Any]] = field(default_factory=list)  # top modules at the peak
    by_module_group: list[dict[str, Any]] = field(default_factory=list)  # same, blocks summed
    peak_module: str = ""  # module of the op running at the peak
    p10_bytes: int = 0  # total_bytes with the lower bound of every underivable term
    p90_bytes: int = 0  # ... and with the upper bound; ``fits``: every level fits
    fit: str = ""  # yes (every level fits) | tight (some do) | no
    headroom_bytes: int = 0  # capacity_bytes - total_bytes (negative: short by that much)
    stack: dict[str, Any] = field(default_factory=dict)  # the software stack assumed
    terms: list[dict[str, Any]] = field(default_factory=list)  # each overhead, with source
    capacity_source: str = ""  # where capacity_bytes (usable memory) comes from
    # of breakdown["temporary"]: bytes by the phase that allocated them
    temporary_by_phase: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TimeEstimate:
    step_ms: float
    method: str  # "roofline", "per-op", "gnn"
    p10_ms: float | None = None
    p90_ms: float | None = None
    # ms per op family, of one micro-batch and the optimizer step under grad_accum
    by_family: dict[str, float] = field(default_factory=dict)
    by_phase: dict[str, float] = field(default_factory=dict)  # ms per phase of the whole step
    overhead_ms: float = 0.0  # step time not attributed to any op (GNN overhead term)
    # spec-sheet figures of this GPU beyond the GNN's training GPUs', read at their edge
    gnn_clamped: list[str] = field(default_factory=list)
    micro_step_ms: float | None = None  # one micro-batch's forward + backward (grad_accum)
    # a later micro-batch's adds into the kept gradients (grad_accum with set_to_none; in
    # step_ms and by_phase["backward"] once per micro-batch after the first)
    accumulate_ms: float = 0.0
    top_ops: list[dict[str, Any]] = field(default_factory=list)
    top_modules: list[dict[str, Any]] = field(default_factory=list)
    # top_modules with repeated blocks summed: "h.*.attn" with "blocks": 36 (trace/module_paths)
    top_module_groups: list[dict[str, Any]] = field(default_factory=list)
    # whole repeated blocks, children included: "h.*" with "blocks": 36 (trace/module_paths)
    block_totals: list[dict[str, Any]] = field(default_factory=list)
    # How near the kernel measurements behind it come to this GPU (boom_ml/timing/basis.py):
    # measured | architecture measured | architecture not measured; None without heads.
    basis: str | None = None
    # the step's half-precision kernels that no GPU of this one's architecture had measured in
    # fp16 ("fp16/bf16 GEMMs", "fp16/bf16 convolutions"; timing/basis.py: unmeasured_half)
    unmeasured_kernels: list[str] = field(default_factory=list)
    # a step in bf16 (autocast or parameters) on a GPU without bf16 tensor cores (before
    # Ampere): False, its bf16 matmuls timed at the fp32 rate; None for steps without bf16
    bf16_tensor_cores: bool | None = None
    # True where the step with TF32 allowed came out slower than in strict fp32, and is timed
    # as that (timing/estimate.py: TF32 never runs below the fp32 rate)
    tf32_capped: bool = False
    # the packaged GPU whose estimate this one is, where this GPU matches or beats it on every
    # spec number and the models had timed this one slower (timing/dominance.py); "" else
    timed_as: str = ""
    # the SDPA kernels the step's attention calls run on this GPU, as PyTorch selects them
    # (trace/sdpa_select.py): {"flash": 24} on an A100, {"math": 24} for bf16 on a T4; {}
    # for a step without SDPA calls
    attention_backends: dict[str, int] = field(default_factory=dict)
    # the per-op sum of the step's kernels on this GPU, whichever method timed the step: the
    # like-for-like figure between steps that two methods timed
    per_op_ms: float | None = None
    # the method an fp32 step of this model family gets, where it is not this step's (an AMP
    # CNN step is timed per-op, an fp32 one by the GNN: each won its cell of the CV)
    fp32_method: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rate_text(samples_per_s: float) -> str:
    """Samples per second: one decimal from 10 up, three significant figures below, their
    trailing zeros kept (a QLoRA step of 86 s on a T4 is 0.0463 samples/s, not 0.0; 6.998 is
    7.00, not 7)."""
    if samples_per_s >= 9.95:
        return f"{samples_per_s:.1f}"
    if not math.isfinite(samples_per_s) or samples_per_s <= 0:
        return f"{samples_per_s:.3g}"
    return _three_figures(samples_per_s)


def _three_figures(x: float) -> str:
    """A positive number below 100 to three significant figures in fixed point, trailing
    zeros kept."""
    return f"{x:.{max(0, 2 - math.floor(math.log10(x)))}f}"


def usd_per_1000_steps(price_usd_per_hour: float | None, step_ms: float) -> float | None:
    """On-demand price of 1,000 steps of ``step_ms`` at ``price_usd_per_hour`` (None: no
    price)."""
    return None if price_usd_per_hour is None else price_usd_per_hour * step_ms * 1000 / 3.6e6


def usd_text(usd: float) -> str:
    """Dollars to three significant figures in fixed point (cents alone printed 0.03 for an
    H100, an A100 and an L4; 0.0260 keeps its zero), whole dollars from 100."""
    if usd >= 99.95:
        return f"{usd:.0f}"
    if usd <= 0:
        return "0"
    return _three_figures(usd)


@dataclass
class GpuPrediction:
    gpu: str
    name: str
    memory: MemoryEstimate
    time: TimeEstimate | None  # None only for advisor candidates that do not fit
    price_usd_per_hour: float | None = None
    # why the stack's PyTorch wheels have no kernels for this GPU (stack_archs.csv), and the
    # CUDA variants of that torch release that do: predicted as if it ran
    stack_missing: str | None = None
    samples: int = 0  # the step's samples: batch size times micro-batches (0: not known)

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def samples_per_s(self) -> float | None:
        """Samples a second (None without a time or samples): the JSON's ``samples_per_s``."""
        return _rate(self.samples, self.time)

    @property
    def usd_per_1000_steps(self) -> float | None:
        """On-demand price of 1,000 steps (None: no price or no time)."""
        return (
            None
            if self.time is None
            else usd_per_1000_steps(self.price_usd_per_hour, self.time.step_ms)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "name": self.name,
            "fits": self.fits,
            "memory": self.memory.to_dict(),
            "time": self.time.to_dict() if self.time is not None else None,
            "price_usd_per_hour": self.price_usd_per_hour,
            "usd_per_1000_steps": self.usd_per_1000_steps,  # the table's $ / 1k steps
            "stack_missing": self.stack_missing,
            # the attribute's, so JSON written from a Session's results has the table's column
            # (only Prediction.to_dict had added it: a hunt)
            "samples_per_s": self.samples_per_s,
        }


@dataclass
class Prediction:
    """What ``boom_ml.predict`` returns: one :class:`GpuPrediction` per GPU in ``gpus`` for a
    one-GPU step; for a multi-GPU layout (``parallel=``) ``gpus`` and ``graph`` are empty and
    each GPU's layout, worst-rank memory and step time are a dict in ``parallel``, as JSON
    has them."""

    model: str
    batch_size: int
    step: dict[str, Any]
    graph: dict[str, Any]
    gpus: list[GpuPrediction]
    # gpu id → [Advice]: the changes that fit, fastest first; where none fits, the closest
    # (fits False: a lower bound or the candidate nearest to fitting) first; then the
    # recipes that fit (Advice.recipe)
    advice: dict[str, list[Any]] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)  # PNG files written (plot=<dir>)
    # multi-GPU layouts (parallel.*): per GPU the layout, worst-rank memory and step time
    parallel: list[dict[str, Any]] = field(default_factory=list)
    # gpu id → the cheapest multi-GPU layouts that fit, where nothing fits on one GPU
    # (report/advisor.py advise_layouts; JSON "layout_advice", beside "advice")
    layout_advice: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_batch: str = "auto"  # the search asked for: auto | on | off (specs.max_batch_setting)

    def best_gpu(self) -> GpuPrediction:
        """The GPU that ``explain=true`` and ``plot=`` describe: the fastest that fits (else
        the fastest), the table's first row. A multi-GPU layout's prediction has no per-GPU
        rows: its results are in :attr:`parallel`, one dict per GPU."""
        if not self.gpus:
            raise ValueError(
                "a multi-GPU layout's prediction has no single-GPU rows; read .parallel (one "
                "dict per GPU: its layout, worst-rank memory and step time)"
            )
        return min(self.gpus, key=lambda g: (not g.fits, g.time.step_ms))

    def samples_per_s(self, result: GpuPrediction) -> float | None:
        """Samples a second on one GPU: the step's batch times its micro-batches, over its
        time (None without a time)."""
        return _rate(self.batch_size * int(self.step.get("grad_accum", 1)), result.time)

    def to_dict(self) -> dict[str, Any]:
        """The prediction as JSON has it: new containers (editing them leaves the prediction
        as it was), NaN and infinities as None (a hunt: an advice that does not fit had
        ``step_ms`` NaN, which strict JSON refuses, where the CLI's JSON said null)."""
        return finite(
            {
                "model": self.model,
                "batch_size": self.batch_size,
                "step": self.step,
                "graph": self.graph,
                # with the table's samples/s: the step's samples (all its micro-batches) per second
                "gpus": [
                    {**g.to_dict(), "samples_per_s": self.samples_per_s(g)} for g in self.gpus
                ],
                "advice": {gpu: [a.to_dict() for a in items] for gpu, items in self.advice.items()},
                "layout_advice": self.layout_advice,
                "max_batch": self.max_batch,
                "plots": self.plots,
                **({"parallel": self.parallel} if self.parallel else {}),
            }
        )


def _rate(samples: int, time: TimeEstimate | None) -> float | None:
    if not samples or time is None or not time.step_ms:
        return None
    return samples / time.step_ms * 1e3


def finite(value: Any) -> Any:
    """``value`` with every container rebuilt and every NaN or infinity made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
