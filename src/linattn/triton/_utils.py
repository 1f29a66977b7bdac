"""Shared helpers of the Triton kernels: block sizes, the chunk index of packed sequences, the
in-kernel feature maps. Imports triton (only imported once the Triton backend is chosen)."""
from __future__ import annotations

from typing import List, NamedTuple

import torch
import triton
import triton.language as tl

# feature maps fused into the kernels (others are computed in PyTorch and passed as identity)
FMAP_IDENTITY, FMAP_ELU1, FMAP_RELU = 0, 1, 2
FUSED_MAPS = {"identity": FMAP_IDENTITY, "elu+1": FMAP_ELU1, "relu": FMAP_RELU}
CHUNK_SIZES = (16, 32, 64)
MAX_FULL_DIM = 256  # kernels that hold a whole K (or K x BV) state in registers


def chunk_size_for(chunk_size: int) -> int:
    """The kernels' token tile BT: the requested chunk size when it is 16, 32 or 64, else 64.
    The result does not depend on it (the chunk form is exact for every chunk size)."""
    return chunk_size if chunk_size in CHUNK_SIZES else 64


def block(n: int, cap: int = 64) -> int:
    """A power-of-two tile >= 16 (tl.dot's minimum) covering n, at most `cap`."""
    return min(cap, max(16, triton.next_power_of_2(n)))


def full_block(n: int, name: str) -> int:
    b = max(16, triton.next_power_of_2(n))
    if b > MAX_FULL_DIM:
        raise ValueError(f"the Triton kernels keep a whole {name} = {n} in registers and support "
                         f"{name} <= {MAX_FULL_DIM}; use backend='torch'")
    return b


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision: exact fp32 ('ieee') for fp32 inputs; 'tf32' for 16-bit inputs, whose own
    rounding (2^-8 / 2^-11) is at least as large as tf32's (2^-11). Operands stay fp32 either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


class Chunks(NamedTuple):
    """Packed sequences cut into chunks of BT tokens that never cross a sequence boundary.

    cu:      int64 [N+1], sequence starts on the flattened token axis
    index:   int32 [NT, 2], (sequence, chunk within the sequence) of every chunk, in order
    offsets: int64 [N+1], index of each sequence's first chunk (row of the per-chunk state arrays)
    """
    cu: torch.Tensor
    index: torch.Tensor
    offsets: torch.Tensor
    N: int
    NT: int


def prepare_chunks(starts: List[int], BT: int, device) -> Chunks:
    lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    n_chunks = [-(-n // BT) for n in lens]
    index, offsets = [], [0]
    for i, c in enumerate(n_chunks):
        index.extend((i, j) for j in range(c))
        offsets.append(offsets[-1] + c)
    return Chunks(
        cu=torch.tensor(starts, dtype=torch.int64, device=device),
        index=torch.tensor(index, dtype=torch.int32, device=device).view(-1, 2),
        offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        N=len(lens), NT=offsets[-1])


def dummy(device) -> torch.Tensor:
    """A placeholder for a pointer argument the kernel does not read (its flag is off)."""
    return torch.empty(1, dtype=torch.float32, device=device)


@triton.jit
def phi(x, FMAP: tl.constexpr):
    """The fused feature maps: identity, elu(x) + 1 (= x + 1 for x > 0, exp(x) else), relu."""
    if FMAP == 1:
        return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))
    elif FMAP == 2:
        return tl.maximum(x, 0.0)
    else:
        return x


@triton.jit
def dphi(x, FMAP: tl.constexpr):
    """Their derivatives, as torch's autograd defines them (relu'(0) = 0, elu'(0) = 1)."""
    if FMAP == 1:
        return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))
    elif FMAP == 2:
        return tl.where(x > 0, 1.0, 0.0)
    else:
        return tl.full(x.shape, 1.0, tl.float32)
