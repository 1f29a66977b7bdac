"""`delta_product`: DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear
RNNs via Householder Products") and Gated DeltaProduct, a thin wrapper over the delta family's core
(`delta_core.py`).

Each token t carries n keys, values and step sizes. With the state S `[K, V]` per head, per token

    S <- Diag(exp(g_t)) S                                                       (once)
    S <- (I - beta_{t,j} k_{t,j} k_{t,j}^T) S + beta_{t,j} k_{t,j} v_{t,j}^T    for j = 1 .. n
    o_t = scale * S^T q_t                                                       (after the n-th step)

so the token's transition is a product of n generalised Householder matrices. beta in [0, 2] (with unit
keys) keeps every factor's eigenvalue 1 - beta ||k||^2 in [-1, 1]: beta in (1, 2] gives the negative
eigenvalues that state tracking needs (the layer's `allow_negative_eigenvalues`). Values above 2 are
accepted and computed exactly, but the state then grows (as DeltaNet with beta ||k||^2 > 2).

The wrapper interleaves the n sub-steps into one sequence of length T * n, [k_{1,1} .. k_{1,n},
k_{2,1} ..], and runs the delta rule of the core on it: the log-gate of token t sits on its first
sub-step (zero on the others), the query of token t on its last sub-step (zero queries elsewhere, whose
outputs are dropped), and packed sequences' offsets are multiplied by n. Every form of the core
(recurrent, chunk, parallel; the Triton kernels for the calls they cover) is therefore exact for
DeltaProduct too, and states round-trip with `delta_rule`'s.

chunk_size counts sub-steps of the interleaved sequence (the core's unit): the work and memory of one
chunk are those of `delta_rule` at the same chunk_size. It is rounded down to a multiple of n (at least
n), so that every chunk holds whole tokens: chunk_size=64 with n=2 means chunks of 32 tokens. A backend
may cap or round it further (per-channel gates use blocks of at most 16, the Triton kernels 16/32/64).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..errors import LinattnError, LinattnTypeError
from ._common import FLOAT_DTYPES, check_cu_seqlens, check_log_gate, check_mode, check_same_device
from .delta_core import DeltaProblem, prepare_delta, run_delta
from .registry import randn, register_op, uniform, unit


def _check(name: str, x, shape, layout: str, ref: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise LinattnTypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise LinattnTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise LinattnError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(x.shape)}")
    check_same_device(x, name, ref)


def prepare_delta_product(q, k, v, beta, *, g=None, scale=None, qk_l2norm: bool = False, mode: str = "chunk",
                          chunk_size: int = 64, initial_state=None, output_final_state: bool = False,
                          cu_seqlens=None) -> Tuple[DeltaProblem, int]:
    """Check a `delta_product` call and prepare the interleaved core problem -> (problem, n)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise LinattnError(f"q must be a torch.Tensor of shape [B, T, H, K], got "
                           f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dtype not in FLOAT_DTYPES:
        raise LinattnTypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    B, T, H, K = q.shape
    if not isinstance(k, torch.Tensor) or k.dim() != 5:
        raise LinattnError(f"k must be a torch.Tensor of shape [B, T, H, n, K] (n keys per token), got "
                           f"{tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__}")
    n = k.shape[3]
    if n < 1:
        raise LinattnError(f"k must have shape [B, T, H, n, K] with n >= 1 keys per token, got {tuple(k.shape)}")
    _check("k", k, (B, T, H, n, K), "[B, T, H, n, K]", q)
    if not isinstance(v, torch.Tensor) or v.dim() != 5:
        raise LinattnError(f"v must be a torch.Tensor of shape [B, T, H, n, V] = {(B, T, H, n)} + (V,), got "
                           f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    # grouped value heads: v, beta, g and the state with HV = m H heads (value head j reads q/k head j // m)
    HV = v.shape[2] if v.shape[2] and H and v.shape[2] % H == 0 else H
    heads = "H" if HV == H else "HV"
    _check("v", v, (B, T, HV, n, v.shape[-1]), f"[B, T, {heads}, n, V] (n as in k)", q)
    if not (q.dtype == k.dtype == v.dtype):
        raise LinattnTypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check("beta", beta, (B, T, HV, n), f"[B, T, {heads}, n] (n as in k)", q)
    if T == 0:
        raise LinattnError("the sequence length T must be at least 1")
    check_mode(mode, chunk_size)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    if g is not None:  # in the caller's terms (the core checks the interleaved gate again)
        check_log_gate(g, "g", B, T, HV, K, allow_diagonal=True, ref=q)

    def interleave(x):  # [B, T, n, H, *] -> [B, T*n, H, *]
        return x.reshape(B, T * n, *x.shape[3:])

    q_i = interleave(torch.cat([q.new_zeros(B, T, n - 1, H, K), q.unsqueeze(2)], dim=2))
    k_i = interleave(k.transpose(2, 3))
    v_i = interleave(v.transpose(2, 3))
    b_i = interleave(beta.transpose(2, 3))
    g_i = None
    if g is not None:  # the token's decay on its first sub-step, none on the others
        g_i = interleave(torch.cat([g.unsqueeze(2), g.new_zeros(B, T, n - 1, *g.shape[2:])], dim=2))
    cu_i = None
    if offsets is not None:  # host offsets (no second device read), in sub-steps
        cu_i = torch.tensor([o * n for o in offsets], dtype=torch.int64)
    C = max(n, chunk_size // n * n)
    prob = prepare_delta(q_i, k_i, v_i, b_i, g=g_i, channel_gate=True, scale=scale, qk_l2norm=qk_l2norm,
                         mode=mode, chunk_size=C, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_i)
    return prob, n


def delta_product(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    qk_l2norm: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(Gated) DeltaProduct: n delta-rule steps per token, a product of n Householder-like transitions.

    Per token: S <- Diag(exp(g_t)) S once, then for j = 1..n S <- (I - beta_{t,j} k_{t,j} k_{t,j}^T) S +
    beta_{t,j} k_{t,j} v_{t,j}^T; o_t = scale * S^T q_t reads the state after the n-th step. beta up to 2
    (with unit keys) gives the negative eigenvalues that state tracking needs (module docstring).

    Grouped value heads: v, beta, g and the state may have HV = m H heads (value head j reads q/k head j // m).

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: The n keys of each token `[B, T, H, n, K]`.
        v: The n values of each token `[B, T, H, n, V]`.
        beta: Step sizes `[B, T, H, n]`, >= 0 (up to 2 for negative eigenvalues).
        g: A log-gate (<= 0) `[B, T, H]` per head or `[B, T, H, K]` per key channel, or None (no decay).
        scale: The output scale; None means K**-0.5.
        qk_l2norm: True L2-normalises q and each of the n keys (inside the op, differentiably).
        mode: The form: "chunk" (training), "recurrent" (decoding), "parallel" (quadratic closed form).
        chunk_size: Counts sub-steps (n per token), rounded down to a multiple of n (module docstring).
        initial_state: The state to start from, `[N, H, K, V]` (also a `delta_rule` state), or None (zeros).
        output_final_state: Also return the state after the last token.
        cu_seqlens: int64 `[N+1]` offsets over the T tokens of N packed sequences (B == 1).
        backend: "auto", "torch", "fla", "triton" or "cpu" (see `delta_rule`).

    Returns:
        o: The output `[B, T, H, V]`, in the input dtype.
        final_state: With output_final_state, the state `[N, H, K, V]` (N = B, or the number of sequences in
            cu_seqlens), fp32 (fp64 for fp64 inputs), which round-trips between modes, calls and `delta_rule`;
            otherwise None.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import delta_product, delta_rule
        >>> B, T, H, n, K, V = 1, 8, 2, 2, 8, 8
        >>> q = torch.randn(B, T, H, K)
        >>> k = F.normalize(torch.randn(B, T, H, n, K), dim=-1)
        >>> v, beta = torch.randn(B, T, H, n, V), 2 * torch.rand(B, T, H, n)
        >>> o, S = delta_product(q, k, v, beta, output_final_state=True)
        >>> o.shape, S.shape
        (torch.Size([1, 8, 2, 8]), torch.Size([1, 2, 8, 8]))

        With n = 1 it is the delta rule:

        >>> o1, _ = delta_product(q, k[:, :, :, :1], v[:, :, :, :1], beta[..., :1])
        >>> o2, _ = delta_rule(q, k[:, :, :, 0], v[:, :, :, 0], beta[..., 0])
        >>> torch.allclose(o1, o2, atol=1e-5)
        True
    """
    prob, n = prepare_delta_product(q, k, v, beta, g=g, scale=scale, qk_l2norm=qk_l2norm, mode=mode,
                                    chunk_size=chunk_size, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    o, S = run_delta(prob, backend)
    B, TN, H, V = o.shape
    return o.reshape(B, TN // n, n, H, V)[:, :, -1], S


def _prepare(*args, backend: str = "auto", **kwargs):
    """delta_product's prepared problem over its n sub-steps per token (its chunk counts sub-steps)."""
    return prepare_delta_product(*args, **kwargs)[0]


def _example(gen, B, T, H, K, V, dtype):
    """Two unit keys and two values per token, beta in (0, 1), a scalar decay (the registry's conformance tests)."""
    q, k, v = unit(gen, (B, T, H, K), dtype), unit(gen, (B, T, H, 2, K), dtype), randn(gen, (B, T, H, 2, V), dtype)
    return (q, k, v, uniform(gen, (B, T, H, 2), dtype)), {"g": uniform(gen, (B, T, H), dtype, -0.3, 0.0)}


register_op("delta_product", delta_product, prepare=_prepare, backends=True, forms=("parallel", "chunk", "recurrent"),
            example=_example, reference="delta_product_ref", state=True,
            description="(Gated) DeltaProduct: n Householder (delta-rule) steps per token")
