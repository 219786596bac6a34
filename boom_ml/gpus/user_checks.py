"""The checks a GPU described in a YAML file passes before it is used: every number in range,
each in the unit its field names, and memory sizes that agree with each other.

A spec a user writes by hand fails quietly otherwise: a negative TDP reached the timing
model's features, ``memory_bandwidth_gbs: 2.039`` (TB/s in a GB/s field) predicted a step 300x
too slow, and ``memory_gb`` given in bytes printed 84,680,475,410 GiB usable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from boom_ml.errors import InvalidInputError
from boom_ml.gpus.spec import GIB, GpuSpec

# Given, these must be above zero (0 in a tensor-core rate means "not given": it is filled).
POSITIVE = ("sm_count", "memory_gb", "memory_bandwidth_gbs", "fp32_tflops", "memory_bytes",
            "total_memory_bytes", "l2_cache_mb", "boost_clock_mhz", "base_clock_mhz", "tdp_w")  # fmt: skip
NON_NEGATIVE = ("tf32_tflops", "fp16_tflops", "bf16_tflops", "fp8_tflops", "price_usd_per_hour")
# Fields a unit slip moves by a factor of 1000 or more (TB/s for GB/s, GFLOPS for TFLOPS, GHz
# for MHz, bytes or MB for GB or MiB, kW for W), or of 64-128 (CUDA cores for SMs), and the
# unit each is in.
UNITS = {"memory_gb": "GB, as the datasheet states it", "memory_bandwidth_gbs": "GB/s",
         "fp32_tflops": "TFLOPS", "tf32_tflops": "TFLOPS", "fp16_tflops": "TFLOPS",
         "bf16_tflops": "TFLOPS", "fp8_tflops": "TFLOPS", "l2_cache_mb": "MiB",
         "boost_clock_mhz": "MHz", "base_clock_mhz": "MHz",
         "sm_count": "SMs (streaming multiprocessors, not CUDA cores)", "tdp_w": "W"}  # fmt: skip
# Checked above only: a small memory is how one asks what a tighter GPU would do (0.3 GB
# makes any step not fit), where a slip to TB is rarer than one to bytes or MB; a 16-bit rate
# can be far below the packaged ones (a GTX 1080 Ti's fp16 runs at 1/64 of its fp32: 0.18).
ABOVE_ONLY = ("memory_gb", "tf32_tflops", "fp16_tflops", "bf16_tflops", "fp8_tflops")
# How far beyond the packaged GPUs' range (Pascal to Blackwell) a value may lie: wide enough for
# a GPU beyond the table, far inside the factor of 1000 a unit slip makes.
UNIT_SLACK = 20
# memory_bytes against memory_gb x 2^30: the packaged GPUs lie at 0.98-1.0, and a datasheet's
# GB read as 10^9 bytes gives 0.93; outside this band the two fields describe different GPUs.
MEMORY_AGREEMENT = (0.9, 1.1)


def check_ranges(values: dict[str, Any], where: str, packaged: Sequence[GpuSpec]) -> None:
    """Raise a one-line error for a field of ``values`` (a user spec's fields, converted) out of
    range: below zero, zero where it cannot be, outside :data:`UNIT_SLACK` times the ``packaged``
    GPUs' range of the field, or memory sizes that contradict each other."""
    for field in POSITIVE + NON_NEGATIVE:
        value = values.get(field)
        if value is None:
            continue
        if value < 0 or (value == 0 and field in POSITIVE):
            must = "positive" if field in POSITIVE else "zero (not given) or positive"
            raise InvalidInputError(f"{where}: field '{field}' must be {must}, got {value}")
    for field, unit in UNITS.items():
        value = values.get(field)
        known = [getattr(g, field) for g in packaged if getattr(g, field)]
        if not value or not known:
            continue
        low = 0.0 if field in ABOVE_ONLY else min(known) / UNIT_SLACK
        high = max(known) * UNIT_SLACK
        if not low <= value <= high:
            raise InvalidInputError(
                f"{where}: field '{field}' is {value:g}, outside {low:g}-{high:g} ({UNIT_SLACK}x "
                f"beyond the packaged GPUs' range): is it in {unit}?"
            )
    # Tensor cores (fp16 from compute capability 7.0, bf16 and TF32 from 8.0) run at least
    # the fp32 rate on every packaged GPU: a lower figure is another rate (a non-tensor one),
    # and a TF32 rate had been derived from it below the fp32 one (a hunt)
    major = int(str(values.get("compute_capability") or "0").partition(".")[0] or 0)
    fp32 = values.get("fp32_tflops")
    for field, since in (("fp16_tflops", 7), ("bf16_tflops", 8), ("tf32_tflops", 8)):
        value = values.get(field)
        if fp32 and value and major >= since and value < fp32:
            raise InvalidInputError(
                f"{where}: field '{field}' is {value:g}, below fp32_tflops {fp32:g}; compute"
                f" capability {values['compute_capability']} runs it on tensor cores, at least"
                " the fp32 rate (the datasheet's dense tensor-core figure)"
            )
    if values.get("memory_bytes") and values.get("memory_gb"):
        share = values["memory_bytes"] / (values["memory_gb"] * GIB)
        if not MEMORY_AGREEMENT[0] <= share <= MEMORY_AGREEMENT[1]:
            raise InvalidInputError(
                f"{where}: memory_bytes {values['memory_bytes']} is not memory_gb "
                f"{values['memory_gb']:g} in bytes ({share:.2f} x {values['memory_gb']:g} GiB)"
            )
    total = values.get("total_memory_bytes")
    physical = values.get("memory_bytes") or (values.get("memory_gb") or 0) * GIB
    if total and physical and total > physical:
        raise InvalidInputError(
            f"{where}: total_memory_bytes {total:.0f} (what PyTorch reports usable) exceeds "
            + (
                f"memory_bytes {physical:.0f}"
                if values.get("memory_bytes")
                else f"memory_gb {values['memory_gb']:g} ({physical:.0f} bytes)"
            )  # fmt: skip
        )
