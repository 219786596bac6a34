"""Multi-GPU layouts (issue #14): data, tensor and pipeline parallelism with ZeRO/FSDP sharding.

Modelled analytically on traced single-rank graphs: ``layout`` (torch-free validation),
``links`` (sourced bandwidths), ``profile`` (1- and 2-layer traces of the per-rank model),
``memory`` and ``time`` (per-rank terms), ``collectives`` + ``nccl`` (NCCL's algorithm choice),
``schedule`` (1F1B / GPipe / interleaved pipelines), ``predict``.
"""

from boom_ml.parallel.layout import Cluster, Layout, validate

__all__ = ["Cluster", "Layout", "predict_parallel", "validate"]


def __getattr__(name: str):  # keep ``import boom_ml.parallel`` torch-free
    if name == "predict_parallel":
        from boom_ml.parallel.predict import predict_parallel

        return predict_parallel
    raise AttributeError(name)
