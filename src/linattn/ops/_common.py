"""Conventions shared by every operator: argument checks, dtypes, variable-length batches.

Every public operator takes q, k `[B, T, H, K]` and v `[B, T, H, V]` (flash-linear-attention's
layout), returns outputs in the input dtype, and keeps its state and accumulators in fp32
(fp64 when the inputs are fp64). Errors name the argument and the shape that was expected.

Two kinds of checks. Shape, dtype and device checks read only metadata and always run. Checks that
read tensor *values* (NaN, the sign of a log-gate, a negative beta) need the values on the host: on
a GPU that is a device-to-host synchronisation per check, and under torch.compile a graph break.
They run according to `set_checks`:

* "auto" (default): for CPU tensors outside torch.compile (where they cost microseconds), never
  for CUDA tensors;
* "full": always (debugging a GPU run);
* "shapes": never.

The environment variable LINATTN_CHECKS sets the initial level.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import LinattnError, LinattnTypeError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MODES = ("parallel", "chunk", "recurrent")
CHECK_LEVELS = ("auto", "full", "shapes")
FLA_CHUNK = 64   # fla's chunk kernels' default chunk length
# per-token log-gates below -LOG_GATE_FLOOR are raised to it: exp() of either is exactly 0 in every dtype, and
# a cumulative sum of gates near the dtype's lowest value would reach -inf (then -inf - -inf = NaN)
LOG_GATE_FLOOR = 1e4

_checks = os.environ.get("LINATTN_CHECKS", "auto").strip().lower() or "auto"
if _checks not in CHECK_LEVELS:
    raise LinattnError(f"LINATTN_CHECKS must be one of {CHECK_LEVELS}, got {_checks!r}")


def set_checks(level: str) -> str:
    """Set how much the operators check tensor values (module docstring).

    Shape, dtype and device checks always run; the checks that read values (NaN, the sign of a log-gate, a
    negative beta) need the values on the host, and run according to the level.

    Args:
        level: "auto" (the default: for CPU tensors outside torch.compile, never for CUDA tensors), "full"
            (always; debugging a GPU run) or "shapes" (never). The environment variable LINATTN_CHECKS sets the
            initial level.

    Returns:
        The previous level, so that a caller can restore it.

    Raises:
        LinattnError: level is not one of "auto", "full", "shapes".

    Examples:
        >>> import linattn
        >>> previous = linattn.set_checks("full")
        >>> linattn.get_checks()
        'full'
        >>> _ = linattn.set_checks(previous)
    """
    global _checks
    if level not in CHECK_LEVELS:
        raise LinattnError(f"checks level must be one of {CHECK_LEVELS}, got {level!r}")
    previous, _checks = _checks, level
    return previous


def get_checks() -> str:
    """The current level of value checks ("auto", "full" or "shapes"; see `set_checks`).

    Returns:
        The level's name.
    """
    return _checks


_suspended = False   # value checks suspended by `value_checks_suspended` (the trainer's steps)


@contextlib.contextmanager
def value_checks_suspended():
    """Inside, the value checks of the "auto" level (which raise on a NaN) do not run; a level the user
    set ("full", "shapes") is kept, and the host reads that only choose a faster path giving the same
    result (`reads_values`) still happen. The trainer checks the loss and gradients itself."""
    global _suspended
    previous, _suspended = _suspended, _suspended or _checks == "auto"
    try:
        yield
    finally:
        _suspended = previous


def check_values(x: torch.Tensor) -> bool:
    """Whether value checks run for tensors like `x` (see `set_checks`)."""
    if _checks == "shapes" or _suspended:
        return False
    if _checks == "full":
        return True
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of `dtype`: fp64 stays fp64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(x, name: str, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise LinattnTypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise LinattnTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() != ndim:
        raise LinattnError(f"{name} must have shape {layout} ({ndim} dims), got {tuple(x.shape)}")


def check_same_device(x: torch.Tensor, name: str, ref: torch.Tensor) -> None:
    if x.device != ref.device:
        raise LinattnError(f"{name} must be on the device of q ({ref.device}), got {x.device}")


def check_qkv(q, k, v, allow_empty_k: bool = False) -> Tuple[int, int, int, int, int]:
    """Check q, k `[B, T, H, K]` and v `[B, T, H, V]`; return (B, T, H, K, V).

    Empty dimensions: T = 0 is refused (no token to attend to); K = 0 is refused too, since
    the default scale K^-1/2 and every state [K, V] would be degenerate, except where the caller
    defines it (`allow_empty_k`: softmax attention, whose scores are then all 0). B, H or V = 0 give
    empty outputs of the right shape in every mode (operators with a further rule check it themselves)."""
    check_tensor(q, "q", 4, "[B, T, H, K]")
    check_tensor(k, "k", 4, "[B, T, H, K]")
    check_tensor(v, "v", 4, "[B, T, H, V]")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise LinattnError(f"k must have the shape of q [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise LinattnError(
            f"v must have shape [B, T, H, V] with B, T, H = {(B, T, H)} as in q, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise LinattnTypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise LinattnError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if T == 0:
        raise LinattnError("the sequence length T must be at least 1")
    if K == 0 and not allow_empty_k:
        raise LinattnError(f"q and k must have shape [B, T, H, K] with K >= 1 (the key dimension K is 0), "
                           f"got {tuple(q.shape)}")
    return B, T, H, K, v.shape[-1]


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of x is finite. A finite sum proves it (an inf or NaN anywhere makes any sum inf or
    NaN), and the sum is one reduction without the boolean copy of isfinite (~25x cheaper on CPU); a sum that
    is not finite (a poisoned element, or finite values whose sum overflows) falls back to the exact test."""
    if not x.is_floating_point() and not x.is_complex():
        return True
    return bool(torch.isfinite(x.detach().sum())) or bool(torch.isfinite(x).all())


