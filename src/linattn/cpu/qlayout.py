"""int4-a8 group scales in the order the compiled product's steps read them (csrc/qmatvec.h `a8_step_scales`).

The compiled int4 product with int8 activations (format "int4_a8") reads four rows a step, i, i + q, i + 2q, i + 3q
(q = `step_quarter(n)`: csrc/rowsched.h `Q_QUARTER`), and their group scales as one vector per step of 64 inputs:
[group][4 rows]. A plan keeps its int4-a8 scales in that order, so that a step widens them where it reads them (round
15; before, each step of four rows transposed the rows' scales into a table first). A `QuantizedLinear`'s `scales`
(what users, save / load, the dequantizer and the prefill path see) stay `[n, ng]` by rows: the plan builder makes the
copy.

Step t < q holds rows t + r q (r = 0..3) as `[ng][4]` at element 4 t ng; from n = 8 the step of the four neighbouring
rows 4q .. 4q + 3 follows as `[ng][4]` at element 4 q ng; the n % 4 last rows follow in their row order, `[row][ng]`
from element 4 (n // 4) ng, where they are in `[n, ng]` too (n < 4: the plain order). A copy made when a plan is
built, never saved: the order follows the kernel's schedule (round 21e: q from n // 4 to n // 4 - 1 for n >= 8).
Nothing here imports linattn.quant.
"""
from __future__ import annotations

import torch

from ..errors import LinattnError

__all__ = ["step_scales", "rows_scales", "step_quarter"]


def step_quarter(n: int) -> int:
    """The compiled products' stream distance q in rows (csrc/rowsched.h `Q_QUARTER`, which it must equal): n // 4 - 1
    from n = 8, so that the four streams of n (a multiple of 4) rows of 512 B, 1 KiB, ... are not a multiple of 4 KiB
    apart; n // 4 below."""
    return n // 4 - 1 if n >= 8 else n // 4


def _check(scales: torch.Tensor, name: str) -> None:
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        raise LinattnError(f"{name}: scales must be a [n, n_groups] tensor, got "
                           f"{getattr(scales, 'dtype', type(scales).__name__)} {list(getattr(scales, 'shape', []))}")


def step_scales(scales: torch.Tensor) -> torch.Tensor:
    """int4 group scales `[n, ng]` by rows -> the same values in the steps' order (module docstring), as a new
    contiguous `[n, ng]` tensor of the same dtype (its rows are no longer the matrix's rows).

    Raises:
        LinattnError: scales is not a 2-D tensor.
    """
    _check(scales, "step_scales")
    n, ng = scales.shape
    q, f = step_quarter(n), 4 * (n // 4)
    head = scales[:4 * q].reshape(4, q, ng).permute(1, 2, 0)   # [t][g][r] = scales[r q + t, g]
    near = scales[4 * q:f].reshape(-1, 4, ng).permute(0, 2, 1)   # (the step of neighbouring rows: [g][r])
    return torch.cat((head.reshape(-1), near.reshape(-1), scales[f:].reshape(-1))).view(n, ng)


def rows_scales(steps: torch.Tensor) -> torch.Tensor:
    """`step_scales`' inverse: scales `[n, ng]` in the steps' order -> `[n, ng]` by rows (a new tensor).

    Raises:
        LinattnError: steps is not a 2-D tensor.
    """
    _check(steps, "rows_scales")
    n, ng = steps.shape
    q, f = step_quarter(n), 4 * (n // 4)
    flat = steps.reshape(-1)
    head = flat[:4 * q * ng].view(q, ng, 4).permute(2, 0, 1).reshape(4 * q, ng)
    near = flat[4 * q * ng:f * ng].view(-1, ng, 4).permute(0, 2, 1).reshape(f - 4 * q, ng)
    return torch.cat((head, near, flat[f * ng:].view(n - f, ng)))
