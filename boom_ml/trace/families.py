"""The op family names: the vocabulary of the op registry (``boom_ml.trace.ops``).

Kept apart from the registry, without torch, so that timing features, importers and the
schema can name families without importing PyTorch. Which op is in which family is decided
only in the registry.
"""

from __future__ import annotations

# The order is part of the GNN's input (one-hot columns, boom_ml/timing/gnn_features.py):
# append new families at the end, or retrain the packaged GNN.
FAMILIES = ("gemm", "conv", "attention", "norm", "softmax", "reduction", "loss", "elementwise",
            "pooling", "fill", "embedding", "optimizer", "copy", "host", "other")  # fmt: skip
# Ops without a registry entry. The recorder also marks ops on host tensors "host" (Adam's
# step counters), which is no registry family: it depends on where the inputs live.
UNKNOWN = "other"
HOST = "host"
