"""Synthetic test models (not measurements): small modules that exercise the tracer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from boom_ml.specs import ModelSpec
from boom_ml.zoo.base import BuiltModel


class TinyCnn(nn.Module):
    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
            nn.Sequential(
                nn.Conv2d(8, 8, 3, padding=1, groups=groups), nn.BatchNorm2d(8), nn.ReLU()
            ),
        )
        self.head = nn.Linear(8, 10)
        self.use_checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.use_checkpoint else block(x)
        return self.head(x.mean(dim=(2, 3)))


class TinyTransformer(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2, vocab: int = 100) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.out = nn.Linear(dim, vocab)
        self.use_checkpoint = False

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv[i](self.norms[i](x)).view(b, s, 3, self.heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + att.transpose(1, 2).reshape(b, s, d)
        gate = F.softmax(self.mlp[i](x), dim=-1)  # an explicit softmax, for the AMP policy
        return x + gate * x

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for i in range(len(self.norms)):
            if self.use_checkpoint:
                x = checkpoint(self.block, i, x, use_reentrant=False)
            else:
                x = self.block(i, x)
        return self.out(x)


def _enable(module: nn.Module) -> None:
    module.use_checkpoint = True


def tiny_cnn(groups: int = 1) -> BuiltModel:
    """``groups``: of the second convolution (8 channels; 8 = depthwise)."""
    with torch.device("meta"):
        module = TinyCnn(groups)

    def inputs(step, device):
        s = step.image_size
        return {
            "x": torch.randn(step.batch_size, 3, s, s, device=device),
            "_labels": torch.randint(0, 10, (step.batch_size,), device=device),
        }

    return BuiltModel(
        ModelSpec("test:tiny-cnn"),
        module,
        "cnn",
        inputs,
        lambda out, inp: F.cross_entropy(out, inp["_labels"]),
        _enable,
        default_image_size=16,
    )


def tiny_transformer() -> BuiltModel:
    with torch.device("meta"):
        module = TinyTransformer()

    def inputs(step, device):
        return {"input_ids": torch.randint(0, 100, (step.batch_size, step.seq_len), device=device)}

    def loss(out, inp):
        return F.cross_entropy(out.flatten(0, 1), inp["input_ids"].flatten())

    return BuiltModel(
        ModelSpec("test:tiny-transformer"),
        module,
        "transformer",
        inputs,
        loss,
        _enable,
        default_seq_len=16,
    )


def tiny_llama_config(**overrides: object) -> dict:
    """A synthetic tiny Llama config (2 layers, hidden 64, MLP 128, 4 query / 2 KV heads of 16);
    not a published model. ``overrides`` set or add fields (vocab size, tying, ...)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        **overrides,
    }
