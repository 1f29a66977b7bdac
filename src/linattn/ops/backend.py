"""Backend dispatch: `backend="auto" | "torch" | "triton" | "cpu" | "fla"` on the operators.

* "torch"  - the PyTorch forms (always available; the reference and the fallback).
* "triton" - the Triton kernels (linattn/triton): chunk mode (forward + backward) and recurrent
             mode (forward only, for decoding). CUDA tensors, or CPU tensors under Triton's
             interpreter (TRITON_INTERPRET=1 set before triton is imported: how CI tests them).
             Without triton: `BackendUnavailableError`; CPU tensors without the interpreter:
             `BackendDeviceError` (both LinattnErrors, also an ImportError / a RuntimeError).
             A call the kernels do not cover falls back to PyTorch with a warning (once per
             reason); the prepared call says why (`triton_unsupported()`).
* "cpu"    - the compiled CPU kernels (linattn/cpu, C + OpenMP built on first use): CPU tensors only
             (`BackendDeviceError` otherwise); `BackendUnavailableError` when they are switched off
             (LINATTN_CPU_KERNELS=0) or cannot be built (no C compiler). A call they do not cover
             falls back to PyTorch with a warning (once per reason), like "triton"; the prepared call
             says why (`cpu_unsupported()`, None when covered; an operator without it has no kernel).
* "fla"    - flash-linear-attention's kernels (fla-core, pinned by the `gpu` extra) through linattn's
             adapters (linattn/fla): CUDA tensors only (`BackendDeviceError` otherwise); without a
             tested fla-core, or for a call the adapters do not cover (fp64, head sizes fla rejects,
             ...), `BackendUnavailableError` naming the reason: never a silent fallback.
* "auto"   - for CUDA tensors "fla" when fla-core imports and covers the call, else "triton" when triton
             is importable and covers it (no call has been measured faster on linattn's Triton kernels
             than on fla's: docs/triton.md); "cpu" for CPU tensors when the compiled kernels are on,
             build, and cover the call; "torch" otherwise. `choose_backend` (`linattn.explain`) says
             which and why; LINATTN_BACKEND_LOG=1 logs each distinct decision once.

An operator validates and prepares its call once (a `LinearProblem` or `DeltaProblem`); the
functions here only read that prepared call: `select_backend` decides, and `triton_linear_attention`
/ `triton_delta` / `cpu_linear_attention` lay its tensors out for the kernels ([TT, H, D], packed
sequences) and launch them; `fla_linear_attention` / `fla_delta` translate it into fla's arguments.
Nothing here imports triton or fla unless a CUDA call or the backend asks for them, and nothing compiles
before a CPU kernel is first needed: `import linattn` does none of these.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable, NamedTuple, Optional

import torch

from .. import cpu, fla
from ..cpu.build import ENV_SWITCH
from ..errors import LinattnError
from ..logs import get_logger
from ..triton import available, interpret_mode
from ._common import compute_dtype
from .l2norm import l2norm

BACKENDS = ("auto", "torch", "triton", "cpu", "fla")
LOG_SWITCH = "LINATTN_BACKEND_LOG"  # =1: log each distinct backend decision once (`select_backend`)
_WARNED = set()
_LOGGED = set()


class BackendUnavailableError(LinattnError, ImportError):
    """The requested backend cannot run here: triton is not installed, or the compiled CPU kernels are switched
    off or cannot be built. The message names what is missing."""


class BackendDeviceError(LinattnError, RuntimeError):
    """The requested backend does not run on the call's device (backend="triton" for CPU tensors without
    TRITON_INTERPRET=1, backend="cpu" for CUDA tensors)."""


def requires_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _fallback(backend: str, why: str) -> str:
    if (backend, why) not in _WARNED:
        _WARNED.add((backend, why))
        warnings.warn(f"backend={backend!r}: {why}; falling back to the PyTorch implementation", stacklevel=5)
    return "torch"


def cpu_kernel_unsupported(problem) -> Optional[str]:
    """Why the compiled CPU kernels do not take this call (None when they do): the operator has no kernel
    (`cpu_unsupported` missing), or the prepared call says why not. Builds nothing."""
    check = getattr(problem, "cpu_unsupported", None)
    if check is None:
        return f"{type(problem).__name__} has no compiled CPU kernel"
    return check()


def _cpu_library_missing(problem) -> Optional[str]:
    """None when the problem's compiled library loads (building it on first use), else what is missing.
    Under torch.compile nothing is built (tracing cannot run a compiler): only a library this process has
    already loaded counts."""
    if not cpu.enabled():
        return f"the compiled CPU kernels are switched off ({ENV_SWITCH}=0)"
    name = getattr(problem, "cpu_kernel", None)
    if torch.compiler.is_compiling():
        if name is None or not cpu.build.is_loaded(name):
            return "the compiled CPU kernels are not loaded yet in this process (torch.compile cannot build them)"
        return None
    if name is None or not cpu.available(name):
        return "the compiled CPU kernels could not be built (no working C compiler? set CC; see the notice above)"
    return None


class BackendChoice(NamedTuple):
    """Which backend a call takes and why (`linattn.explain`)."""
    backend: str
    reason: str
    #: set when a requested "cpu" / "triton" backend falls back to PyTorch: why (`select_backend` warns once)
    fallback: Optional[str] = None

    def __str__(self) -> str:
        return f"{self.backend}: {self.reason}"


def fla_unsupported(problem) -> Optional[str]:
    """Why fla's kernels do not take this call (None when they do): a device they do not run on, fla-core
    missing or untested (`linattn.fla.unavailable`, which imports fla on its first call), or the prepared call's
    own reason (`fla_unsupported()`; an operator without it has no fla adapter)."""
    if not fla.runs_on(problem.q.device):
        return f"fla-core's kernels run on CUDA tensors, not {problem.q.device.type}"
    check = getattr(problem, "fla_unsupported", None)
    why = f"{type(problem).__name__} has no fla adapter yet" if check is None else check()
    return why if why is not None else fla.unavailable()


def _choose_auto(problem) -> BackendChoice:
    if problem.q.device.type == "cpu":
        why = cpu_kernel_unsupported(problem) or _cpu_library_missing(problem)
        if why is None:
            return BackendChoice("cpu", "CPU tensors and the compiled CPU kernels cover the call")
        return BackendChoice("torch", f"CPU tensors; no compiled CPU kernel: {why}")
    if not problem.q.is_cuda:
        return BackendChoice("torch", f"no kernel backend runs on {problem.q.device.type} tensors")
    if torch.compiler.is_compiling():  # fla's entry points are torch.compiler.disable'd: a graph break
        no_fla = "under torch.compile fla's kernels would break the graph (ask for backend='fla' to accept that)"
    else:
        no_fla = fla_unsupported(problem)
    if no_fla is None:
        return BackendChoice("fla", f"CUDA tensors and fla-core {fla.TESTED_VERSION} covers the call")
    if not available():
        return BackendChoice("torch", f"no fla: {no_fla}; no Triton: triton is not installed")
    no_triton = problem.triton_unsupported()
    if no_triton is None:
        return BackendChoice("triton", f"no fla: {no_fla}; linattn's Triton kernels cover the call")
    return BackendChoice("torch", f"no fla: {no_fla}; no Triton: {no_triton}")


def _choose_cpu(problem) -> BackendChoice:
    if problem.q.device.type != "cpu":
        raise BackendDeviceError(f"backend='cpu' runs on CPU tensors, got q on {problem.q.device}; "
                                 "use backend='auto', 'torch', 'fla' or 'triton'")
    if not cpu.enabled():
        raise BackendUnavailableError(f"backend='cpu': {_cpu_library_missing(problem)}; use backend='auto' "
                                      "or 'torch'")
    why = cpu_kernel_unsupported(problem)
    if why is not None:  # checked before building: an uncovered call needs no library
        return BackendChoice("torch", f"backend='cpu' does not cover the call: {why}", why)
    missing = _cpu_library_missing(problem)
    if missing is not None:
        if torch.compiler.is_compiling():  # not an error: the same call outside torch.compile builds them
            return BackendChoice("torch", f"backend='cpu': {missing}", missing)
        raise BackendUnavailableError(f"backend='cpu': {missing}; use backend='auto' or 'torch'")
    return BackendChoice("cpu", "backend='cpu' was asked for and covers the call")


def _choose_triton(problem) -> BackendChoice:
    if not available():
        raise BackendUnavailableError("backend='triton' needs the triton package: pip install 'linattn[triton]' "
                                      "(or use backend='auto' / 'torch')")
    if not problem.q.is_cuda and not interpret_mode():
        raise BackendDeviceError("backend='triton' runs on CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
                                 "before triton is imported (Triton's interpreter: slow, for tests) or use "
                                 "backend='torch'")
    why = problem.triton_unsupported()
    if why is None:
        return BackendChoice("triton", "backend='triton' was asked for and covers the call")
    return BackendChoice("torch", f"backend='triton' does not cover the call: {why}", why)


def _choose_fla(problem) -> BackendChoice:
    """backend='fla' asked for: every call it cannot take raises (never a silent fallback), naming the reason."""
    if not fla.runs_on(problem.q.device):
        raise BackendDeviceError(f"backend='fla' runs fla-core's Triton kernels on CUDA tensors, got q on "
                                 f"{problem.q.device}; use backend='auto' or 'torch' here ({fla.INSTALL_HINT} on a "
                                 "GPU machine)")
    missing = fla.unavailable()
    if missing is not None:
        raise BackendUnavailableError(f"backend='fla': {missing}; or use backend='auto' / 'torch'")
    why = fla_unsupported(problem)
    if why is not None:
        raise BackendUnavailableError(f"backend='fla' does not cover this call: {why} (fla-core "
                                      f"{fla.TESTED_VERSION}, {fla.INSTALL_HINT}); use backend='auto' or 'torch'")
    return BackendChoice("fla", f"backend='fla' was asked for and fla-core {fla.TESTED_VERSION} covers the call")


_CHOOSERS = {"auto": _choose_auto, "cpu": _choose_cpu, "triton": _choose_triton, "fla": _choose_fla,
             "torch": lambda problem: BackendChoice("torch", "backend='torch' was asked for")}


def choose_backend(backend: str, problem) -> BackendChoice:
    """Which backend a prepared call takes and why (`select_backend` without the log line).

    Raises LinattnError for an unknown backend name, and the errors of `select_backend`."""
    if backend not in BACKENDS:
        raise LinattnError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return _CHOOSERS[backend](problem)


def _log_first(backend: str, problem, choice: BackendChoice) -> None:
    """LINATTN_BACKEND_LOG=1: one log line per distinct decision (operator, backend asked, backend taken, why)."""
    if os.environ.get(LOG_SWITCH, "0").strip().lower() not in ("1", "true", "yes", "on"):
        return
    key = (type(problem).__name__, backend, choice)
    if key not in _LOGGED:
        _LOGGED.add(key)
        get_logger("backend").info(f"linattn backend: {type(problem).__name__} backend={backend!r} -> {choice}")


def select_backend(backend: str, problem) -> str:
    """Resolve `backend` for a prepared call; returns "torch", "triton", "cpu" or "fla".

    Raises LinattnError for an unknown backend name, BackendUnavailableError when "triton" is requested without
    triton, "cpu" without built kernels, or "fla" without a tested fla-core or for a call fla does not cover,
    and BackendDeviceError when "triton" is requested for CPU tensors without TRITON_INTERPRET=1, "cpu" for
    CUDA tensors or "fla" for non-CUDA tensors. An uncovered call falls back to "torch" with a warning on "cpu"
    and "triton". With LINATTN_BACKEND_LOG=1 each distinct decision is logged once (`choose_backend` says why).
    """
    choice = choose_backend(backend, problem)
    _log_first(backend, problem, choice)
    if choice.fallback is not None:
        return _fallback(backend, choice.fallback)
    return choice.backend


def _starts(problem):
    B, T = problem.q.shape[:2]
    return [i * T for i in range(B + 1)] if problem.offsets is None else list(problem.offsets)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype (x itself when it is: no operator call)."""
    return x if x.dtype == dtype else x.to(dtype)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] -> [B*T, H, ...], contiguous (a view when it already is)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def triton_linear_attention(p):
    """A prepared `linear_attention` call on the Triton kernels.
    -> num [B, T, H, V], den [B, T, H] or None (fp32), final kv and z (or None)."""
    from ..triton.linear import chunk_linear_attention, fused_recurrent_linear_attention

    B, T = p.q.shape[:2]
    H, V = p.v.shape[2], p.v.shape[-1]  # value heads; q, k keep theirs: value head j reads q/k head j // (H / Hq)
    if p.fmap.fused_kernel is not None:  # phi(scale q) is computed inside the kernels
        fq, fk, fused, scale = p.q, p.k, p.fmap.fused_kernel, p.scale
    else:  # any other linear-space map: features by PyTorch (fp32), identity in the kernels
        fq, fk = p.features(torch.float32)
        fused, scale = "identity", 1.0
    g = _flat(p.log_gate.float()) if p.log_gate is not None else None
    h0 = z0 = None
    if p.state is not None:
        h0, z0 = p.state.kv.float().contiguous(), p.state.z.float().contiguous()
    kw = dict(fused=fused, scale=scale, norm=bool(p.normalize or p.output_final_state), starts=_starts(p),
              output_final_state=p.output_final_state)
    n = 1 if p.folded else p.value_groups  # q, k repeated to the value heads: the kernels read head j // n
    if n > 1:
        fq, fk = fq[:, :, ::n], fk[:, :, ::n]
    args = (_flat(fq), _flat(fk), _flat(p.v), g, h0, z0)
    if p.mode == "recurrent":
        num, den, kv, z = fused_recurrent_linear_attention(*args, **kw)
    else:
        num, den, kv, z = chunk_linear_attention(*args, chunk_size=p.chunk_size, **kw)
    return num.view(B, T, H, V), (den.view(B, T, H) if den is not None else None), kv, z


