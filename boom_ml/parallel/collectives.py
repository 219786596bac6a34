"""Alpha-beta model of NCCL ring collectives, and which link each process group runs on.

Ring all-reduce of S bytes over n ranks: ``base + 2(n-1) alpha + 2(n-1)/n * S / busbw``;
all-gather and reduce-scatter (S = the full, gathered size): ``base + (n-1) alpha +
(n-1)/n * S / busbw``; a point-to-point send: ``base + alpha + S / busbw``. ``busbw`` is the
nccl-tests bus bandwidth of the link (``links.csv``), which is defined so that these formulas hold.

Ranks are numbered tp-innermost, then dp, then pp (Megatron's order), so a group of ``size``
ranks with stride ``stride`` spans ``size * stride`` consecutive ranks. A group inside one node
uses the intra-node link; a group across nodes runs at the NICs' rate: per-GPU NICs add up over
the group's members in a node (a ring crossing nodes uses that many NICs), capped by the
intra-node link; a per-node NIC is shared.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from boom_ml.parallel.layout import Cluster, Layout
from boom_ml.parallel.links import Link


@dataclass(frozen=True)
class GroupLink:
    name: str  # tp | dp | pp
    size: int
    link: str  # link name, or "intra+inter" names
    busbw_gbs: float
    alpha_us: float
    base_us: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_link(
    name: str, size: int, stride: int, world: int, cluster: Cluster, intra: Link, inter: Link
) -> GroupLink:
    """The bandwidth and latency a group's collectives see (see the module doc)."""
    gpn = cluster.gpus_per_node
    span = size * stride
    if span <= gpn or world <= gpn:
        return GroupLink(name, size, intra.name, intra.busbw_gbs, intra.alpha_us, intra.base_us)
    members_per_node = max(1, gpn // stride) if stride < gpn else 1
    members_per_node = min(members_per_node, size)
    if inter.scope == "per_gpu":
        bw = min(inter.busbw_gbs * members_per_node, intra.busbw_gbs)
    else:
        bw = inter.busbw_gbs
    return GroupLink(name, size, f"{intra.name}+{inter.name}", bw, inter.alpha_us, inter.base_us)


def groups(layout: Layout, cluster: Cluster, intra: Link, inter: Link) -> dict[str, GroupLink]:
    world = layout.world
    return {
        "tp": group_link("tp", layout.tp, 1, world, cluster, intra, inter),
        "dp": group_link("dp", layout.dp, layout.tp, world, cluster, intra, inter),
        "pp": group_link("pp", layout.pp, layout.tp * layout.dp, world, cluster, intra, inter),
    }


def _seconds_ms(nbytes: float, gbs: float) -> float:
    return nbytes / (gbs * 1e9) * 1e3


def all_reduce_ms(nbytes: float, group: GroupLink) -> float:
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    lat = (group.base_us + 2 * (n - 1) * group.alpha_us) * 1e-3
    return lat + _seconds_ms(2 * (n - 1) / n * nbytes, group.busbw_gbs)


def all_gather_ms(nbytes: float, group: GroupLink) -> float:
    """All-gather (or reduce-scatter) whose gathered (unscattered) size is ``nbytes``."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    lat = (group.base_us + (n - 1) * group.alpha_us) * 1e-3
    return lat + _seconds_ms((n - 1) / n * nbytes, group.busbw_gbs)


reduce_scatter_ms = all_gather_ms

MIB = 2**20
DDP_BUCKET_BYTES = 25 * MIB  # torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # dist._DEFAULT_FIRST_BUCKET_BYTES (default bucket_cap_mb only)


def ddp_buckets(
    ready_bytes: list[int], cap: int = DDP_BUCKET_BYTES, first_cap: int = DDP_FIRST_BUCKET_BYTES
) -> list[int]:
    """Bytes of DDP's buckets, in all-reduce order, from gradient sizes in ready order.

    After the first step DDP rebuilds its buckets in the order gradients become ready
    (``Reducer::rebuild_buckets`` -> ``compute_bucket_assignment_by_size``): a bucket closes as
    soon as it holds at least its limit (1 MiB for the first, 25 MiB after), so the last
    bucket holds the last-ready gradient (the embedding's) plus what came after the last close.
    Checked against DDP's own buckets in ``tests/test_parallel_traced.py``.
    """
    out: list[int] = []
    size, limit = 0, first_cap
    for nbytes in ready_bytes:
        size += nbytes
        if size >= limit:
            out.append(size)
            size, limit = 0, cap
    if size:
        out.append(size)
    return out


def send_ms(nbytes: float, group: GroupLink) -> float:
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    return (group.base_us + group.alpha_us) * 1e-3 + _seconds_ms(nbytes, group.busbw_gbs)


@dataclass
class Collective:
    """One kind of collective in a step: per-call bytes, calls per step, total and exposed ms."""

    op: str  # all_reduce | all_gather | reduce_scatter | send_recv
    group: str  # tp | dp | pp | embedding
    what: str  # what it carries
    bytes: int  # per call
    calls: int  # per optimizer step, on the worst rank
    ms: float  # all calls
    exposed_ms: float  # not hidden behind compute

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ms"] = round(self.ms, 4)
        d["exposed_ms"] = round(self.exposed_ms, 4)
        return d
