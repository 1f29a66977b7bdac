"""What the PyTorch forms of `linear_attention` share: their layout, their one return type (`FormResult`),
and the constants of the log-space maps.

The forms live one per module: `linear_parallel.py` (the quadratic form and the bidirectional one),
`linear_recurrent.py` (token by token), `linear_chunk.py` (chunkwise, linear-space features, by matmuls)
and `linear_chunk_log.py` (chunkwise, log-space features and diagonal gates). `linear.py` validates a
call, picks the form and turns its `FormResult` into outputs and a state.

Layout inside the forms: [B, H, T, D]; a state S [B, H, K_phi, V + 1] is [kv | z] (the normaliser's
state z beside the values' kv, so both decay together); mu [B, H, K_phi] is the state's per-feature
log-scale for log-space maps (the true state is exp(mu) * S), None otherwise; g a log-gate
[B, H, T, 1] (scalar per head) or [B, H, T, K_phi] (diagonal), or None.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# Log-scale of an empty state, and log-feature of a padding key: finite, so that differences
# of two such values never produce NaN, yet exp() of it is exactly 0.
NEG = -1e30
LOG_BLOCK = 16  # block size of the log-space chunk path (its intra-block work is O(T * 16 * K))


class FormResult(NamedTuple):
    """What every form returns, in the forms' layout. num and den are taken relative to the row
    log-scale c for log-space maps (their ratio is the normalised output either way)."""
    num: torch.Tensor               # [B, H, T, V]  sum_j w_ij v_j
    den: torch.Tensor               # [B, H, T]     sum_j w_ij
    c: Optional[torch.Tensor]       # [B, H, T]     row log-scale (log-space maps), else None
    S: Optional[torch.Tensor]       # [B, H, K_phi, V + 1] final state [kv | z], or None when not computed
    mu: Optional[torch.Tensor]      # [B, H, K_phi] its log-scale (log-space maps), else None


def row_scale(x: torch.Tensor, dims) -> torch.Tensor:
    """The row's maximum log-weight over `dims`, the stabiliser of a log-space row."""
    return x.amax(dim=dims).detach()  # stabilisers carry no gradient: their effect cancels exactly


def with_ones(x: torch.Tensor) -> torch.Tensor:
    """v [.., V] -> [v | 1] [.., V + 1]: the forms that work on the ones column get the denominator beside."""
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


def split_ones(o: torch.Tensor, c, S, mu) -> FormResult:
    """A form's output [.., V + 1] (numerator | denominator) -> `FormResult`."""
    V = o.shape[-1] - 1
    return FormResult(o[..., :V], o[..., V], c, S, mu)
