"""Helpers shared by several test files (import them as `from helpers import ...`: pytest puts tests/ on the path)."""
from __future__ import annotations

import torch

from linattn.models.registry import build_mixer


def perturbed_mixer(name: str, d: int = 32, H: int = 2, dtype: torch.dtype = torch.float32, **kw):
    """A registered mixer in eval mode whose biases and norm weights are moved off their initial values, so a
    decode path that skips a bias or a norm cannot agree with the reference by accident (seeded)."""
    torch.manual_seed(0)
    layer = build_mixer(name, d, H, **kw).to(dtype).eval()
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return layer