def cpu_linear_attention(p, eps=None):
    """A prepared `linear_attention` call on the compiled CPU kernels (linattn/cpu/linear.py): the features by
    PyTorch in the compute dtype (fp32, fp64 for fp64 inputs; autograd differentiates the map), the chunk form
    compiled. -> num [B, T, H, V], den [B, T, H] or None, final kv and z (None without output_final_state; z None
    without norm), in the compute dtype,
    whether num is already num / den (eps given: the kernel divides, see `finish`) and whether every value of num
    is finite (the kernel's flag; None when unknown)."""
    from ..cpu.linear import FMAPS, chunk_linear_attention

    B, T, H = p.q.shape[:3]
    V = p.v.shape[-1]
    cdt = torch.float64 if p.q.dtype == torch.float64 else torch.float32
    norm = bool(p.normalize or p.output_final_state)  # the final state always carries z
    fused = p.fmap.fused_kernel if p.fmap.fused_kernel in FMAPS and not p.fmap.positional else None
    # the features in the compute dtype, as on the PyTorch path (no context to enter where autocast is off)
    with torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else contextlib.nullcontext():
        if fused is not None:  # phi(scale q), psi(k) inside the kernels: one pass, the same bits at every position
            fq, fk, scale = _as(p.q, cdt), _as(p.k, cdt), p.scale
        else:
            (fq, fk), scale = p.features(cdt), 1.0
        g = _flat(p.log_gate.to(cdt)) if p.log_gate is not None else None
        S0 = None
        if p.state is not None:
            kv0 = p.state.kv.to(cdt)
            S0 = (torch.cat([kv0, p.state.z.to(cdt).unsqueeze(-1)], dim=-1) if norm else kv0).contiguous()
        num, den, S, divided, finite = chunk_linear_attention(_flat(fq), _flat(fk), _flat(_as(p.v, cdt)), g, S0,
                                                              starts=_starts(p), chunk_size=p.chunk_size, norm=norm,
                                                              fmap=fused, scale=scale, eps=eps)
    kv, z = (None, None) if not p.output_final_state else (S[..., :V], S[..., V]) if norm else (S, None)
    return num.view(B, T, H, V), (den.view(B, T, H) if den is not None else None), kv, z, divided, finite


