"""NCCL's algorithm and protocol choice (boom_ml/parallel/nccl.py) and the groups it is made for.

Exact values are NCCL 2.28.3's model (src/graph/tuning.cc) worked by hand from the constants in
nccl_algorithms.csv and the links' busbw in links.csv.
"""

from __future__ import annotations

import pytest

from boom_ml.gpus import get_gpu
from boom_ml.parallel.collectives import (
    Collective,
    algorithm_for,
    all_gather_ms,
    all_reduce_ms,
    group_link,
    groups,
    reduce_scatter_ms,
)
from boom_ml.parallel.layout import Cluster, Layout
from boom_ml.parallel.links import inter_link, intra_link
from boom_ml.parallel.nccl import Comm, _rows, best, estimate, estimates

MIB, GIB = 2**20, 2**30


def node_group(gpu_id: str, n: int = 8, cluster: Cluster | None = None):
    """A group of ``n`` GPUs inside one node of ``gpu_id``, as predict_parallel builds it."""
    gpu, cluster = get_gpu(gpu_id), cluster or Cluster()
    intra = intra_link(cluster, gpu.id, gpu.name, gpu.architecture)
    inter = inter_link(cluster, gpu.architecture)
    return group_link("tp", n, 1, n, cluster, intra, inter)


def dp_group(gpu_id: str, tp: int, dp: int):
    gpu, cluster = get_gpu(gpu_id), Cluster()
    intra = intra_link(cluster, gpu.id, gpu.name, gpu.architecture)
    return groups(Layout(tp=tp, dp=dp), cluster, intra, inter_link(cluster, gpu.architecture))["dp"]


def test_ring_simple_is_the_alpha_beta_ring_on_one_node():
    """8 x A100 SXM, 1 GiB: base 8.4 + 2(n-1) x NVLink 3.4 us + 2(n-1)/n S / 230 GB/s."""
    group = node_group("a100-80gb-sxm")
    ring = estimate("all_reduce", "ring", "Simple", GIB, group.comm())
    assert ring.latency_us == pytest.approx(8.4 + 14 * 3.4)
    assert ring.us == pytest.approx(8.4 + 14 * 3.4 + 2 * 7 / 8 * GIB / 230e3)
    # large and inside a node: ring beats the tree, whose bus bandwidth NCCL takes x .92, x 1/2
    assert algorithm_for("all_reduce", GIB, group) == "ring/Simple"
    assert all_reduce_ms(GIB, group) == pytest.approx(ring.us * 1e-3)
    tree = estimate("all_reduce", "tree", "Simple", GIB, group.comm())
    assert tree.algbw_gbs == pytest.approx(230 * 0.92 * 0.5)  # 2^30 / 64 = 2^24: past the table
    # all-gather and reduce-scatter: n - 1 steps, (n-1)/n of the gathered bytes
    ag = 8.4 + 7 * 3.4 + 7 / 8 * GIB / 230e3
    assert all_gather_ms(GIB, group) == reduce_scatter_ms(GIB, group) == pytest.approx(ag * 1e-3)


def test_tree_correction_at_medium_sizes():
    """1 MiB: log2(2^20 / 64) = 14, NCCL's Simple tree correction there is .5."""
    tree = estimate("all_reduce", "tree", "Simple", MIB, node_group("a100-80gb-sxm").comm())
    assert tree.algbw_gbs == pytest.approx(230 * 0.92 * 0.5 * 0.5)


def test_tree_beats_ring_for_a_small_all_reduce_across_64_nodes():
    """512 A100s on 64 DGX nodes, 64 KiB: the ring's 2 x 511 steps against the tree's 2 x (7
    intra + log2(64) network) hops."""
    group = dp_group("a100-80gb-sxm", tp=1, dp=512)
    assert (group.nodes, group.busbw_gbs) == (64, 8 * 24)
    tree = best("all_reduce", 64 * 2**10, group.comm())
    assert tree.name == "tree/LL"
    assert tree.latency_us == pytest.approx(6.8 + 2 * (7 * 0.6 + 6 * 5.0))
    rings = [e for e in estimates("all_reduce", 64 * 2**10, group.comm()) if e.algorithm == "ring"]
    assert rings and min(e.us for e in rings) > 5 * tree.us
    assert algorithm_for("all_reduce", 64 * 2**10, group) == "tree/LL"


