"""GpuSpec: one row of the packaged GPU table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

GIB = 1024**3
# The architectures the package models, each with the compute capabilities NVIDIA's CUDA GPUs
# list gives it (as sm_version: 8.6 is 86), lowest and highest.
ARCHITECTURES = {
    "pascal": (60, 62),
    "volta": (70, 72),
    "turing": (75, 75),
    "ampere": (80, 87),
    "ada": (89, 89),
    "hopper": (90, 90),
    "blackwell": (100, 121),
}


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet numbers for one GPU. TFLOPS are dense (no sparsity); None when unknown."""

    id: str  # canonical id, e.g. "h100-sxm"
    name: str  # marketing name, e.g. "NVIDIA H100 SXM5 80GB"
    architecture: str  # pascal, volta, turing, ampere, ada, hopper, blackwell
    compute_capability: str  # "9.0"
    sm_count: int
    boost_clock_mhz: float | None  # None where no source lists it
    # Base clock: what the card guarantees within its TDP. On power-limited cards (L4, T4)
    # it is far below boost, and long compute-bound kernels run nearer to it. None if unsourced.
    base_clock_mhz: float | None
    memory_gb: float  # capacity as the datasheet states it, e.g. 80
    memory_bandwidth_gbs: float  # GB/s (1e9 bytes/s)
    l2_cache_mb: float | None  # MiB (cudaDeviceProp.l2CacheSize / 2**20); None where unsourced
    fp32_tflops: float
    tf32_tflops: float | None
    fp16_tflops: float | None  # tensor-core dense fp16 (fp32 accumulate where the sheet says so)
    bf16_tflops: float | None
    fp8_tflops: float | None
    tdp_w: float | None
    # total device memory in bytes: memory_gb * 2**30 unless a source gives the exact total
    # (convention in boom_ml/gpus/__init__.py); cudaMemGetInfo reports a little less (ECC, driver)
    memory_bytes: int
    # what torch.cuda.get_device_properties(i).total_memory reports (boom_ml/gpus/capacity.csv,
    # sourced per row); None: not known, memory_bytes stands in
    total_memory_bytes: int | None = None
    capacity_source: str = ""
    price_usd_per_hour: float | None = None
    price_source: str | None = None
    source: str = ""

    @property
    def bf16_tensor_cores(self) -> bool:
        """bf16 tensor cores came with Ampere (NVIDIA A100 Tensor Core GPU Architecture
        whitepaper); a sheet that gives a bf16 rate says so too."""
        return bool(self.bf16_tflops) or self.sm_version >= 80

    @property
    def bf16_peak_tflops(self) -> float:
        """bf16 matrix peak: the sheet's; else fp16's where there are bf16 tensor cores (they
        run bf16 at the fp16 rate); else fp32's: older GPUs run bf16 GEMMs without them."""
        if self.bf16_tflops:
            return float(self.bf16_tflops)
        tensor = self.bf16_tensor_cores and self.fp16_tflops
        return float(self.fp16_tflops if tensor else self.fp32_tflops)

    def peak_flops(self, dtype: str, tf32: bool = False) -> float:
        """Peak FLOP/s for matrix work in ``dtype`` ('float32', 'float16', 'bfloat16', ...)."""
        dtype = dtype.replace("torch.", "")
        if dtype in ("float16", "half"):
            value = self.fp16_tflops
        elif dtype == "bfloat16":
            value = self.bf16_peak_tflops
        elif dtype.startswith("float8"):
            value = self.fp8_tflops or self.fp16_tflops
        elif dtype in ("float32", "float") and tf32 and self.tf32_tflops:
            value = self.tf32_tflops
        else:
            value = None
        return float(value or self.fp32_tflops) * 1e12

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_gbs * 1e9

    @property
    def capacity_bytes(self) -> int:
        """Memory a process can use: what PyTorch reports as the device's total memory."""
        return int(self.total_memory_bytes or self.memory_bytes)

    @property
    def sm_version(self) -> int:
        major, _, minor = self.compute_capability.partition(".")
        return int(major) * 10 + int(minor or 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