def cpu_linear_log_attention(p):
    """A prepared `linear_attention` call of a log-space map (Hadamard Exp, FAVOR+) on the compiled CPU kernels
    (linattn/cpu/linear_log.py): the log-features by PyTorch in the compute dtype, the token scan compiled (the
    chunk and recurrent forms alike). -> num, den [B, T, H, *] relative to the row log-scale c [B, T, H], the
    final kv, z and log-scale (or None), in the compute dtype."""
    from ..cpu.linear_log import chunk_linear_log_attention

    B, T, H = p.q.shape[:3]
    V = p.v.shape[-1]
    cdt = torch.float64 if p.q.dtype == torch.float64 else torch.float32
    with torch.autocast("cpu", enabled=False):
        fq, fk = p.features(cdt)
        g = _flat(p.log_gate.to(cdt)) if p.log_gate is not None else None
        S0 = mu0 = None
        if p.state is not None:
            S0 = torch.cat([p.state.kv.to(cdt), p.state.z.to(cdt).unsqueeze(-1)], dim=-1).contiguous()
            mu0 = p.state.log_scale.detach().to(cdt).contiguous()
        num, den, c, S, mu = chunk_linear_log_attention(_flat(fq), _flat(fk), _flat(p.v.to(cdt)), g, S0, mu0,
                                                        starts=_starts(p), chunk_size=p.chunk_size)
    kv, z = (S[..., :V], S[..., V]) if p.output_final_state else (None, None)
    return (num.view(B, T, H, V), den.view(B, T, H), c.view(B, T, H), kv, z,
            mu if p.output_final_state else None)


