"""The delta family's scan on compiled CPU kernels (`csrc/delta.c`), as torch custom ops.

    S_t = D_t S_{t-1} - a_t k_t ((D_t S_{t-1})^T k_t)^T + a_t k_t v_t^T,      o_t = S_t^T q_t

the general scan of `ops/delta_core.py` with the delta rule's own read (r = None) and D_t = exp(g_t): no gate,
one log-gate per head (g [TT, H]) or one per key channel (g [TT, H, K]). DeltaNet, Gated DeltaNet, EFLA
(which only changes a, computed before the kernel) and Kimi Delta Attention all run on it. The inputs are the
prepared ones (q scaled, k, v, a rescaled by the key norm; without a gradient the forward can take the raw ones and
prepare each row itself: `delta_scan`'s prep), flat over tokens: [TT, H, D] with the sequence
boundaries `starts` (B equal sequences, or cu_seqlens); states [N, H, K, V]; float32 or float64.

The kernel scans token by token with the state in cache (csrc/delta.c says why this beats the chunk form on
a CPU). The forward stores the state every CHECKPOINT tokens when a gradient is needed; the backward, also
compiled, recomputes each stretch from its checkpoint and runs the reverse recurrence. Memory: the
checkpoints, TT/CHECKPOINT states per head, and no per-token intermediates.

Ops: `linattn::cpu_delta_fwd` (registered with autograd) and `linattn::cpu_delta_bwd`; `delta_scan` is the
entry point. Nothing here imports linattn.ops.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence, Tuple

import torch

from ..errors import LinattnError
from . import bindings, checkpoint_offsets, ptr, threads, torch_on_one_thread
from .abi import DeltaPlan

__all__ = ["CHECKPOINT", "PREP_L2", "PREP_RAW", "available", "delta_prepare", "delta_prepare_raw",
           "delta_prepare_raw_a", "delta_scan", "floor_log_gate", "l2_rows", "prep_available", "prepare_rows",
           "write_strength"]

CHECKPOINT = 64  # tokens between the states the forward keeps for the backward
#: the forward's own preparation of raw rows (`delta_scan`'s prep; csrc/delta.c PREP_*): delta_prepare's rows
#: (qk_l2norm "rsqrt", a = beta) and delta_prepare_raw_a's (no qk_l2norm, a = beta)
PREP_L2, PREP_RAW = 1, 2


def available() -> bool:
    """True when the kernels are switched on and delta.c builds (compiles it on the first call)."""
    return bindings.bind("delta") is not None


def _gate(g: Optional[torch.Tensor]) -> int:
    return 0 if g is None else (1 if g.dim() == 2 else 2)


def _decays(g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """exp(g) for the kernels (torch's vectorised exp; the kernels read decays, not log-gates)."""
    return torch.exp(g) if g is not None else None


# a thread per GRAIN of tokens x heads x K x V (about a millisecond of one thread's forward scan)
GRAIN = float(1 << 23)


def _plan(q: torch.Tensor, V: int, starts: torch.Tensor, ck_off: torch.Tensor, g: Optional[torch.Tensor],
          prep: Optional[Tuple[int, float, float]] = None) -> DeltaPlan:
    TT, H, K = q.shape
    plan = DeltaPlan(starts.numel() - 1, H, K, V, CHECKPOINT, ptr(starts), ptr(ck_off), _gate(g),
                     threads(float(TT) * H * K * V, GRAIN))
    if prep is not None and prep[0]:
        plan.prep, plan.scale, plan.eps = prep
    return plan


def _forward(q, k, v, a, g, S0, starts, ck_off, n_ckpt, prep=None):
    TT, H, K = q.shape
    V, N = v.shape[-1], starts.numel() - 1
    o = q.new_empty(TT, H, V)
    S = q.new_empty(N, H, K, V)
    ckpt = q.new_empty(n_ckpt, H, K, V)
    dec = _decays(g)  # held here: the kernel reads it through a raw pointer
    plan = _plan(q, V, starts, ck_off, g, prep)
    bindings.require("delta")("linattn_delta_fwd", q.dtype, ctypes.byref(plan), ptr(q), ptr(k), ptr(v), ptr(a),
                              ptr(dec), ptr(S0), ptr(o), ptr(S), ptr(ckpt) if n_ckpt else None)
    return o, S, ckpt


@torch.library.custom_op("linattn::cpu_delta_fwd", mutates_args=(), device_types="cpu")
def delta_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, g: Optional[torch.Tensor],
              S0: Optional[torch.Tensor], starts: torch.Tensor, ck_off: torch.Tensor, n_ckpt: int, prep: int = 0,
              scale: float = 0.0, eps: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (o [TT, H, V], S [N, H, K, V], checkpoints [n_ckpt, H, K, V]; n_ckpt = 0: none kept). prep, scale, eps:
    `delta_scan`'s prep (0: none; else q, k, v, a are the raw rows and beta, prepared by the scan, forward and
    backward)."""
    with torch_on_one_thread():  # the decays (torch.exp) around the kernel, also when the op is called directly
        return _forward(q, k, v, a, g, S0, starts, ck_off, n_ckpt, (prep, scale, eps))


@delta_fwd.register_fake
def _(q, k, v, a, g, S0, starts, ck_off, n_ckpt, prep=0, scale=0.0, eps=0.0):
    TT, H, K = q.shape
    V, N = v.shape[-1], starts.shape[0] - 1
    return q.new_empty(TT, H, V), q.new_empty(N, H, K, V), q.new_empty(n_ckpt, H, K, V)


@torch.library.custom_op("linattn::cpu_delta_bwd", mutates_args=(), device_types="cpu")
def delta_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, g: Optional[torch.Tensor],
              ckpt: torch.Tensor, starts: torch.Tensor, ck_off: torch.Tensor, do: torch.Tensor, dS: torch.Tensor,
              prep: int = 0, scale: float = 0.0, eps: float = 0.0
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv, da, dg (empty without a gate), dS0) from do [TT, H, V] and dS = dL/dS_final; with the
    forward's prep, q, k, v, a are its raw rows and beta, and dq, dk, dv, da their gradients (the scan prepares each
    row again where it reads it: no prepared rows kept between the passes)."""
    with torch_on_one_thread():  # the decays and the copy around the kernel, also when the op is called directly
        return _backward_kernel(q, k, v, a, g, ckpt, starts, ck_off, do, dS, (prep, scale, eps))