def test_ring_plateau_and_network_steps_across_nodes():
    """16 A100s on 2 nodes: 2(n-1) steps of which 2(nodes-1) cross the network (14 us), the
    rest NVLink (3.4 us, above NCCL's 3 x 1 us proxy overhead); x 1.4 above 64 B per channel."""
    group = dp_group("a100-80gb-sxm", tp=1, dp=16)
    assert group.nodes == 2
    lat = 8.4 + 28 * 3.4 + 2 * 14.0
    small = estimate("all_reduce", "ring", "Simple", 32 * 16 * 64 - 1, group.comm())
    large = estimate("all_reduce", "ring", "Simple", 32 * 16 * 64, group.comm())
    assert small.latency_us == pytest.approx(lat)
    assert large.latency_us == pytest.approx(lat * 1.4)


def test_groups_count_nodes_and_nics():
    # tp=8: one dp member per node, one HDR NIC each; tp=2: four members a node, four NICs
    wide = dp_group("a100-80gb-sxm", tp=8, dp=4)
    assert (wide.nodes, wide.busbw_gbs, wide.comm().per_node) == (4, 24.0, 1)
    narrow = dp_group("a100-80gb-sxm", tp=2, dp=8)
    assert (narrow.nodes, narrow.busbw_gbs, narrow.comm().per_node) == (2, 96.0, 4)
    inside = dp_group("a100-80gb-sxm", tp=2, dp=4)
    assert (inside.nodes, inside.link) == (1, "nvlink3")


@pytest.mark.parametrize("pp,tp,nodes", [(2, 1, 1), (4, 1, 1), (8, 1, 1), (4, 4, 2), (16, 1, 2)])
def test_the_tied_embedding_group_is_the_first_and_last_stage(pp, tp, nodes):
    """Two ranks whatever pp is; on two nodes when the pipeline spans nodes (8 GPUs a node),
    one NIC's bandwidth then (HDR 200: 24 GB/s bus bandwidth)."""
    gpu, cluster = get_gpu("a100-80gb-sxm"), Cluster()
    intra = intra_link(cluster, gpu.id, gpu.name, gpu.architecture)
    got = groups(Layout(tp=tp, pp=pp), cluster, intra, inter_link(cluster, gpu.architecture))
    emb = got["embedding"]
    assert (emb.size, emb.nodes, got["pp"].nodes) == (2, nodes, nodes)
    assert emb.busbw_gbs == (intra.busbw_gbs if nodes == 1 else 24.0)


def test_pat_for_gathers_with_one_gpu_per_node():
    """64 nodes x 1 GPU, 1 MiB all-gather: PAT, latency 8 + log2(64) x 14 / 3.5 + 64 x 2.8."""
    group = dp_group("a100-80gb-sxm", tp=8, dp=64)
    pat = best("all_gather", MIB, group.comm())
    assert pat.name == "pat/Simple"
    assert pat.latency_us == pytest.approx(8.0 + 6 * 14 / 3.5 + 64 * 2.8)
    assert pat.algbw_gbs == pytest.approx(24 * 0.75)


@pytest.mark.parametrize(
    ("gpu_id", "intra", "large"),
    [("h100-sxm", "auto", "nvls/Simple"), ("h200", "auto", "nvls/Simple"),
     ("a100-80gb-sxm", "auto", "ring/Simple"), ("h100-pcie", "auto", "ring/Simple"),
     ("h100-nvl", "nvlink", "ring/Simple"), ("l4", "auto", "ring/Simple")],
)  # fmt: skip
def test_nvls_only_on_hopper_nvswitch_nodes(gpu_id, intra, large):
    group = node_group(gpu_id, cluster=Cluster(intra=intra))
    assert algorithm_for("all_reduce", 256 * MIB, group) == large


