"""No step is timed slower on a GPU than on a GPU it matches or beats on every spec number.

The anchor cap (``anchors.py``) holds each kernel row to the *measured* GPUs it beats. Two
GPUs that no row measured can still come out in the wrong order, and a whole step timed by
the GNN has no such cap: resnet50 fp32 at batch 64 came out 14 % slower on an RTX 4090 than
on an A30, and 8 % slower on an L40S than on an RTX A6000, though each of the first beats
the second on every field of :data:`anchors.DOMINANCE_FIELDS`; fp16 on an L40S 7 % slower
than on an L40, whose spec sheet differs only in the L40S's favour (a helper's hunt).

A GPU that dominates another (``anchors.dominates``: at least as good on every field, of the
same or a newer architecture) runs any kernel the other runs at least as fast, so it runs the
same step at least as fast. Each GPU asked is timed as the fastest of itself and the packaged
GPUs it dominates (``TimeEstimate.timed_as`` names the one whose estimate it takes); two
GPUs with the same spec sheet but memory size take the same time. Nothing is fitted; the
packaged GPUs it compares against are the ones ``python -m boom_ml.gpus`` lists, whichever
were asked, so a GPU's time does not depend on the other GPUs in the request.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from boom_ml.estimates import TimeEstimate
from boom_ml.gpus import all_gpus
from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.anchors import dominates


def dominated_extra(gpus: list[GpuSpec]) -> list[GpuSpec]:
    """The packaged GPUs that some GPU of ``gpus`` dominates, not themselves in ``gpus``."""
    return [b for b in all_gpus() if b not in gpus and any(dominates(a, b) for a in gpus)]


def no_slower_than_dominated(
    gpus: list[GpuSpec],
    estimates: list[TimeEstimate],
    asked: int | None = None,
    in_full: Callable[[int], TimeEstimate] | None = None,
) -> list[TimeEstimate]:
    """The estimates of the first ``asked`` GPUs (default all), each where a GPU of ``gpus``
    it dominates was timed faster replaced by a copy of the fastest such GPU's, ``timed_as``
    naming it (``gpus`` must hold every packaged GPU each dominates: :func:`dominated_extra`).
    ``in_full(k)``: the estimate to copy for GPU ``k`` where ``estimates[k]`` holds totals
    alone."""
    asked = len(gpus) if asked is None else asked
    pick = in_full or estimates.__getitem__
    out = []
    for a, est in zip(gpus[:asked], estimates[:asked], strict=True):
        below = [k for k, b in enumerate(gpus) if dominates(a, b)]
        fastest = min(below, key=lambda k: estimates[k].step_ms, default=None)
        if fastest is None or estimates[fastest].step_ms >= est.step_ms:
            out.append(est)
            continue
        taken = copy.deepcopy(pick(fastest))
        taken.timed_as = gpus[fastest].id
        out.append(taken)
    return out