def _backward_kernel(q, k, v, a, g, ckpt, starts, ck_off, do, dS, prep=None):
    dq, dk, dv, da = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(a)
    dg = torch.empty_like(g) if g is not None else q.new_empty(0)
    dS0 = dS.clone()  # the kernel turns dL/dS_final into dL/dS0 in place
    dec = _decays(g)  # held here: the kernel reads it through a raw pointer
    plan = _plan(q, v.shape[-1], starts, ck_off, g, prep)
    bindings.require("delta")("linattn_delta_bwd", q.dtype, ctypes.byref(plan), ptr(q), ptr(k), ptr(v), ptr(a),
                              ptr(dec), ptr(ckpt), ptr(do), ptr(dS0), ptr(dq), ptr(dk), ptr(dv), ptr(da),
                              ptr(dg) if g is not None else None)
    return dq, dk, dv, da, dg, dS0


@delta_bwd.register_fake
def _(q, k, v, a, g, ckpt, starts, ck_off, do, dS, prep=0, scale=0.0, eps=0.0):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(a),
            torch.empty_like(g) if g is not None else q.new_empty(0), torch.empty_like(dS))


def _setup(ctx, inputs, output):
    q, k, v, a, g, S0, starts, ck_off, n_ckpt, *prep = inputs
    ctx.has_gate, ctx.has_S0, ctx.prep = g is not None, S0 is not None, prep
    # no zero-filled gradients for outputs the loss does not reach: the checkpoints never are ([n_ckpt, H, K, V], a
    # full pass of writes per call), nor is the final state in training; _backward treats None as zeros
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, a, g, output[2], starts, ck_off)


def _backward(ctx, do, dS, _dckpt):
    q, k, v, a, g, ckpt, starts, ck_off = ctx.saved_tensors
    N, H, K, V = starts.shape[0] - 1, q.shape[1], q.shape[2], v.shape[-1]
    with torch_on_one_thread():  # the layout and zeros around the kernel: cpu.torch_on_one_thread says why
        do = do.contiguous() if do is not None else v.new_zeros(v.shape)
        dS = dS.contiguous() if dS is not None else q.new_zeros(N, H, K, V)
        dq, dk, dv, da, dg, dS0 = delta_bwd(q, k, v, a, g, ckpt, starts, ck_off, do, dS, *ctx.prep)
    return (dq, dk, dv, da, (dg if ctx.has_gate else None), (dS0 if ctx.has_S0 else None), None, None, None,
            *(None for _ in ctx.prep))


