"""Building blocks shared by the layers and models: RMSNorm, gated RMSNorm, RoPE, ShortConv, SwiGLU.

All of them are plain PyTorch and work on the library's `[B, T, ...]` layout.
"""
from __future__ import annotations

import ctypes
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cpu import conv as _cpu_conv
from ..errors import LinattnError
from ..ops.l2norm import L2NORM_EPS, l2norm
from .packing import check_cu_seqlens, packed_positions


def cdt(x: torch.Tensor) -> torch.dtype:
    """Compute dtype: fp64 stays fp64, everything else runs in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension (computed in fp32, or fp64).

    Args:
        dim: The normalised width.
        eps: Added to the mean of squares.
        elementwise_affine: A learnable weight per channel (else none).
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.dim, self.eps = int(dim), float(eps)
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise x over its last dimension.

        Args:
            x: `[..., dim]`.

        Returns:
            The normalised x, in x's dtype.
        """
        w = self.weight
        if not torch.is_grad_enabled() and x.dtype == cdt(x) and (w is None or w.dtype == x.dtype):
            # inference (decoding): one fused call, the same values as the lines below (tests/layers/test_fast_decode)
            return F.rms_norm(x, (self.dim,), w, self.eps)
        xf = x.to(cdt(x))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if w is not None:
            y = y * w.to(xf.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


GATE_ACTIVATIONS = ("silu", "sigmoid")


def gate_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The output gate's activation: silu (FLA, Gated DeltaNet, Mamba2) or sigmoid (Kimi Linear)."""
    return F.silu(x) if name == "silu" else torch.sigmoid(x)


class GatedRMSNorm(RMSNorm):
    """A gated RMSNorm over the last dimension (`dim` channels), in three conventions:

    * gate_before_norm=False (default): RMSNorm(x) * act(gate) (FLA's FusedRMSNormGated, Kimi Linear's with
      act = sigmoid);
    * gate_before_norm=True: RMSNorm(x * act(gate)) (Mamba2's MambaRMSNormGated, norm_before_gate=False);
    * group_size: the mean of squares is taken over groups of `group_size` consecutive channels (Mamba2's
      n_groups: group_size = dim / n_groups) instead of all `dim`; the weight stays one per channel.

    act is silu (default) or sigmoid. Computed in fp32 (fp64 for fp64 inputs), returned in x's dtype.

    Args:
        dim: The channels.
        eps: Added to the mean of squares.
        elementwise_affine: A learnable weight per channel.
        gate_act: "silu" or "sigmoid".
        gate_before_norm: The convention (above).
        group_size: Normalise groups of this many channels (None: all `dim`).
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, *, gate_act: str = "silu",
                 gate_before_norm: bool = False, group_size: Optional[int] = None):
        super().__init__(dim, eps, elementwise_affine)
        if gate_act not in GATE_ACTIVATIONS:
            raise LinattnError(f"gate_act must be one of {GATE_ACTIVATIONS}, got {gate_act!r}")
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                       or group_size < 1 or self.dim % group_size):
            raise LinattnError(f"group_size must be a positive int that divides the normalised width {self.dim} "
                               f"(or None: the whole width), got {group_size!r}")
        self.gate_act, self.gate_before_norm = gate_act, bool(gate_before_norm)
        self.group_size = None if group_size in (None, self.dim) else int(group_size)

    @property
    def plain(self) -> bool:
        """Whether this is the default RMSNorm(x) * silu(gate) (the fast decoding step's form)."""
        return self.gate_act == "silu" and not self.gate_before_norm and self.group_size is None

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Normalise x and apply the gate (class docstring).

        Args:
            x: `[..., dim]`.
            gate: The gate's input `[..., dim]` (act(gate) multiplies); None: no gate.

        Returns:
            The output, in x's dtype.
        """
        if self.plain:
            y = super().forward(x)
            return y if gate is None else y * F.silu(gate)
        xf = x.to(cdt(x))
        if gate is not None and self.gate_before_norm:
            xf = xf * gate_activation(self.gate_act, gate.to(xf.dtype))
        if self.group_size is None:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            xg = xf.unflatten(-1, (self.dim // self.group_size, self.group_size))
            y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        if self.weight is not None:
            y = y * self.weight.to(xf.dtype)
        if gate is not None and not self.gate_before_norm:
            y = y * gate_activation(self.gate_act, gate.to(xf.dtype))
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.plain else f", gate_act={self.gate_act!r}, "
                                       f"gate_before_norm={self.gate_before_norm}, group_size={self.group_size}")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half / GPT-NeoX form) for `[B, T, H, D]` tensors.

    cos/sin tables (fp64, plain attributes rather than buffers, so `model.to(bfloat16)` cannot
    round them) are precomputed for `max_seq_len` positions and extended on demand, so any
    position works. `apply(x, offset)` rotates token t of x as absolute position offset + t;
    `offset` is an int or a `[B]` tensor (per-sequence positions). `apply(x, positions=p)` takes
    explicit integer positions `[T]` or `[B, T]` instead (packed documents restart at 0).

    Args:
        dim: D, the rotated width (even).
        base: The frequency base.
        max_seq_len: The positions precomputed at first.
    """

    def __init__(self, dim: int, base: float = 10000.0, max_seq_len: int = 2048):
        super().__init__()
        if dim % 2:
            raise LinattnError(f"RoPE needs an even head dimension, got {dim}")
        self.dim, self.base = int(dim), float(base)
        self._cos: Optional[torch.Tensor] = None
        self._sin: Optional[torch.Tensor] = None
        self._build(max(1, int(max_seq_len)), torch.device("cpu"))

    def _build(self, n: int, device: torch.device) -> None:
        inv = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim))
        ang = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv[None, :]
        self._cos, self._sin = torch.cos(ang), torch.sin(ang)

    def cos_sin(self, positions: torch.Tensor, need: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (fp64) of integer positions.

        Args:
            positions: Integer positions, any shape.
            need: A number > the largest position, to size the table (None: computed from positions).

        Returns:
            (cos, sin), each `[..., dim/2]` (fp64).
        """
        if need is None:
            need = int(positions.max().item()) + 1 if positions.numel() else 1
        n = self._cos.shape[0]
        if need > n or self._cos.device != positions.device:
            self._build(max(need, n if need <= n else 2 * n), positions.device)
        return self._cos[positions], self._sin[positions]

    def apply(self, x: torch.Tensor, offset=0, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rotate x by its tokens' positions.

        Args:
            x: `[B, T, H, D]`.
            offset: Token t is at absolute position offset + t: an int, or a `[B]` tensor (per-sequence positions).
            positions: Explicit integer positions `[T]` or `[B, T]` instead (packed documents restart at 0).

        Returns:
            The rotated tensor, in x's dtype.

        Raises:
            LinattnError: positions of the wrong shape.
        """
        T = x.shape[1]
        if positions is not None:
            if positions.shape[-1] != T or positions.dim() not in (1, 2):
                raise LinattnError(f"positions must have shape [T] or [B, T] with T = {T}, "
                                   f"got {tuple(positions.shape)}")
            pos = positions.to(device=x.device, dtype=torch.long)
            pos = pos.view(1, T) if pos.dim() == 1 else pos
            need = None
        elif isinstance(offset, torch.Tensor) and offset.dim() == 1:
            pos = offset.to(x.device).view(-1, 1) + torch.arange(T, device=x.device)  # [B, T]
            need = None
        else:
            pos = (int(offset) + torch.arange(T, device=x.device)).view(1, T)
            need = int(offset) + T
        cos, sin = self.cos_sin(pos, need)  # [B or 1, T, D/2]
        xf = x.to(cdt(x))
        cos, sin = cos.unsqueeze(2).to(xf.dtype), sin.unsqueeze(2).to(xf.dtype)  # broadcast over heads
        x1, x2 = xf[..., : self.dim // 2], xf[..., self.dim // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.to(x.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, offset=0,
                positions: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k by their tokens' positions (see `apply`).

        Args:
            q: `[B, T, H, D]`.
            k: `[B, T, H, D]`.
            offset: Token t is at absolute position offset + t (an int or a `[B]` tensor).
            positions: Explicit positions `[T]` or `[B, T]` instead.

        Returns:
            (q, k) rotated.
        """
        return self.apply(q, offset, positions), self.apply(k, offset, positions)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


class _ShiftedTaps(torch.autograd.Function):
    """y = sum_j w[j] * xp[:, j:j + T] for xp `[B, T + K - 1, D]`, w `[K, D]` -> `[B, T, D]` (a causal depthwise
    convolution, ShortConv._taps). Its own backward writes dxp into one buffer with K in-place multiply-adds and
    dw as K per-channel dot products: autograd through the slices would allocate, zero and copy a full-size
    gradient per tap."""

    @staticmethod
    def forward(ctx, xp, w):
        K = w.shape[0]
        T = xp.shape[1] - K + 1
        y = xp[:, :T] * w[0]
        for j in range(1, K):
            y.addcmul_(xp[:, j:j + T], w[j])
        ctx.save_for_backward(xp, w)
        return y

    @staticmethod
    def backward(ctx, g):
        xp, w = ctx.saved_tensors
        K = w.shape[0]
        T = xp.shape[1] - K + 1
        dxp = dw = None
        if ctx.needs_input_grad[0]:
            dxp = torch.zeros_like(xp)
            for j in range(K):
                dxp[:, j:j + T].addcmul_(g, w[j])
        if ctx.needs_input_grad[1]:
            dw = torch.stack([(g * xp[:, j:j + T]).sum((0, 1)) for j in range(K)])
        return dxp, dw


class ShortConv(nn.Module):
    """Causal depthwise 1-D convolution over time (FLA's ShortConvolution, pure PyTorch).

    x `[B, T, D]` -> `[B, T, D]`; output t sees inputs t-K+1..t only. With a `state` (the last
    K-1 inputs, `[B, D, K-1]`) it continues a previous call exactly; it returns the new state.
    With `cu_seqlens` (packed documents, B = 1) the look-back is zeroed at every document start,
    so no output sees a token of an earlier document; the returned state is then None.

    Args:
        dim: D, the channels.
        kernel_size: K, the taps.
        activation: "silu" or None, applied to the output.
        bias: A bias per channel.

    Raises:
        LinattnError: kernel_size below 1 or an unknown activation.

    Examples:
        >>> import torch
        >>> from linattn.layers import ShortConv
        >>> conv = ShortConv(8, kernel_size=4)
        >>> x = torch.randn(2, 10, 8)
        >>> y, state = conv(x)
        >>> y2, _ = conv(x[:, 6:], state=conv(x[:, :6])[1])   # continue from the state
        >>> torch.allclose(y[:, 6:], y2, atol=1e-6)
        True
    """

    def __init__(self, dim: int, kernel_size: int = 4, activation: Optional[str] = "silu", bias: bool = False):
        super().__init__()
        if kernel_size < 1:
            raise LinattnError(f"kernel_size must be >= 1, got {kernel_size}")
        if activation not in (None, "silu", "swish"):
            raise LinattnError(f"activation must be None or 'silu', got {activation!r}")
        self.dim, self.kernel_size, self.activation = int(dim), int(kernel_size), activation
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Conv1d's default
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, state: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Convolve x causally over time, continuing from `state`.

        Args:
            x: The input `[B, T, D]`.
            state: The last K-1 inputs of a previous call `[B, D, K-1]`, or None (zeros before the first token).
            cu_seqlens: int64 `[N+1]` offsets of packed documents (B = 1): the look-back is zeroed at every start.

        Returns:
            (y `[B, T, D]`, the new state `[B, D, K-1]`, or None with cu_seqlens).
        """
        B, T, D = x.shape
        if cu_seqlens is not None:
            if state is not None:
                raise LinattnError("ShortConv: a state (decoding) cannot be combined with cu_seqlens "
                                   "(packed documents)")
            return self._packed(x, check_cu_seqlens(cu_seqlens, B, T)), None
        if T > 1 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
            return self._taps(x, state)   # (bf16 / fp16 keep conv1d, which accumulates in fp32)
        xt = x.transpose(1, 2)
        if state is None:
            state = xt.new_zeros(B, D, self.kernel_size - 1)
        xp = torch.cat([state.to(xt.dtype), xt], dim=-1)
        bias = None if self.bias is None else self.bias.to(xt.dtype)
        if T == 1:
            # one decoded token: a dot product per channel; a depthwise conv1d call costs ~10x more here
            y = (xp * self.weight.to(xt.dtype).view(D, -1)).sum(-1, keepdim=True)
            y = y if bias is None else y + bias[:, None]
        else:
            y = F.conv1d(xp, self.weight.to(xt.dtype), bias, groups=D)
        if self.activation is not None:
            y = F.silu(y)
        new_state = xp[..., xp.shape[-1] - (self.kernel_size - 1):]
        return y.transpose(1, 2), new_state

    def _taps(self, x: torch.Tensor, state: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The convolution on the CPU as K multiply-adds of shifted inputs in x's own [B, T, D] layout: the
        same values as F.conv1d (to rounding), but its backward is a few elementwise passes, where the
        depthwise conv1d's (mkldnn) backward took ~30% of a Gated DeltaNet LM's training step."""
        B, T, D = x.shape
        K = self.kernel_size
        w = self.weight.to(x.dtype).view(D, K).t().contiguous()                 # [K, D]: contiguous taps
        if _cpu_conv.available(x.dtype) and T >= K - 1:   # no padded copy: the kernel reads the look-back apart
            past = state.to(x.dtype).transpose(1, 2) if state is not None else None
            y = _cpu_conv.short_conv_sep(x, past, w, None if self.bias is None else self.bias.to(x.dtype),
                                         self.activation is not None)
            return y, x[:, T - (K - 1):].transpose(1, 2).contiguous()
        if state is None:
            xp = F.pad(x, (0, 0, K - 1, 0))                                      # [B, T + K - 1, D]
        else:
            xp = torch.cat([state.to(x.dtype).transpose(1, 2), x], dim=1)
        if _cpu_conv.available(x.dtype):   # the compiled kernel (cpu/conv.py): SiLU fused, one pass each way
            y = _cpu_conv.short_conv(xp, w, None if self.bias is None else self.bias.to(x.dtype),
                                     self.activation is not None)
        else:
            y = _ShiftedTaps.apply(xp, w)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
            if self.activation is not None:
                y = F.silu(y)
        # the last K - 1 inputs, [B, D, K - 1], copied: a view would keep the whole padded input alive in a cache
        return y, xp[:, T:].transpose(1, 2).contiguous()

    def _packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The convolution of packed documents: window tap i of output t reads input t - (K-1) + i,
        kept only when that input lies in t's own document (position in document >= K-1-i)."""
        _, T, D = x.shape
        K = self.kernel_size
        xt = x.transpose(1, 2)                                            # [1, D, T]
        win = F.pad(xt, (K - 1, 0)).unfold(-1, K, 1)                      # [1, D, T, K]
        pos = packed_positions(cu_seqlens, T, x.device)                   # [T]
        keep = torch.arange(K, device=x.device)[None, :] >= (K - 1 - pos)[:, None]   # [T, K]
        w = self.weight.to(xt.dtype).view(D, K)
        y = torch.einsum("bdtk,dk->bdt", win * keep.to(xt.dtype), w)
        if self.bias is not None:
            y = y + self.bias.to(xt.dtype)[:, None]
        if self.activation is not None:
            y = F.silu(y)
        return y.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"{self.dim}, kernel_size={self.kernel_size}, activation={self.activation}"


class SwiGLU(nn.Module):
    """w_down(silu(x w_gate) * (x w_up)), bias-free by default.

    Args:
        d_model: The input and output width.
        hidden: The inner width; defaults to 8/3 d, rounded up to 32.
        bias: Biases on the three projections.
    """

    def __init__(self, d_model: int, hidden: Optional[int] = None, bias: bool = False):
        super().__init__()
        if hidden is None:
            hidden = 32 * math.ceil(8 * d_model / 3 / 32)
        self.d_model, self.hidden = int(d_model), int(hidden)
        self.w_gate_up = nn.Linear(d_model, 2 * hidden, bias=bias)
        self.w_down = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """w_down(silu(x w_gate) * (x w_up)).

        Args:
            x: `[..., d_model]`.

        Returns:
            `[..., d_model]`.
        """
        a, b = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(a) * b)


class FusedParams:
    """Concatenations (along dim 0) of several parameters, e.g. the weights of the q/k/v/gate
    projections of one layer, so that a single-token decoding step runs one matrix-vector product
    instead of one per projection. Built on first use and reused while every part is unchanged: the
    key is each part's version counter (bumped by in-place updates: optimizer steps, load_state_dict,
    `with torch.no_grad(): p.copy_(...)`), storage address and dtype (`.to()`, new `.data`). Writes
    through `p.data` bypass the version counter; call `clear()` after those. Not a buffer: the
    state dict and the parameters are untouched. Use it only without autograd (the results are
    detached)."""

    __slots__ = ("_key", "_value", "_last")

    def __init__(self):
        self._key = self._value = self._last = None

    def clear(self) -> None:
        """Forget the concatenations. The last ones stay a candidate: the next `get` reuses those same tensors when
        every part still equals its rows bit for bit (a read instead of a new copy: a new generation after nothing
        changed, `LanguageModel.new_cache`, costs no re-fusing and keeps the plans that point into them)."""
        if self._value is not None:
            self._last = (self._key, self._value)
        self._key, self._value = None, None

    def get(self, *groups) -> Tuple[torch.Tensor, ...]:
        """One torch.cat(group) along dim 0 per group (a list of parameters); an int n in a group
        stands for n zero rows (a missing bias); an empty group gives None."""
        key = tuple((p._version, p.data_ptr(), p.dtype) if isinstance(p, torch.Tensor) else p
                    for g in groups for p in (*g, None))
        if key != self._key:
            with torch.no_grad():
                last, self._last = self._last, None
                if last is not None and last[0] == key and all(map(self._holds, last[1], groups)):
                    self._value = last[1]
                else:
                    self._value = tuple(self._cat(g) for g in groups)
            self._key = key
        return self._value

    @staticmethod
    def _holds(cat: Optional[torch.Tensor], group) -> bool:
        """Whether `cat` is still `_cat(group)`, bit for bit."""
        if cat is None:
            return not any(isinstance(p, torch.Tensor) for p in group)
        row = 0
        for p in group:
            n = p.shape[0] if isinstance(p, torch.Tensor) else p
            part = cat[row:row + n]
            if not (_same_bits(part, p.detach()) if isinstance(p, torch.Tensor) else not part.any()):
                return False
            row += n
        return row == cat.shape[0]

    @staticmethod
    def _cat(group) -> Optional[torch.Tensor]:
        ref = next((p for p in group if isinstance(p, torch.Tensor)), None)
        if ref is None:
            return None
        return torch.cat([p.detach() if isinstance(p, torch.Tensor) else ref.new_zeros((p,) + tuple(ref.shape[1:]))
                          for p in group])

    def __repr__(self) -> str:
        return f"FusedParams({'built' if self._value is not None else 'empty'})"

    def __reduce__(self):  # pickling / deepcopy give an empty one: rebuilt on first use
        return (FusedParams, ())


def _libc_memcmp():
    try:
        fn = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_int
    return fn


_MEMCMP = _libc_memcmp()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits: libc's memcmp over contiguous CPU storage (a read at memory speed;
    torch.equal builds an elementwise mask first, several times slower on large weights), else torch.equal."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if (_MEMCMP is None or a.device.type != "cpu" or b.device.type != "cpu" or not a.is_contiguous()
            or not b.is_contiguous()):
        return torch.equal(a, b)
    return _MEMCMP(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0


def mamba_log_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, owner: Optional[nn.Module] = None):
    """Mamba2's log-decay -exp(A_log) * softplus(a + dt_bias), in fp32 (fp64 when a is fp64: an fp64 model
    keeps its precision). With `owner` (single-token decoding without autograd) -exp(A_log) is kept on it
    while A_log is unchanged (the same values)."""
    f = cdt(a)
    neg_a = -torch.exp(A_log.to(f)) if owner is None else mamba_neg_a(A_log, f, owner)
    a = a if a.dtype == f else a.to(f)
    return neg_a * F.softplus(a + (dt_bias if dt_bias.dtype == f else dt_bias.to(f)))


def init_mamba_decay(n_heads: int, A_range=(1.0, 16.0), dt_min: float = 1e-3, dt_max: float = 0.1):
    """Mamba2's initialisation: A ~ U(A_range) (stored as log A), dt ~ logU(dt_min, dt_max)
    (stored through the inverse softplus as dt_bias)."""
    A = torch.empty(n_heads).uniform_(*A_range)
    dt = torch.exp(torch.rand(n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
    return torch.log(A), dt_bias


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS, convention: str = "rsqrt") -> torch.Tensor:
    """x / ||x|| over the last dimension (in fp32, or fp64), the delta rule's q/k normalisation.

    The operators' own implementation (`linattn.ops.l2norm`).

    Args:
        x: The tensor `[..., K]`.
        eps: The floor.
        convention: "rsqrt" x * rsqrt(sum x^2 + eps) or "clamp" x / max(||x||, eps).

    Returns:
        The normalised tensor, in x's dtype.
    """
    return l2norm(x.to(cdt(x)), convention, eps).to(x.dtype)


def mamba_neg_a(A_log: torch.Tensor, f: torch.dtype, owner: nn.Module) -> torch.Tensor:
    """-exp(A_log) in dtype f, detached, kept on `owner` while A_log is unchanged (decoding without autograd)."""
    key = (A_log._version, A_log.data_ptr(), A_log.dtype, f)
    kept = owner.__dict__.get("_neg_exp_A_log")
    if kept is None or kept[0] != key:
        kept = owner.__dict__["_neg_exp_A_log"] = (key, -torch.exp(A_log.detach().to(f)))
    return kept[1]
