"""Advice from the command's plain function: a change the model cannot take, a max-batch
search without an answer, an interrupt inside a trace, a candidate that fails to trace."""

from __future__ import annotations

import json

from boom_ml.predict import run
from tests.test_predict_cli import BASE, _factory_file

FLAT_CNN = """
import torch
def make():
    # three convolutions, no nn.Sequential / ModuleList: nothing to checkpoint
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 64, 3, padding=1)
            self.b = torch.nn.Conv2d(64, 64, 3, padding=1)
            self.head = torch.nn.Linear(64, 10)
        def forward(self, x):
            return self.head(self.b(self.a(x)).mean(dim=(2, 3)))
    return Flat()
"""


def test_advice_skips_a_change_the_model_cannot_take(tmp_path):
    """A model without blocks cannot be checkpointed: that candidate is no advice, and the
    prediction asked for (checkpointing=none) still prints, with the changes that work."""
    options = {**BASE, "model": _factory_file(tmp_path, FLAT_CNN), "batch_size": 128,
               "image_size": 512, "advice": True, "max_batch": "off"}  # fmt: skip
    result = json.loads(run(options))
    assert result["gpus"][0]["memory"]["fits"] is False
    changes = [a["change"] for a in result["advice"]["l4"]]
    assert changes and not any("checkpointing" in c for c in changes)
    assert any("batch_size" in c for c in changes)


def test_a_max_batch_search_without_an_answer_says_why(tmp_path):
    """inception_v3 (aux head) at batch 3 on a 0.8 GB GPU: the search halves to batch 1, which
    the model refuses; the estimate stands and the table and JSON say why there is no max
    batch (was a log line nobody sees)."""
    gpu = tmp_path / "tiny.yaml"
    gpu.write_text("name: tiny\narchitecture: ampere\ncompute_capability: '8.6'\nsm_count: 10\n"
                   "memory_gb: 0.8\nmemory_bandwidth_gbs: 100\nfp32_tflops: 5\n")  # fmt: skip
    options = {**BASE, "model": "torchvision:inception_v3", "gpu": str(gpu), "batch_size": 3,
               "image_size": None, "advice": False, "max_batch": "on"}  # fmt: skip
    memory = json.loads(run(options))["gpus"][0]["memory"]
    assert memory["max_batch_size"] is None and memory["fits"] is False
    assert "trains with batch_size >= 2" in memory["max_batch_error"]
    table = run({**options, "output": "table"})
    assert "max batch on tiny: not found (torchvision:inception_v3 trains with batch_size" in table


def test_an_interrupt_inside_a_trace_is_never_a_skipped_candidate():
    from boom_ml.errors import TraceError, interrupted

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as inner:
            raise TraceError("could not trace") from inner
    except TraceError as err:
        assert interrupted(err)
    assert not interrupted(TraceError("a BatchNorm of one value"))


BN_HEAD = """
import torch
def make():
    # a BatchNorm1d over the pooled features: batch 1 cannot train it
    return torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 10))
"""


def test_a_candidate_that_fails_to_trace_is_no_advice(tmp_path):
    """The batch-1 candidate of a model whose BatchNorm1d needs two samples fails inside the
    trace; the prediction asked for (batch 2) still prints."""
    gpu = tmp_path / "small.yaml"
    gpu.write_text("name: small\narchitecture: ampere\ncompute_capability: '8.6'\nsm_count: 10\n"
                   "memory_gb: 0.3\nmemory_bandwidth_gbs: 100\nfp32_tflops: 5\n")  # fmt: skip
    options = {**BASE, "model": _factory_file(tmp_path, BN_HEAD), "gpu": str(gpu),
               "batch_size": 2, "image_size": 512, "max_batch": "off"}  # fmt: skip
    result = json.loads(run(options))
    assert result["gpus"][0]["memory"]["fits"] is False
    assert not any("batch_size=1" in a["change"] for a in result["advice"].get("small", []))


def test_a_batchnorm_over_one_value_says_what_helps(tmp_path):
    """A hunt: deeplabv3 at batch 1 stopped on PyTorch's words alone (a BatchNorm over its
    pooled 1x1 map); inception's aux head had a hint, the rest none."""
    import pytest

    from boom_ml.errors import BoomError

    options = {**BASE, "model": _factory_file(tmp_path, BN_HEAD), "batch_size": 1,
               "advice": False, "max_batch": "off"}  # fmt: skip
    with pytest.raises(BoomError) as err:
        run(options)
    assert str(err.value).endswith(
        "Expected more than 1 value per channel when training, got input size"
        " torch.Size([1, 64]) (a BatchNorm sees one value per channel: give batch_size >= 2;"
        " a larger image_size helps only a map made 1x1 by a small image, not one after a"
        " global pool, as in DeepLabV3's head)"
    )


def test_no_batch_that_trains_a_batchnorm_fits_says_so(tmp_path):
    """Batch 2 does not fit and batch 1 leaves a BatchNorm one value per channel: the search
    says no batch fits, not PyTorch's words with a hint to try a larger image (a hunt:
    deeplabv3 at 1400 px on a T4). The small synthetic GPU of the test above."""
    gpu = tmp_path / "small.yaml"
    gpu.write_text("name: small\narchitecture: ampere\ncompute_capability: '8.6'\nsm_count: 10\n"
                   "memory_gb: 0.3\nmemory_bandwidth_gbs: 100\nfp32_tflops: 5\n")  # fmt: skip
    options = {**BASE, "model": _factory_file(tmp_path, BN_HEAD), "gpu": str(gpu),
               "batch_size": 2, "image_size": 512, "max_batch": "on", "advice": False}  # fmt: skip
    result = json.loads(run(options))
    assert result["gpus"][0]["memory"]["max_batch_error"] == (
        "no batch of 2 or more fits, and one sample leaves a BatchNorm one value per channel,"
        " which training refuses"
    )
