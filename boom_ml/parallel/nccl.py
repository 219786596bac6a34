"""Which algorithm and protocol NCCL runs a collective with, and how long it takes.

NCCL predicts the time of every (algorithm, protocol) pair it may run as
``latency + bytes / algorithm bandwidth`` and runs the fastest (``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime`` in src/graph/tuning.cc, version 2.28.3). This module re-expresses that
model; its constants are in ``nccl_algorithms.csv``, each with its source.

Algorithms: ``ring``; ``tree`` (all-reduce: a chain inside each node, a double binary tree
across nodes, so latency grows with log2(nodes) rather than with the ranks); ``nvls`` (NVLink
SHARP: the NVSwitch reduces and multicasts; one node of a Hopper+ NVSwitch system);
``nvls_tree`` (NVLS inside each node, a tree across nodes; all-reduce); ``pat`` (all-gather and
reduce-scatter with one GPU per node). Protocols: ``LL`` (8-byte flag+data stores: lowest
latency, a quarter to half the bandwidth), ``LL128`` (128-byte lines; NVLink only) and
``Simple`` (full bandwidth, highest latency); NVLS, NVLS-tree and PAT run Simple only.

Where boom-ml departs from NCCL: NCCL's bus bandwidth is the channel count x per-channel
bandwidth of its topology search; here it is the measured nccl-tests ring busbw of the link
(``links.csv``), the same quantity at large sizes. The per-channel caps, which need the channel
count, are left out (``nccl_algorithms.csv`` header). NVLS's algorithm bandwidth is the measured
one at 8 GPUs, flat in the GPU count as measured (NCCL converts a fixed bus bandwidth by
n / 2(n-1), which overstates NVLS on 2-4 GPUs, where it measures no faster than ring). Host CPUs
are taken as x86 Intel (NCCL's default rows), and network latency as InfiniBand's (no extra
per-NIC latency). CollNet (in-network SHARP switches) is not modelled. NCCL's model ranks the
pairs; the time it gives is floored at what the network carries across nodes (each node sends
2(N - 1)/N of an all-reduce's buffer out through its NICs): on two nodes NCCL doubles
NVLS-tree's network bandwidth and would otherwise price it faster than that.
"""

from __future__ import annotations

import csv
import functools
import io
import math
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
OPS = ("all_reduce", "all_gather", "reduce_scatter")
# NCCL's enum order, which its tuner walks keeping the first of equal times
ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree", "pat")
PROTOCOLS = ("LL", "LL128", "Simple")


@dataclass(frozen=True)
class Comm:
    """What NCCL's model needs to know about a communicator."""

    ranks: int
    nodes: int
    busbw_gbs: float  # nccl-tests ring bus bandwidth at large sizes (NIC-limited across nodes)
    hw: str = "nvlink"  # nvlink | pci: the link between GPUs in a node
    sm: int = 0  # compute capability x 10 (70, 80, 90, 100); 0 unknown: NCCL's oldest rows
    nvls_busbw_gbs: float = 0.0  # NVLink SHARP all-reduce busbw on 8 GPUs; 0: no NVLS
    nic_per_gpu: bool = True  # each GPU has a NIC on its PCIe switch (else LL128 stays off)

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes  # NCCL's nRanks / nNodes, an integer division


@dataclass(frozen=True)
class Estimate:
    algorithm: str
    protocol: str
    latency_us: float
    algbw_gbs: float  # bytes / (time - latency), after NCCL's size corrections
    us: float  # the time: NCCL's, or the network's floor where that is longer (below)
    tuner_us: float = 0.0  # NCCL's own predicted time, which its tuner ranks the pairs by

    @property
    def name(self) -> str:
        return f"{self.algorithm}/{self.protocol}"


def _rows() -> list[dict[str, str]]:
    text = (HERE / "nccl_algorithms.csv").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


@functools.cache
def constants() -> dict[tuple[str, str, str, str], tuple[float, ...]]:
    """(constant, algorithm, protocol, where) -> its value(s), from ``nccl_algorithms.csv``."""
    out = {}
    for r in _rows():
        key = (r["constant"], r["algorithm"], r["protocol"], r["where"])
        out[key] = tuple(float(v) for v in r["value"].split())
    return out


def _c(constant: str, algorithm: str = "", protocol: str = "", where: str = "") -> float:
    return constants()[(constant, algorithm, protocol, where)][0]


