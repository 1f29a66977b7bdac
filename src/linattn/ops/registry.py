"""The operator registry: every public operator registers itself at the bottom of its own module.

    register_op("my_op", my_op, prepare=prepare_my_op, forms=("chunk", "recurrent"),
                example=_example, reference=_reference)

What reads it: `chunk_size_used(name, ...)` (through `prepare`), `op_names()` (the public operators, for the
benchmarks and the docs), and tests/test_registry_conformance.py, which gives every operator with an `example` and
a `reference` its tests without naming it: each form against the fp64 reference (outputs and gradients, T not a
multiple of the chunk, T = 1), causality (a later change never moves an earlier output), and, for the operators
that carry a state, two calls with the state passed along equal one call.

This module imports nothing heavy (torch and errors only), so any operator module can import it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from ..errors import ConfigError, LinattnError


class OpSpec(NamedTuple):
    """One registered operator.

    fn: the public function; it returns `o` or `(o, state)`.
    prepare: `prepare(*args, **kwargs)` with the operator's own arguments -> its prepared problem, whose
        `chunk_size_used(backend)` says the chunk really used (None: the operator has no chunk size to report).
    backends: whether `fn` takes `backend=` (then chunk_size_used resolves it with `select_backend`).
    forms: the values `fn`'s `mode=` takes (empty: no mode argument).
    chunk_arg: the keyword naming its chunk length (`chunk_size`; the softmax side's `block_size`), or None.
    example: `example(generator, B, T, H, K, V, dtype) -> (args, kwargs)`: small valid inputs (tensors [B, T, ...]
        in args or kwargs are the per-token inputs, the rest are per-call parameters).
    reference: the fp64 formula on the same inputs, `reference(*args, **kwargs) -> o` or `(o, ...)`, o [B, T, H, V];
        a string names a function of ops/reference.py that takes the operator's arguments as they are (resolved
        on use, so the operator's module never imports the references).
    state: whether `fn` takes `initial_state=` / `output_final_state=` (continues a sequence across calls).
    """
    name: str
    fn: Callable[..., Any]
    prepare: Optional[Callable[..., Any]] = None
    backends: bool = False
    forms: Tuple[str, ...] = ()
    chunk_arg: Optional[str] = "chunk_size"
    example: Optional[Callable[..., Tuple[tuple, Dict[str, Any]]]] = None
    reference: Union[str, Callable[..., Any], None] = None
    state: bool = False
    description: str = ""


_OPS: Dict[str, OpSpec] = {}


# -- helpers for the operators' `example`s -------------------------------------------------------------------
def randn(gen, shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def unit(gen, shape, dtype):
    """Rows of unit L2 norm along the last axis."""
    x = randn(gen, shape, dtype)
    return x / x.norm(dim=-1, keepdim=True)


def uniform(gen, shape, dtype, low: float = 0.0, high: float = 1.0):
    return low + (high - low) * torch.rand(*shape, generator=gen, dtype=dtype)


def register_op(name: str, fn: Callable[..., Any], *, prepare: Optional[Callable[..., Any]] = None,
                backends: bool = False, forms: Tuple[str, ...] = (), chunk_arg: Optional[str] = "chunk_size",
                example: Optional[Callable[..., Any]] = None, reference: Union[str, Callable[..., Any], None] = None,
                state: bool = False, description: str = "", overwrite: bool = False) -> None:
    """Register operator `name`. Call it at the bottom of the operator's module.

    Registered operators get their tests without being named (tests/test_registry_conformance.py: each form against
    the fp64 reference, causality, states across calls), and `chunk_size_used` and the benchmarks know them.

    Args:
        name: The operator's public name.
        fn: The public function; it returns `o` or `(o, state)`.
        prepare: `prepare(*args, **kwargs)` with the operator's own arguments -> its prepared problem, whose
            `chunk_size_used(backend)` says the chunk really used (None: no chunk size to report).
        backends: Whether `fn` takes `backend=`.
        forms: The values `fn`'s `mode=` takes (empty: no mode argument).
        chunk_arg: The keyword naming its chunk length (`chunk_size`; the softmax side's `block_size`), or None.
        example: `example(generator, B, T, H, K, V, dtype) -> (args, kwargs)`: small valid inputs.
        reference: The fp64 formula on the same inputs, a callable or the name of a function of ops/reference.py.
        state: Whether `fn` takes `initial_state=` / `output_final_state=`.
        description: One line for listings.
        overwrite: Replace an operator already registered under `name`.

    Raises:
        ConfigError: An empty or taken name, or an argument that is not callable / not a tuple of mode names.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"an operator name must be a non-empty string, got {name!r}")
    if name in _OPS and not overwrite:
        raise ConfigError(f"operator {name!r} is already registered (pass overwrite=True to replace it)")
    for arg, value in (("fn", fn), ("prepare", prepare), ("example", example),
                       ("reference", None if isinstance(reference, str) else reference)):
        if value is not None and not callable(value):
            raise ConfigError(f"operator {name!r}: {arg} must be callable, got {type(value).__name__}")
    if fn is None:
        raise ConfigError(f"operator {name!r}: fn must be callable, got None")
    if isinstance(forms, str) or not all(isinstance(f, str) for f in forms):
        raise ConfigError(f"operator {name!r}: forms must be a tuple of mode names, got {forms!r}")
    _OPS[name] = OpSpec(name, fn, prepare, bool(backends), tuple(forms), chunk_arg, example, reference,
                        bool(state), description)


def unregister_op(name: str) -> None:
    """Remove a registered operator (for plugins and tests).

    Args:
        name: The operator's name.

    Raises:
        LinattnError: An unknown operator.
    """
    op_spec(name)
    del _OPS[name]


def op_names() -> List[str]:
    """The registered operators, in registration order.

    Returns:
        Their names.

    Examples:
        >>> from linattn.ops.registry import op_names
        >>> {"linear_attention", "delta_rule", "softmax_attention"} <= set(op_names())
        True
    """
    return list(_OPS)


def op_spec(name: str) -> OpSpec:
    """The registration of operator `name`.

    Args:
        name: A name of `op_names()`.

    Returns:
        Its `OpSpec`.

    Raises:
        LinattnError: An unknown operator.
    """
    if name not in _OPS:
        raise LinattnError(f"unknown operator {name!r}; registered: {', '.join(_OPS)}")
    return _OPS[name]


def reference_of(name: str) -> Optional[Callable[..., Any]]:
    """Operator `name`'s fp64 reference as a callable.

    Args:
        name: A name of `op_names()`.

    Returns:
        The reference (None if the operator registered none).
    """
    ref = op_spec(name).reference
    if isinstance(ref, str):
        from . import reference  # on use: only the tests and benchmarks need the references
        return getattr(reference, ref)
    return ref


def chunk_size_used(op: str, *args, backend: str = "auto", **kwargs) -> int:
    """The chunk length operator `op` really uses for this call, on the backend it would pick.

    The Triton kernels round to 16 / 32 / 64; log-space maps and diagonal or per-channel gates use blocks of at
    most 16 on the PyTorch path; recurrent is 1 and parallel T.

    Args:
        op: The operator's name ("linear_attention", "delta_rule", ...): one of `chunk_size_ops()`, the operators
            registered with a `prepare`.
        *args: The operator's positional arguments (q, k, v, ...), as in the call.
        backend: The backend asked for, as the operator's `backend`.
        **kwargs: The operator's keyword arguments, as in the call.

    Returns:
        The chunk length, in the operator's own unit (delta_product and rwkv7 count sub-steps).

    Raises:
        LinattnError: An unknown op, or arguments the operator rejects.

    Examples:
        >>> import torch
        >>> from linattn import chunk_size_used
        >>> q, k, v = torch.randn(3, 1, 100, 2, 16).unbind(0)
        >>> chunk_size_used("linear_attention", q, k, v, chunk_size=64, backend="torch")
        64
        >>> chunk_size_used("linear_attention", q, k, v, feature_map="hadamard_exp", backend="torch")
        16
    """
    spec = _OPS.get(op)
    if spec is None or spec.prepare is None:
        raise LinattnError(f"op must be one of {', '.join(chunk_size_ops())} (the operators with a chunk size to "
                           f"report), got {op!r}")
    problem = spec.prepare(*args, **kwargs)
    if not spec.backends:
        return problem.chunk_size_used()
    from .backend import select_backend  # imported on use: backend.py reaches the compiled kernels' loader
    return problem.chunk_size_used(select_backend(backend, problem))


def explain(op: Union[str, Callable[..., Any]], *args, backend: str = "auto", **kwargs):
    """Which backend a call would take, and why, without running it: the field's most common surprise is a
    silent slow fallback. The same decision as the call itself (`linattn.ops.backend.choose_backend`), so a
    backend that would raise raises here too.

    Args:
        op: The operator, by name ("linear_attention", "delta_rule", ...) or as the function itself.
        *args: The operator's positional arguments (q, k, v, ...), as in the call.
        backend: The backend asked for, as the operator's `backend`.
        **kwargs: The operator's keyword arguments, as in the call.

    Returns:
        A `BackendChoice` (backend, reason); `str()` of it reads "fla: CUDA tensors and fla-core 0.6.0 covers
        the call".

    Raises:
        LinattnError: An unknown op, arguments the operator rejects, or the backend's own errors
            (`BackendUnavailableError`, `BackendDeviceError`).

    Examples:
        >>> import torch
        >>> import linattn
        >>> q, k, v = torch.randn(3, 1, 8, 2, 16).unbind(0)
        >>> linattn.explain("linear_attention", q, k, v, backend="torch").backend
        'torch'
    """
    from .backend import BackendChoice, choose_backend  # on use, as in chunk_size_used

    name = next((n for n, spec in _OPS.items() if spec.fn is op), None) if callable(op) else op
    spec = _OPS.get(name)
    if spec is None:
        raise LinattnError(f"op must be a registered operator ({', '.join(_OPS)}) or its function, got {op!r}")
    if not spec.backends or spec.prepare is None:
        return BackendChoice("torch", f"{name} has no backend= argument: it always runs its PyTorch forms")
    return choose_backend(backend, spec.prepare(*args, **kwargs))


def chunk_size_ops() -> List[str]:
    """The registered operators `chunk_size_used` answers for (those registered with a `prepare`).

    Returns:
        Their names.
    """
    return [n for n, s in _OPS.items() if s.prepare is not None]


__all__ = ["OpSpec", "register_op", "unregister_op", "op_names", "op_spec", "chunk_size_used", "chunk_size_ops",
           "reference_of", "randn", "unit", "uniform"]
