"""The codes of the feature maps that kernels apply themselves (the compiled CPU chunk and decoding kernels, the
Triton kernels): one table for every path. csrc/common.h's LA_FMAP_* are the same numbers (a test reads them).

Imports nothing, so that `linattn.cpu` and `linattn.triton` (which never import `linattn.ops`) can both use it.
Other feature maps are computed in PyTorch and reach the kernels as given features (`identity`).
"""
from __future__ import annotations

from typing import Dict

FMAP_IDENTITY, FMAP_ELU1, FMAP_RELU = 0, 1, 2
#: a FeatureMap's `fused_kernel` name -> the code the kernels take
FUSED_MAPS: Dict[str, int] = {"identity": FMAP_IDENTITY, "elu+1": FMAP_ELU1, "relu": FMAP_RELU}

__all__ = ["FMAP_IDENTITY", "FMAP_ELU1", "FMAP_RELU", "FUSED_MAPS"]
