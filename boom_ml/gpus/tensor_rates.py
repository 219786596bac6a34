"""Tensor-core rates a user's GPU spec leaves out, from the packaged GPUs of its SM."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from boom_ml.gpus.spec import GpuSpec

TENSOR_RATES = ("tf32_tflops", "fp16_tflops", "bf16_tflops", "fp8_tflops")
# fp16 first: with no rate given it is filled from the per-SM median and the others by its
# ratios (each from its own median, bf16 came out 1.5x fp16 on an Ampere spec: the A10G,
# without a bf16 figure, left the bf16 median alone)
FILL_ORDER = ("fp16_tflops", "tf32_tflops", "bf16_tflops", "fp8_tflops")


def fill_tensor_rates(values: dict[str, Any], packaged: Iterable[GpuSpec]) -> list[str]:
    """Tensor-core rates a user spec leaves out (or gives as 0), from the packaged GPUs of
    its compute capability (the same SM: the same tensor-core work per SM and clock), or of
    its major version, or of its architecture where none has that SM. A rate the spec gives
    sets the others by the ratio those GPUs show (bf16 = fp16 and tf32 = fp16 / 2 on every packaged Ampere to
    Blackwell GPU that lists both: a file with fp16 alone had its bf16 filled above it); else
    the median of rate / (SMs x boost MHz), times the spec's SMs and boost clock (a GPU
    without one counts at the clock its fp32 rate implies on those SMs, else at its
    architecture's median clock), and on tensor cores never below
    the spec's fp32 rate: fp16 so, where the spec gives no rate, and the others from it by
    the ratios. A rate none of them lists (bf16 before Ampere, fp16 tensor cores on
    a GTX 1080 Ti's SM) stays unknown. Without this, an A100 spec with fp32_tflops alone timed
    its fp16 matmuls at the fp32 rate, 16x too slow. Returns the fields filled."""
    arch = [g for g in packaged if g.architecture == values["architecture"]]
    cc = float(values["compute_capability"])
    same_sm = [g for g in arch if float(g.compute_capability) == cc]
    # else the same major version (a 10.3 part takes the B200's 10.0, not the 12.0 cards')
    same_major = [g for g in arch if int(float(g.compute_capability)) == int(cc)]
    pool = same_sm or same_major or arch
    clocks = [float(g.boost_clock_mhz) for g in arch if g.boost_clock_mhz]
    arch_clock = statistics.median(clocks) if clocks else None
    clock = values["boost_clock_mhz"] if (values["boost_clock_mhz"] or 0) > 0 else None
    # fp32 = SMs x lanes x 2 x clock: without a clock, the one the spec's fp32 rate implies
    # at its SM's lanes (an A100 spec without one had counted at Ampere's median 1695 MHz,
    # not 1410, and its tensor rates came out 1.2x the A100's)
    lanes = [g.fp32_tflops / (g.sm_count * g.boost_clock_mhz) for g in pool
             if g.fp32_tflops and g.boost_clock_mhz]  # fmt: skip
    if clock is None and lanes and (values["fp32_tflops"] or 0) > 0:
        clock = values["fp32_tflops"] / (values["sm_count"] * statistics.median(lanes))
    clock = clock or arch_clock
    tensor_cores = float(values["compute_capability"]) >= 7.0  # Volta on
    given = [f for f in TENSOR_RATES if (values[f] or 0) > 0]
    filled = []
    for field in FILL_ORDER:
        if field in given:
            continue
        for ref in given:  # a given rate, by the ratio the same SMs show
            ratios = [getattr(g, field) / getattr(g, ref) for g in pool
                      if getattr(g, field) and getattr(g, ref)]  # fmt: skip
            if ratios:
                values[field] = round(values[ref] * statistics.median(ratios), 1)
                break
        else:
            per = [getattr(g, field) / (g.sm_count * (g.boost_clock_mhz or arch_clock))
                   for g in pool if getattr(g, field)]  # fmt: skip
            if not per or not clock:
                continue
            rate = statistics.median(per) * values["sm_count"] * clock
            floor = values["fp32_tflops"] if tensor_cores else 0.0  # tensor cores: >= fp32
            values[field] = round(max(rate, floor), 1)
            given.append(field)  # the reference of the rates still to fill
        filled.append(field)
    return sorted(filled, key=TENSOR_RATES.index)