delta_fwd.register_autograd(_backward, setup_context=_setup)



def delta_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, g: Optional[torch.Tensor],
               S0: Optional[torch.Tensor], starts: Sequence[int], prep: Optional[Tuple[int, float, float]] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scan on prepared, flat inputs: q, k [TT, H, K], v [TT, H, V], a [TT, H], g None / [TT, H] /
    [TT, H, K], S0 [N, H, K, V] or None, starts [N + 1] -> (o [TT, H, V], S_final [N, H, K, V]).
    Every tensor in one dtype (float32 or float64), on the CPU; differentiable in all of them.

    prep = (PREP_L2 or PREP_RAW, scale, eps): q, k, v are the raw rows and a is beta, prepared as `delta_prepare`
    (eps its L2 epsilon) or `delta_prepare_raw_a` (eps unused) prepare them, with the same bits and the same
    gradients: eagerly by the scan itself as it reads each row, forward and backward (nothing prepared is written
    out nor kept for the backward), under torch.compile by that pass."""
    q, k, v, a = q.contiguous(), k.contiguous(), v.contiguous(), a.contiguous()
    g = g.contiguous() if g is not None else None
    S0 = S0.contiguous() if S0 is not None else None
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, a, g, S0))
    eager = not torch.compiler.is_compiling()
    if prep is not None and prep[0] not in (PREP_L2, PREP_RAW):
        raise LinattnError(f"prep must be (PREP_L2 = {PREP_L2} or PREP_RAW = {PREP_RAW}, scale, eps), got {prep!r}")
    if prep is not None and not eager:
        q, k, v, a = prepare_rows(q, k, v, a, prep)
        prep = None
    starts = list(starts)
    st = torch.tensor(starts, dtype=torch.int64)
    if not need_grad and eager:
        # eager inference (decoding): the kernel directly; the custom op's dispatch would cost more than a
        # one-token step (the op is there for autograd and torch.compile)
        o, S, _ = _forward(q, k, v, a, g, S0, st, st, 0, prep)
        return o, S
    offs, n = checkpoint_offsets(starts, CHECKPOINT)
    o, S, _ = delta_fwd(q, k, v, a, g, S0, st, torch.tensor(offs, dtype=torch.int64), n if need_grad else 0,
                        *(prep if prep is not None else ()))
    return o, S


# ----------------------------------------------------------------------------------------------
# The preprocessing of prepare_delta (qk_l2norm="rsqrt", a = beta) in one pass (csrc/deltaprep.c)
# ----------------------------------------------------------------------------------------------

# a thread per PREP_GRAIN of rows x their width (about a millisecond of one thread's pass)
PREP_GRAIN = float(1 << 20)


def _prep_threads(rows: int, width: int) -> int:
    return threads(float(rows) * width, PREP_GRAIN)


def prep_available(dtype: torch.dtype) -> bool:
    """True for float32 / float64 when the kernels are switched on and deltaprep.c builds, eagerly (the fused
    preprocessing is an autograd Function around a ctypes call: torch.compile traces the PyTorch form)."""
    if dtype not in (torch.float32, torch.float64) or torch.compiler.is_compiling():
        return False
    return bindings.bind("deltaprep") is not None


class _DeltaPrep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, scale, eps):
        K, V = q.shape[-1], v.shape[-1]
        R = beta.numel()
        qo, ko, vo, a = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
        bindings.require("deltaprep")("linattn_dprep_fwd", q.dtype, R, K, V, ptr(q), ptr(k), ptr(v), ptr(beta), scale,
                                      eps, ptr(qo), ptr(ko), ptr(vo), ptr(a), _prep_threads(R, 2 * K + V))
        ctx.save_for_backward(q, k)
        ctx.scale, ctx.eps, ctx.V = scale, eps, V
        ctx.set_materialize_grads(False)
        return qo, ko, vo, a

    @staticmethod
    @torch_on_one_thread()
    def backward(ctx, dqo, dko, dvo, da):
        q, k = ctx.saved_tensors
        K, V = q.shape[-1], ctx.V
        R = q.numel() // K if K else 0
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        dv = q.new_empty(*q.shape[:-1], V)
        dbeta = q.new_empty(q.shape[:-1])
        c = [x.contiguous() if x is not None else None for x in (dqo, dko, dvo, da)]
        bindings.require("deltaprep")("linattn_dprep_bwd", q.dtype, R, K, V, ptr(q), ptr(k), ctx.scale, ctx.eps,
                                      *(ptr(x) for x in c), ptr(dq), ptr(dk), ptr(dv), ptr(dbeta),
                                      _prep_threads(R, 2 * K + V))
        return dq, dk, dv, dbeta, None, None


def delta_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float,
                  eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """prepare_delta's preprocessing with qk_l2norm="rsqrt" and a = beta, on q, k [B, T, H, K], v [B, T, H, V],
    beta [B, T, H] (one dtype, float32 or float64, CPU) -> (scale l2(q), l2(k) / d, v / d, beta d^2), d =
    max(|l2(k)|, 1), differentiable in q, k, v, beta (d held constant, as there). csrc/deltaprep.c has the formulas."""
    return _DeltaPrep.apply(q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), float(scale),
                            float(eps))


class _DeltaPrepRaw(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        K, V = q.shape[-1], v.shape[-1]
        R = q.numel() // K if K else 0
        qo, ko, vo = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lam = q.new_empty(q.shape[:-1], dtype=torch.float64)
        bindings.require("deltaprep")("linattn_dprep_raw_fwd", q.dtype, R, K, V, ptr(q), ptr(k), ptr(v), scale,
                                      ptr(qo), ptr(ko), ptr(vo), ptr(lam), _prep_threads(R, 2 * K + V))
        ctx.save_for_backward(k)
        ctx.scale, ctx.V = scale, V
        ctx.set_materialize_grads(False)
        return qo, ko, vo, lam

    @staticmethod
    @torch_on_one_thread()
    def backward(ctx, dqo, dko, dvo, dlam):
        (k,) = ctx.saved_tensors
        K, V = k.shape[-1], ctx.V
        R = k.numel() // K if K else 0
        dq, dk = torch.empty_like(k), torch.empty_like(k)
        dv = k.new_empty(*k.shape[:-1], V)
        c = [x.contiguous() if x is not None else None for x in (dqo, dko, dvo)]
        dl = dlam.to(torch.float64).contiguous() if dlam is not None else None
        bindings.require("deltaprep")("linattn_dprep_raw_bwd", k.dtype, R, K, V, ptr(k), ctx.scale,
                                      *(ptr(x) for x in c), ptr(dl), ptr(dq), ptr(dk), ptr(dv),
                                      _prep_threads(R, 2 * K + V))
        return dq, dk, dv, None


def delta_prepare_raw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """prepare_delta's preprocessing without the q/k normalisation (EFLA, whose coefficient reads lam): q, k
    [B, T, H, K], v [B, T, H, V] (float32 or float64, CPU) -> (scale q, k / d, v / d, lam = |k|^2 in float64),
    d = sqrt(max(lam, 1)) held constant; differentiable in q, k, v (and through lam in k)."""
    return _DeltaPrepRaw.apply(q.contiguous(), k.contiguous(), v.contiguous(), float(scale))


class _DeltaPrepRawA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, scale):
        K, V = q.shape[-1], v.shape[-1]
        R = beta.numel()
        qo, ko, vo, a = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
        bindings.require("deltaprep")("linattn_dprep_rawa_fwd", q.dtype, R, K, V, ptr(q), ptr(k), ptr(v), ptr(beta),
                                      scale, ptr(qo), ptr(ko), ptr(vo), ptr(a), _prep_threads(R, 2 * K + V))
        ctx.save_for_backward(k)
        ctx.scale, ctx.V = scale, V
        ctx.set_materialize_grads(False)
        return qo, ko, vo, a

    @staticmethod
    @torch_on_one_thread()
    def backward(ctx, dqo, dko, dvo, da):
        (k,) = ctx.saved_tensors
        K, V = k.shape[-1], ctx.V
        R = k.numel() // K
        dq, dk = torch.empty_like(k), torch.empty_like(k)
        dv, dbeta = k.new_empty(*k.shape[:-1], V), k.new_empty(k.shape[:-1])
        c = [x.contiguous() if x is not None else None for x in (dqo, dko, dvo, da)]
        bindings.require("deltaprep")("linattn_dprep_rawa_bwd", k.dtype, R, K, V, ptr(k), ctx.scale,
                                      *(ptr(x) for x in c), ptr(dq), ptr(dk), ptr(dv), ptr(dbeta),
                                      _prep_threads(R, 2 * K + V))
        return dq, dk, dv, dbeta, None


def delta_prepare_raw_a(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`delta_prepare_raw` and `write_strength` in one pass each way (no qk_l2norm, a = beta: Gated DeltaNet's
    common call): q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H] (one dtype, float32 or float64, CPU) ->
    (scale q, k / d, v / d, a = beta max(|k|^2, 1)), d = sqrt(max(|k|^2, 1)) held constant; the bits of the two
    steps, with no torch operator on [B, T, H] between the pass and the scan. Differentiable in q, k, v, beta; K >= 1.
    """
    return _DeltaPrepRawA.apply(q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), float(scale))