def _log2i(n: int) -> int:
    """NCCL's log2i: floor(log2(n)), -1 for 0."""
    return n.bit_length() - 1


def _generation(sm: int) -> str:
    """The row NCCL's per-generation tables use (below sm80 everything is Volta's)."""
    return "blackwell" if sm >= 100 else "hopper" if sm >= 90 else "ampere" if sm >= 80 else "volta"


def _ll_max(comm: Comm) -> float:
    """NCCL's absolute cap on LL bus bandwidth: by GPU on one node, by host CPU across nodes."""
    where = (
        _generation(comm.sm) if comm.nodes == 1 else "2 nodes" if comm.nodes == 2 else "3+ nodes"
    )
    return _c("ll_max_busbw_gbs", "", "LL", where)


def _enabled(op: str, algorithm: str, protocol: str, comm: Comm) -> bool:
    if algorithm in ("nvls", "nvls_tree", "pat") and protocol != "Simple":
        return False
    # LL128 by default only over NVLink on sm70+, with NICs on the GPUs' PCIe switches
    if protocol == "LL128" and not (
        comm.hw == "nvlink" and comm.sm >= 70 and (comm.nodes == 1 or comm.nic_per_gpu)
    ):
        return False
    nvls = comm.nvls_busbw_gbs > 0 and comm.per_node >= 2  # NVLS needs GPUs on one switch
    if algorithm == "ring":
        return True
    if algorithm == "tree":
        return op == "all_reduce"
    if algorithm == "nvls":  # across nodes only with CollNet, not modelled
        return nvls and comm.nodes == 1
    if algorithm == "nvls_tree":
        return nvls and comm.nodes > 1 and op == "all_reduce"
    if algorithm == "pat":  # NCCL enables PAT only with one rank per node
        return op != "all_reduce" and comm.nodes == comm.ranks
    raise ValueError(f"unknown NCCL algorithm {algorithm!r}")


def _algbw(op: str, algorithm: str, protocol: str, comm: Comm) -> float:
    """Algorithm bandwidth (GB/s): NCCL's bus bandwidth rule, then its bus -> algorithm ratio."""
    n, bus = comm.ranks, comm.busbw_gbs
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    if algorithm == "ring":
        if protocol == "LL":
            bus = min(_ll_max(comm), bus * _c("busbw_factor", "ring", "LL"))
        elif protocol == "LL128":
            bus *= _c("busbw_factor", "ring", "LL128")
        return bus * n / steps
    if algorithm == "tree":
        bus *= _c("busbw_factor", "tree")
        if protocol == "LL":
            bus = min(bus * _c("busbw_factor", "tree", "LL"), _ll_max(comm))
        elif protocol == "LL128":
            where = "1 node" if comm.nodes == 1 else "2+ nodes"
            bus *= _c("busbw_factor", "tree", "LL128", where)
        return bus * _c("algbw_ratio", "tree")
    measured = _c("nvls_measured_ranks", "nvls", "Simple")
    if algorithm == "nvls" and op == "all_reduce":
        return comm.nvls_busbw_gbs * measured / (2 * (measured - 1))
    if algorithm == "nvls":
        # NCCL: all-gather / reduce-scatter lose all-reduce's two-operation pipelining and move
        # (ppn - 1) / ppn of the data; no bus -> algorithm conversion for these
        ppn = comm.per_node
        return (
            comm.nvls_busbw_gbs
            / _c("nvls_allreduce_pipelining", "nvls", "Simple")
            * (ppn - 1)
            / ppn
        )
    if algorithm == "nvls_tree":
        # NCCL: the NVLS bus bandwidth or the network's, twice the network's on two nodes
        net = bus * (2 if comm.nodes <= 2 else 1)
        return min(comm.nvls_busbw_gbs, net) * n / steps
    if algorithm == "pat":
        return bus * _c("busbw_factor", "pat", "Simple")
    raise ValueError(f"unknown NCCL algorithm {algorithm!r}")