def test_nvls_crossover_on_8_h100s():
    """nccl-tests on one 8 x H100 node picks ring/LL up to 1 MB, NVLS/Simple from 2 MB
    (github.com/NVIDIA/nccl-tests/issues/309; an observation, not used to set any constant)."""
    group = node_group("h100-sxm")
    assert algorithm_for("all_reduce", MIB, group) == "ring/LL"
    assert algorithm_for("all_reduce", 2 * MIB, group) == "nvls/Simple"
    nvls = best("all_reduce", 256 * MIB, group.comm())
    assert nvls.latency_us == 25.0
    assert nvls.algbw_gbs == pytest.approx(480 * 8 / 14)  # ~275 GB/s, nccl-tests/issues/212


def test_nvls_not_on_two_gpus_and_tree_across_h100_nodes():
    # 2 GPUs: the ring's 370 GB/s algorithm bandwidth beats NVLS's 274 (NVLS measures no faster
    # than ring on 2-4 GPUs, github.com/NVIDIA/nccl/issues/1455)
    assert algorithm_for("all_reduce", GIB, node_group("h100-sxm", n=2)) == "ring/Simple"
    # 4 DGX H100 nodes: NVLS inside each node, a tree across; ring ties its bandwidth
    group = dp_group("h100-sxm", tp=1, dp=32)
    assert (group.nodes, group.busbw_gbs) == (4, 8 * 46.0)
    assert algorithm_for("all_reduce", GIB, group) == "nvls_tree/Simple"


def test_no_all_reduce_outruns_the_network_between_two_nodes():
    """4 H100s on 2 nodes, one NDR NIC each (46 GB/s): NCCL's model doubles NVLS-tree's network
    bandwidth on two nodes, min(480, 2 x 92) x 4/6 = 122.7 GB/s, but each node must send the
    whole buffer out through its 2 x 46 GB/s (a hunt: 16.16 ms for 1,976,131,072 B). The
    tuner still picks NVLS-tree by its own figure; the time is the network's floor."""
    gpu, cluster = get_gpu("h100-sxm"), Cluster(gpus_per_node=2)
    intra = intra_link(cluster, gpu.id, gpu.name, gpu.architecture)
    inter = inter_link(cluster, gpu.architecture)
    group = groups(Layout(dp=4), cluster, intra, inter)["dp"]
    nbytes = 1_976_131_072
    assert (group.nodes, group.busbw_gbs) == (2, 92.0)
    nvls_tree = estimate("all_reduce", "nvls_tree", "Simple", nbytes, group.comm())
    assert nvls_tree.tuner_us == pytest.approx(nvls_tree.latency_us + nbytes / (184 * 4 / 6 * 1e3))
    assert nvls_tree.algbw_gbs == 92.0
    assert algorithm_for("all_reduce", nbytes, group) == "nvls_tree/Simple"
    assert all_reduce_ms(nbytes, group) == pytest.approx(
        (nvls_tree.latency_us + nbytes / 92e3) * 1e-3
    )
    # an all-gather over 2 nodes moves half the gathered bytes out of each: 2 x 92 GB/s at most
    shared = Comm(ranks=2, nodes=2, busbw_gbs=2.5, sm=90, nic_per_gpu=False)
    assert all(e.algbw_gbs <= 2 * 2.5 for e in estimates("all_gather", GIB, shared))


