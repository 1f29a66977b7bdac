"""Delta-rule layers: `DeltaNet`, `GatedDeltaNet` and `EFLA` (error-free linear attention).

All three follow FLA's layer pattern: q/k/v projections, a short causal convolution (kernel 4,
SiLU) on each, a per-head write strength beta from `b_proj`, the `linattn.delta_rule` operator,
a per-head output norm (gated by `g_proj` for Gated DeltaNet) and `o_proj`. With n_value_heads = HV
(Qwen3-Next's grouped value heads, a multiple of n_heads) v, beta, the decay, the output norm and gate are
per value head, and value head j reads q/k head j // (HV / n_heads). beta and the decay are computed in
fp32, or fp64 in an fp64 model.

* DeltaNet:       S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, q and k L2-normalised.
* GatedDeltaNet:  the same with a decay exp(g_t) per head, g = -exp(A_log) * softplus(a_proj(x) + dt_bias).
* EFLA:           the exact solution of dS/dt = -k k^T S + k v^T over a step beta:
                  alpha_t = (1 - exp(-beta_t |k_t|^2)) / |k_t|^2 replaces beta_t. Keys keep their
                  norm (it is EFLA's dynamic gate); queries are L2-normalised by default.
                  Variants of beta (EFLA paper, section 5.2):
                    "sigmoid"   beta = sigmoid(b_proj(x))                     (the default)
                    "adaptive"  beta = softplus(alpha) * sigmoid(b_proj(x)), a learnable alpha per head
                                ("Adaptive Decay"; initialised so that softplus(alpha) = 1)
                    "loose"     beta = softplus(b_proj(x))                    ("Loose beta", no upper bound)
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cpu import delta as _cpu_delta
from ..errors import LinattnError
from ..ops import delta_rule
from ..ops.l2norm import L2NORM_CONVENTIONS, L2NORM_EPS
from .base import AttentionBase
from .cache import LayerCache
from .common import cdt, init_mamba_decay, l2_normalize, mamba_log_decay
from .registry import register_mixer

BETA_MODES = ("sigmoid", "adaptive", "loose")
QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
#: the q/k normalisations (`qk_norm`), last dimension, eps = 1e-6 (docs/conventions.md)
QK_NORMS = ("l2", "l2-clamp", "sum", "none")


class DeltaNet(AttentionBase):
    """DeltaNet layer (Yang et al. 2024): delta rule with sigmoid beta and L2-normalised q, k.

    The options after qk_activation are flash-linear-attention's layers' (`linattn.hf.import_fla`); each
    default keeps the layer as it was.

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        chunk_size: for the operator.
        scale: for q (None, the default, means head_dim**-0.5).
        short_conv: The short convolution on q, k, v (default True).
        output_norm: The per-head output norm (default True).
        beta_bias: (True): b_proj has a bias (fla's has none).
        use_beta: (True): False means beta = 1 and no b_proj.
        allow_negative_eigenvalues: (False): beta doubled, so 1 - beta ||k||^2 reaches -1 (state tracking).
        qk_activation: ("silu", `QK_ACTIVATIONS`): the q/k feature activation, "silu" being the short
            convolution's; "relu", "elu" (elu + 1) or "identity" replace it (the q/k convolutions then have none),
            as fla's DeltaNet.
        activation_without_conv: (False): without a short convolution q, k and v are the plain projections; True
            applies SiLU to them anyway (q and k: unless qk_activation says otherwise), as all of fla's delta layers.
        qk_norm: The q/k normalisation, one of the class's `qk_norms` (`QK_NORMS`): "l2" (the default)
            x * rsqrt(sum x^2 + 1e-6), as fla and transformers; "l2-clamp" x / max(||x||, 1e-6), what checkpoints
            written before the choice existed used (`LMConfig.l2norm_convention="clamp"`); "sum" x / max(sum |x|,
            1e-6), fla's DeltaNet qk_norm="sum"; "none" (EFLA: its queries; keys are never normalised there).
        l2norm_convention: Deprecated (a DeprecationWarning): "clamp" means qk_norm="l2-clamp", "rsqrt" "l2".
        **kwargs: `AttentionBase`'s options (head_dim, n_value_heads, output_gate, ...).

    Raises:
        LinattnError: A bad option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import DeltaNet, LayerCache
        >>> layer = DeltaNet(64, 4).double()
        >>> x = torch.randn(2, 10, 64, dtype=torch.float64)
        >>> y = layer(x)
        >>> cache = LayerCache()                     # prefill 9 tokens, then decode the 10th
        >>> _ = layer(x[:, :9], cache)
        >>> torch.allclose(layer(x[:, 9:], cache), y[:, 9:])
        True
    """

    exact = False
    #: the `qk_norm` values this layer takes ("l2", the default, first)
    qk_norms: Tuple[str, ...] = ("l2", "l2-clamp", "sum")
    #: whether qk_norm normalises the keys too (EFLA: the queries only)
    normalises_keys = True
    # LMConfig.l2norm_convention is the L2 form of the model's "l2" layers (`config_kwargs` folds it into qk_norm)
    config_fields = AttentionBase.config_fields + ("chunk_size", "l2norm_convention", "n_value_heads")

    def __init__(self, d_model: int, n_heads: int, *, chunk_size: int = 64, scale: Optional[float] = None,
                 short_conv: bool = True, output_norm: bool = True, qk_norm: Optional[str] = None,
                 beta_bias: bool = True, use_beta: bool = True, allow_negative_eigenvalues: bool = False,
                 qk_activation: str = "silu", activation_without_conv: bool = False,
                 l2norm_convention: Optional[str] = None, **kwargs):
        if l2norm_convention is not None:
            warnings.warn(f"{type(self).__name__}(l2norm_convention=...) is deprecated: give qk_norm='l2' (the rsqrt "
                          f"form) or qk_norm='l2-clamp' (the clamp form) instead", DeprecationWarning, stacklevel=2)
            if l2norm_convention not in L2NORM_CONVENTIONS:
                raise LinattnError(f"l2norm_convention must be one of {L2NORM_CONVENTIONS}, got "
                                   f"{l2norm_convention!r}")
        qk_norm = self.resolve_qk_norm(qk_norm, l2norm_convention)
        if qk_norm not in self.qk_norms:
            raise LinattnError(f"qk_norm must be one of {self.qk_norms} for {type(self).__name__}, got {qk_norm!r}")
        if qk_activation not in QK_ACTIVATIONS:
            raise LinattnError(f"qk_activation must be one of {QK_ACTIVATIONS}, got {qk_activation!r}")
        super().__init__(d_model, n_heads, short_conv=short_conv, output_norm=output_norm, **kwargs)
        # the one option, and what the operator and the decoding steps read from it (plain attributes)
        self.qk_norm = qk_norm
        self.qk_l2norm = self.normalises_keys and qk_norm in ("l2", "l2-clamp")   # q and k, inside the operator
        self.l2norm_convention = "clamp" if qk_norm == "l2-clamp" else "rsqrt"
        self.q_l2norm = not self.normalises_keys and qk_norm == "l2"              # the queries only, by the layer
        self.chunk_size = int(chunk_size)
        self.scale = self.resolve_scale(scale, self.head_dim)
        self.use_beta = bool(use_beta)
        self.allow_negative_eigenvalues = bool(allow_negative_eigenvalues)
        self.qk_activation = qk_activation
        self.activation_without_conv = bool(activation_without_conv)
        if self.use_beta:
            self.b_proj = nn.Linear(d_model, self.n_value_heads, bias=bool(beta_bias))     # one beta per value head
        if qk_activation != "silu" and self.short_conv:   # the activation comes after the q/k convolutions
            self.q_conv.activation = self.k_conv.activation = None

    @classmethod
    def resolve_qk_norm(cls, qk_norm: Optional[str], l2norm_convention: Optional[str] = None,
                        q_l2norm: Optional[bool] = None) -> str:
        """The `qk_norm` that the old options meant: `l2norm_convention` "clamp" turns "l2" into "l2-clamp" where
        the layer had that choice (the operator normalised q and k), EFLA's `q_l2norm` is "l2" or "none".

        Args:
            qk_norm: The new option, or None (the default, "l2", unless q_l2norm says otherwise).
            l2norm_convention: "rsqrt", "clamp" or None.
            q_l2norm: EFLA's old switch, or None.

        Returns:
            The qk_norm value.
        """
        if qk_norm is None:
            qk_norm = "none" if q_l2norm is False else "l2"
        if qk_norm == "l2" and l2norm_convention == "clamp" and "l2-clamp" in cls.qk_norms:
            return "l2-clamp"
        return qk_norm

    @classmethod
    def config_kwargs(cls, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The keyword arguments for this layer from what the registry gives it (`build_mixer`: a model config's
        fields and mixer_kwargs): the model's `l2norm_convention` and a saved config's old options fold into
        `qk_norm`, without a warning (a saved config keeps its meaning).

        Args:
            kwargs: The config fields and mixer_kwargs for the layer.

        Returns:
            The same without `l2norm_convention` / `q_l2norm`, with `qk_norm`.
        """
        kw = dict(kwargs)
        kw["qk_norm"] = cls.resolve_qk_norm(kw.get("qk_norm"), kw.pop("l2norm_convention", None),
                                            kw.pop("q_l2norm", None))
        return kw

    @property
    def _plain_features(self) -> bool:
        """Whether q, k, v are the base layer's (the options above at their defaults)."""
        return self.qk_activation == "silu" and not (self.activation_without_conv and not self.short_conv)

    def _features(self, q, k, v):
        """The q/k/v activations of the options above (elementwise, any shape)."""
        if self.activation_without_conv and not self.short_conv:
            v = F.silu(v)
            if self.qk_activation == "silu":
                q, k = F.silu(q), F.silu(k)
        if self.qk_activation == "relu":
            q, k = F.relu(q), F.relu(k)
        elif self.qk_activation == "elu":
            q, k = F.elu(q) + 1.0, F.elu(k) + 1.0
        return q, k, v

    def _qkv(self, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        q, k, v = super()._qkv(x, cache, cu_seqlens)
        return (q, k, v) if self._plain_features else self._features(q, k, v)

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        """The write strength per token and value head: the hook a delta variant overrides.

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            beta `[B, T, HV]` (HV = n_value_heads), in fp32 (fp64 in an fp64 model).
        """
        if not self.use_beta:
            f = cdt(x)
            return torch.full((*x.shape[:2], self.n_value_heads), 2.0 if self.allow_negative_eigenvalues else 1.0,
                              dtype=f, device=x.device)
        return self._beta_of(self.b_proj(x))

    def _beta_of(self, b: torch.Tensor) -> torch.Tensor:
        """beta from the b_proj output, in fp32 (fp64 in an fp64 model)."""
        beta = torch.sigmoid(b.to(cdt(b)))
        return 2.0 * beta if self.allow_negative_eigenvalues else beta

    def log_gate(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The log-decay per token: the hook a gated variant overrides (DeltaNet has none).

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            g `[B, T, HV]` (per head) or `[B, T, HV, K]` (per key channel), <= 0; or None (no decay).
        """
        return None

    def _prepare_qk(self, q, k):
        return q, k

    # -- single-token decoding (fast_decode.py's "delta" step) --------------------------------------
    def fast_step_kind(self) -> Optional[str]:
        # subclasses change the operator; fla's options (hf import) change q/k/v or beta: the general path
        if type(self) not in (DeltaNet, GatedDeltaNet, EFLA) or not getattr(self, "_plain_features", True) \
                or not getattr(self, "use_beta", True) or getattr(self, "allow_negative_eigenvalues", False) \
                or self.qk_norm == "sum":
            return None
        return "delta"

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        q, k = self._prepare_qk(q, k)
        l2 = self.l2norm_convention if self.qk_l2norm else False
        if self.qk_norm == "sum":   # fla's sum_norm: F.normalize(x, p=1, eps=1e-6), in place of the L2 norm
            q, k = (F.normalize(t.to(cdt(t)), p=1.0, dim=-1, eps=1e-6).to(t.dtype) for t in (q, k))
            l2 = False
        beta = self.beta(x).to(q.dtype)
        g = self.log_gate(x)
        o, state = delta_rule(
            q, k, v, beta, g=g, exact=self.exact, scale=self.scale, qk_l2norm=l2,
            mode=self._mode(cache, x.shape[1]), chunk_size=self.chunk_size,
            initial_state=cache.state if cache is not None else None,
            output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.state = state
        return o


class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet (Yang et al. 2024b): DeltaNet with a Mamba2-style decay per head and an
    output gate (gated RMSNorm).

    The decay is exp(g_t) with g = -exp(A_log) * softplus(a_proj(x) + dt_bias) (module docstring).

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        output_gate: defaults to True.
        **kwargs: `DeltaNet`'s options (chunk_size, scale, qk_norm, ...) and `AttentionBase`'s
            (head_dim, n_value_heads, ...).

    Examples:
        >>> import torch
        >>> from linattn.layers import GatedDeltaNet, LayerCache
        >>> layer = GatedDeltaNet(64, 4).double()
        >>> x = torch.randn(2, 10, 64, dtype=torch.float64)
        >>> y = layer(x)
        >>> cache = LayerCache()                     # prefill 9 tokens, then decode the 10th
        >>> _ = layer(x[:, :9], cache)
        >>> torch.allclose(layer(x[:, 9:], cache), y[:, 9:])
        True
    """

    def __init__(self, d_model: int, n_heads: int, *, output_gate: bool = True, **kwargs):
        super().__init__(d_model, n_heads, output_gate=output_gate, **kwargs)
        self.a_proj = nn.Linear(d_model, self.n_value_heads, bias=False)     # one decay per value head
        A_log, dt_bias = init_mamba_decay(self.n_value_heads)
        self.A_log = nn.Parameter(A_log)
        self.dt_bias = nn.Parameter(dt_bias)

    def log_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The Mamba2-style log-decay g = -exp(A_log) * softplus(a_proj(x) + dt_bias) per head.

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            g `[B, T, HV]`, <= 0.
        """
        return self._gate_of(self.a_proj(x))

    def _gate_of(self, a: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """The log-decay from the a_proj output (fast: -exp(A_log) kept between decoding steps)."""
        return mamba_log_decay(a, self.A_log, self.dt_bias, self if fast else None)


class EFLA(DeltaNet):
    """Error-Free Linear Attention (Lei et al.): the delta rule integrated exactly.

    Keys are never normalised (their norm is the dynamic gate).

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        beta_mode: "sigmoid" | "adaptive" | "loose" (module docstring).
        q_l2norm: Deprecated (a DeprecationWarning): False means qk_norm="none", True "l2".
        **kwargs: `DeltaNet`'s options (chunk_size, scale, qk_norm: "l2", the default, normalises the queries,
            "none" leaves them; keys never are) and `AttentionBase`'s.

    Raises:
        LinattnError: A bad beta_mode or other option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import EFLA
        >>> EFLA(64, 4, beta_mode="adaptive")(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    exact = True
    qk_norms = ("l2", "none")
    normalises_keys = False

    def __init__(self, d_model: int, n_heads: int, *, beta_mode: str = "sigmoid", q_l2norm: Optional[bool] = None,
                 **kwargs):
        if q_l2norm is not None:
            warnings.warn("EFLA(q_l2norm=...) is deprecated: give qk_norm='l2' (queries normalised) or qk_norm='none'",
                          DeprecationWarning, stacklevel=2)
            kwargs["qk_norm"] = self.resolve_qk_norm(kwargs.get("qk_norm"), q_l2norm=bool(q_l2norm))
        if beta_mode not in BETA_MODES:
            raise LinattnError(f"beta_mode must be one of {BETA_MODES}, got {beta_mode!r}")
        if kwargs.get("allow_negative_eigenvalues") or not kwargs.get("use_beta", True):
            raise LinattnError("EFLA takes neither allow_negative_eigenvalues=True nor use_beta=False (beta_mode "
                               "chooses its beta)")
        super().__init__(d_model, n_heads, **kwargs)
        self.beta_mode = beta_mode
        if beta_mode == "adaptive":
            # softplus(alpha) = 1 at init, i.e. alpha = log(e - 1)
            self.beta_alpha = nn.Parameter(torch.full((self.n_value_heads,), math.log(math.e - 1.0)))

    def _beta_of(self, b: torch.Tensor) -> torch.Tensor:
        b = b.to(cdt(b))
        if self.beta_mode == "loose":
            return F.softplus(b)
        beta = torch.sigmoid(b)
        if self.beta_mode == "adaptive":
            beta = F.softplus(self.beta_alpha.to(b.dtype)) * beta
        return beta

    def _prepare_qk(self, q, k):
        if not self.q_l2norm:
            return q, k
        if q.device.type == "cpu" and q.shape[-1] and _cpu_delta.prep_available(q.dtype):
            return _cpu_delta.l2_rows(q, L2NORM_EPS), k   # one compiled pass each way, l2_normalize's values
        return l2_normalize(q), k

    def extra_repr(self) -> str:
        return super().extra_repr() + f", beta_mode={self.beta_mode!r}"


# the mixers of this module (their registration order is the order of linattn.mixers(): see layers/__init__.py)
register_mixer("deltanet", DeltaNet, {}, "DeltaNet: delta rule, sigmoid beta, L2-normalised q/k", short_conv=True)
register_mixer("gated-deltanet", GatedDeltaNet, {}, "Gated DeltaNet: delta rule with a scalar decay",
               short_conv=True)
register_mixer("efla", EFLA, {"beta_mode": "sigmoid"}, "EFLA: exactly integrated delta rule", short_conv=True)
register_mixer("efla-adaptive", EFLA, {"beta_mode": "adaptive"}, "EFLA + adaptive decay softplus(alpha)*beta",
               short_conv=True)
register_mixer("efla-loose", EFLA, {"beta_mode": "loose"}, "EFLA + loose beta (softplus)", short_conv=True)