def check_finite_output(result, op: str, also: Sequence[torch.Tensor] = (), **inputs: Optional[torch.Tensor]):
    """Refuse an output that overflowed: finite inputs, yet inf or NaN in the output, or in the tensors
    `also` (statistics that can overflow while the output stays finite). `result` is the
    output or a tuple (output, state); it is returned as it is. Inputs that hold inf/NaN themselves pass
    (their outputs are inf/NaN by design). Runs when value checks run for the output; the finite case
    costs one pass over each tensor."""
    o = result[0] if isinstance(result, tuple) else result
    if not check_values(o) or all(all_finite(x) for x in (o, *also)):
        return result
    given = {name: x for name, x in inputs.items() if isinstance(x, torch.Tensor) and x.numel()}
    if not all(all_finite(x) for x in given.values()):
        return result
    sizes = ", ".join(f"|{name}| <= {x.detach().abs().max().item():.3g}" for name, x in given.items())
    raise LinattnError(
        f"{op} overflowed {o.dtype} (finite inputs, {sizes}, gave inf/NaN outputs): values this large exceed "
        f"the dtype's range inside the computation (scores, states or statistics that grow with their square "
        f"or exponential). Scale the inputs down (e.g. normalise q and k) or compute in float64.")


def check_mode(mode: str, chunk_size: int) -> None:
    if mode not in MODES:
        raise LinattnError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise LinattnError(f"chunk_size must be a positive int, got {chunk_size!r}")


def check_scale(scale, default: float) -> float:
    """`scale=None` means the operator's default; otherwise a real number."""
    if scale is None:
        return float(default)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise LinattnTypeError(f"scale must be a float or None (the default), got {type(scale).__name__}")
    if not math.isfinite(scale):  # nan/inf would turn every output into NaN
        raise LinattnError(f"scale must be a finite number (or None for the default), got {scale!r}")
    return float(scale)


def check_log_gate(g, name: str, B: int, T: int, H: int, K: Optional[int] = None,
                   allow_diagonal: bool = False, ref: Optional[torch.Tensor] = None) -> None:
    """A log-gate is `[B, T, H]` (scalar per head) or, if allowed, `[B, T, H, K]`; every entry <= 0
    and finite (checked when value checks run)."""
    layout = "[B, T, H]" + (f" or [B, T, H, {K}]" if allow_diagonal else "")
    if not isinstance(g, torch.Tensor):
        raise LinattnTypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(g).__name__}")
    if g.dtype not in FLOAT_DTYPES:
        raise LinattnTypeError(f"{name} must be a floating tensor, got {g.dtype}")
    ok = tuple(g.shape) == (B, T, H) or (allow_diagonal and tuple(g.shape) == (B, T, H, K))
    if not ok:
        raise LinattnError(f"{name} must have shape {layout} = "
                           f"{(B, T, H)}{' or ' + str((B, T, H, K)) if allow_diagonal else ''}, got {tuple(g.shape)}")
    if ref is not None:
        check_same_device(g, name, ref)
    if check_values(g) and not bool((g <= 0).all()):  # one pass catches NaN and positive entries
        if torch.isnan(g).any():
            raise LinattnError(f"{name} contains NaN")
        raise LinattnError(f"{name} is a log-gate and must be <= 0 everywhere (decay exp({name}) in (0, 1]); "
                           f"got a maximum of {g.max().item():.4g}")