def prepare_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                 prep: Tuple[int, float, float]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows a `prep` = (PREP_L2 or PREP_RAW, scale, eps) describes, prepared by their pass: `delta_prepare`
    (eps its L2 epsilon) or `delta_prepare_raw_a` (eps unused) -> (q, k, v, a), what the fused scan prepares itself."""
    kind, scale, eps = prep
    return (delta_prepare(q, k, v, beta, scale, eps) if kind == PREP_L2
            else delta_prepare_raw_a(q, k, v, beta, scale))


class _L2Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        K = x.shape[-1]
        y = torch.empty_like(x)
        bindings.require("deltaprep")("linattn_l2rows_fwd", x.dtype, x.numel() // K, K, ptr(x), eps, ptr(y),
                                      _prep_threads(x.numel() // K, K))
        ctx.save_for_backward(x)
        ctx.eps = eps
        return y

    @staticmethod
    @torch_on_one_thread()
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        K = x.shape[-1]
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        bindings.require("deltaprep")("linattn_l2rows_bwd", x.dtype, x.numel() // K, K, ptr(x), ctx.eps, ptr(dy),
                                      ptr(dx), _prep_threads(x.numel() // K, K))
        return dx, None


def l2_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(sum x^2 + eps) over the last dimension (ops/l2norm.py's "rsqrt" form, overflow-safe rows
    included) in one pass each way, for a float32 / float64 CPU x with a non-empty last dimension."""
    return _L2Rows.apply(x.contiguous(), float(eps))


