"""TLinFormer (Tang 2025, "Rethinking Transformer Connectivity"): exact softmax attention with a
fixed-size observation window, linear in the context length, and a two-mode inference cache.

Structure (that of the public code, simonFelix-Ai/TLinFormer):

* `n_blocks` blocks of `inner_depth` pre-norm layers: one **compress** layer, `inner_depth - 2`
  **hidden** layers (the paper's H) and one **restore** layer. Every layer (norms, one q/k/v
  projection, output projection, SwiGLU) is shared by two streams:

  - the **context stream** (the history, length N, all attention non-causal):
      compress: the queries of the last W_oh context tokens attend to the whole context, giving
                the compressed context `zip` (length W = min(W_oh, N)); residual = those W tokens;
      hidden:   self-attention within `zip`;
      restore:  the queries of the whole context (the compress layer's, as in the public code)
                attend to `zip`; residual = the context, so the output has length N again and
                feeds the next block (the last block's restore output is not needed and skipped).
  - the **generation stream** (the current window of up to W_og tokens): in every layer two
    separately normalised softmax attentions are summed, non-causal cross-attention to the
    context stream's keys/values of that layer (compress: the whole context, so every window
    token reaches all of the history directly; hidden/restore: `zip`) and causal self-attention
    within the window; then the output projection, residual and SwiGLU.

* RoPE with absolute positions: context at 0..N-1, `zip` at N-W..N-1, the window at N, N+1, ...
* Windows: token t belongs to window c = t // W_og; its history is every token before c * W_og.
  A forward pass over a sequence slides the window by W_og (training: all windows, one loss);
  logits at t depend on tokens <= t only.
* Inference cache (`TLinFormerCache`), the paper's two modes:
  - **miss** (the window slid, so the history changed, or a new prompt): the context stream is
    recomputed from the token ids, cost linear in N; kept: per block the compress layer's context
    keys/values (the only O(N) part), per layer the keys/values of `zip`, and the window's own
    keys/values (preallocated for W_og tokens);
  - **hit** (the next token in the same window): only the new token's work, per layer one query
    against the cached context keys/values (N in the compress layers, W in the others) and the
    window's keys, ~ n_blocks * D * N + O(layers * D * (W_og + W_oh)) per token.
  Cached and uncached decoding compute the same function (greedy tokens equal, logits to ~1e-6).

`TLinFormerLM` has the interface of `LanguageModel` (forward -> LMOutput, new_cache, stream,
generate, num_parameters, is_causal), so training, evaluation, checkpoints and `linattn generate`
work with it unchanged; `TLinFormerConfig` is a JSON-serialisable dataclass whose dict carries
`"arch": "tlinformer"` so loaders can tell it from an `LMConfig`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError, LinattnError, LinattnTypeError
from ..layers import Cache, RMSNorm, RotaryEmbedding, SwiGLU, tensor_nbytes
from ..ops import softmax_attention
from .config import JsonConfig
from .family import CausalLM, register_family
from .generation import join_generated, stream_tokens
from .lm import LMOutput, count_parameters, init_lm_weights

ARCH = "tlinformer"


def auto_history_window(context_len: int) -> int:
    """W_oh = 12 ln(N) rounded up to a multiple of 8 (the public code's "auto"); at least 8."""
    n = max(int(context_len), 1)
    return max(8, 8 * math.ceil(12.0 * math.log(n) / 8.0))


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

@dataclass
class TLinFormerConfig(JsonConfig):
    """Configuration of a `TLinFormerLM`.

    vocab_size, d_model, n_heads (head_dim = d_model // n_heads, even for RoPE).
    n_blocks: stacked TLinFormer blocks; inner_depth: layers per block (>= 2: compress,
        inner_depth - 2 hidden, restore). Total layers n_blocks * inner_depth.
    history_window: W_oh, the size of the compressed context, an int > 0 or "auto"
        (12 ln N rounded up to a multiple of 8, N the context length).
    generation_window: W_og > 0, the window slid over the sequence (<= max_seq_len).
    max_seq_len: the longest training sequence expected (RoPE table size; positions beyond it
        still work, the table grows).
    ffn_hidden: SwiGLU width (default 8/3 d rounded up to 32); qkv_bias: biases on q/k/v.
    tie_embeddings, final_norm, norm_eps, init_std, rope_base: as in `LMConfig`.
    arch: always "tlinformer" (lets loaders dispatch on the config dict).
    """

    vocab_size: int = field(metadata={"help": "vocabulary size (in training: the tokenizer's)"})
    d_model: int = field(default=256, metadata={"help": "model width"})
    n_heads: int = field(default=4, metadata={"help": "attention heads (d_model / n_heads must be even)"})
    n_blocks: int = field(default=2, metadata={"help": "tlinformer: stacked blocks"})
    inner_depth: int = field(default=4, metadata={
        "help": "tlinformer: layers per block (>= 2: compress, inner_depth - 2 hidden, restore)"})
    history_window: Union[int, str] = field(default=128, metadata={
        "help": "tlinformer: W_oh, the compressed context size, an int or auto (12 ln N rounded up to 8)",
        "choices": ("auto",)})
    generation_window: int = field(default=128, metadata={
        "help": "tlinformer: W_og, the window slid over the sequence (<= max_seq_len)"})
    max_seq_len: int = field(default=2048, metadata={
        "help": "the longest training sequence expected (RoPE table size; it grows on demand)"})
    ffn_hidden: Optional[int] = field(default=None, metadata={"help": "SwiGLU width; none: 8/3 d_model rounded to 32"})
    qkv_bias: bool = field(default=False, metadata={"help": "tlinformer: biases on q/k/v"})
    rope_base: float = field(default=10000.0, metadata={"help": "RoPE base"})
    tie_embeddings: bool = field(default=True, metadata={"help": "share the input embedding with the output head"})
    final_norm: bool = field(default=True, metadata={"help": "RMSNorm before the output head"})
    norm_eps: float = field(default=1e-6, metadata={"help": "RMSNorm epsilon"})
    init_std: float = field(default=0.02, metadata={"help": "std of the normal init"})
    arch: str = field(default=ARCH, metadata={
        "help": "the model family, always tlinformer (set with --model tlinformer)", "choices": (ARCH,)})

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError (a ValueError) naming the first bad field."""
        def pos_int(name, min_value=1):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < min_value:
                raise ConfigError(f"TLinFormerConfig.{name} must be an int >= {min_value}, got {v!r}")

        if self.arch != ARCH:
            raise ConfigError(f"TLinFormerConfig.arch must be {ARCH!r}, got {self.arch!r}")
        for name in ("vocab_size", "d_model", "n_heads", "n_blocks", "max_seq_len"):
            pos_int(name)
        pos_int("inner_depth", 2)
        if self.d_model % self.n_heads:
            raise ConfigError(f"TLinFormerConfig.d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"TLinFormerConfig: RoPE needs an even head dimension, got d_model / n_heads = "
                             f"{self.d_model // self.n_heads}")
        w = self.history_window
        if isinstance(w, str):
            if w != "auto":
                raise ConfigError(f"TLinFormerConfig.history_window (W_oh) must be a positive int or 'auto', "
                                 f"got {w!r}")
        elif not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ConfigError(f"TLinFormerConfig.history_window (W_oh) must be a positive int or 'auto', got {w!r}")
        g = self.generation_window
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            raise ConfigError(f"TLinFormerConfig.generation_window (W_og) must be a positive int, got {g!r}")
        if g > self.max_seq_len:
            raise ConfigError(f"TLinFormerConfig.generation_window (W_og = {g}) is larger than max_seq_len "
                             f"({self.max_seq_len}): the generation window must fit in a training sequence")
        if self.ffn_hidden is not None:
            pos_int("ffn_hidden")
        if not self.norm_eps > 0 or not self.init_std > 0 or not self.rope_base > 0:
            raise ConfigError("TLinFormerConfig.norm_eps, init_std and rope_base must be > 0")

    # -- derived -----------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.n_blocks * self.inner_depth

    @property
    def n_hidden(self) -> int:
        """Hidden layers per block (the paper's H)."""
        return self.inner_depth - 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def history_window_for(self, context_len: int) -> int:
        """The compressed-context size W = min(W_oh, N) for a context of N tokens."""
        w = auto_history_window(context_len) if self.history_window == "auto" else int(self.history_window)
        return min(w, int(context_len))


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------

class TLinFormerCache(Cache):
    """The decoding cache of a `TLinFormerLM`.

    layers[i]["ctx"].extra: keys/values "k", "v" `[B, H, S, Dh]` the window attends to in layer i (S = N in the
        compress layers, W = min(W_oh, N) in the others); empty while the history is empty.
    layers[i]["x"].extra:   the window's own keys/values "k", "v" `[B, H, W_og, Dh]` (preallocated once).
    ids: every token consumed so far (a miss re-encodes the history from them).
    context_len: the history length N of the cached window (None: nothing cached yet);
    x_len: tokens of that window consumed; hits / misses: how each call was served.
    `nbytes()` counts every tensor held, preallocated capacity included.
    """

    def __init__(self, n_layers: int):
        super().__init__(n_layers)
        self.ids: Optional[torch.Tensor] = None   # [B, capacity] int64
        self.context_len: Optional[int] = None
        self.x_len = 0
        self.hits = 0
        self.misses = 0
        self.last_mode: Optional[str] = None

    def append_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Store new token ids; return all ids so far `[B, seen + T]` (a view)."""
        B, T = ids.shape
        n = self.seen_tokens
        if self.ids is not None and self.ids.shape[0] != B:
            raise LinattnError(f"this cache holds a batch of {self.ids.shape[0]} sequences, got {B}")
        cap = 0 if self.ids is None else self.ids.shape[1]
        if n + T > cap:
            new_cap = max(n + T, 2 * cap, 256)
            buf = ids.new_empty(B, new_cap)
            if n:
                buf[:, :n] = self.ids[:, :n]
            self.ids = buf
        self.ids[:, n:n + T] = ids
        return self.ids[:, : n + T]

    def nbytes(self) -> int:
        return super().nbytes() + tensor_nbytes(self.ids)

    def __repr__(self) -> str:
        return (f"TLinFormerCache(n_layers={len(self.layers)}, seen_tokens={self.seen_tokens}, "
                f"context_len={self.context_len}, x_len={self.x_len}, hits={self.hits}, misses={self.misses}, "
                f"nbytes={self.nbytes()})")


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

def _cross(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q `[B, T, H, D]` attends to k, v `[B, H, S, D]` (non-causal unless masked) -> `[B, T, H, D]`."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
    return o.transpose(1, 2)


class TLinLayer(nn.Module):
    """One pre-norm layer whose weights serve both streams; `kind` is compress / hidden / restore."""

    KINDS = ("compress", "hidden", "restore")

    def __init__(self, config: TLinFormerConfig, kind: str, layer_idx: int):
        super().__init__()
        if kind not in self.KINDS:
            raise LinattnError(f"kind must be one of {self.KINDS}, got {kind!r}")
        c = config
        self.kind, self.layer_idx = kind, layer_idx
        self.n_heads, self.head_dim = c.n_heads, c.head_dim
        self.norm1 = RMSNorm(c.d_model, eps=c.norm_eps)
        self.qkv_proj = nn.Linear(c.d_model, 3 * c.d_model, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.norm2 = RMSNorm(c.d_model, eps=c.norm_eps)
        self.ffn = SwiGLU(c.d_model, c.ffn_hidden)

    def qkv(self, x: torch.Tensor, rope: RotaryEmbedding, pos: int):
        """q, k, v `[B, T, H, Dh]` of norm1(x), RoPE at absolute positions pos, pos + 1, ..."""
        B, T, _ = x.shape
        H = self.n_heads
        qkv = self.qkv_proj(self.norm1(x)).view(B, T, 3 * H, self.head_dim)
        qk = rope.apply(qkv[:, :, : 2 * H], pos)   # q and k rotated in one call (same positions)
        return qk[:, :, :H], qk[:, :, H:], qkv[:, :, 2 * H:]

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual around the attention output `[B, T, H, Dh]`, then the residual SwiGLU."""
        B, T = attn.shape[:2]
        h = x + self.o_proj(attn.reshape(B, T, -1))
        return h + self.ffn(self.norm2(h))

    def extra_repr(self) -> str:
        return f"kind={self.kind}, layer_idx={self.layer_idx}"


class TLinBlock(nn.Module):
    """compress, hidden x (inner_depth - 2), restore."""

    def __init__(self, config: TLinFormerConfig, block_idx: int):
        super().__init__()
        d = config.inner_depth
        kinds = ["compress"] + ["hidden"] * (d - 2) + ["restore"]
        self.layers = nn.ModuleList([TLinLayer(config, k, block_idx * d + i) for i, k in enumerate(kinds)])

    def context(self, C: torch.Tensor, W: int, rope: RotaryEmbedding, need_output: bool):
        """The context stream over C `[B, N, d]` with a compressed size W (1 <= W <= N).

        Returns (output `[B, N, d]` or None when not needed, [(k, v) `[B, H, S, Dh]` per layer]):
        the keys/values the generation stream attends to in each layer.
        """
        N = C.shape[1]
        hs = N - W
        comp = self.layers[0]
        q, k, v = comp.qkv(C, rope, 0)                       # the whole context, positions 0..N-1
        k_t, v_t = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        kvs = [(k_t, v_t)]
        z = comp.finish(C[:, hs:], _cross(q[:, hs:], k_t, v_t))   # last W queries -> all N keys
        for lay in self.layers[1:-1]:
            qz, kz, vz = lay.qkv(z, rope, hs)
            kvs.append((kz.transpose(1, 2).contiguous(), vz.transpose(1, 2).contiguous()))
            z = lay.finish(z, softmax_attention(qz, kz, vz, causal=False))
        rest = self.layers[-1]
        B = z.shape[0]
        kz, vz = rest.qkv_proj(rest.norm1(z)).view(B, W, 3, rest.n_heads, rest.head_dim).unbind(2)[1:]
        kz = rope.apply(kz, hs)
        kz_t, vz_t = kz.transpose(1, 2).contiguous(), vz.transpose(1, 2).contiguous()
        kvs.append((kz_t, vz_t))
        out = rest.finish(C, _cross(q, kz_t, vz_t)) if need_output else None   # all N queries -> zip
        return out, kvs


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------

class TLinFormerLM(nn.Module, CausalLM):
    """A TLinFormer language model (see the module docstring); the "tlinformer" family, a `CausalLM`.

    >>> model = TLinFormerLM(TLinFormerConfig(vocab_size=256, d_model=64, n_heads=4, n_blocks=2,
    ...                                       inner_depth=4, history_window=32, generation_window=32))
    >>> out = model(ids)                          # logits [B, T, 256]: the window slid over ids
    >>> out = model(ids, use_cache=True)          # prefill (cache miss)
    >>> out = model(next_ids, cache=out.cache)    # decode: hit inside a window, miss when it slides
    >>> model.generate(ids, 20, temperature=0)    # greedy; use_cache=False recomputes each step

    Packed documents (`cu_seqlens`) are not supported: a window's history is every earlier
    token of the row, so forward raises LinattnError when given them.
    """

    #: forward rejects cu_seqlens (packed documents)
    supports_cu_seqlens = False

    def __init__(self, config: TLinFormerConfig):
        super().__init__()
        if not isinstance(config, TLinFormerConfig):
            raise LinattnTypeError(f"config must be a TLinFormerConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.rope = RotaryEmbedding(c.head_dim, base=c.rope_base, max_seq_len=c.max_seq_len)
        self.blocks = nn.ModuleList([TLinBlock(c, b) for b in range(c.n_blocks)])
        self.norm = RMSNorm(c.d_model, eps=c.norm_eps) if c.final_norm else None
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        init_lm_weights(self, self.config.init_std, self.config.n_layers)

    # -- LanguageModel interface -------------------------------------------------------------
    @property
    def is_causal(self) -> bool:
        return True

    @property
    def layers(self) -> List[TLinLayer]:
        return [lay for b in self.blocks for lay in b.layers]

    def new_cache(self) -> TLinFormerCache:
        return TLinFormerCache(self.config.n_layers)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (shared ones counted once); optionally without the embedding/head."""
        return count_parameters(self, exclude_embeddings)

    # -- the two streams ---------------------------------------------------------------------
    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.embed.weight)

    def _window(self, ids: torch.Tensor, start: int, end: int,
                cache: Optional[TLinFormerCache]) -> torch.Tensor:
        """Window tokens ids[:, start:end] with history ids[:, :start], from scratch (a cache miss).
        Returns their final hidden states; fills `cache` when given."""
        N = start
        x = self.embed(ids[:, start:end])
        C = self.embed(ids[:, :N]) if N > 0 else None
        W = self.config.history_window_for(N) if N > 0 else 0
        layers = self.layers
        ctx_kv: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(layers)
        li = 0
        for bi, block in enumerate(self.blocks):
            if C is not None:
                C, kvs = block.context(C, W, self.rope, need_output=bi + 1 < len(self.blocks))
                ctx_kv[li: li + len(kvs)] = kvs
            for lay in block.layers:
                q, k, v = lay.qkv(x, self.rope, N)
                a = softmax_attention(q, k, v, causal=True)
                if ctx_kv[li] is not None:
                    a = a + _cross(q, *ctx_kv[li])
                if cache is not None:
                    self._store(cache, li, ctx_kv[li], k, v)
                x = lay.finish(x, a)
                li += 1
        if cache is not None:
            cache.context_len, cache.x_len = N, end - start
            cache.misses += 1
            cache.last_mode = "miss"
        return x

    def _store(self, cache: TLinFormerCache, li: int, ctx, k: torch.Tensor, v: torch.Tensor) -> None:
        lc = cache.layer(li, "ctx")
        lc.extra = {} if ctx is None else dict(zip("kv", ctx))
        x_lc = cache.layer(li, "x")
        xc = x_lc.extra
        B, T, H, D = k.shape
        Wg = self.config.generation_window
        if "k" not in xc or xc["k"].shape[0] != B or xc["k"].dtype != k.dtype or xc["k"].device != k.device:
            xc["k"] = k.new_empty(B, H, Wg, D)
            xc["v"] = v.new_empty(B, H, Wg, v.shape[-1])
        xc["k"][:, :, :T] = k.transpose(1, 2)
        xc["v"][:, :, :T] = v.transpose(1, 2)
        x_lc.offset = T

    def _hit(self, ids: torch.Tensor, cache: TLinFormerCache) -> torch.Tensor:
        """New tokens `ids` continuing the cached window (a cache hit): only their own work."""
        T = ids.shape[1]
        N, m = cache.context_len, cache.x_len
        x = self.embed(ids)
        mask = None
        if T > 1:  # new token i sits at window index m + i and sees indices <= m + i
            mask = (m + torch.arange(T, device=ids.device))[:, None] >= torch.arange(m + T, device=ids.device)[None]
        for li, lay in enumerate(self.layers):
            q, k, v = lay.qkv(x, self.rope, N + m)
            x_lc = cache.layers[li]["x"]
            xc = x_lc.extra
            xc["k"][:, :, m:m + T] = k.transpose(1, 2)
            xc["v"][:, :, m:m + T] = v.transpose(1, 2)
            x_lc.offset = m + T
            a = _cross(q, xc["k"][:, :, : m + T], xc["v"][:, :, : m + T], mask)
            ctx = cache.layers[li]["ctx"].extra
            if "k" in ctx:
                a = a + _cross(q, ctx["k"], ctx["v"])
            x = lay.finish(x, a)
        cache.x_len = m + T
        cache.hits += 1
        cache.last_mode = "hit"
        return x

    # -- forward -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: Optional[TLinFormerCache] = None, *, use_cache: bool = False,
                targets: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                logits_to_keep: int = 0) -> LMOutput:
        """input_ids `[B, T]` -> LMOutput(logits `[B, T, vocab]`, aux_loss (0), cache[, loss]).

        Without a cache the generation window slides over input_ids in steps of W_og, every
        window attending to all tokens before it. With a cache (from `use_cache=True` or an
        earlier call) input_ids continue the cached sequence: tokens inside the cached window are
        a cache hit, a token that starts a new window a miss (the history is re-encoded).
        logits_to_keep=n > 0 returns (and computes) only the logits of the last n tokens: windows
        that hold none of them are skipped (a prefill needs only the last window).
        targets `[B, T]` (aligned with the logits; -100 ignored) adds `.loss`.
        cu_seqlens (packed documents) is not supported and raises LinattnError.
        """
        if cu_seqlens is not None:
            raise LinattnError("TLinFormerLM does not support packed documents (cu_seqlens): its windows attend to "
                               "every earlier token of the row, across document boundaries; pass one document "
                               "per row ([B, T] batches) instead")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
                torch.int64, torch.int32):
            raise LinattnError(f"input_ids must be an int64 tensor [B, T], got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        B, T = input_ids.shape
        if T == 0:
            raise LinattnError("input_ids must hold at least one token")
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise LinattnError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        if cache is None and use_cache:
            cache = self.new_cache()
        if cache is not None and (not isinstance(cache, TLinFormerCache) or len(cache) != self.config.n_layers):
            raise LinattnError(f"cache must be a TLinFormerCache with {self.config.n_layers} layers "
                             f"(model.new_cache()), got {cache!r}")
        input_ids = input_ids.long()
        if cache is not None:
            start = cache.seen_tokens
            ids = cache.append_ids(input_ids)
        else:
            start, ids = 0, input_ids
        total = start + T
        keep_from = start if logits_to_keep == 0 else max(start, total - logits_to_keep)
        Wg = self.config.generation_window
        last_c = (total - 1) // Wg
        hidden = []
        for c in range(keep_from // Wg, last_c + 1):
            cs, ce = c * Wg, min((c + 1) * Wg, total)
            lo = max(cs, keep_from)
            if cache is not None and cache.context_len == cs:
                h = self._hit(ids[:, max(cs, start):ce], cache)      # the cached window continues
                h = h[:, lo - max(cs, start):]
            else:
                h = self._window(ids, cs, ce, cache if c == last_c else None)[:, lo - cs:]
            hidden.append(h)
        if cache is not None:  # the loop ended on the last window, which left its state in the cache
            cache.seen_tokens = total
        logits = self._head(hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=1))
        aux = torch.zeros((), dtype=torch.float32, device=logits.device)
        loss = None
        if targets is not None:
            if targets.shape[:2] != logits.shape[:2]:
                raise LinattnError(f"targets must have shape {tuple(logits.shape[:2])}, got {tuple(targets.shape)}")
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=-100)
        return LMOutput(logits=logits, aux_loss=aux, cache=cache, loss=loss)

    # -- generation --------------------------------------------------------------------------
    def stream(self, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
               top_k: Optional[int] = None, top_p: Optional[float] = None,
               generator: Union[torch.Generator, int, None] = None, seed: Optional[int] = None,
               eos_token_id: Optional[int] = None, use_cache: bool = True) -> Iterator[Union[int, torch.Tensor]]:
        """Yield generated tokens one at a time (an int for a 1-D prompt, a `[B]` tensor for `[B, T]`),
        as `LanguageModel.stream`. use_cache=False recomputes the last window (and its history)
        at every step, the cache-miss cost each time."""
        seen = []  # use_cache=False: the whole sequence each step

        def forward(new_ids, out):
            if use_cache:
                if out is None:
                    return self(new_ids, use_cache=True, logits_to_keep=1)
                return self(new_ids, cache=out.cache)
            seen.append(new_ids)
            return self(torch.cat(seen, dim=1), logits_to_keep=1)

        return stream_tokens(self, input_ids, max_new_tokens, forward, temperature, top_k, top_p, generator, seed,
                             eos_token_id)

    def generate(self, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 generator: Union[torch.Generator, int, None] = None, seed: Optional[int] = None,
                 eos_token_id: Optional[int] = None, use_cache: bool = True) -> torch.Tensor:
        """Prompt followed by up to max_new_tokens sampled tokens (`[T + n]` or `[B, T + n]`).

        temperature 0 is greedy; top_k / top_p / generator / seed as in `LanguageModel.generate`.
        use_cache=True decodes incrementally (hits inside a window, a miss when it slides);
        use_cache=False recomputes every step; both give the same tokens."""
        return join_generated(self, input_ids, list(self.stream(input_ids, max_new_tokens, temperature, top_k, top_p,
                                                                generator, seed, eos_token_id, use_cache=use_cache)))


def _tiny_config(vocab_size: int) -> TLinFormerConfig:
    """A small TLinFormer (the family registry's example, built by the tests)."""
    return TLinFormerConfig(vocab_size=vocab_size, d_model=32, n_heads=4, n_blocks=2, inner_depth=3, history_window=3,
                            generation_window=4, max_seq_len=64)


register_family("tlinformer", TLinFormerConfig, TLinFormerLM,
                "TLinFormer: windowed exact attention with history compression", tiny_config=_tiny_config)

__all__ = ["TLinFormerConfig", "TLinFormerLM", "TLinFormerCache", "TLinLayer", "TLinBlock", "auto_history_window"]