# offsets already read and validated: tensor -> (its version, T, the offsets). A packed call checks the same
# cu_seqlens in the model, every layer, its short convolutions and its operator; the host reads it once (for a CUDA
# tensor every read is a device-to-host synchronisation). An in-place change bumps the version: read again.
_CHECKED_OFFSETS = WeakIdKeyDictionary()


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> Optional[List[int]]:
    """Validate packed-sequence offsets; return them as a Python list (or None).

    Reading the offsets is one host synchronisation for a CUDA tensor (the sequence boundaries decide the work, so
    every backend needs them on the host), once per tensor: the same offsets checked again (the next layer, the
    operator under a layer) are not read again unless they were changed in place.
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise LinattnTypeError(f"cu_seqlens must be an int64 tensor [N+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int64, torch.int32) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise LinattnError(f"cu_seqlens must be an integer tensor of shape [N+1] with N >= 1, "
                           f"got dtype {cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}")
    if B != 1:
        raise LinattnError(f"cu_seqlens packs sequences along T and needs batch size 1 ([1, T_total, ...]), "
                           f"got batch size {B}")
    remember = not torch.compiler.is_compiling()
    seen = _CHECKED_OFFSETS.get(cu_seqlens) if remember else None
    if seen is not None and seen[0] == cu_seqlens._version and seen[1] == T:
        return list(seen[2])
    offs = [int(x) for x in cu_seqlens.tolist()]
    if offs[0] != 0 or offs[-1] != T:
        raise LinattnError(f"cu_seqlens must start at 0 and end at T = {T} (the sequence length), got {offs[0]} ... "
                           f"{offs[-1]}")
    if any(b <= a for a, b in zip(offs[:-1], offs[1:])):
        raise LinattnError(f"cu_seqlens must be strictly increasing (every sequence needs at least one token), "
                           f"got {offs}")
    if remember:
        _CHECKED_OFFSETS[cu_seqlens] = (cu_seqlens._version, T, offs)
    return list(offs)


def cat_parts(parts: Sequence[Any], dim: int) -> Any:
    """Per-sequence results joined along `dim`: tensors by torch.cat, tuples (NamedTuples too) field by field,
    None stays None (a part every sequence leaves out)."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts), dim=dim)
    if isinstance(first, tuple):
        fields = [cat_parts([x[j] for x in parts], dim) for j in range(len(first))]
        return type(first)(*fields) if hasattr(first, "_fields") else tuple(fields)
    raise TypeError(f"cat_parts joins tensors, tuples of them and None, got {type(first).__name__}")


def run_varlen(offsets: Sequence[int], fn: Callable[[int, slice], Tuple[Any, Any]],
               stack_states: Optional[Callable[[List[Any]], Any]] = None, *, dim: int = 1) -> Tuple[Any, Any]:
    """Run `fn(i, tokens)` on each packed sequence i and join the results; the one loop over `cu_seqlens`
    of every operator.

    `fn` gets the sequence index and its slice of the T axis and returns (output, state). The outputs (a tensor
    or a tuple of tensors, whose T axis is `dim`) are concatenated along `dim`; the states are combined by
    `stack_states`, by default concatenated along their first (sequence) axis by `cat_parts`. No information
    crosses a sequence boundary by construction.
    """
    outs, states = [], []
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        o, s = fn(i, slice(a, b))
        outs.append(o)
        states.append(s)
    return cat_parts(outs, dim), (stack_states(states) if stack_states is not None else cat_parts(states, 0))


def pad_time(x: torch.Tensor, multiple: int, dim: int, value: float = 0.0) -> torch.Tensor:
    """Pad dimension `dim` at its end up to a multiple of `multiple`."""
    T = x.shape[dim]
    pad = (-T) % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def reads_values(x: torch.Tensor) -> bool:
    """Whether reading a value of `x` on the host is free (CPU tensors in eager mode) and allowed (the
    checks level is not "shapes"): the forms use it only to skip work that gives the same result."""
    return _checks != "shapes" and x.device.type == "cpu" and not torch.compiler.is_compiling()


def causal_matmul(A: torch.Tensor, X: torch.Tensor, input: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`input + A @ X` for a causally masked A `[..., C, C]` (zero above the diagonal), in which a row
    j of X never reaches an output row i < j, even when X_j holds inf or NaN.

    A plain matmul multiplies the masked zeros A_ij (j > i) by X_j, and 0 * inf = NaN would turn every
    earlier row into NaN. Here the non-finite entries of X are taken out by selection (nan_to_num to 0)
    before the product, and put back into the rows that really see them (i >= j) through a running
    sum down each column, so those rows are still inf or NaN. For finite X both ways give the same
    values (the running sum is exactly 0), so CPU tensors in eager mode, where one reduction tells
    whether X is finite, skip the extra passes when it is; elsewhere the branch-free form always runs.
    """
    if reads_values(X) and bool(torch.isfinite(X.sum())):
        return torch.baddbmm(input, A, X) if (input is not None and A.dim() == 3) else (
            A @ X if input is None else input + A @ X)
    X_safe = torch.nan_to_num(X, nan=0.0, posinf=0.0, neginf=0.0)
    poison = (X - X_safe).cumsum(-2)  # exactly 0 where every earlier X is finite, else inf or NaN
    # the same operations as above, with an exact 0 added: the finite rows keep their bits
    if input is None:
        return A @ X_safe + poison
    return torch.baddbmm(input + poison, A, X_safe) if A.dim() == 3 else (input + poison) + A @ X_safe
