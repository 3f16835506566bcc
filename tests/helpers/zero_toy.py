"""The toy problem colo.ShardedMasterWeightOptimizer's tests train (optimizers/test_zero.py, and each
rank in helpers/zero_worker.py): five parameters of awkward sizes (no world size divides their
total), two parameter groups (one without weight decay), a batch of 12 rows split over the ranks."""
from __future__ import annotations

import torch

SHAPES = [(37, 16), (16,), (16, 16), (5,), (61, 16)]


def build_params(region=None, dtype=torch.bfloat16) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    values = [torch.randn(shape) for shape in SHAPES]
    if region is None:
        return [torch.nn.Parameter(v.to(dtype)) for v in values]
    # One allocation each, as vLLM's weights are, and not in the parameters' order (vLLM's fused
    # qkv_proj puts q, k, v weights before their biases; HF lists q weight, q bias, k weight, ...).
    tensors = {}
    for i in (2, 0, 4, 1, 3):
        tensors[i] = region.empty(values[i].shape, dtype)
        tensors[i].copy_(values[i])
    return [torch.nn.Parameter(tensors[i]) for i in range(len(values))]


def build_groups(params) -> list[dict]:
    return [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(12, 16, generator=generator), torch.randn(12, 37, generator=generator)


def loss_fn(params, x, y) -> torch.Tensor:
    """Mean over the rows given (every rank's share is the same size, so the mean of the ranks'
    losses is the loss over the whole batch)."""
    w0, b, w1, s, w2 = (p.float() for p in params)
    h = torch.tanh(x @ w1 + b)
    return ((h @ w0.T - y) ** 2).mean() + (h @ w2.T).square().mean() * 1e-2 + s.square().sum() * 1e-3