def _latency(op: str, algorithm: str, protocol: str, comm: Comm) -> float:
    """Latency (us) as NCCL sums it: base + per-step hardware latencies."""
    n, nodes, ppn = comm.ranks, comm.nodes, comm.per_node
    base = _c("base_latency_us", algorithm, protocol)
    hw = "nvlink" if algorithm.startswith("nvls") else comm.hw  # NVLS exists on NVLink only
    intra = _c("hw_latency_us", algorithm, protocol, hw)
    # with one rank per node nothing hides the network: NCCL takes the tree's network latency
    inter = _c("hw_latency_us", "tree" if ppn == 1 else algorithm, protocol, "net")
    if algorithm == "ring":
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        inter_steps = 0 if nodes == 1 else 2 * (nodes - 1) if op == "all_reduce" else nodes - 1
        if nodes > 1:  # every step also posts to the network proxy
            over = _c("net_overhead_us", "ring")
            if protocol == "Simple":
                over *= _c("net_overhead_factor", "ring", "Simple")
            intra = max(intra, over)
        return base + (steps - inter_steps) * intra + inter_steps * inter
    if algorithm == "tree":
        return base + 2 * ((ppn - 1) * intra + _log2i(nodes) * inter)
    if algorithm == "nvls":
        return intra + (inter if nodes > 1 else 0.0)  # NCCL replaces the base latency
    if algorithm == "nvls_tree":
        return base + intra + 2 * _log2i(nodes) * inter
    if algorithm == "pat":
        return (
            base
            + _log2i(nodes) * inter / _c("pat_log_divisor", "pat", "Simple")
            + n * _c("pat_rank_latency_us", "pat", "Simple")
        )
    raise ValueError(f"unknown NCCL algorithm {algorithm!r}")


def estimate(op: str, algorithm: str, protocol: str, nbytes: float, comm: Comm) -> Estimate:
    """NCCL's predicted time of one pair (``ncclTopoGetAlgoTime``); ``nbytes`` is the whole
    buffer (all-gather: the gathered size, reduce-scatter: the unscattered one)."""
    bw = _algbw(op, algorithm, protocol, comm)
    lat = _latency(op, algorithm, protocol, comm)
    if algorithm == "tree" and op == "all_reduce":
        # NCCL's static correction for trees at medium sizes, by power of two from 64 B
        table = constants()[("tree_correction", "tree", protocol, "")]
        size = _log2i(int(nbytes) >> 6)
        if 0 <= size < len(table):
            bw *= table[size]
    if algorithm == "ring" and protocol == "Simple" and comm.nodes > 1 and op == "all_reduce":
        per = _c("ring_plateau_bytes", "ring", "Simple")
        channels = _c("ring_plateau_channels", "ring", "Simple")
        if nbytes / (channels * comm.ranks) >= per:  # NCCL's "plateau effect of ring"
            lat *= _c(
                "ring_plateau_factor", "ring", "Simple", "sm80+" if comm.sm >= 80 else "below sm80"
            )
    tuner_us = lat + nbytes / (1e3 * bw)
    # NCCL's model is a ranking: across two nodes it doubles NVLS-tree's network bandwidth
    # (each direction of a NIC), which can price an all-reduce faster than the NICs carry it
    # (4 H100s on 2 nodes: 16.2 ms for 1.98 GB through 92 GB/s per node, a hunt); the time
    # is at least the network's floor
    bw = min(bw, _network_algbw(op, comm))
    return Estimate(algorithm, protocol, lat, bw, lat + nbytes / (1e3 * bw), tuner_us)


def _network_algbw(op: str, comm: Comm) -> float:
    """The most algorithm bandwidth (GB/s) the network lets through across ``comm.nodes``
    nodes, each sending ``comm.busbw_gbs`` (its NICs' ring bus bandwidth) out: an all-reduce
    sends at least 2(N - 1)/N of the buffer out of each node (a reduce-scatter, then an
    all-gather, of the nodes' shares), an all-gather or a reduce-scatter (N - 1)/N; no bound
    inside one node."""
    nodes = comm.nodes
    if nodes <= 1:
        return math.inf
    steps = 2 * (nodes - 1) if op == "all_reduce" else nodes - 1
    return comm.busbw_gbs * nodes / steps


def estimates(op: str, nbytes: float, comm: Comm) -> list[Estimate]:
    """Every (algorithm, protocol) NCCL would consider for this collective."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    return [
        estimate(op, a, p, nbytes, comm)
        for a in ALGORITHMS
        for p in PROTOCOLS
        if _enabled(op, a, p, comm)
    ]


def best(op: str, nbytes: float, comm: Comm) -> Estimate:
    """The pair NCCL's tuner picks: the smallest time its model predicts (first listed on a
    tie)."""
    return min(estimates(op, nbytes, comm), key=lambda e: e.tuner_us)
