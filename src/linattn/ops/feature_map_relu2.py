"""The squared-ReLU feature map, `relu2`: phi(x) = psi(x) = relu(x)^2, so k(a, b) = sum_d relu(a_d)^2 relu(b_d)^2.

Non-negative like relu, with a continuous derivative at 0 (Primer's squared-ReLU activation used as a feature
map). Also the walked example of CONTRIBUTING's "A new feature map" recipe: this module is the
whole addition (plus its import in ops/__init__.py); `linear_attention(..., feature_map="relu2")`, the
`LinearAttention` layer and the `linear-relu2` mixer accept it from the registry, and
tests/test_registry_conformance.py tests it against the fp64 reference built from `kernel` below.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .feature_maps import FeatureMap, register_feature_map


class SquaredReLU(FeatureMap):
    """phi = psi = relu(x)^2: non-negative, zero for a non-positive input (the normaliser can vanish: see eps)."""
    name = "relu2"

    def phi(self, x, pos=None):
        return F.relu(x).square()

    psi = phi

    def kernel(self, a, b, i=None, j=None):
        """sum_d relu(a_d)^2 relu(b_d)^2, from the formula (the reference's kernel)."""
        return torch.einsum("td,sd->ts", a.clamp_min(0) ** 2, b.clamp_min(0) ** 2)


register_feature_map("relu2", SquaredReLU)
