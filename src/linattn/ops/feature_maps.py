"""Feature maps: a kernel k(a, b) = phi(a) . psi(b) written as a (phi, psi) pair.

phi is applied to queries, psi to keys; they need not be equal (ELA section III: the decomposition
needs no symmetry). Two kinds exist:

* linear-space maps return the features themselves (elu+1, relu, the squared-Euclidean kernels...);
* log-space maps (`log_space = True`) return the *logarithm* of positive features. The kernels
  built on exp (Hadamard Exp, FAVOR+) overflow fp32 for inputs around 45, so the operators take
  their log-features and stabilise them with running maxima, as online softmax does.

Positional maps (`positional = True`, cosFormer) also take the absolute token positions.

Each map carries its own capabilities, so the operators and backends ask the object and never a
list of names: `log_space`, `positional`, `fused_kernel` (the name of the in-kernel form the Triton
kernels fuse, or None: the features are then computed by PyTorch first), `feature_dim(head_dim)`
(the width K_phi of phi and psi), the classmethod `build(head_dim, *, max_seq_len=None, seed=0)` (how
`get_feature_map` and the `LinearAttention` layer make one from what the layer knows: cosFormer takes its
horizon from max_seq_len, FAVOR+ its draw from seed) and `kernel(a, b)`, k(a_i, b_j) written from the formula
for the fp64 references.

Registry. `register_feature_map(name, cls)` adds a map by name, from any module (a user's too): the operators
(`linear_attention(..., feature_map=name)`), the `LinearAttention` layer and a `linear-<name>` mixer then accept
it, and tests/test_registry_conformance.py gives it its fp64-reference, form-agreement, causality and decode
tests. The maps below register themselves at the bottom of this module; `feature_map_names()` lists them all.

Range. Every map computes its features from the formula, and the features are as large as
the kernel they build: taylor2's x x^T and the squared-Euclidean maps' |x|^2 exceed float32 once |x|
passes ~1e19, magnitude_direction's (|x|^2 + 1) x once it passes ~7e12, and q . k does for the
linear-space maps when |q| |k| passes ~3e38. No rescaling inside a map can avoid it: with normalize=False
the features' scale is the answer. `linear_attention` refuses such finite inputs with a `LinattnError`
naming the largest |q|, |k|, |v| (where value checks run) instead of returning inf/NaN. FAVOR+'s
log-features w.x - |x|^2/2 go to -inf for |x| past ~1e19 (a weight of exactly 0, the limit).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError, LinattnError, LinattnTypeError


class FeatureMap:
    """A (phi, psi) pair with k(a, b) = phi(a) . psi(b); subclass it or pass two callables.

    Both callables map `[..., K]` to `[..., K_phi]` with the same K_phi. Set `log_space=True`
    if they return log-features (the kernel is then sum_d exp(phi_d(a) + psi_d(b))). A subclass overrides
    `phi` (and `psi` when it differs), sets `name`, and may override `build`, `kernel` and `feature_dim`;
    `register_feature_map` makes it available by name.

    Args:
        phi: The query feature map, `[..., K]` -> `[..., K_phi]` (None only in a subclass that overrides `phi`).
        psi: The key feature map; None: psi = phi.
        log_space: phi and psi return log-features.
        name: The map's name (in reprs and reports).

    Raises:
        LinattnTypeError: phi or psi is not callable.
        LinattnError: neither phi nor a subclass's `phi`.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import FeatureMap, linear_attention
        >>> fm = FeatureMap(phi=lambda x: F.elu(x) + 1)            # psi defaults to phi
        >>> fm = FeatureMap(phi=lambda a: a[..., [0, 1]] * torch.tensor([1., 2.]),
        ...                 psi=lambda b: b[..., [1, 0]])            # asymmetric, ELA eq. (6)
        >>> q, k, v = torch.randn(3, 1, 6, 2, 4).unbind(0)
        >>> o, _ = linear_attention(q, k, v, feature_map=FeatureMap(phi=lambda x: F.elu(x) + 1))
        >>> o2, _ = linear_attention(q, k, v, feature_map="elu+1")
        >>> torch.allclose(o, o2)
        True
    """

    name = "custom"
    log_space = False
    positional = False
    fused_kernel: Optional[str] = None  # the in-kernel form of the Triton kernels, if any

    def __init__(self, phi: Optional[Callable] = None, psi: Optional[Callable] = None, *,
                 log_space: bool = False, name: str = "custom"):
        if phi is not None and not callable(phi):
            raise LinattnTypeError(f"phi must be callable, got {type(phi).__name__}")
        if psi is not None and not callable(psi):
            raise LinattnTypeError(f"psi must be callable, got {type(psi).__name__}")
        if phi is None and type(self) is FeatureMap:
            raise LinattnError("FeatureMap needs at least phi (psi defaults to phi)")
        self._phi, self._psi = phi, (psi if psi is not None else phi)
        if phi is not None:
            self.log_space, self.name = bool(log_space), name

    def phi(self, x: torch.Tensor, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The query features.

        Args:
            x: `[..., K]` (the operator passes `[B, T, H, K]`).
            pos: The tokens' positions `[B, T]` (positional maps such as cosFormer), or None.

        Returns:
            `[..., K_phi]` (log-features for a log-space map).
        """
        return self._phi(x)

    def psi(self, x: torch.Tensor, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The key features (phi's, unless the map is asymmetric).

        Args:
            x: `[..., K]`.
            pos: The tokens' positions `[B, T]` (positional maps), or None.

        Returns:
            `[..., K_phi]`.
        """
        return self._psi(x)

    @classmethod
    def build(cls, head_dim: int, *, max_seq_len: Optional[int] = None, seed: int = 0) -> "FeatureMap":
        """The map for heads of width `head_dim` (what `get_feature_map(name, head_dim)` returns).

        A subclass uses what it needs; override it when the map needs more than `cls()`.

        Args:
            head_dim: The width K of the queries and keys.
            max_seq_len: the longest sequence the caller expects (None: not known; cosFormer's horizon).
            seed: for maps with drawn parameters (FAVOR+'s projection).

        Returns:
            A new instance of the map.
        """
        return cls()

    def kernel(self, a: torch.Tensor, b: torch.Tensor, i: Optional[torch.Tensor] = None,
               j: Optional[torch.Tensor] = None) -> torch.Tensor:
        """k(a_i, b_j) for all pairs (i, j: the positions, for positional maps).

        The references call it in fp64. This default evaluates phi and psi (sum_d exp(phi_d + psi_d) for
        log-space maps); a new map should override it with its kernel written from the formula, so its
        reference does not share the features' code.

        Args:
            a: Queries `[T, K]`.
            b: Keys `[S, K]`.
            i: The queries' positions `[T]` (positional maps only).
            j: The keys' positions `[S]`.

        Returns:
            The kernel matrix `[T, S]`.
        """
        fa, fb = self.phi(a[None, :, None], None if i is None else i[None]), self.psi(
            b[None, :, None], None if j is None else j[None])
        fa, fb = fa[0, :, 0], fb[0, :, 0]
        if self.log_space:
            return torch.logsumexp(fa[:, None, :] + fb[None, :, :], -1).exp()
        return fa @ fb.T

    def feature_dim(self, head_dim: int) -> int:
        """K_phi, the width of phi(x) and psi(x) for inputs of width `head_dim`.

        Found by evaluating phi on one zero vector unless the subclass knows it.

        Args:
            head_dim: The input width K.

        Returns:
            K_phi.
        """
        x = torch.zeros(1, 1, 1, head_dim)
        return int(self.phi(x, torch.zeros(1, 1, dtype=torch.int64) if self.positional else None).shape[-1])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Identity(FeatureMap):
    """k(a, b) = a . b: unnormalised linear attention as in eq. (6) of the history seed."""
    name = "identity"
    fused_kernel = "identity"

    def phi(self, x, pos=None):
        return x

    psi = phi


class EluPlusOne(FeatureMap):
    """phi = psi = elu(x) + 1 (Katharopoulos et al.), strictly positive."""
    name = "elu+1"
    fused_kernel = "elu+1"

    def phi(self, x, pos=None):
        return F.elu(x) + 1.0

    psi = phi


class ReLU(FeatureMap):
    """phi = psi = relu(x). Non-negative but can be all zero: the normaliser can vanish (see eps)."""
    name = "relu"
    fused_kernel = "relu"

    def phi(self, x, pos=None):
        return F.relu(x)

    psi = phi


class CosFormer(FeatureMap):
    """cosFormer: relu features re-weighted by cos(pi/2 * (i - j) / M), decomposed exactly.

    cos(pi/2 (i-j)/M) = cos(a_i) cos(a_j) + sin(a_i) sin(a_j) with a_i = pi i / (2M), so
    phi(q_i) = [relu(q_i) cos a_i, relu(q_i) sin a_i] and psi likewise: K_phi = 2K. Positions are
    absolute within a sequence (they continue from a carried state). The weight stays
    non-negative while i - j <= M: keep `max_len` at or above the longest sequence.
    """
    name = "cosformer"
    positional = True

    def __init__(self, max_len: int = 4096):
        if max_len < 1:
            raise LinattnError(f"max_len must be >= 1, got {max_len}")
        self.max_len = int(max_len)

    @classmethod
    def build(cls, head_dim: int, *, max_seq_len: Optional[int] = None, seed: int = 0) -> "CosFormer":
        return cls() if max_seq_len is None else cls(max_len=max_seq_len)   # the layer's horizon: its max_seq_len

    def phi(self, x, pos=None):
        if pos is None:
            raise LinattnError("cosformer needs token positions")
        angle = (math.pi / (2 * self.max_len)) * pos.to(x.dtype)
        angle = angle.reshape(*angle.shape, *([1] * (x.dim() - angle.dim())))  # broadcast over H, K
        r = F.relu(x)
        return torch.cat([r * torch.cos(angle), r * torch.sin(angle)], dim=-1)

    psi = phi


class Taylor2(FeatureMap):
    """Second-order Taylor kernel of exp (Based): k(a, b) = 1 + a.b + (a.b)^2 / 2.

    phi(x) = [1, x, vec(x x^T) / sqrt(2)], so K_phi = 1 + K + K^2.
    """
    name = "taylor2"

    def phi(self, x, pos=None):
        outer = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) * (0.5 ** 0.5)
        return torch.cat([torch.ones_like(x[..., :1]), x, outer], dim=-1)

    psi = phi


class HadamardExp(FeatureMap):
    """ELA's Hadamard Exp kernel, k(a, b) = sum_d exp(a_d) exp(b_d) (eq. 5), in log-space."""
    name = "hadamard_exp"
    log_space = True

    def phi(self, x, pos=None):
        return x

    psi = phi


class SumSqEuclid(FeatureMap):
    """ELA's summation squared-Euclidean kernel ||a + b||^2 (eq. 3): phi = [a, |a|^2, 1], psi = [2b, 1, |b|^2]."""
    name = "sum_sq_euclid"
    sign = 2.0

    def phi(self, x, pos=None):
        one = torch.ones_like(x[..., :1])
        return torch.cat([x, (x * x).sum(-1, keepdim=True), one], dim=-1)

    def psi(self, x, pos=None):
        one = torch.ones_like(x[..., :1])
        return torch.cat([self.sign * x, one, (x * x).sum(-1, keepdim=True)], dim=-1)


class SubSqEuclid(SumSqEuclid):
    """ELA's subtraction squared-Euclidean kernel ||a - b||^2 (eq. 4): psi uses -2b."""
    name = "sub_sq_euclid"
    sign = -2.0


class MagnitudeDirection(FeatureMap):
    """ELA eq. (13): k(a, b) = (a.b + 1)(|a|^2 + 1)(|b|^2 + 1).

    phi(a) = (|a|^2 + 1) [a, 1]. The direction factor a.b + 1 is negative when a.b < -1, so this
    kernel can give negative weights and a normaliser of either sign; the operators keep the
    result finite (see `linear_attention`'s eps) but a normalised output is then not an average.
    """
    name = "magnitude_direction"

    def phi(self, x, pos=None):
        mag = (x * x).sum(-1, keepdim=True) + 1.0
        return mag * torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)

    psi = phi


def _orthogonal_gaussian(n_rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """n_rows x dim matrix whose dim-blocks have orthogonal rows with chi(dim)-distributed norms."""
    blocks = []
    for _ in range(math.ceil(n_rows / dim)):
        g = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        # QR's sign convention ties each column's sign to its own entries; fixing the signs of
        # R's diagonal makes q Haar-distributed, so every row is an unbiased N(0, I) direction
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(q.T)
    w = torch.cat(blocks, dim=0)[:n_rows]
    norms = torch.randn(n_rows, dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return w * norms[:, None]


class FAVORPlus(nn.Module, FeatureMap):
    """Performer's FAVOR+: positive (orthogonal) random features with E[phi(a).phi(b)] = exp(a . b).

    phi(x)_r = exp(w_r . x - |x|^2 / 2) / sqrt(m) for m random rows w_r ~ N(0, I) (orthogonal
    within each block of `dim` rows when `orthogonal=True`, with chi-distributed norms). It is
    a log-space map: the operator applies the usual stabiliser itself (exactly, with a running
    maximum per feature) instead of Performer's per-head constant. For softmax-like attention
    exp(q.k / sqrt(d)), pass `scale=d**-0.5` to the operator... or scale q and k by d**-0.25.

    `redraw()` draws new features (from the module's own generator, so a seed fixes the
    whole sequence of draws); the projection is a buffer and moves with `.to(device)`.

    Args:
        dim: The width of the inputs (the head dimension).
        n_features: m, the number of random features (default dim * log(dim + 1)).
        orthogonal: Orthogonal rows within each block of `dim` rows.
        seed: Seeds the module's generator.

    Raises:
        LinattnError: dim or n_features below 1.

    Examples:
        >>> import torch
        >>> from linattn import FAVORPlus, linear_attention
        >>> q, k, v = torch.randn(3, 1, 8, 2, 16).unbind(0)
        >>> fm = FAVORPlus(16, n_features=64, seed=0)
        >>> o, _ = linear_attention(q, k, v, feature_map=fm, scale=16 ** -0.5)
        >>> o.shape
        torch.Size([1, 8, 2, 16])
    """
    name = "favor+"
    log_space = True

    def __init__(self, dim: int, n_features: Optional[int] = None, *, orthogonal: bool = True,
                 seed: int = 0):
        nn.Module.__init__(self)
        if dim < 1:
            raise LinattnError(f"dim must be >= 1, got {dim}")
        self.dim = int(dim)
        self.n_features = int(n_features) if n_features is not None else max(1, int(dim * math.log(dim + 1)))
        if self.n_features < 1:
            raise LinattnError(f"n_features must be >= 1, got {n_features}")
        self.orthogonal = bool(orthogonal)
        self._generator = torch.Generator().manual_seed(int(seed))
        self.register_buffer("projection", torch.empty(self.n_features, self.dim), persistent=True)
        self.redraw()

    @torch.no_grad()
    def redraw(self) -> None:
        """Draw a new random projection in place."""
        if self.orthogonal:
            w = _orthogonal_gaussian(self.n_features, self.dim, self._generator)
        else:
            w = torch.randn(self.n_features, self.dim, generator=self._generator, dtype=torch.float64)
        self.projection.copy_(w.to(self.projection.dtype))

    def phi(self, x, pos=None):
        """The log-features w_r . x - |x|^2 / 2 - log(m) / 2 (psi is the same map).

        Args:
            x: `[..., dim]`.
            pos: Unused (FAVOR+ is not positional).

        Returns:
            `[..., n_features]` log-features.

        Raises:
            LinattnError: x's last dimension is not `dim`.
        """
        if x.shape[-1] != self.dim:
            raise LinattnError(f"FAVORPlus was built for dim {self.dim}, got inputs with last dim {x.shape[-1]}")
        w = self.projection.to(device=x.device, dtype=x.dtype)
        return x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(self.n_features)

    psi = phi

    @classmethod
    def build(cls, head_dim: int, *, max_seq_len: Optional[int] = None, seed: int = 0) -> "FAVORPlus":
        """A FAVORPlus(head_dim, seed=seed): a fixed draw per seed; build FAVORPlus yourself for more control.

        Args:
            head_dim: The input width.
            max_seq_len: Unused.
            seed: Seeds the projection.

        Returns:
            The map.
        """
        return cls(head_dim, seed=seed)  # a fixed draw per seed; build FAVORPlus yourself for more control

    def feature_dim(self, head_dim: int) -> int:
        """K_phi = n_features.

        Args:
            head_dim: The input width (the map's `dim`).

        Returns:
            n_features.
        """
        return self.n_features

    def forward(self, x):
        """The (positive) features themselves, exp(phi(x)); for inspection, not for the operator.

        Args:
            x: `[..., dim]`.

        Returns:
            `[..., n_features]`.
        """
        return torch.exp(self.phi(x))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_features={self.n_features}, orthogonal={self.orthogonal}"


# name -> FeatureMap subclass, in registration order (the built-in maps first)
FEATURE_MAPS: Dict[str, type] = {}
_LISTENERS: List[Callable[[str], None]] = []


def register_feature_map(name: str, cls: type, *, overwrite: bool = False) -> None:
    """Make feature map `cls` available by name: to `linear_attention`, `LinearAttention` and a `linear-<name>` mixer.

    `cls.build(head_dim, max_seq_len=..., seed=...)` makes an instance for a layer or a call; override it when the
    map needs more than `cls()`. Call this at the bottom of the module that defines the map.

    Args:
        name: The name (`cls.name` must be the same).
        cls: A `FeatureMap` subclass.
        overwrite: Replace a map already registered under `name`.

    Raises:
        ConfigError: An empty name, a `cls.name` that differs, or a name already registered without overwrite.
        LinattnTypeError: cls is not a `FeatureMap` subclass.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import FeatureMap, linear_attention, mixers, register_feature_map
        >>> class Softplus(FeatureMap):
        ...     name = "softplus"
        ...     def phi(self, x, pos=None):
        ...         return F.softplus(x)
        ...     psi = phi
        >>> register_feature_map("softplus", Softplus)
        >>> q, k, v = torch.randn(3, 1, 6, 2, 4).unbind(0)
        >>> o, _ = linear_attention(q, k, v, feature_map="softplus")
        >>> "linear-softplus" in mixers()
        True

        (Removing it again, as tests and plugins may:)

        >>> from linattn.models.registry import unregister_mixer
        >>> from linattn.ops.feature_maps import unregister_feature_map
        >>> unregister_feature_map("softplus")
        >>> unregister_mixer("linear-softplus")
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a feature map name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
        raise LinattnTypeError(f"feature map {name!r}: cls must be a FeatureMap subclass, got {cls!r}")
    if cls.name != name:
        raise ConfigError(f"feature map {name!r}: cls.name must be the registered name, got {cls.name!r}")
    if name in FEATURE_MAPS and not overwrite:
        raise ConfigError(f"feature map {name!r} is already registered (pass overwrite=True to replace it)")
    new = name not in FEATURE_MAPS
    FEATURE_MAPS[name] = cls
    if new:
        for listener in list(_LISTENERS):
            listener(name)


def unregister_feature_map(name: str) -> None:
    """Remove a registered feature map (for plugins and tests; its `linear-<name>` mixer stays until
    `unregister_mixer` removes it)."""
    if name not in FEATURE_MAPS:
        raise ConfigError(f"unknown feature map {name!r}; registered: {', '.join(FEATURE_MAPS)}")
    del FEATURE_MAPS[name]


def on_feature_map_registered(listener: Callable[[str], None]) -> None:
    """Call `listener(name)` for every feature map registered from now on (the `linear-<name>` mixers)."""
    _LISTENERS.append(listener)


def feature_map_names() -> Tuple[str, ...]:
    """The names of every registered feature map, in registration order.

    Returns:
        The names (the built-in maps first).

    Examples:
        >>> from linattn import feature_map_names
        >>> "elu+1" in feature_map_names() and "favor+" in feature_map_names()
        True
    """
    return tuple(FEATURE_MAPS)


def get_feature_map(feature_map: Union[str, FeatureMap, None], dim: int, *, max_seq_len: Optional[int] = None,
                    seed: int = 0) -> FeatureMap:
    """Resolve a feature map given by name, as an instance, or as None.

    Args:
        feature_map: A registered name (built for head dimension `dim`: `cls.build(dim, max_seq_len=...,
            seed=...)`), a FeatureMap (returned as it is), or None (identity: q and k are already features).
        dim: The head dimension a named map is built for.
        max_seq_len: Passed to `build` (cosFormer's horizon).
        seed: Passed to `build` (FAVOR+'s projection).

    Returns:
        The `FeatureMap`.

    Raises:
        LinattnError: An unknown name.
        LinattnTypeError: Neither a name, a FeatureMap nor None.

    Examples:
        >>> from linattn import get_feature_map
        >>> get_feature_map("elu+1", 16)
        EluPlusOne('elu+1')
        >>> get_feature_map("favor+", 16, seed=1).n_features
        45
    """
    if feature_map is None:
        return Identity()
    if isinstance(feature_map, FeatureMap):
        return feature_map
    if isinstance(feature_map, str):
        if feature_map in FEATURE_MAPS:
            return FEATURE_MAPS[feature_map].build(dim, max_seq_len=max_seq_len, seed=seed)
        raise LinattnError(f"unknown feature_map {feature_map!r}; expected one of {feature_map_names()}, "
                           f"a linattn.FeatureMap, or None")
    raise LinattnTypeError(f"feature_map must be a name, a linattn.FeatureMap or None, "
                           f"got {type(feature_map).__name__}")


for _cls in (Identity, EluPlusOne, ReLU, CosFormer, Taylor2, HadamardExp, SumSqEuclid, SubSqEuclid, MagnitudeDirection,
             FAVORPlus):
    register_feature_map(_cls.name, _cls)


def __getattr__(name: str):
    # FEATURE_MAP_NAMES is read from the registry on each access, so maps registered by later modules are in it
    if name == "FEATURE_MAP_NAMES":
        return feature_map_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FeatureMap", "Identity", "EluPlusOne", "ReLU", "CosFormer", "Taylor2", "HadamardExp", "SumSqEuclid",
           "SubSqEuclid", "MagnitudeDirection", "FAVORPlus", "FEATURE_MAPS", "feature_map_names",
           "get_feature_map", "register_feature_map", "unregister_feature_map", "on_feature_map_registered"]
