"""Forgetting attention (FoX, Lin et al. 2025): softmax attention with a data-dependent forget gate.

    s_ij = scale q_i . k_j + G_i - G_j   (j <= i, and i - j < window if given),   G_t = sum_{s<=t} g_s,
    o_i  = sum_j softmax_j(s_ij) v_j,

with g_t = log f_t <= 0 one log-gate per token and head (seed eq. 22: the forget-gated linear
attention's Gamma inside the exponential; a constant g is ALiBi). g=None is plain causal softmax
attention.

Three forms that agree to floating-point precision:

* `parallel`  - explicit T x T scores (the reference form);
* `chunk`     - blockwise online softmax over block diagonals (`_flash.py`): memory O(T * block) in
                the forward *and* the backward, which is a custom autograd.Function that recomputes
                the score blocks from the saved log-sum-exp (no checkpointing, nothing T x T kept);
* `recurrent` - decoding: a KV cache plus the running G, one token at a time
                (`forgetting_attention_step`, also the layer's decoding path).

The gates' cumulative sum is kept in fp64 (`_flash.py`, "Gate precision"), so strong gates (g = -20
per token) give exact, finite outputs: every row keeps its own key with bias 0, so no row underflows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch

from .. import fla
from ..errors import LinattnError, LinattnTypeError
from ._common import check_finite_output, check_log_gate, check_qkv, check_scale, compute_dtype, run_varlen
from ._flash import (
    FlaSoftmaxCall,
    causal_mask,
    check_block_size,
    check_finite_gate,
    check_mode,
    check_scale_state_packing,
    check_window,
    empty_kv_cache,
    flash_attention,
    from_heads_first,
    gate_bias,
    kv_cache_attend,
    masked_softmax,
    to_heads_first,
)
from .backend import fla_forgetting_attention, select_backend
from .registry import randn, register_op, uniform


class ForgettingAttentionState(NamedTuple):
    """The decoding state of `forgetting_attention`: the KV cache and the running gate sum.

    Attributes:
        k: `[B, L, H, K]`, the cached keys (compute dtype; with a window only the last window - 1 tokens
            are kept).
        v: `[B, L, H, V]`, the cached values.
        G: `[B, L, H]` fp64, the cumulative log-gate at each cached token (None without g).
        G_now: `[B, H]` fp64, the cumulative log-gate of the last token seen (None without g).
    """
    k: torch.Tensor
    v: torch.Tensor
    G: Optional[torch.Tensor]
    G_now: Optional[torch.Tensor]


@dataclass
class _Problem(FlaSoftmaxCall):
    q: torch.Tensor            # [B, T, H, K] compute dtype, scaled
    k: torch.Tensor
    v: torch.Tensor
    g: Optional[torch.Tensor]  # [B, T, H] compute dtype or None
    window: Optional[int]
    mode: str
    block_size: int
    offsets: Optional[List[int]]
    output_final_state: bool
    out_dtype: torch.dtype
    #: the caller's q, k, v and the resolved scale (what fla's kernel takes)
    source: Tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]

    fla_kernel = "parallel_forgetting_attn"

    def fla_head_dims(self) -> Optional[str]:
        K = self.q.shape[-1]
        return None if K <= fla.MAX_HEAD_DIM else f"fla's attention kernels take K <= {fla.MAX_HEAD_DIM}, got K = {K}"


def _prepare(q, k, v, g, window, scale, mode, block_size, cu_seqlens, output_final_state) -> _Problem:
    B, T, H, K, V = check_qkv(q, k, v)
    check_mode(mode)
    check_block_size(block_size)
    window = check_window(window)
    if g is not None:
        check_log_gate(g, "g", B, T, H, ref=q)
        check_finite_gate(g)
    scale, offsets = check_scale_state_packing(scale, K, output_final_state, cu_seqlens, B, T)
    cdt = compute_dtype(q.dtype)
    return _Problem(q.to(cdt) * scale, k.to(cdt), v.to(cdt), g.to(cdt) if g is not None else None, window,
                    mode, block_size, offsets, output_final_state, q.dtype, (q, k, v, scale))


def _parallel(q, k, v, g, window):
    """[B, T, H, *] -> o [B, T, H, V]: explicit T x T scores."""
    T = q.shape[1]
    s = torch.einsum("bihk,bjhk->bhij", q, k)
    if g is not None:
        G = g.double().cumsum(1).transpose(1, 2)                  # [B, H, T] fp64
        s = s + gate_bias(G, q.dtype)
    p = masked_softmax(s, causal_mask(T, q.device, window))
    return torch.einsum("bhij,bjhv->bihv", p, v)


def _chunk(q, k, v, g, window, block_size):
    B, _, H, _ = q.shape
    gh = to_heads_first(g, g.dtype) if g is not None else None
    o = flash_attention(to_heads_first(q, q.dtype), to_heads_first(k, k.dtype), to_heads_first(v, v.dtype), gh,
                        block_size, window)
    return from_heads_first(o, B, H)


def _step_loop(q, k, v, g, state: Optional[ForgettingAttentionState], window):
    """Token-by-token decoding over [B, T, H, *] (already scaled, compute dtype) -> (o, state)."""
    kc, vc, Gc, G_now = state if state is not None else empty_kv_cache(k, v, g is not None)
    outs = []
    for t in range(q.shape[1]):
        o_t, kc, vc, Gc, G_now = kv_cache_attend(q[:, t], k[:, t:t + 1], v[:, t:t + 1],
                                                 g[:, t] if g is not None else None, kc, vc, Gc, G_now, window)
        outs.append(o_t)
    if window is not None:   # the next token sees the last window - 1 of these
        keep = window - 1
        kc, vc = kc[:, kc.shape[1] - min(keep, kc.shape[1]):], vc[:, vc.shape[1] - min(keep, vc.shape[1]):]
        if Gc is not None:
            Gc = Gc[:, Gc.shape[1] - min(keep, Gc.shape[1]):]
    return torch.stack(outs, dim=1), ForgettingAttentionState(kc, vc, Gc, G_now)


def _final_state(p: _Problem) -> ForgettingAttentionState:
    k, v = p.k.detach(), p.v.detach()
    G = p.g.detach().double().cumsum(1) if p.g is not None else None
    G_now = G[:, -1] if G is not None else None
    if p.window is not None:
        keep = min(p.window - 1, k.shape[1])
        k, v = k[:, k.shape[1] - keep:], v[:, v.shape[1] - keep:]
        G = G[:, G.shape[1] - keep:] if G is not None else None
    return ForgettingAttentionState(k, v, G, G_now)


def _run(p: _Problem):
    def one(q, k, v, g):
        if p.mode == "parallel":
            return _parallel(q, k, v, g, p.window)
        if p.mode == "chunk":
            return _chunk(q, k, v, g, p.window, p.block_size)
        return _step_loop(q, k, v, g, None, p.window)[0]

    if p.offsets is None:
        o = one(p.q, p.k, p.v, p.g)
    else:
        o, _ = run_varlen(p.offsets, lambda i, s: (one(p.q[:, s], p.k[:, s], p.v[:, s],
                                                       p.g[:, s] if p.g is not None else None), None))
    o = o.to(p.out_dtype)
    return (o, _final_state(p)) if p.output_final_state else o


def forgetting_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], *,
                         window: Optional[int] = None, scale: Optional[float] = None, mode: str = "chunk",
                         block_size: int = 64, cu_seqlens: Optional[torch.Tensor] = None,
                         output_final_state: bool = False, backend: str = "auto"):
    """Forgetting attention (FoX): softmax attention with a data-dependent forget gate (module docstring).

    s_ij = scale q_i . k_j + G_i - G_j over the keys j <= i (and i - j < window), G_t = sum_{s<=t} g_s,
    o_i = sum_j softmax_j(s_ij) v_j. g=None is plain causal softmax attention.

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]`.
        g: Log forget gates `[B, T, H]` (<= 0, finite), or None.
        window: Keys with i - j < window only (None: all earlier keys).
        scale: The score scale; None means K**-0.5.
        mode: "parallel" (explicit T x T scores, the reference) | "chunk" (blockwise online softmax, memory
            O(T * block)) | "recurrent" (a KV cache, token by token); they agree to floating-point precision.
        block_size: The chunk form's block length.
        cu_seqlens: int64 `[N+1]` offsets of packed sequences (B must be 1); G restarts at every start.
        output_final_state: Also return a `ForgettingAttentionState` for `forgetting_attention_step`.
        backend: "auto" (fla's `parallel_forgetting_attn` for covered CUDA calls, PyTorch otherwise), "torch"
            or "fla" (see docs/backends.md); `linattn.explain` says which a call takes and why.

    Returns:
        o (torch.Tensor): The output `[B, T, H, V]` in the input dtype; returned alone unless
            output_final_state.
        final_state (ForgettingAttentionState): With output_final_state, the decoding state; the call then
            returns the pair (o, final_state).

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> from linattn import forgetting_attention, forgetting_attention_step
        >>> B, T, H, K = 1, 9, 2, 8
        >>> q, k, v = torch.randn(3, B, T, H, K).unbind(0)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(B, T, H))
        >>> o = forgetting_attention(q, k, v, g)
        >>> o.shape
        torch.Size([1, 9, 2, 8])

        Prefill the first tokens, then decode the last one from the state:

        >>> o8, state = forgetting_attention(q[:, :8], k[:, :8], v[:, :8], g[:, :8], output_final_state=True)
        >>> o9, state = forgetting_attention_step(q[:, 8:], k[:, 8:], v[:, 8:], g[:, 8:], state)
        >>> torch.allclose(o9, o[:, 8:], atol=1e-5)
        True
    """
    p = _prepare(q, k, v, g, window, scale, mode, block_size, cu_seqlens, output_final_state)
    result = fla_forgetting_attention(p) if select_backend(backend, p) == "fla" else _run(p)
    return check_finite_output(result, "forgetting_attention", q=q, k=k, v=v)


def _check_state(state, B, H, K, V, with_gate: bool, device) -> None:
    if not isinstance(state, ForgettingAttentionState):
        raise LinattnTypeError(f"state must be a ForgettingAttentionState (from output_final_state=True or a "
                               f"previous step), got {type(state).__name__}")
    k, v, G, G_now = state
    if k.dim() != 4 or k.shape[0] != B or k.shape[2:] != (H, K) or v.shape[:3] != k.shape[:3] or v.shape[3] != V:
        raise LinattnError(f"state.k must be [B, L, H, K] with B, H, K = {(B, H, K)} and state.v [B, L, H, {V}], "
                           f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if (G is None) != (not with_gate):
        raise LinattnError("state and call disagree about the gate: pass g at every step of a gated state "
                           "(and none for an ungated one)")
    if k.device != device:
        raise LinattnError(f"state must be on the device of q ({device}), got {k.device}")


def forgetting_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                              state: Optional[ForgettingAttentionState] = None, *, window: Optional[int] = None,
                              scale: Optional[float] = None):
    """Decode new tokens (usually one) after the tokens summarised in `state`.

    Each token appends its key, value and cumulative gate G_t = G_{t-1} + g_t to the cache, then
    attends every cached key j with scale q_t . k_j + G_t - G_j.

    Args:
        q: Queries `[B, T, H, K]` (usually T = 1).
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]`.
        g: Log forget gates `[B, T, H]` (<= 0), or None; a gated state needs g at every step.
        state: The state from `forgetting_attention(..., output_final_state=True)` or a previous step; None:
            an empty cache.
        window: Keys with i - j < window only (None: all earlier keys); with a window only the last
            window - 1 tokens are kept.
        scale: The score scale; None means K**-0.5.

    Returns:
        o (torch.Tensor): The output `[B, T, H, V]`, in the input dtype.
        state (ForgettingAttentionState): The new state (the cache with the new tokens appended).

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value, or a state that does not match the call.
        LinattnTypeError: state is not a `ForgettingAttentionState`.

    Examples:
        >>> import torch
        >>> from linattn import forgetting_attention, forgetting_attention_step
        >>> q, k, v = torch.randn(3, 1, 5, 2, 8).unbind(0)
        >>> g = -torch.rand(1, 5, 2)
        >>> state, outs = None, []
        >>> for t in range(5):                              # token by token from an empty cache
        ...     s = slice(t, t + 1)
        ...     o_t, state = forgetting_attention_step(q[:, s], k[:, s], v[:, s], g[:, s], state)
        ...     outs.append(o_t)
        >>> torch.allclose(torch.cat(outs, 1), forgetting_attention(q, k, v, g), atol=1e-5)
        True
    """
    B, T, H, K, V = check_qkv(q, k, v)
    window = check_window(window)
    if g is not None:
        check_log_gate(g, "g", B, T, H, ref=q)
        check_finite_gate(g)
    scale = check_scale(scale, K ** -0.5)
    if state is not None:
        _check_state(state, B, H, K, V, g is not None, q.device)
    cdt = compute_dtype(q.dtype)
    o, state = _step_loop(q.to(cdt) * scale, k.to(cdt), v.to(cdt), g.to(cdt) if g is not None else None,
                          state, window)
    return o.to(q.dtype), state


def _example(gen, B, T, H, K, V, dtype):
    """q, k, v and a forget gate (a log-decay in (-0.5, 0)) (the registry's conformance tests)."""
    q, k, v = randn(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, V), dtype)
    return (q, k, v, uniform(gen, (B, T, H), dtype, -0.5, 0.0)), {}


def _prepare_call(q, k, v, g, *, window=None, scale=None, mode="chunk", block_size=64, cu_seqlens=None,
                  output_final_state=False, backend="auto"):
    """forgetting_attention's prepared problem from its own arguments (the registry's `prepare`)."""
    return _prepare(q, k, v, g, window, scale, mode, block_size, cu_seqlens, output_final_state)


register_op("forgetting_attention", forgetting_attention, prepare=_prepare_call, backends=True,
            forms=("parallel", "chunk", "recurrent"),
            chunk_arg="block_size", example=_example, reference="forgetting_attention_ref",
            description="FoX: softmax attention with a data-dependent forget gate")


__all__ = ["forgetting_attention", "forgetting_attention_step", "ForgettingAttentionState"]
