"""The max-batch search bounds a batch by its allocated peak without the cuDNN workspaces a
capped replay drops where they do not fit (max_batch.py: _unbounded_peaks, _allocated_bound)."""

from __future__ import annotations

import boom_ml
from tests.test_predict_cli_advice import FLAT_CNN  # two 64-channel convolutions, no blocks


def test_a_batch_that_fits_is_never_above_the_max_batch(tmp_path) -> None:
    """Batch 64 fits this CNN on an L4 at every level (its p90 replay drops the workspaces
    that do not fit), and the search from it had answered 63: its allocated-peak bound held
    the workspaces, 24.2 GiB at 64. The answer is the same from either side now, and it is
    the largest batch whose verdict is yes: 86 to 111 are tight (the p90 replay, dropping
    workspaces, fits; the p50 one runs out), and the search had answered 111."""
    path = tmp_path / "flat.py"
    path.write_text(FLAT_CNN)
    kw = dict(gpu="l4", image_size=512, advice=False)
    at_64 = boom_ml.predict(f"file:{path}:make", batch_size=64, **kw).gpus[0]
    at_128 = boom_ml.predict(f"file:{path}:make", batch_size=128, **kw).gpus[0]
    assert at_64.memory.fit == "yes" and at_128.memory.fit == "no"
    assert at_64.memory.max_batch_size == at_128.memory.max_batch_size == 85
    for batch, fit in ((85, "yes"), (86, "tight"), (111, "tight")):
        at = boom_ml.predict(f"file:{path}:make", batch_size=batch, max_batch="off", **kw)
        assert at.gpus[0].memory.fit == fit
