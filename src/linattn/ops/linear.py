"""Kernelized linear attention: o_i = sum_j w_ij v_j (/ sum_j w_ij), w_ij = phi(q_i) . psi(k_j) x decay.

Three forms that agree to floating-point precision:

* `parallel`  - the quadratic form with an explicit T x T weight matrix (the reference);
* `chunk`     - chunkwise: exact attention inside a chunk, a carried state between chunks (training);
* `recurrent` - one token at a time with a constant-size state (decoding).

A call is validated and prepared once (`prepare_linear_attention` -> `LinearProblem`: feature map
resolved, gates turned into one log-gate, scale, state and packed-sequence offsets checked), then
run by a backend: the PyTorch forms, or the Triton and compiled CPU kernels (`ops/backend.py`).
This module holds the public entry, the preparation, the choice of a form and the output (`finish`);
the forms live one per module and share one return type, `FormResult` (`linear_common.py`):
`linear_parallel.py`, `linear_recurrent.py`, `linear_chunk.py` (linear-space features: the matmul
form with a scalar gate and the fast form without one) and `linear_chunk_log.py` (log-space maps and
diagonal gates: the block form and the shifted matmul path).

The normaliser is computed by appending a column of ones to V, so its state z = sum psi(k) decays
with the numerator by construction and every form shares the state S = [kv | z].

Log-space feature maps (Hadamard Exp, FAVOR+) keep a per-feature log-scale mu next to the state,
the running maximum of the (decayed) key log-features, exactly like online softmax keeps its
running max: the true state is exp(mu_d) * S_d. Each output row is computed relative to its own
maximum log-weight c_i, which cancels in the normalised output (and is multiplied back otherwise).
Chunkwise, those maps and diagonal (GLA) gates use the log-space block algorithm (`linear_chunk_log.py`), whose
every exponent is <= 0, with blocks of LOG_BLOCK tokens; the plain feature maps with no gate or a
scalar gate use pure matmuls (without a gate, in eager mode, through the fused form with a hand-written
backward in `ops/linear_chunk.py`). The log-space maps with no gate or a scalar gate also have a matmul
path, for CPU tensors in eager mode: features shifted per chunk by the chunk's first key, rows scaled
by a running maximum, and a row-local test of which rows that represents exactly (the others, rare,
come from the block path). On CUDA and under torch.compile the log-space maps always take the block
path: no host synchronisation and one graph, at the block path's cost. Every other choice depends only
on the map, the gate and the mode.

Causality, to the bit. Every stabiliser, shift and path choice a row uses depends only on tokens up to
that row, so changing later tokens never changes an earlier output, not even by rounding: in the chunk
and recurrent forms, running on a prefix x[:, :t] gives the bits of the first t outputs of the full
run. Masks act by selection, never by multiplying with 0 (0 * inf = NaN), and a later value never
enters an earlier row's product (`causal_matmul`): an inf or NaN at position t leaves every output
before t exactly as it was (it does reach later outputs, and through the carried state later chunks).

The normalised output of a log-space map divides by the *stabilised* denominator,
sum_j w_ij / exp(c_i) >= 1 for these strictly positive kernels, so eps never changes it and adding a
constant to every query entry leaves the output unchanged.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from .. import fla
from ..cpu import MAX_CHUNK as CPU_MAX_CHUNK
from ..cpu.abi import LOG_MAX_FEATURES as CPU_LOG_MAX_FEATURES
from ..errors import LinattnError, LinattnTypeError
from ..triton import triton_chunk_size
from ._common import (
    FLA_CHUNK,
    LOG_GATE_FLOOR,
    check_cu_seqlens,
    check_finite_output,
    check_log_gate,
    check_mode,
    check_qkv,
    check_scale,
    check_values,
    compute_dtype,
    reads_values,
    run_varlen,
)
from .backend import (
    cpu_linear_attention,
    cpu_linear_log_attention,
    fla_linear_attention,
    requires_grad,
    select_backend,
    triton_linear_attention,
)
from .feature_maps import FeatureMap, get_feature_map
from .heads import value_groups
from .linear_chunk import FUSED, chunk_matmul_form, linear_chunk
from .linear_chunk_log import chunk_log_form, log_chunk_matmul_form
from .linear_common import LOG_BLOCK, NEG, FormResult
from .linear_parallel import bidirectional_form, parallel_form
from .linear_recurrent import recurrent_form
from .registry import randn, register_op, uniform


class LinearAttentionState(NamedTuple):
    """The recurrent state of `linear_attention`, one row per sequence.

    N = B, or the number of sequences in `cu_seqlens`. All tensors are fp32 (fp64 for fp64 inputs). It
    round-trips between the forms and between calls.

    Attributes:
        kv: `[N, H, K_phi, V]`, sum_j decay * psi(k_j) v_j^T.
        z: `[N, H, K_phi]`, sum_j decay * psi(k_j), the normaliser's state.
        log_scale: `[N, H, K_phi]`, log-space maps only (else None): kv and z are stored divided by
            exp(log_scale), per feature; -1e30 marks an empty state.
        offset: `[N]` int64, tokens consumed so far (positions continue from here).
    """
    kv: torch.Tensor
    z: torch.Tensor
    log_scale: Optional[torch.Tensor]
    offset: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Validate and prepare once
# ----------------------------------------------------------------------------------------------

@dataclass
class LinearProblem:
    """One validated `linear_attention` call, ready for a backend. Tensors q, k, v are the caller's
    ([B, T, H, *], any float dtype); `log_gate` is the decay as one log-gate in the compute dtype,
    [B, T, H] (scalar per head, also for a constant gamma) or [B, T, H, K_phi] (diagonal), or None."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    fmap: FeatureMap
    causal: bool
    normalize: bool
    log_gate: Optional[torch.Tensor]
    scale: float
    mode: str
    chunk_size: int
    eps: float
    offsets: Optional[List[int]]
    N: int
    Kf: int
    state: Optional[LinearAttentionState]
    offset0: torch.Tensor
    output_final_state: bool
    #: grouped value heads (`prepare_linear_attention`): the caller's v had HV = value_groups * H heads; folded:
    #: they are folded into the value width here (v [B, T, H, n V], `finish` unfolds), else q, k (and a gate
    #: given per q/k head) were repeated to HV heads
    value_groups: int = 1
    folded: bool = False

    @property
    def diagonal_gate(self) -> bool:
        return self.log_gate is not None and self.log_gate.dim() == 4

    @property
    def cpu_kernel(self) -> str:
        """The compiled CPU library: csrc/linear_log.c for the log-space maps, csrc/linear.c for the others."""
        return "linear_log" if self.fmap.log_space else "linear"

    def cpu_unsupported(self) -> Optional[str]:
        """Why the compiled CPU kernels do not cover this call (None when they do): the causal chunk form of the
        linear-space maps with no gate or a scalar one, and the causal chunk and recurrent forms of the log-space
        maps (one token scan, csrc/linear_log.c) with K_phi up to its limit; any float dtype (computed in fp32,
        fp64 for fp64)."""
        if self.q.device.type != "cpu":
            return f"the compiled kernels run on CPU tensors, not {self.q.device.type}"
        log_space = self.fmap.log_space
        if self.mode != "chunk" and not (log_space and self.mode == "recurrent"):
            return f"mode={self.mode!r} has no compiled CPU kernel (chunk has)"
        if not self.causal:
            return "causal=False has no compiled CPU kernel"
        if log_space and self.Kf > CPU_LOG_MAX_FEATURES:
            return (f"the feature map {self.fmap.name} gives K_phi = {self.Kf} log-features for head width "
                    f"{self.q.shape[-1]}; the compiled log-space kernel takes at most {CPU_LOG_MAX_FEATURES}")
        if log_space and self.state is not None and self.state.log_scale is not None \
                and self.state.log_scale.requires_grad:
            return "an initial log_scale that requires grad has no compiled CPU kernel (kv and z may)"
        if self.diagonal_gate:
            return "diagonal gates g [B, T, H, K] (GLA) have no compiled CPU kernel"
        if self.chunk_size > CPU_MAX_CHUNK:
            return f"chunk_size > {CPU_MAX_CHUNK} has no compiled CPU kernel"
        return None

    def triton_unsupported(self) -> Optional[str]:
        """Why the Triton kernels do not cover this call (None when they do)."""
        if self.q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"the kernels take fp16 / bf16 / fp32 inputs, not {self.q.dtype}"
        if self.mode not in ("chunk", "recurrent"):
            return f"mode={self.mode!r} has no Triton kernel (chunk and recurrent do)"
        if not self.causal:
            return "causal=False has no Triton kernel"
        if self.fmap.log_space:
            return f"log-space feature maps ({self.fmap.name}) have no Triton kernel"
        if self.diagonal_gate and self.mode != "recurrent":  # the decoding kernel takes them
            return "diagonal gates g [B, T, H, K] (GLA) have no Triton chunk kernel"
        if self.mode == "recurrent" and requires_grad(self.q, self.k, self.v, self.log_gate, *self._state_tensors()):
            return "the fused recurrent kernel is forward-only (decoding) and an input requires grad"
        return None

    def fla_unsupported(self) -> Optional[str]:
        """Why fla's kernels do not cover this call (None when they do; the device and fla-core itself are checked
        by the dispatch): the causal chunk and recurrent forms of the linear-space maps, any gate, fp16 / bf16 /
        fp32."""
        if self.q.dtype not in fla.DTYPES:
            return f"fla's kernels take fp16 / bf16 / fp32 inputs, not {self.q.dtype}"
        if self.mode not in ("chunk", "recurrent"):
            return f"mode={self.mode!r} has no fla kernel (chunk and recurrent do)"
        if not self.causal:
            return "causal=False has no fla kernel"
        if self.fmap.log_space:
            return f"log-space feature maps ({self.fmap.name}) carry a log-scale state that fla's kernels do not"
        if (self.mode == "chunk" and self.log_gate is not None and self.log_gate.dim() == 3
                and self.constant_log_gate() is None   # (chunk_simple_gla with g: fla.GATED_BACKWARD_KERNELS)
                and requires_grad(self.q, self.k, self.v, self.log_gate, *self._state_tensors())):
            return fla.gated_backward_refused()
        return None

    def constant_log_gate(self) -> Optional[torch.Tensor]:
        """The log-gate as one value per head [H] when it is the same at every batch row and token (a constant
        gamma: expanded, stride 0) and needs no gradient (fla's g_gamma has none), else None."""
        lg = self.log_gate
        if lg is None or lg.dim() != 3 or lg.stride()[:2] != (0, 0) or requires_grad(lg):
            return None
        return lg[0, 0]

    def positions(self) -> torch.Tensor:
        """Absolute token positions [B or 1, T] (positional maps; a carried state continues them)."""
        T, dev = self.q.shape[1], self.q.device
        if self.offsets is None:
            return self.offset0.view(self.N, 1) + torch.arange(T, device=dev)
        return torch.cat([self.offset0[i] + torch.arange(b - a, device=dev)
                          for i, (a, b) in enumerate(zip(self.offsets[:-1], self.offsets[1:]))]).view(1, T)

    def features(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """phi(scale q) and psi(k) in `dtype`, [B, T, H, K_phi] (shared by both backends)."""
        q_c, k_c = self.q.to(dtype), self.k.to(dtype)
        if self.scale != 1.0:
            q_c = q_c * self.scale
        pos = self.positions() if self.fmap.positional else None
        fq, fk = self.fmap.phi(q_c, pos), self.fmap.psi(k_c, pos)
        B, T, H = self.q.shape[:3]
        if fq.shape != (B, T, H, self.Kf) or fk.shape != (B, T, H, self.Kf):
            raise LinattnError(f"feature map {self.fmap!r} must map [B, T, H, K] to [B, T, H, K_phi] for both "
                               f"phi and psi (K_phi = {self.Kf}); got {tuple(fq.shape)} and {tuple(fk.shape)}")
        return fq, fk

    def _state_tensors(self):
        return () if self.state is None else (self.state.kv, self.state.z)

    def chunk_size_used(self, backend: str) -> int:
        """The chunk length a backend really uses for this call (recurrent: 1, parallel: T)."""
        if self.mode == "recurrent":
            return 1
        if self.mode == "parallel" or not self.causal:
            return self.q.shape[1]
        if backend == "triton":
            return triton_chunk_size(self.chunk_size)
        if backend == "fla":  # fla's default chunk (its result does not depend on it)
            return FLA_CHUNK
        if self.fmap.log_space or self.diagonal_gate:
            return min(self.chunk_size, LOG_BLOCK)
        return self.chunk_size


def _gate_to_log(gamma, g, B, T, H, Kf, dtype, device) -> Optional[torch.Tensor]:
    """gamma (float or [H]) or g ([B, T, H] / [B, T, H, Kf]) -> one log-gate [B, T, H(, Kf)], or None."""
    if gamma is not None:
        if isinstance(gamma, torch.Tensor):
            if gamma.dim() != 1 or gamma.shape[0] != H:
                raise LinattnError(f"gamma must be a float or a per-head tensor of shape [H] = [{H}], "
                                   f"got shape {tuple(gamma.shape)}")
            gam = gamma.to(device=device, dtype=dtype)
            if check_values(gam) and not bool(((gam > 0) & (gam <= 1)).all()):
                raise LinattnError(f"gamma is a decay and must lie in (0, 1], got {gam.tolist()}")
        elif isinstance(gamma, (int, float)) and not isinstance(gamma, bool):
            if not 0 < gamma <= 1:
                raise LinattnError(f"gamma is a decay and must lie in (0, 1], got {gamma}")
            gam = torch.full((H,), float(gamma), dtype=dtype, device=device)
        else:
            raise LinattnTypeError(f"gamma must be a float or a tensor of shape [H], got {type(gamma).__name__}")
        return torch.log(gam).view(1, 1, H).expand(B, T, H)
    if g is not None:
        check_log_gate(g, "g", B, T, H, Kf, allow_diagonal=True)
        if check_values(g) and not bool(torch.isfinite(g).all()):
            raise LinattnError("g must be finite (a log-gate of -inf would erase the state; use a large "
                               "negative value), as in delta_rule")
        # per-token log-gates below -LOG_GATE_FLOOR give exp() = 0 in every dtype either way; the floor keeps a
        # cumulative sum of gates near the dtype's lowest value from reaching -inf (then -inf - -inf = NaN)
        return g.to(device=device, dtype=dtype).clamp_min(-LOG_GATE_FLOOR)
    return None


def _check_state(state, N, H, Kf, V, log_space, device) -> None:
    if not isinstance(state, LinearAttentionState):
        raise LinattnTypeError(f"initial_state must be a linattn.LinearAttentionState (as returned with "
                               f"output_final_state=True), got {type(state).__name__}")
    if tuple(state.kv.shape) != (N, H, Kf, V):
        raise LinattnError(f"initial_state.kv must have shape [N, H, K_phi, V] = {(N, H, Kf, V)}, "
                           f"got {tuple(state.kv.shape)}")
    if tuple(state.z.shape) != (N, H, Kf):
        raise LinattnError(f"initial_state.z must have shape [N, H, K_phi] = {(N, H, Kf)}, "
                           f"got {tuple(state.z.shape)}")
    if log_space != (state.log_scale is not None):
        raise LinattnError("initial_state.log_scale must be a [N, H, K_phi] tensor for log-space feature maps "
                           "(hadamard_exp, favor+) and None for the others")
    if log_space and tuple(state.log_scale.shape) != (N, H, Kf):
        raise LinattnError(f"initial_state.log_scale must have shape [N, H, K_phi] = {(N, H, Kf)}, "
                           f"got {tuple(state.log_scale.shape)}")
    if tuple(state.offset.shape) != (N,):
        raise LinattnError(f"initial_state.offset must have shape [N] = [{N}], got {tuple(state.offset.shape)}")
    for name in ("kv", "z", "log_scale", "offset"):
        t = getattr(state, name)
        if t is not None and t.device != device:
            raise LinattnError(f"initial_state.{name} must be on the device of q ({device}), got {t.device}")


_FEATURE_DIMS: Dict[Tuple[type, str, int], int] = {}  # K_phi of the maps built from a registered name


def _feature_dim(fmap: FeatureMap, K: int, asked) -> int:
    """fmap.feature_dim(K), which evaluates phi on a zero row unless the map knows it: once per (class, name, K)
    for a map built from its registered name (the same map at every call), every time for a map passed in."""
    if not isinstance(asked, str):
        return fmap.feature_dim(K)
    key = (type(fmap), asked, K)
    Kf = _FEATURE_DIMS.get(key)
    if Kf is None:
        Kf = _FEATURE_DIMS[key] = fmap.feature_dim(K)
    return Kf


def prepare_linear_attention(q, k, v, *, feature_map="elu+1", causal=True, normalize=True, gamma=None, g=None,
                             scale=None, mode="chunk", chunk_size=64, initial_state=None,
                             output_final_state=False, cu_seqlens=None, eps=1e-6) -> LinearProblem:
    """Every check of `linear_attention`, once; returns the prepared call (see `LinearProblem`).

    The arguments are `linear_attention`'s (see there); the prepared problem is run with
    `linattn.ops.linear.run_linear_attention(problem, backend)`, and its `chunk_size_used(backend)` says which
    chunk a backend uses.

    Args:
        q: Queries `[B, T, H, K]`.
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]` (or `[B, T, HV, V]`).
        feature_map: A registered name, a `FeatureMap`, or None.
        causal: Attend to earlier keys only.
        normalize: Divide by the kernel's row sum.
        gamma: RetNet's constant decay.
        g: A log-gate `[B, T, H]` or `[B, T, H, K_phi]`.
        scale: The query scale (None: 1).
        mode: "chunk", "recurrent" or "parallel".
        chunk_size: The chunk length of the chunk form.
        initial_state: A `LinearAttentionState`, or None.
        output_final_state: Return the final state when the problem is run.
        cu_seqlens: int64 `[N+1]` offsets of packed sequences (B == 1).
        eps: The floor on |den|.

    Returns:
        The prepared call, a `LinearProblem`.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> from linattn import linear_attention, prepare_linear_attention
        >>> from linattn.ops.linear import run_linear_attention
        >>> q, k, v = torch.randn(3, 1, 10, 2, 8).unbind(0)
        >>> p = prepare_linear_attention(q, k, v, feature_map="relu")
        >>> o, _ = run_linear_attention(p, "torch")
        >>> torch.allclose(o, linear_attention(q, k, v, feature_map="relu")[0], atol=1e-6)
        True
    """
    n = value_groups(q, v)
    folded = False
    if n > 1:
        # grouped value heads: a gate shared by the n value heads of a q/k head (none, g [B, T, H(, K_phi)],
        # a float or [H] gamma) leaves one weight matrix per q/k head, so the n value heads are folded into the
        # value width (no copy of q or k; the normaliser is per q/k head anyway). A gate per value head, or a
        # carried state (whose z, log_scale are kept per value head), repeats q and k to HV heads instead.
        H = q.shape[2]
        shared = ((g is None or (isinstance(g, torch.Tensor) and g.dim() >= 3 and g.shape[2] == H))
                  and (not isinstance(gamma, torch.Tensor) or tuple(gamma.shape) == (H,)))
        if shared and initial_state is None:
            v, folded = v.reshape(*v.shape[:2], H, n * v.shape[3]), True
        else:
            q, k = q.repeat_interleave(n, dim=2), k.repeat_interleave(n, dim=2)
            if isinstance(g, torch.Tensor) and g.dim() >= 3 and g.shape[2] == H:
                g = g.repeat_interleave(n, dim=2)
            if isinstance(gamma, torch.Tensor) and tuple(gamma.shape) == (H,):
                gamma = gamma.repeat_interleave(n)
    B, T, H, K, V = check_qkv(q, k, v)
    if V == 0:
        raise LinattnError(f"v must have shape [B, T, H, V] with V >= 1, got {tuple(v.shape)}")
    check_mode(mode, chunk_size)
    fmap = get_feature_map(feature_map, K)
    if not causal:
        if gamma is not None or g is not None:
            raise LinattnError("forget gates (gamma, g) need causal=True: a decay is defined along the causal order")
        if mode == "recurrent":
            raise LinattnError("mode='recurrent' needs causal=True; use 'chunk' or 'parallel' for "
                               "bidirectional attention")
    if gamma is not None and g is not None:
        raise LinattnError("pass either gamma (constant decay) or g (data-dependent log-gate), not both")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise LinattnError(f"eps must be a non-negative float, got {eps!r}")
    scale = check_scale(scale, 1.0)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N = B if offsets is None else len(offsets) - 1
    Kf = _feature_dim(fmap, K, feature_map)
    log_gate = _gate_to_log(gamma, g, B, T, H, Kf, compute_dtype(q.dtype), q.device)
    if initial_state is not None:
        _check_state(initial_state, N, H, Kf, V, fmap.log_space, q.device)
        offset0 = initial_state.offset.to(torch.int64)
    else:
        offset0 = torch.zeros(N, dtype=torch.int64, device=q.device)
    return LinearProblem(q, k, v, fmap, bool(causal), bool(normalize), log_gate, scale, mode, chunk_size,
                         float(eps), offsets, N, Kf, initial_state, offset0, bool(output_final_state), n, folded)


# ----------------------------------------------------------------------------------------------
# The PyTorch backend: the forms (one per module, see linear_common.py) and their dispatch
# ----------------------------------------------------------------------------------------------

def _run_form(p: LinearProblem, fq, fk, vt, glog, S, mu) -> FormResult:
    """One sequence (or a batch of equal-length ones) in the forms' [B, H, T, D] layout (`linear_common.py`):
    picks the form from the mode, causality, the map and the gate."""
    log_space = p.fmap.log_space
    if p.causal and p.mode == "chunk" and not p.diagonal_gate:
        if not log_space:
            return chunk_matmul_form(fq, fk, vt, glog, S, p.chunk_size)
        if not fk.is_cuda and not torch.compiler.is_compiling():  # as before: a CPU, eager-mode path
            shifted = log_chunk_matmul_form(fq, fk, vt, glog, S, mu, p.chunk_size)
            if shifted is not None:
                return shifted
    if p.mode == "parallel":
        return parallel_form(fq, fk, vt, glog, S, mu, p.causal, log_space, p.output_final_state)
    if not p.causal:
        return bidirectional_form(fq, fk, vt, S, mu)
    if p.mode == "recurrent":
        return recurrent_form(fq, fk, vt, glog, S, mu)
    return chunk_log_form(fq, fk, vt, glog, S, mu, min(p.chunk_size, LOG_BLOCK), log_space)


def _fast_chunk(p: LinearProblem) -> bool:
    """Whether the call takes the fast chunk form (ops/linear_chunk.py): causal, chunk mode, linear-space
    features, no gate, eager mode (under torch.compile the autograd form traces into one graph)."""
    return (p.causal and p.mode == "chunk" and p.log_gate is None and not p.fmap.log_space
            and not torch.compiler.is_compiling())


def _run_fast_chunk(p: LinearProblem, cdt) -> FormResult:
    """`_run_torch` on the fast chunk form; the maps with an in-kernel form are applied inside it."""
    V = p.v.shape[-1]
    fused = p.fmap.fused_kernel if (p.fmap.fused_kernel in FUSED and not p.fmap.positional) else None
    if fused is not None:
        xq, xk = p.q.to(cdt), p.k.to(cdt)
        if p.scale != 1.0:
            xq = xq * p.scale
    else:
        xq, xk = p.features(cdt)
    v = p.v.to(cdt)
    H = p.q.shape[2]
    if p.state is not None:
        S0 = torch.cat([p.state.kv, p.state.z.unsqueeze(-1)], dim=-1).to(cdt)
    else:
        S0 = torch.zeros(p.N, H, p.Kf, V + 1, dtype=cdt, device=p.q.device)
    if p.offsets is None:
        return linear_chunk(xq, xk, v, S0, p.chunk_size, fused)
    return _varlen(p, lambda i, s: linear_chunk(xq[:, s], xk[:, s], v[:, s], S0[i:i + 1], p.chunk_size, fused))


def _varlen(p: LinearProblem, one: Callable[[int, slice], FormResult]) -> FormResult:
    """`one(i, tokens)` on each packed sequence (`run_varlen`), joined into one result: num, den, c along T,
    the states stacked (kept only when asked for)."""
    def parts(i: int, tokens: slice):
        r = one(i, tokens)
        return (r.num, r.den, r.c), (r.S, r.mu)

    (num, den, c), (S, mu) = run_varlen(p.offsets, parts, dim=2)
    return FormResult(num, den, c, S, mu) if p.output_final_state else FormResult(num, den, c, None, None)


def _run_torch(p: LinearProblem) -> FormResult:
    """The PyTorch forms on a prepared call, in the forms' layout (`linear_common.py`)."""
    cdt = compute_dtype(p.q.dtype)
    V = p.v.shape[-1]
    if _fast_chunk(p):
        return _run_fast_chunk(p, cdt)
    fq, fk = p.features(cdt)
    fq, fk, vt = fq.transpose(1, 2), fk.transpose(1, 2), p.v.to(cdt).transpose(1, 2)
    glog = None
    if p.log_gate is not None:  # [B, T, H(, Kf)] -> [B, H, T, 1 or Kf]
        glog = p.log_gate.unsqueeze(-1) if p.log_gate.dim() == 3 else p.log_gate
        glog = glog.transpose(1, 2)
    if p.state is not None:
        S0 = torch.cat([p.state.kv, p.state.z.unsqueeze(-1)], dim=-1).to(cdt)
        mu0 = p.state.log_scale.to(cdt) if p.fmap.log_space else None
    else:
        S0 = torch.zeros(p.N, fq.shape[1], p.Kf, V + 1, dtype=cdt, device=fq.device)
        mu0 = torch.full((p.N, fq.shape[1], p.Kf), NEG, dtype=cdt, device=fq.device) if p.fmap.log_space else None
    if p.offsets is None:
        return _run_form(p, fq, fk, vt, glog, S0, mu0)
    return _varlen(p, lambda i, s: _run_form(p, fq[:, :, s], fk[:, :, s], vt[:, :, s],
                                             glog[:, :, s] if glog is not None else None,
                                             S0[i:i + 1], mu0[i:i + 1] if mu0 is not None else None))


def _divide_finite_part(num, den, finite: Optional[bool] = None):
    """num / den, whose backward stays finite where num is inf or NaN but its gradient is 0 (rows after
    a non-finite token that the loss does not use): autograd's d/d den = -grad * num / den^2 would be
    0 * NaN there and would carry NaN into every earlier key through den. The same values as num / den.
    finite: whether num is finite when the caller knows it (the compiled kernel's flag), else one reduction
    tells (CPU tensors in eager mode)."""
    if finite is None:
        finite = reads_values(num) and bool(torch.isfinite(num.sum()))
    if finite:
        return num / den
    safe = torch.nan_to_num(num, nan=0.0, posinf=0.0, neginf=0.0)
    return safe / den + (num - safe)


def _den_floor(den, eps: float):
    """den floored to |den| >= eps keeping its sign (relu features, magnitude_direction's signed weights)."""
    floor = torch.as_tensor(eps, dtype=den.dtype, device=den.device)
    return torch.where(den < 0, torch.minimum(den, -floor), torch.maximum(den, floor))


class _FlooredDivide(torch.autograd.Function):
    """o = num / floor(den) with a lean backward for finite num (the compiled CPU path's outputs under autograd):
    d num = do / den', d den = -(do . o) / den' where |den| > eps (the floor's own slope), 3 passes over the
    output instead of autograd's ~7 for num / den'. The same forward bits as `finish`'s division."""

    @staticmethod
    def forward(ctx, num, den, eps):
        d = _den_floor(den, eps).unsqueeze(-1)
        out = num / d
        ctx.save_for_backward(out, d, (den > eps) | (den < -eps))
        return out

    @staticmethod
    def backward(ctx, do):
        out, d, mask = ctx.saved_tensors
        dnum = do / d
        dden = (dnum * out).sum(-1).neg_().masked_fill_(~mask, 0)
        return dnum, dden, None


def finish(p: LinearProblem, num, den, c, kv, z, mu, divided: bool = False,
           lean_grad: bool = False, finite: Optional[bool] = None
           ) -> Tuple[torch.Tensor, Optional[LinearAttentionState]]:
    """Outputs [B, T, H, V] in the input dtype from num [B, T, H, V] and den [B, T, H] (both taken
    relative to the row log-scale c [B, T, H] for log-space maps), and the final state. divided: num is already
    the normalised output (the compiled CPU kernel's lin_divide does this division, bit for bit). lean_grad:
    divide finite num through `_FlooredDivide` (the compiled path; the PyTorch forms keep autograd's division).
    finite: whether every value of num is finite, when the caller knows it (the compiled kernel's flag, read in
    place of a reduction over num); None: a reduction tells where one is free (CPU tensors in eager mode)."""
    if p.normalize and divided:
        out = num
    elif p.normalize:
        if c is not None:
            # log-space maps: den is the stabilised denominator (>= 1 for their positive kernels), so eps
            # acts on it and the output is invariant to a shift of the queries
            den = den.clamp_min(p.eps)
        else:  # a floor on |den| that keeps its sign (relu features, magnitude_direction's signed weights)
            if finite is None and lean_grad:
                finite = reads_values(num) and bool(torch.isfinite(num.detach().sum()))
            if lean_grad and finite:
                out = _FlooredDivide.apply(num, den, p.eps)
                den = None
            else:
                den = _den_floor(den, p.eps)
        if den is not None:
            out = _divide_finite_part(num, den.unsqueeze(-1), finite)
    else:
        # exp(c) alone may overflow fp32 where the product does not: rescale in fp64
        out = num if c is None else (num.double() * torch.exp(c.double()).unsqueeze(-1)).to(num.dtype)
    state = None
    if p.output_final_state:
        T = p.q.shape[1]
        seq_lens = (torch.tensor([b - a for a, b in zip(p.offsets[:-1], p.offsets[1:])], device=p.q.device)
                    if p.offsets is not None else T)
        state = LinearAttentionState(kv=kv, z=z, log_scale=mu, offset=p.offset0 + seq_lens)
    if p.folded:  # back to the caller's HV = n H value heads (`prepare_linear_attention`)
        n = p.value_groups
        out = out.reshape(*out.shape[:2], out.shape[2] * n, out.shape[3] // n)
        if state is not None:
            N, H, Kf, nV = state.kv.shape
            kv = state.kv.reshape(N, H, Kf, n, nV // n).transpose(2, 3).reshape(N, H * n, Kf, nV // n)
            state = state._replace(kv=kv, z=state.z.repeat_interleave(n, dim=1),
                                   log_scale=None if mu is None else mu.repeat_interleave(n, dim=1))
    return out.to(p.q.dtype), state


def run_linear_attention(p: LinearProblem, backend: str = "auto"):
    """Run a prepared call on `backend` ("auto", "torch", "triton", "cpu" or "fla")."""
    return _run_linear_attention(p, backend)[0]


def _run_linear_attention(p: LinearProblem, backend: str, check: Optional[Callable] = None):
    """`run_linear_attention`, and whether every value of the output is known finite without a pass over it (the
    compiled CPU kernel's flag, when the output is its own, not converted to another dtype nor divided here).
    check (`linear_attention`'s): applied to (result, finite), both inside `_cpu_torch_scope`; it returns the
    result. The backend is chosen once, here."""
    chosen = select_backend(backend, p)
    if check is None:
        return _run_chosen(p, chosen)
    with _cpu_torch_scope(p, chosen):
        result, finite = _run_chosen(p, chosen)
        return check(result, finite), finite


def _run_chosen(p: LinearProblem, chosen: str):
    """`_run_linear_attention` on the backend chosen for it."""
    if chosen == "cpu" and p.fmap.log_space:  # num and den come relative to the row log-scale c
        num, den, c, kv, z, mu = cpu_linear_log_attention(p)
        return finish(p, num, den, c, kv, z, mu), False
    if chosen == "cpu":  # the kernel divides by the normaliser itself (one pass less), flagging inf / NaN
        num, den, kv, z, divided, finite = cpu_linear_attention(p, eps=p.eps if p.normalize else None)
        out = finish(p, num, den, None, kv, z, None, divided=divided, lean_grad=True, finite=finite)
        known = (divided or not p.normalize) and out[0].dtype == num.dtype
        return out, finite if known else False   # (the flag itself is read only by a value check)
    if chosen in ("triton", "fla"):
        num, den, kv, z = (triton_linear_attention if chosen == "triton" else fla_linear_attention)(p)
        return finish(p, num, den, None, kv, z, None), False
    # the forms compute in the prepared compute dtype (fp32 for half inputs): autocast must not take their
    # products back to bf16/fp16 (nor meet the fast form's in-place products)
    with torch.autocast(p.q.device.type, enabled=False):
        num, den, c, S, mu = _run_torch(p)
        V = p.v.shape[-1]
        kv, z = (S[..., :V], S[..., V]) if S is not None else (None, None)
        num, den = num.transpose(1, 2), den.transpose(1, 2)  # [B, H, T, *] -> [B, T, H, *]
        return finish(p, num, den, c.transpose(1, 2) if c is not None else None, kv, z, mu), False


def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    feature_map: Union[str, FeatureMap, None] = "elu+1",
    causal: bool = True,
    normalize: bool = True,
    gamma: Union[float, torch.Tensor, None] = None,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: Optional[LinearAttentionState] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[LinearAttentionState]]:
    """Kernelized linear attention, optionally gated (RetNet, Mamba2 / simple GLA, GLA), causal or not.

    Weights w_ij = k(scale * q_i, k_j) = phi(scale * q_i) . psi(k_j), times the decay
    prod_{t=j+1..i} exp(g_t) when a gate is given (RetNet: constant `gamma` in (0, 1], a float
    or per-head `[H]`; Mamba2 / simple GLA: `g` `[B, T, H]`; GLA: `g` `[B, T, H, K_phi]`, a
    log-gate <= 0 per feature). Gates are causal only; the normaliser decays with the numerator.

    normalize=True: o_i = sum_j w_ij v_j / den_i with den_i = sum_j w_ij; eps is a floor on |den|
    (sign kept): outputs are the exact ratio whenever |den| >= eps and stay finite when it
    vanishes (relu features before any active key, or magnitude_direction's negative weights).
    For log-space maps (hadamard_exp, favor+) eps floors the stabilised denominator, which is >= 1,
    so the output is the exact ratio and does not change when a constant is added to the queries.
    normalize=False: the plain sum (it overflows only when the true value exceeds the dtype).

    Grouped value heads (Mamba2's groups, GVA): v `[B, T, HV, V]` with HV = n * H; value head j reads q/k head
    j // n (transformers' repeat_interleave). A gate may be per q/k head (g `[B, T, H(, K_phi)]`, gamma a float
    or `[H]`: shared by the group) or per value head (`[B, T, HV(, K_phi)]`, `[HV]`). The state is per value head,
    kv `[N, HV, K_phi, V]`, z and log_scale `[N, HV, K_phi]`. With a shared gate and no initial state the n value
    heads are folded into the value width (q, k are not copied); otherwise q and k are repeated to HV heads.

    Inputs of any float dtype; accumulation in fp32 (fp64 for fp64 inputs); output in the input dtype.

    Args:
        q: Queries `[B, T, H, K]`, any float dtype (fp16, bf16, fp32, fp64).
        k: Keys `[B, T, H, K]`, the dtype of q.
        v: Values `[B, T, H, V]` (or `[B, T, HV, V]`, grouped value heads).
        feature_map: The kernel's phi/psi pair: a name in `FEATURE_MAP_NAMES` (e.g. "elu+1", "relu",
            "hadamard_exp", "favor+"), a `FeatureMap` instance, or None (identity).
        causal: Attend to earlier keys only (j <= i). Gates and mode="recurrent" need causal=True.
        normalize: Divide by the kernel's row sum (above); False: the plain weighted sum.
        gamma: RetNet's constant decay in (0, 1]: a float, or per head `[H]` (or `[HV]`).
        g: A log-gate (<= 0): `[B, T, H]` per head (Mamba2 / simple GLA) or `[B, T, H, K_phi]` per feature
            (GLA); or None.
        scale: The query scale; None means 1 (the kernel of the raw queries; pass K**-0.5 for softmax-like
            temperature).
        mode: The form: "chunk" (training), "recurrent" (decoding; causal only), "parallel" (quadratic
            reference). They compute the same function (to rounding).
        chunk_size: The chunk length of the chunk form, in tokens (see `chunk_size_used`).
        initial_state: A `LinearAttentionState` to start from (a previous call's, from any mode), or None.
        output_final_state: Also return the state after the last token.
        cu_seqlens: int64 `[N+1]` offsets of N packed independent sequences (B == 1); the state then has N rows.
        eps: The floor on |den| (above).
        backend: "auto" (for CUDA tensors fla's kernels when fla-core is installed and covers the call, else
            linattn's Triton kernels when they do; the compiled CPU kernels for CPU tensors when they build and
            cover it; PyTorch otherwise), "torch", "fla" (CUDA; see docs/backends.md), "triton" (on CPU only
            under TRITON_INTERPRET=1; see docs/triton.md) or "cpu" (see docs/cpu_kernels.md).
            `linattn.explain` says which a call takes and why.

    Returns:
        o: The output `[B, T, H, V]` (or `[B, T, HV, V]`), in the input dtype.
        final_state: With output_final_state, the `LinearAttentionState` after the last token (fp32, fp64 for
            fp64 inputs; N rows), which round-trips between modes and calls; otherwise None.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it), or finite inputs
            whose kernel values or sums exceed the dtype.

    Examples:
        >>> import torch
        >>> from linattn import linear_attention
        >>> B, T, H, K, V = 2, 10, 4, 16, 32
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> o, state = linear_attention(q, k, v, feature_map="elu+1", output_final_state=True)
        >>> o.shape, state.kv.shape, state.z.shape
        (torch.Size([2, 10, 4, 32]), torch.Size([2, 4, 16, 32]), torch.Size([2, 4, 16]))

        The forms agree, and a state carries a sequence across calls:

        >>> o_rec, _ = linear_attention(q, k, v, mode="recurrent")
        >>> torch.allclose(o, o_rec, atol=1e-5)
        True
        >>> o1, s1 = linear_attention(q[:, :4], k[:, :4], v[:, :4], output_final_state=True)
        >>> o2, _ = linear_attention(q[:, 4:], k[:, 4:], v[:, 4:], initial_state=s1)
        >>> torch.allclose(torch.cat([o1, o2], 1), o, atol=1e-5)
        True

        RetNet's decay, and GLA's per-feature gate:

        >>> o, _ = linear_attention(q, k, v, feature_map="identity", normalize=False, gamma=0.9, scale=K ** -0.5)
        >>> o, _ = linear_attention(q, k, v, g=-torch.rand(B, T, H, K))
    """
    p = prepare_linear_attention(q, k, v, feature_map=feature_map, causal=causal, normalize=normalize, gamma=gamma,
                                 g=g, scale=scale, mode=mode, chunk_size=chunk_size, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens, eps=eps)
    # finite inputs whose kernel values or sums exceed the dtype: a clear error, not NaN (an output that the
    # compiled kernel found finite while writing it needs no pass over it)
    def check(result, finite):
        o = result[0] if isinstance(result, tuple) else result
        if not check_values(o) or finite:   # (`finite`, the kernel's flag, read only where values are checked)
            return result
        return check_finite_output(result, "linear_attention", q=q, k=k, v=v)

    return _run_linear_attention(p, backend, check)[0]


def _cpu_torch_scope(p: LinearProblem, chosen: str):
    """`cpu.torch_on_one_thread` for a call that the compiled kernels take (`chosen`, the backend selected) with the
    map inside them (the torch operators around them are then the layout and, where the kernel's flag does not
    settle it, one finiteness pass), else nothing."""
    if chosen != "cpu" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    from ..cpu import torch_on_one_thread
    from ..cpu.linear import FMAPS

    fmap = p.fmap
    if fmap.fused_kernel is not None and fmap.fused_kernel in FMAPS and not fmap.positional and not fmap.log_space:
        return torch_on_one_thread()
    return contextlib.nullcontext()


def _prepare(q, k, v, *, backend: str = "auto", **kwargs):
    return prepare_linear_attention(q, k, v, **kwargs)


def _example(gen, B, T, H, K, V, dtype):
    """elu+1 features, a scalar decay, no q scaling (the registry's conformance tests; every registered feature
    map gets its own tests there too)."""
    q, k = 0.5 * randn(gen, (B, T, H, K), dtype), 0.5 * randn(gen, (B, T, H, K), dtype)
    v = randn(gen, (B, T, H, V), dtype)
    return (q, k, v), {"feature_map": "elu+1", "g": uniform(gen, (B, T, H), dtype, -0.3, 0.0), "scale": 1.0}


def _reference(q, k, v, *, feature_map, g=None, scale=1.0):
    from .reference import linear_attention_ref
    return linear_attention_ref(q, k, v, feature_map, log_gate=g, scale=scale)


register_op("linear_attention", linear_attention, prepare=_prepare, backends=True,
            forms=("parallel", "chunk", "recurrent"), example=_example, reference=_reference, state=True,
            description="kernelized linear attention with any registered feature map and gate")
