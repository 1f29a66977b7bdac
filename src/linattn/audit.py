"""Causality audit: does any output depend on a later token?

`check_causality(model)` feeds random sequences, then for each cut position p replaces every
token after p with other random tokens and compares the outputs at positions 0..p. A causal
model gives identical outputs there (up to `atol`); any position that changes is reported.

The audit runs on a float64 copy of the model by default: a causal model then changes no earlier
output by more than rounding (~1e-15 relative; on CPU exactly 0), while a leak shows up however
small the leaking path is at initialisation (a freshly initialised bidirectional lobe moves earlier
logits by only ~1e-6, below fp32 noise on some hardware).

This is how the ELA memory lobe's "sudden drop" is exposed: its bidirectional form lets
position t read tokens after t, the audit flags it, and with a causal lobe the drop vanishes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .errors import LinattnError


@dataclass
class CausalityReport:
    """Result of `check_causality`; true when the model passed.

    Attributes:
        ok: no earlier output changed.
        offending_positions: the positions whose output changed when only later tokens did.
        max_diff: the largest change at a position that should not have changed.
        seq_len: The length of the probe sequences.
        cuts: The cut positions tried.
        atol: The tolerance used.
        dtype: The dtype the audit ran in.
        leaks: {cut p: positions <= p that changed}.
    """
    ok: bool
    offending_positions: List[int]
    max_diff: float
    seq_len: int
    cuts: List[int]
    atol: float
    dtype: str = "float64"
    leaks: Dict[int, List[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return (f"causality audit passed: perturbing tokens after each of {len(self.cuts)} cut positions "
                    f"(seq_len {self.seq_len}, {self.dtype}) never changed an earlier output "
                    f"(max change {self.max_diff:.3g} <= tolerance {self.atol:.3g})")
        first = sorted(self.leaks.items())[:3]
        detail = "; ".join(f"changing tokens after {p} moved outputs at {v[:8]}{'...' if len(v) > 8 else ''}"
                           for p, v in first)
        return (f"causality audit FAILED: {len(self.offending_positions)} position(s) see later tokens "
                f"(max change {self.max_diff:.3g} > tolerance {self.atol:.3g}, {self.dtype}); offending positions "
                f"{self.offending_positions[:16]}{'...' if len(self.offending_positions) > 16 else ''}. {detail}")

    __repr__ = __str__


def _outputs(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.double() if out.dtype == torch.float64 else out.float()


@torch.no_grad()
def check_causality(model: Callable, seq_len: int = 32, batch_size: int = 2, vocab_size: Optional[int] = None,
                    cuts: Optional[Sequence[int]] = None, atol: Optional[float] = None, seed: int = 0,
                    dtype: Optional[torch.dtype] = torch.float64, device=None,
                    exact: bool = False) -> CausalityReport:
    """Audit `model` (ids `[B, T]` -> logits `[B, T, V]`, or an object with `.logits`) for causality.

    The model is audited in eval mode; the caller's model is left untouched.

    Args:
        model: The model to audit: any callable from token ids `[B, T]` to logits (module docstring).
        seq_len: The length of the random probe sequences.
        batch_size: The number of random probe sequences.
        vocab_size: token range (default `model.config.vocab_size`).
        cuts: the positions p after which tokens are replaced (default: every p in 0..seq_len-2).
        atol: the largest change still counted as "unchanged"; default 1e-9 (float64) or 1e-5
            (other dtypes), times max(1, max |logit|).
        seed: seeds the probe tokens.
        dtype: run the audit on a copy of the model (an nn.Module) converted to this dtype
            (default float64); None audits the model as it is.
        device: The device of the probe tokens (None: the model's).
        exact: bitwise mode: an earlier output may not change at all, not even by rounding
            (atol = 0). linattn's operators make every data-dependent choice (stabilisers, shifts,
            paths) from tokens up to the output position, so their models pass it in any dtype.

    Returns:
        A `CausalityReport`, true when no earlier output changed; `str(report)` says what leaked.

    Raises:
        LinattnError: A bad argument (e.g. no vocab_size and no `model.config.vocab_size`).

    Examples:
        >>> from linattn import LanguageModel, LMConfig, audit
        >>> model = LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, mixer="gated-deltanet"))
        >>> report = audit.check_causality(model, seq_len=8)
        >>> report.ok
        True
    """
    if not isinstance(exact, bool):
        raise LinattnError(f"exact must be a bool, got {exact!r}")
    if exact:
        if atol not in (None, 0):
            raise LinattnError(f"exact=True compares bits (atol = 0); got atol={atol!r}")
        atol = 0.0
    if vocab_size is None:
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab_size is None:
            raise LinattnError("pass vocab_size: the model has no config.vocab_size")
    if seq_len < 2:
        raise LinattnError(f"seq_len must be >= 2, got {seq_len}")
    if vocab_size < 2:
        raise LinattnError(f"vocab_size must be >= 2 to perturb tokens, got {vocab_size}")
    cuts = list(range(seq_len - 1)) if cuts is None else sorted(int(c) for c in cuts)
    if any(not 0 <= c < seq_len - 1 for c in cuts):
        raise LinattnError(f"cuts must lie in [0, seq_len - 2] = [0, {seq_len - 2}], got {cuts}")
    is_module = isinstance(model, torch.nn.Module)
    if device is None:
        p = next(iter(model.parameters()), None) if is_module else None
        device = p.device if p is not None else torch.device("cpu")
    used = "as is"
    if is_module and dtype is not None:
        model = copy.deepcopy(model).to(dtype)
        used = str(dtype).replace("torch.", "")
    was_training = getattr(model, "training", None)
    if was_training is not None:
        model.eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g).to(device)
    try:
        base = _outputs(model, ids)
        if atol is None:
            atol = (1e-9 if dtype == torch.float64 else 1e-5) * max(1.0, float(base.abs().max()))
        offending, leaks, max_diff = set(), {}, 0.0
        for p in cuts:
            pert = ids.clone()
            shift = torch.randint(1, vocab_size, (batch_size, seq_len - p - 1), generator=g).to(device)
            pert[:, p + 1:] = (ids[:, p + 1:] + shift) % vocab_size  # every later token differs
            diff = (_outputs(model, pert)[:, : p + 1] - base[:, : p + 1]).abs()
            diff = torch.nan_to_num(diff, nan=float("inf")).amax(dim=(0, 2))  # per position
            max_diff = max(max_diff, float(diff.max()))
            bad = [int(i) for i in torch.nonzero(diff > atol).flatten()]
            if bad:
                leaks[p] = bad
                offending.update(bad)
    finally:
        if was_training:
            model.train()
    return CausalityReport(ok=not offending, offending_positions=sorted(offending), max_diff=max_diff,
                           seq_len=seq_len, cuts=cuts, atol=atol, dtype=used, leaks=leaks)