# ----------------------------------------------------------------------------------------------
# The small torch steps of a compiled call, their backward on one thread too (cpu.torch_on_one_thread)
# ----------------------------------------------------------------------------------------------

class _FloorLogGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, floor):
        ctx.save_for_backward(g)
        ctx.floor = floor
        return g.clamp_min(-floor)

    @staticmethod
    @torch_on_one_thread()
    def backward(ctx, dy):
        (g,) = ctx.saved_tensors
        return torch.where(g >= -ctx.floor, dy, torch.zeros((), dtype=dy.dtype)), None  # clamp_min's backward


def floor_log_gate(g: torch.Tensor, floor: float) -> torch.Tensor:
    """g.clamp_min(-floor), the same values and gradient (torch's clamp_min backward), its backward on one thread."""
    return _FloorLogGate.apply(g, float(floor))


class _WriteStrength(torch.autograd.Function):
    @staticmethod
    def forward(ctx, beta, lam):
        d2 = lam.clamp_min(1.0)
        ctx.save_for_backward(d2)
        return (beta.to(d2.dtype) * d2).to(beta.dtype)

    @staticmethod
    @torch_on_one_thread()
    def backward(ctx, da):
        (d2,) = ctx.saved_tensors
        return (da.to(d2.dtype) * d2).to(da.dtype), None


def write_strength(beta: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """The rescaled write strength beta max(lam, 1) (lam = |k|^2 held constant, in float64), in beta's dtype: the
    arithmetic of prepare_delta's PyTorch lines, differentiable in beta, its backward on one thread."""
    return _WriteStrength.apply(beta, lam.detach())
