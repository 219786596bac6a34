"""Link bandwidths and latencies (``links.csv``) and which link a GPU uses (``gpu_links.csv``).

``cluster.intra=auto`` means the GPU's own link. The rule, from ``gpus.csv``'s ``name`` and
``architecture`` (the table is not edited; ``gpu_links.csv`` lists the exceptions):

* a name containing "SXM" -> NVLink of its architecture's generation
  (pascal 1, volta 2, ampere 3, hopper 4, blackwell 5);
* any other card -> PCIe of its host-interface generation (pascal/volta/turing gen3,
  ampere/ada gen4, hopper/blackwell gen5).

``cluster.intra=nvlink`` on a card without NVLink is an error (one line), and so is one on a
PCIe card whose NVLink is a bridge (``gpu_links.csv``: intra PCIe, ``nvls=no``) with more than
two of them in a node: a bridge joins a pair. NVLink SHARP (NVLS) comes with the link
(``links.csv`` ``nvls_busbw_gbs``) unless ``gpu_links.csv`` says ``nvls=no`` (NVLink bridges
between pairs of cards: no NVSwitch).
``cluster.inter=auto`` means InfiniBand NDR400 for Hopper and later, HDR200 before (the NICs of
the DGX generation that shipped with each GPU).
"""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.layout import Cluster

HERE = Path(__file__).parent
NVLINK_BY_ARCH = {
    "pascal": "nvlink1",
    "volta": "nvlink2",
    "ampere": "nvlink3",
    "hopper": "nvlink4",
    "blackwell": "nvlink5",
}
PCIE_BY_ARCH = {
    "pascal": "pcie3",
    "volta": "pcie3",
    "turing": "pcie3",
    "ampere": "pcie4",
    "ada": "pcie4",
    "hopper": "pcie5",
    "blackwell": "pcie5",
}
NEW_IB = ("hopper", "blackwell")


@dataclass(frozen=True)
class Link:
    """One link type: NCCL ring bus bandwidth and the alpha-beta latencies."""

    name: str
    kind: str  # intra | inter
    scope: str  # per_gpu | per_node (one NIC shared by the node's GPUs)
    line_gbs: float
    busbw_gbs: float
    alpha_us: float  # per ring step
    base_us: float  # per collective
    source: str
    nccl_hw: str = "net"  # nvlink | pci | net: NCCL's latency class (tuning.cc NCCL_HW_*)
    sm: int = 0  # compute capability x 10 of the GPUs on this link (NCCL's constant rows)
    nvls_busbw_gbs: float = 0.0  # NVLink SHARP all-reduce busbw on 8 GPUs; 0: no NVLS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rows(name: str) -> list[dict[str, str]]:
    text = (HERE / name).read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


@functools.cache
def links() -> dict[str, Link]:
    out = {}
    for row in _rows("links.csv"):
        out[row["link"]] = Link(
            name=row["link"],
            kind=row["kind"],
            scope=row["scope"],
            line_gbs=float(row["line_gbs"]),
            busbw_gbs=float(row["busbw_gbs"]),
            alpha_us=float(row["alpha_us"]),
            base_us=float(row["base_us"]),
            source=row["source"],
            nccl_hw=row["nccl_hw"],
            sm=int(row["sm"] or 0),
            nvls_busbw_gbs=float(row["nvls_busbw_gbs"]),
        )
    return out


@functools.cache
def _exceptions() -> dict[str, dict[str, str]]:
    return {row["id"]: row for row in _rows("gpu_links.csv")}


def own_links(gpu_id: str, name: str, architecture: str) -> tuple[str, str | None]:
    """(the GPU's own intra-node link, its NVLink or None) by the rule in the module doc."""
    row = _exceptions().get(gpu_id)
    if row is not None:
        return row["intra"], row["nvlink"] or None
    arch = architecture.lower()
    if "sxm" in name.lower() and arch in NVLINK_BY_ARCH:
        return NVLINK_BY_ARCH[arch], NVLINK_BY_ARCH[arch]
    return PCIE_BY_ARCH.get(arch, "pcie3"), None


def intra_link(
    cluster: Cluster, gpu_id: str, name: str, architecture: str, node_gpus: int | None = None
) -> Link:
    """The link between GPUs of one node; ``node_gpus``: how many of a node's GPUs the layout
    uses (checked against a bridge's pair)."""
    own, nvlink = own_links(gpu_id, name, architecture)
    if cluster.intra == "auto":
        link = links()[own]
    elif cluster.intra == "nvlink":
        if nvlink is None:
            raise InvalidInputError(
                f"cluster.intra=nvlink but {gpu_id} has no NVLink; use cluster.intra=auto or pcie"
            )
        row = _exceptions().get(gpu_id) or {}
        bridge = row.get("nvls") == "no" and own.startswith("pcie")
        if bridge and node_gpus is not None and node_gpus > 2:
            raise InvalidInputError(
                f"cluster.intra=nvlink: {gpu_id}'s NVLink is a bridge between two cards, and the "
                f"layout puts {node_gpus} in a node; use cluster.gpus_per_node=2 (pairs joined "
                "by bridges, the pairs over the inter-node link) or cluster.intra=pcie"
            )
        link = links()[nvlink]
    else:
        link = links()[PCIE_BY_ARCH.get(architecture.lower(), "pcie3")]
    row = _exceptions().get(gpu_id)
    if row is not None and row["nvls"] == "no":  # NVLink without an NVSwitch: no NVLS
        link = replace(link, nvls_busbw_gbs=0.0)
    return link


def inter_link(cluster: Cluster, architecture: str) -> Link:
    if cluster.inter != "auto":
        return links()[cluster.inter]
    return links()["ib-ndr400" if architecture.lower() in NEW_IB else "ib-hdr200"]
