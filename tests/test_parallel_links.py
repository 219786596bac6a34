"""Links a layout's collectives run on: NVLink bridges between two PCIe cards, and the
table's line naming the links (``boom_ml/parallel/links.py``, ``links.csv``, ``gpu_links.csv``)."""

from __future__ import annotations

import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.layout import Cluster
from boom_ml.parallel.links import intra_link


def test_nvlink_bridges_join_pairs_of_pcie_cards():
    """The A100 PCIe (NVLink Bridge for 2 GPUs, 600 GB/s: the SXM4 rate), the GA102 cards
    (RTX 3090, RTX A6000, A40: 112.5 GB/s bidirectional) and the H100 NVL take a bridge
    between two cards: cluster.intra=nvlink is theirs for a layout of two per node, not more;
    auto stays PCIe (a bridge is an option); the RTX 4090 has none."""
    from boom_ml.gpus import get_gpu

    nvlink = Cluster(intra="nvlink")
    for gpu_id, link, line in (("a100-80gb-pcie", "nvlink3", 300), ("rtx-3090", "nvlink3_ga102",
                               56.25), ("rtx-a6000", "nvlink3_ga102", 56.25)):  # fmt: skip
        gpu = get_gpu(gpu_id)
        paired = intra_link(nvlink, gpu.id, gpu.name, gpu.architecture, node_gpus=2)
        assert (paired.name, paired.line_gbs, paired.nvls_busbw_gbs) == (link, line, 0.0)
        assert intra_link(Cluster(), gpu.id, gpu.name, gpu.architecture).name == "pcie4"
        with pytest.raises(InvalidInputError, match=f"{gpu_id}'s NVLink is a bridge between two"):
            intra_link(nvlink, gpu.id, gpu.name, gpu.architecture, node_gpus=4)
    with pytest.raises(InvalidInputError, match="rtx-4090 has no NVLink"):
        intra_link(nvlink, "rtx-4090", "NVIDIA GeForce RTX 4090", "ada", node_gpus=2)
    with pytest.raises(
        InvalidInputError, match="a bridge between two cards, and the layout puts 8"
    ):
        import boom_ml

        boom_ml.predict("hf:gpt2", gpu="h100-nvl", parallel={"dp": 8}, cluster={"intra": "nvlink"})


def test_a_layout_names_the_links_its_collectives_were_timed_on():
    """cluster.intra/inter=auto named no link: the table now says which, with its ring busbw
    (links.csv), and the method says tp-sharded only where tp > 1 (a helper's hunt)."""
    import json

    from boom_ml.predict import run

    base = {"model": "hf:HuggingFaceTB/SmolLM2-135M", "gpu": "rtx-4090", "batch_size": 1,
            "seq_len": 128, "advice": False, "cache": False}  # fmt: skip
    text = run({**base, "parallel": {"dp": 2}})
    assert (
        "rtx-4090: top collectives (exposed ms), over pcie4 (ring busbw 25.2 GB/s) within a node:"
        in text
    )
    assert "traces of the model, linear in layers" in text
    two = json.loads(run({**base, "output": "json", "parallel": {"dp": 4, "tp": 3},
                          "cluster": {"gpus_per_node": 4}}))  # fmt: skip
    time = two["parallel"][0]["time"]
    assert time["links"] == {"intra": "pcie4", "intra_busbw_gbs": 25.2, "inter": "ib-hdr200",
                             "inter_busbw_gbs": 24.0}  # fmt: skip
    assert "traces of the tp=3-sharded model" in time["method"]