def triton_delta(p):
    """A prepared delta-family call on the Triton kernels. -> (o [B, T, H, V] fp32, final state or None)."""
    from ..triton.delta import chunk_delta_rule, fused_recurrent_delta_rule

    B, T = p.q.shape[:2]
    H, V = p.v.shape[2], p.v.shape[-1]  # value heads; q, k keep theirs: value head j reads q/k head j // (H / Hq)
    args = (_flat(p.q), _flat(p.k), _flat(p.v), _flat(p.a), _flat(p.g) if p.g is not None else None,
            p.S0.float().contiguous() if p.S0 is not None else None)
    kw = dict(starts=_starts(p), output_final_state=p.output_final_state)
    if p.mode == "recurrent":
        o, S = fused_recurrent_delta_rule(*args, **kw)
    else:
        o, S = chunk_delta_rule(*args, chunk_size=p.chunk_size, **kw)
    return o.view(B, T, H, V), S


def cpu_delta(p):
    """A prepared delta-family call on the compiled CPU kernels (linattn/cpu/delta.py): the delta rule's own
    read (r = None), any gate; with `p.prep` the raw rows and beta, which the scan prepares as it reads them.
    -> (o [B, T, H, V], final state [N, H, K, V]) in the compute dtype."""
    from ..cpu.delta import delta_scan

    B, T, H, V = p.v.shape
    q, k, _ = p.value_head_qkr()
    o, S = delta_scan(_flat(q), _flat(k), _flat(p.v), _flat(p.a), _flat(p.g) if p.g is not None else None,
                      p.S0, _starts(p), prep=p.prep)
    return o.view(B, T, H, V), S