def test_protocols_nccl_leaves_off():
    pcie = {e.protocol for e in estimates("all_reduce", MIB, node_group("l4").comm())}
    assert pcie == {"LL", "Simple"}  # LL128 needs NVLink
    shared_nic = Comm(ranks=16, nodes=2, busbw_gbs=2.5, hw="nvlink", sm=80, nic_per_gpu=False)
    assert "LL128" not in {e.protocol for e in estimates("all_reduce", MIB, shared_nic)}
    nvlink = {e.name for e in estimates("all_reduce", MIB, node_group("a100-80gb-sxm").comm())}
    assert nvlink == {f"{a}/{p}" for a in ("ring", "tree") for p in ("LL", "LL128", "Simple")}


@pytest.mark.parametrize("gpu_id", ["a100-80gb-sxm", "h100-sxm", "l4"])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_collective_time_is_the_fastest_candidate(gpu_id, op):
    timed = {"all_reduce": all_reduce_ms, "all_gather": all_gather_ms,
             "reduce_scatter": reduce_scatter_ms}[op]  # fmt: skip
    for group in (node_group(gpu_id), dp_group(gpu_id, tp=2, dp=16)):
        for nbytes in (4096, MIB, 64 * MIB, GIB):
            found = estimates(op, nbytes, group.comm())
            fastest = min(found, key=lambda e: e.tuner_us)  # NCCL's tuner ranks by its model
            assert timed(nbytes, group) == pytest.approx(fastest.us * 1e-3)
            assert algorithm_for(op, nbytes, group) == fastest.name


def test_nothing_to_move_and_point_to_point():
    group = node_group("h100-sxm")
    assert all_reduce_ms(0, group) == 0.0 and algorithm_for("all_reduce", 0, group) == ""
    assert algorithm_for("send_recv", MIB, group) == "p2p"
    single = node_group("h100-sxm", n=1)
    assert all_gather_ms(MIB, single) == 0.0 and algorithm_for("all_gather", MIB, single) == ""
    c = Collective("all_reduce", "tp", "x", 8, 1, 0.0, 0.0)
    assert c.to_dict()["algorithm"] == ""


def test_every_nccl_constant_is_sourced():
    rows = _rows()
    assert rows and all(r["source"].strip() for r in rows)
    keys = [(r["constant"], r["algorithm"], r["protocol"], r["where"]) for r in rows]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("sharding", ["none", "zero1", "zero2", "zero3", "fsdp"])
def test_the_last_ready_gradient_is_reduced_in_the_open_under_every_sharding(sharding):
    """The embedding's gradient is the backward's last: its reduction has no compute left to
    hide behind, and the optimizer step waits for it. DDP's last bucket counted so; ZeRO-1/2
    had counted a 25 MiB bucket and FSDP's root unit nothing (a hunt: ~2 ms too optimistic on
    Llama-3.2-1B at dp=4)."""
    from boom_ml.parallel.time import Shape, dp_collectives

    embed, layer, layers = 50_000_000, 10_000_000, 8
    params = embed + layers * layer
    shape = Shape(batch_size=1, seq_len=1024, hidden=2048, act_bytes=2, checkpointing=False,
                  params_layer=layer, params_first=embed, params_last=0)  # fmt: skip
    group = dp_group("h100-sxm", tp=1, dp=4)
    layout = Layout(dp=4, sharding=sharding)
    colls = dp_collectives(shape, layout, params, backward_ms=1e3, compute_mb_ms=1.5e3,
                           group=group, embed_group=None, tied_params=0,
                           layer_params=layers * layer, layer_trainable=layers * layer,
                           last_ready_bytes=embed * 4)  # fmt: skip
    reduce = all_reduce_ms if sharding == "none" else reduce_scatter_ms
    # 1 s of backward hides all the rest; the embedding's 200 MB (the root unit under FSDP2,
    # alone; with DDP's or ZeRO's last bucket, up to 25 MiB more) stays in the open
    floor = reduce(embed * 4, group)
    exposed = sum(c.exposed_ms for c in colls if c.op != "all_gather")
    assert floor <= exposed <= reduce(embed * 4 + 25 * MIB, group) + 1e-9
