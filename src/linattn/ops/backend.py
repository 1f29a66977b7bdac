"""Backend dispatch: `backend="auto" | "torch" | "triton"` on the operators.

* "torch"  - the PyTorch forms (always available; the reference and the fallback).
* "triton" - the Triton kernels (linattn/triton): chunk mode (forward + backward) and recurrent
             mode (forward only, for decoding). CUDA tensors, or CPU tensors under Triton's
             interpreter (TRITON_INTERPRET=1 set before triton is imported: how CI tests them).
             A call the kernels do not cover falls back to PyTorch with a warning (once per
             reason); the prepared call says why (`triton_unsupported()`).
* "auto"   - "triton" for CUDA tensors when triton is importable and the call is covered,
             "torch" otherwise (silently).

An operator validates and prepares its call once (a `LinearProblem` or `DeltaProblem`); the
functions here only read that prepared call: `select_backend` decides, and `triton_linear_attention`
/ `triton_delta` lay its tensors out for the kernels ([TT, H, D], packed sequences) and launch them.
Nothing here imports triton unless the Triton backend is chosen: `import linattn` never imports it.
"""
from __future__ import annotations

import warnings

import torch

from ..errors import LinattnError
from ..triton import available, interpret_mode

BACKENDS = ("auto", "torch", "triton")
_WARNED = set()


def requires_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def select_backend(backend: str, problem) -> str:
    """Resolve `backend` for a prepared call; returns "torch" or "triton".

    Raises LinattnError for an unknown backend name, ImportError when "triton" is requested without
    triton, and RuntimeError when it is requested for CPU tensors without TRITON_INTERPRET=1.
    """
    if backend not in BACKENDS:
        raise LinattnError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    on_cuda = problem.q.is_cuda
    if backend == "auto":
        if not on_cuda or not available() or problem.triton_unsupported() is not None:
            return "torch"
        return "triton"
    if not available():
        raise ImportError("backend='triton' needs the triton package: pip install 'linattn[triton]' "
                          "(or use backend='auto' / 'torch')")
    if not on_cuda and not interpret_mode():
        raise RuntimeError("backend='triton' runs on CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
                           "before triton is imported (Triton's interpreter: slow, for tests) or use backend='torch'")
    why = problem.triton_unsupported()
    if why is not None:
        if why not in _WARNED:
            _WARNED.add(why)
            warnings.warn(f"backend='triton': {why}; falling back to the PyTorch implementation", stacklevel=4)
        return "torch"
    return "triton"


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

    B, T, H = p.q.shape[:3]
    V = p.v.shape[-1]
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
    args = (_flat(fq), _flat(fk), _flat(p.v), g, h0, z0)
    if p.mode == "recurrent":
        num, den, kv, z = fused_recurrent_linear_attention(*args, **kw)
    else:
        num, den, kv, z = chunk_linear_attention(*args, chunk_size=p.chunk_size, **kw)
    return num.view(B, T, H, V), (den.view(B, T, H) if den is not None else None), kv, z


def triton_delta(p):
    """A prepared delta-family call on the Triton kernels. -> (o [B, T, H, V] fp32, final state or None)."""
    from ..triton.delta import chunk_delta_rule, fused_recurrent_delta_rule

    B, T, H = p.q.shape[:3]
    V = p.v.shape[-1]
    args = (_flat(p.q), _flat(p.k), _flat(p.v), _flat(p.a), _flat(p.g) if p.g is not None else None,
            p.S0.float().contiguous() if p.S0 is not None else None)
    kw = dict(starts=_starts(p), output_final_state=p.output_final_state)
    if p.mode == "recurrent":
        o, S = fused_recurrent_delta_rule(*args, **kw)
    else:
        o, S = chunk_delta_rule(*args, chunk_size=p.chunk_size, **kw)
    return o.view(B, T, H, V), S