class DeltaSource(NamedTuple):
    """The caller's validated inputs of a delta-family call, before the PyTorch preprocessing: what the fla
    backend translates into fla's arguments (`fla_delta`). q, k `[B, T, H, K]`, v `[B, T, HV,
    V]` and beta `[B, T, HV]` as given; l2 the qk_l2norm convention (None, "rsqrt", "clamp"); scale resolved;
    coefficient EFLA's (or None)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    l2: Optional[str]
    scale: float
    coefficient: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


class Rwkv7Source(NamedTuple):
    """The caller's inputs of an `rwkv7` call (fla's `chunk_rwkv7` arguments; the core runs two sub-steps per
    token instead, `ops/rwkv7.py`); w is the log decay in the compute dtype."""
    r: torch.Tensor
    w: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scale: float


def _cu_seqlens(p, steps: int = 1) -> Optional[torch.Tensor]:
    """The prepared offsets as fla's cu_seqlens, on the device; `steps` core sub-steps per token (rwkv7: 2)."""
    if p.offsets is None:
        return None
    return torch.tensor([o // steps for o in p.offsets], dtype=torch.int64, device=p.q.device)


def _running_key_sum(p, fq, fk, scale):
    """Without a gate the normaliser is a running sum: z_t = z_0 + sum_{j <= t} psi(k_j) per sequence, den_t =
    scale phi(q_t) . z_t, in the compute dtype (one cumulative sum instead of a ones column that would widen
    every value tile of fla's kernel by one). -> den [B, T, H], final z [N, H, K]."""
    cdt = compute_dtype(p.q.dtype)
    cs = fk.to(cdt).cumsum(1)                                                    # [B, T, H, K]
    if p.offsets is not None:  # restart at each sequence: subtract the sum before its first token
        starts, lens = p.offsets[:-1], [b - a for a, b in zip(p.offsets[:-1], p.offsets[1:])]
        lens_t = torch.tensor(lens, device=cs.device)
        before = torch.cat([cs.new_zeros(1, 1, *cs.shape[2:]), cs[:, :-1]], dim=1)[:, starts]
        T = cs.shape[1]  # output_size: no host read of lens_t
        cs = cs - before.repeat_interleave(lens_t, dim=1, output_size=T)
        if p.state is not None:
            cs = cs + p.state.z.to(cdt).unsqueeze(0).repeat_interleave(lens_t, dim=1, output_size=T)
        z = cs[0, [b - 1 for b in p.offsets[1:]]]
    else:
        if p.state is not None:
            cs = cs + p.state.z.to(cdt).unsqueeze(1)
        z = cs[:, -1]
    return scale * (fq.to(cdt) * cs).sum(-1), z


def fla_linear_attention(p):
    """A prepared `linear_attention` call on fla's kernels (linattn/fla/linear.py): the features by PyTorch in
    the input dtype's compute dtype, taken to the kernel dtype (fp16 computes in fp32: its range cannot hold the
    unnormalised sums), the identity map's scale passed to fla; the normaliser a running key sum without a gate
    (`_running_key_sum`), else the ones column. -> num [B, T, H, V], den [B, T, H] or None, final kv and z (or
    None)."""
    from ..fla.linear import linear_attention

    kdt = torch.float32 if p.q.dtype == torch.float16 else p.q.dtype
    if p.fmap.name == "identity":  # raw q and k: fla multiplies by the scale in the kernel
        fq, fk, scale = p.q.to(kdt), p.k.to(kdt), p.scale
    else:
        (fq, fk), scale = (x.to(kdt) for x in p.features(compute_dtype(p.q.dtype))), 1.0
    gamma_log = p.constant_log_gate()  # fla's g_gamma [H]; the log-gates are in the compute dtype (fp32) already
    log_gate = p.log_gate if gamma_log is None else None
    norm = bool(p.normalize or p.output_final_state)  # the final state always carries z
    summed = norm and p.log_gate is None and p.q.shape[1] > 0
    S0 = None
    if p.state is not None:
        kv0 = p.state.kv
        S0 = (torch.cat([kv0, p.state.z.unsqueeze(-1)], dim=-1) if norm and not summed else kv0).contiguous()
    num, den, S = linear_attention(fq, fk, p.v.to(kdt), scale=scale, normalize=norm and not summed,
                                   log_gate=log_gate, gamma_log=gamma_log, initial_state=S0,
                                   output_final_state=p.output_final_state, cu_seqlens=_cu_seqlens(p), mode=p.mode)
    if summed:
        den, z = _running_key_sum(p, fq, fk, scale)
        return num, den, S, (z if p.output_final_state else None)
    V = p.v.shape[-1]
    kv, z = (S[..., :V], S[..., V]) if S is not None and norm else (S, None)
    return num, den, kv, z


def fla_delta(p):
    """A prepared delta-family call on fla's kernels (linattn/fla/delta.py), from the caller's own tensors
    (`DeltaProblem.source`): qk_l2norm "rsqrt" in the kernel, "clamp" and EFLA's keys normalised here first.
    -> (o [B, T, HV, V], final state [N, HV, K, V] or None)."""
    from ..fla.delta import delta_rule, rwkv7

    src = p.source
    if isinstance(src, Rwkv7Source):  # fla's chunk_rwkv7 has linattn's rwkv7 arguments and meaning
        return rwkv7(*src[:6], scale=src.scale, initial_state=p.S0.contiguous() if p.S0 is not None else None,
                     output_final_state=p.output_final_state, cu_seqlens=_cu_seqlens(p, steps=2), mode=p.mode)
    q, k, beta = src.q, src.k, src.beta
    in_kernel = src.l2 == "rsqrt" and src.coefficient is None
    if src.l2 is not None and not in_kernel:  # clamp, or EFLA's coefficient reading the normalised keys' norm
        q, k = l2norm(q, src.l2), l2norm(k, src.l2)
    if src.coefficient is not None:  # EFLA: fla's beta is the exact write strength a_t, from ||k||^2
        kc = k.to(compute_dtype(k.dtype))
        beta = src.coefficient(beta.to(kc.dtype), (kc * kc).sum(-1))
    S0 = p.S0.contiguous() if p.S0 is not None else None
    return delta_rule(q, k, src.v, beta.to(q.dtype), g=p.g, scale=src.scale, l2norm_in_kernel=in_kernel,
                      initial_state=S0,
                      output_final_state=p.output_final_state, cu_seqlens=_cu_seqlens(p), mode=p.mode)


def fla_forgetting_attention(p) -> torch.Tensor:
    """A prepared `forgetting_attention` call on fla's `parallel_forgetting_attn` (linattn/fla/attention.py), from
    the caller's q, k, v (fla scales q itself) and the gate in the compute dtype. -> o [B, T, H, V]."""
    from ..fla.attention import forgetting_attention

    q, k, v, scale = p.source
    return forgetting_attention(q, k, v, p.g, scale=scale, window=p.window,
                                cu_seqlens=_cu_seqlens(p)).to(p.out_dtype)


def fla_path_attention(p) -> torch.Tensor:
    """A prepared `path_attention` call on fla's `parallel_path_attn` (linattn/fla/attention.py): the caller's q,
    k, v (fla scales the scores itself), w, beta and the gate in the compute dtype (fp32, as fla requires).
    -> o [B, T, H, V]."""
    from ..fla.attention import path_attention

    q, k, v, scale = p.source
    return path_attention(q, k, v, p.w, p.beta, p.g, scale=scale, cu_seqlens=_cu_seqlens(p)).to(p.out_dtype)
