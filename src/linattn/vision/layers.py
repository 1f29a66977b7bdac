"""Attention over 2-D feature maps `[B, C, H, W]`: the grid's H*W cells are the tokens.

* `LinearAttention2d`: bidirectional kernelized linear attention through `linattn.linear_attention`
  (any of its feature maps; ELA's Hadamard Exp by default). Cost O(H*W * d^2) per head.
* `SoftmaxAttention2d`: bidirectional softmax attention through `linattn.softmax_attention`.
  Cost O((H*W)^2 * d) per head.
* `ConvStack2d`: a residual stack of 3x3 convolutions, the local operator the attention replaces
  (the "deep convolutions" of a YOLO neck), with the same input/output contract.

The two attention layers share one block, as in YOLO-LAT's neck: a bias-free 1x1 convolution to
q, k, v; per-head attention; a bias-free 1x1 output projection; then `norm(x + out)` with
BatchNorm2d. For the exponential kernels q and k are divided by sqrt(head_dim) before the kernel
(the public YOLO-LAT code's temperature); linattn evaluates Hadamard Exp in log-space, so no
exponential is taken here and large activations do not overflow.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..feature_maps import FeatureMap, get_feature_map


def _check_channels(channels: int, heads: int) -> int:
    if not isinstance(channels, int) or channels < 1:
        raise ConfigError(f"channels must be a positive int, got {channels!r}")
    if not isinstance(heads, int) or heads < 1 or channels % heads:
        raise ConfigError(f"heads must be a positive int dividing channels ({channels}), got {heads!r}")
    return channels // heads


def _check_map(x: torch.Tensor, channels: int, who: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != channels:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ConfigError(f"{who} expects a [B, {channels}, H, W] tensor, got {shape}")


class _Attention2d(nn.Module):
    """q, k, v by a 1x1 conv; attention over the H*W cells (subclasses); projection; norm(x + o)."""

    def __init__(self, channels: int, heads: int = 4, qk_scale: Optional[float] = None):
        super().__init__()
        self.channels, self.heads = channels, heads
        self.head_dim = _check_channels(channels, heads)
        self.qk_scale = self.head_dim ** -0.5 if qk_scale is None else float(qk_scale)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1, bias=False)
        self.proj = nn.Conv2d(channels, channels, 1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [B, T, H, D]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_map(x, self.channels, type(self).__name__)
        B, C, H, W = x.shape
        # [B, 3C, H, W] -> 3 x [B, T, heads, head_dim], T = H*W in row-major (y, x) order
        qkv = self.qkv(x).reshape(B, 3, self.heads, self.head_dim, H * W).permute(1, 0, 4, 2, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]
        o = self.attend(q, k, v)                                   # [B, T, heads, head_dim]
        o = o.permute(0, 2, 3, 1).reshape(B, C, H, W)
        return self.norm(x + self.proj(o))


class LinearAttention2d(_Attention2d):
    """Bidirectional linear attention over a feature map, `linattn.linear_attention(causal=False)`.

    feature_map: a name of `linattn.FEATURE_MAP_NAMES` (default "hadamard_exp") or a FeatureMap.
    qk_scale: multiplies q and k before the kernel (default head_dim**-0.5, as YOLO-LAT).
    """

    def __init__(self, channels: int, heads: int = 4, feature_map: Union[str, FeatureMap] = "hadamard_exp",
                 qk_scale: Optional[float] = None, eps: float = 1e-6):
        super().__init__(channels, heads, qk_scale)
        try:
            fmap = get_feature_map(feature_map, self.head_dim)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"feature map {feature_map!r}: {e}") from None
        if fmap is None:
            raise ConfigError("LinearAttention2d needs a feature map")
        self.feature_map = fmap
        if isinstance(fmap, nn.Module):  # FAVOR+: its projection is a buffer saved with the model
            self.fmap_module = fmap
        self.eps = float(eps)

    def attend(self, q, k, v):
        from ..ops import linear_attention

        s = self.qk_scale
        o, _ = linear_attention(q * s, k * s, v, feature_map=self.feature_map, causal=False, mode="chunk",
                                eps=self.eps)
        return o

    def extra_repr(self) -> str:
        return f"channels={self.channels}, heads={self.heads}, feature_map={getattr(self.feature_map, 'name', '?')}"


class SoftmaxAttention2d(_Attention2d):
    """Bidirectional softmax attention over a feature map, `linattn.softmax_attention(causal=False)`
    with the usual 1/sqrt(head_dim) temperature (qk_scale: an explicit one)."""

    def attend(self, q, k, v):
        from ..ops import softmax_attention

        # contiguous [B, T, H, D]: SDPA's fused CPU kernel needs unit-stride features; on the strided
        # views of the qkv convolution it falls back to the math form, which materialises T x T
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return softmax_attention(q, k, v, causal=False, scale=self.qk_scale)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, heads={self.heads}"


class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) + BatchNorm2d + SiLU, the YOLO building block."""

    def __init__(self, c_in: int, c_out: int, k: int = 1, s: int = 1, groups: int = 1):
        super().__init__(nn.Conv2d(c_in, c_out, k, s, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(c_out), nn.SiLU(inplace=True))


class ConvStack2d(nn.Module):
    """`depth` residual 3x3 conv blocks (Conv + BN + SiLU): x <- x + block(x). Receptive field
    grows by 2 cells per block, against the attention layers' global one."""

    def __init__(self, channels: int, depth: int = 3):
        super().__init__()
        if not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"depth must be a positive int, got {depth!r}")
        self.channels = channels
        self.blocks = nn.ModuleList([ConvBNAct(channels, channels, 3) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_map(x, self.channels, "ConvStack2d")
        for b in self.blocks:
            x = x + b(x)
        return x


__all__ = ["LinearAttention2d", "SoftmaxAttention2d", "ConvStack2d", "ConvBNAct"]
