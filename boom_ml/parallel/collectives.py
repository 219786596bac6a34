"""Time of NCCL collectives, and which link each process group runs on.

All-reduce, all-gather and reduce-scatter are timed as NCCL's tuner would run them
(``nccl.py``): ring, tree, NVLink SHARP (NVLS) or PAT, each with the LL, LL128 or Simple
protocol, whichever NCCL's model predicts fastest. ``busbw`` is the nccl-tests ring bus bandwidth
of the link (``links.csv``). For large messages on one node without NVLS that is the ring with
Simple: all-reduce of S bytes over n ranks takes ``8.4 + 2(n-1) 3.4 us + 2(n-1)/n S / busbw`` on
NVLink. A point-to-point send stays alpha-beta: ``base + alpha + S / busbw``.

Ranks are numbered tp-innermost, then dp, then pp (Megatron's order), so a group of ``size``
ranks with stride ``stride`` spans ``size * stride`` consecutive ranks. A group inside one node
uses the intra-node link (a group that straddles a node boundary is across nodes: ``placement``); a group across nodes runs at the NICs' rate: per-GPU NICs add up over
the group's members in a node (a ring crossing nodes uses that many NICs), capped by the
intra-node link; a per-node NIC is shared.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, fields, replace
from typing import Any

from boom_ml.parallel.layout import Cluster, Layout
from boom_ml.parallel.links import Link
from boom_ml.parallel.nccl import Comm, Estimate, best


def scalar_fields(obj: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` of a dataclass whose fields are all str, int, float or bool,
    without its recursive deep copy: a layout search of 207 layouts on 44 GPUs turns 80k
    links and collectives into dicts (3 s with ``asdict``)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass(frozen=True)
class GroupLink:
    name: str  # tp | dp | pp | embedding
    size: int
    link: str  # link name, or "intra+inter" names
    busbw_gbs: float
    alpha_us: float  # point-to-point sends only
    base_us: float
    nodes: int = 1  # nodes the group spans
    hw: str = "nvlink"  # nvlink | pci: NCCL's latency class of the link inside a node
    sm: int = 0  # compute capability x 10 NCCL keys its constants on (0: unknown)
    nvls_busbw_gbs: float = 0.0  # NVLink SHARP all-reduce busbw; 0: none
    nic_per_gpu: bool = True  # across nodes: one NIC per GPU (else one shared per node)

    def to_dict(self) -> dict[str, Any]:
        return scalar_fields(self)

    def comm(self) -> Comm:
        return Comm(self.size, self.nodes, self.busbw_gbs, self.hw, self.sm,
                         self.nvls_busbw_gbs, self.nic_per_gpu)  # fmt: skip


@functools.lru_cache(maxsize=1 << 12)
def placement(size: int, stride: int, world: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, members on its sparsest node) of the slowest group of ``size`` ranks ``stride``
    apart: the groups are ``base + k * stride`` in each block of ``size * stride`` consecutive
    ranks, and the placement repeats every lcm(block, node) ranks. A group that straddles a
    node boundary (tp=4 on 6-GPU nodes: ranks 4-7 on two nodes) crosses the network as a
    group spanning whole nodes does; the slowest is the one with the fewest members (NICs) on
    a node, then the most nodes."""
    block = size * stride
    slowest = (1, size)
    for outer in range(0, min(world, math.lcm(block, gpus_per_node)), block):
        for inner in range(stride):
            per_node = Counter((outer + inner + k * stride) // gpus_per_node for k in range(size))
            here = (len(per_node), min(per_node.values()))
            if (here[0] > 1, -here[1], here[0]) > (slowest[0] > 1, -slowest[1], slowest[0]):
                slowest = here
    return slowest


def group_link(
    name: str, size: int, stride: int, world: int, cluster: Cluster, intra: Link, inter: Link
) -> GroupLink:
    """The bandwidth and latency a group's collectives see (see the module doc)."""
    gpn = cluster.gpus_per_node
    inside = GroupLink(name, size, intra.name, intra.busbw_gbs, intra.alpha_us, intra.base_us,
                       hw=intra.nccl_hw, sm=intra.sm, nvls_busbw_gbs=intra.nvls_busbw_gbs)  # fmt: skip
    if world <= gpn:
        return inside
    nodes, members_per_node = placement(size, stride, world, gpn)
    if nodes == 1:
        return inside
    per_gpu = inter.scope == "per_gpu"
    if per_gpu:
        bw = min(inter.busbw_gbs * members_per_node, intra.busbw_gbs)
    else:
        bw = inter.busbw_gbs
    return replace(inside, link=f"{intra.name}+{inter.name}", busbw_gbs=bw,
                   alpha_us=inter.alpha_us, base_us=inter.base_us,
                   nodes=nodes, nic_per_gpu=per_gpu)  # fmt: skip


def groups(layout: Layout, cluster: Cluster, intra: Link, inter: Link) -> dict[str, GroupLink]:
    """The tp, dp and pp groups of one rank, and the embedding group that all-reduces a tied
    embedding's gradient: the first and the last pipeline stage, two ranks, on two nodes
    when the pipeline spans nodes (one rank of each end per node: one NIC's bandwidth)."""
    world = layout.world
    pp = group_link("pp", layout.pp, layout.tp * layout.dp, world, cluster, intra, inter)
    ends = 2 if layout.pp > 1 else 1
    apart = cluster.gpus_per_node if pp.nodes > 1 else 1  # a stride that puts them on 2 nodes
    return {
        "tp": group_link("tp", layout.tp, 1, world, cluster, intra, inter),
        "dp": group_link("dp", layout.dp, layout.tp, world, cluster, intra, inter),
        "pp": pp,
        "embedding": group_link("embedding", ends, apart, world, cluster, intra, inter),
    }


def _seconds_ms(nbytes: float, gbs: float) -> float:
    return nbytes / (gbs * 1e9) * 1e3


# A layout search asks the same few (op, size, group) questions for every layout and GPU
# (269k calls, 2,037 distinct, for Llama-3-8B on 44 GPUs with advice); the answer is pure.
@functools.lru_cache(maxsize=1 << 14)
def choice(op: str, nbytes: float, group: GroupLink) -> Estimate | None:
    """NCCL's pick for one call (None when the group has one rank or nothing to move)."""
    if group.size <= 1 or nbytes <= 0:
        return None
    return best(op, nbytes, group.comm())


def algorithm_for(op: str, nbytes: float, group: GroupLink) -> str:
    """ "ring/Simple", "tree/LL", "nvls/Simple"...: what NCCL runs; "p2p" for a send, "" for none."""
    if op == "send_recv":
        return "p2p" if group.size > 1 and nbytes > 0 else ""
    pick = choice(op, nbytes, group)
    return pick.name if pick else ""


def _ms(op: str, nbytes: float, group: GroupLink) -> float:
    pick = choice(op, nbytes, group)
    return pick.us * 1e-3 if pick else 0.0


def all_reduce_ms(nbytes: float, group: GroupLink) -> float:
    return _ms("all_reduce", nbytes, group)


def all_gather_ms(nbytes: float, group: GroupLink) -> float:
    """All-gather whose gathered size is ``nbytes``."""
    return _ms("all_gather", nbytes, group)


def reduce_scatter_ms(nbytes: float, group: GroupLink) -> float:
    """Reduce-scatter whose unscattered size is ``nbytes``."""
    return _ms("reduce_scatter", nbytes, group)


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
    algorithm: str = ""  # NCCL's algorithm/protocol for one call (algorithm_for)

    def to_dict(self) -> dict[str, Any]:
        d = scalar_fields(self)
        d["ms"] = round(self.ms, 4)
        d["exposed_ms"] = round(self.exposed_ms, 4)
        return d
