"""Backend dispatch: `backend="auto" | "torch" | "triton" | "cpu"` on the operators.

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
* "auto"   - "triton" for CUDA tensors when triton is importable and the call is covered; "cpu" for
             CPU tensors when the compiled kernels are on, build, and cover the call; "torch"
             otherwise (silently).

An operator validates and prepares its call once (a `LinearProblem` or `DeltaProblem`); the
functions here only read that prepared call: `select_backend` decides, and `triton_linear_attention`
/ `triton_delta` / `cpu_linear_attention` lay its tensors out for the kernels ([TT, H, D], packed
sequences) and launch them. Nothing here imports triton unless the Triton backend is chosen, and
nothing compiles before a CPU kernel is first needed: `import linattn` does neither.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from .. import cpu
from ..cpu.build import ENV_SWITCH
from ..errors import LinattnError
from ..triton import available, interpret_mode

BACKENDS = ("auto", "torch", "triton", "cpu")
_WARNED = set()


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


def select_backend(backend: str, problem) -> str:
    """Resolve `backend` for a prepared call; returns "torch", "triton" or "cpu".

    Raises LinattnError for an unknown backend name, BackendUnavailableError when "triton" is requested without
    triton or "cpu" without built kernels, and BackendDeviceError when "triton" is requested for CPU tensors
    without TRITON_INTERPRET=1 or "cpu" for CUDA tensors. An uncovered call falls back to "torch" with a warning.
    """
    if backend not in BACKENDS:
        raise LinattnError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    on_cuda = problem.q.is_cuda
    if backend == "auto":
        if problem.q.device.type == "cpu":
            if cpu_kernel_unsupported(problem) is None and _cpu_library_missing(problem) is None:
                return "cpu"
            return "torch"
        if not on_cuda or not available() or problem.triton_unsupported() is not None:
            return "torch"
        return "triton"
    if backend == "cpu":
        if problem.q.device.type != "cpu":
            raise BackendDeviceError(f"backend='cpu' runs on CPU tensors, got q on {problem.q.device}; "
                                     "use backend='auto', 'torch' or 'triton'")
        if not cpu.enabled():
            raise BackendUnavailableError(f"backend='cpu': {_cpu_library_missing(problem)}; use backend='auto' "
                                          "or 'torch'")
        why = cpu_kernel_unsupported(problem)
        if why is not None:  # checked before building: an uncovered call needs no library
            return _fallback("cpu", why)
        missing = _cpu_library_missing(problem)
        if missing is not None:
            if torch.compiler.is_compiling():  # not an error: the same call outside torch.compile builds them
                return _fallback("cpu", missing)
            raise BackendUnavailableError(f"backend='cpu': {missing}; use backend='auto' or 'torch'")
        return "cpu"
    if not available():
        raise BackendUnavailableError("backend='triton' needs the triton package: pip install 'linattn[triton]' "
                                      "(or use backend='auto' / 'torch')")
    if not on_cuda and not interpret_mode():
        raise BackendDeviceError("backend='triton' runs on CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
                                 "before triton is imported (Triton's interpreter: slow, for tests) or use "
                                 "backend='torch'")
    why = problem.triton_unsupported()
    return "triton" if why is None else _fallback("triton", why)


def _starts(problem):
    B, T = problem.q.shape[:2]
    return [i * T for i in range(B + 1)] if problem.offsets is None else list(problem.offsets)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] -> [B*T, H, ...], contiguous (a view when it already is)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def triton_linear_attention(p):
    """A prepared `linear_attention` call on the Triton kernels.
    -> num [B, T, H, V], den [B, T, H] or None (fp32), final kv and z (or None)."""
    from ..triton.linear import chunk_linear_attention, fused_recurrent_linear_attention

    B, T = p.q.shape[:2]
    H, V = p.v.shape[2], p.v.shape[-1]  # value heads: the kernels take grouped q/k heads (H a multiple)
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
    compiled. -> num [B, T, H, V], den [B, T, H] or None, final kv and z (or None), in the compute dtype, and
    whether num is already num / den (eps given and no backward: the kernel divides, see `finish`)."""
    from ..cpu.linear import FMAPS, chunk_linear_attention

    B, T, H = p.q.shape[:3]
    V = p.v.shape[-1]
    cdt = torch.float64 if p.q.dtype == torch.float64 else torch.float32
    norm = bool(p.normalize or p.output_final_state)  # the final state always carries z
    fused = p.fmap.fused_kernel if p.fmap.fused_kernel in FMAPS and not p.fmap.positional else None
    with torch.autocast("cpu", enabled=False):  # the features in the compute dtype, as on the PyTorch path
        if fused is not None:  # phi(scale q), psi(k) inside the kernels: one pass, the same bits at every position
            fq, fk, scale = p.q.to(cdt), p.k.to(cdt), p.scale
        else:
            (fq, fk), scale = p.features(cdt), 1.0
        g = _flat(p.log_gate.to(cdt)) if p.log_gate is not None else None
        S0 = None
        if p.state is not None:
            kv0 = p.state.kv.to(cdt)
            S0 = (torch.cat([kv0, p.state.z.to(cdt).unsqueeze(-1)], dim=-1) if norm else kv0).contiguous()
        num, den, S, divided = chunk_linear_attention(_flat(fq), _flat(fk), _flat(p.v.to(cdt)), g, S0,
                                                      starts=_starts(p), chunk_size=p.chunk_size, norm=norm,
                                                      fmap=fused, scale=scale, eps=eps)
    kv, z = (S[..., :V], S[..., V]) if norm else (S, None)
    return num.view(B, T, H, V), (den.view(B, T, H) if den is not None else None), kv, z, divided


def triton_delta(p):
    """A prepared delta-family call on the Triton kernels. -> (o [B, T, H, V] fp32, final state or None)."""
    from ..triton.delta import chunk_delta_rule, fused_recurrent_delta_rule

    B, T = p.q.shape[:2]
    H, V = p.v.shape[2], p.v.shape[-1]  # value heads: the kernels take grouped q/k heads (H a multiple)
    n = p.value_groups  # prepare_delta repeated q, k to the value heads; the kernels read head j // n themselves
    q, k = (p.q, p.k) if n == 1 else (p.q[:, :, ::n], p.k[:, :, ::n])
    args = (_flat(q), _flat(k), _flat(p.v), _flat(p.a), _flat(p.g) if p.g is not None else None,
            p.S0.float().contiguous() if p.S0 is not None else None)
    kw = dict(starts=_starts(p), output_final_state=p.output_final_state)
    if p.mode == "recurrent":
        o, S = fused_recurrent_delta_rule(*args, **kw)
    else:
        o, S = chunk_delta_rule(*args, chunk_size=p.chunk_size, **kw)
    return o.view(B, T, H, V), S


def cpu_delta(p):
    """A prepared delta-family call on the compiled CPU kernels (linattn/cpu/delta.py): the delta rule's own
    read (r = None), any gate. -> (o [B, T, H, V], final state [N, H, K, V]) in the compute dtype."""
    from ..cpu.delta import delta_scan

    B, T, H = p.q.shape[:3]
    V = p.v.shape[-1]
    o, S = delta_scan(_flat(p.q), _flat(p.k), _flat(p.v), _flat(p.a), _flat(p.g) if p.g is not None else None,
                      p.S0, _starts(p))
    return o.view(B, T, H, V), S
