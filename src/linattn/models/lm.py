"""`LanguageModel`: token embedding, a stack of blocks (mixer + FFN/MoE [+ memory lobe]), optional
final norm, tied or untied head; incremental decoding with a `Cache`; sampling.

Blocks:

* residual="prenorm":   h = x + mixer(norm1(x));  f = ffn(norm2(h));  out = h + f [+ lobe(f)]
* residual="hyperlink": a = mixer(norm1(x));  f = ffn(a) [+ a if hyperlink_ffn_skip];  out = x + f [+ lobe(f)]
  (ELA's Hyper-Link: one norm per layer, no residual around the mixer; ffn="none" makes f = a.)

The mixer of a block gets exactly the config fields its registry entry declares
(`registry.mixer_config_kwargs`); nothing here knows about particular mixers.
`LanguageModel` is the "lm" model family (`models/family.py`) and follows `CausalLM`.
Packed documents: `model(ids [1, T_total], cu_seqlens=offsets)` runs every document as if alone.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ..errors import LinattnError, LinattnTypeError
from ..layers import Cache, RMSNorm, SwiGLU, check_cu_seqlens
from ..layers.base import hooked
from ..layers.cache import model_layout
from ..layers.common import FusedParams
from ..layers.rwkv7 import RWKV7ChannelMix
from ..ops._common import check_values
from . import decode_plan
from .config import LMConfig
from .decode_plan import BlockDescription, ModelDescription, block_token, model_step, plan_linear
from .family import CausalLM, register_family
from .generation import greedy_tokens, join_generated, stream_tokens
from .lobe import MemoryLobe
from .moe import MoE
from .registry import build_mixer, mixer_config_kwargs


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameters of any model (the language models and the vision ones), shared ones counted once;
    exclude_embeddings: without a language model's `.embed` and (optional) `.lm_head` weights."""
    seen, total = set(), 0
    skip = set()
    if exclude_embeddings:
        head = getattr(model.lm_head, "weight", None)  # a quantized head holds buffers, no weight parameter
        skip = {id(model.embed.weight)} | ({id(head)} if head is not None else set())
    for p in model.parameters():
        if id(p) in seen or (exclude_embeddings and id(p) in skip):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def init_lm_weights(model: nn.Module, std: float, n_layers: int) -> None:
    """GPT-2 style init: N(0, std), output projections (o_proj, w_down) scaled by 1/sqrt(2 n_layers)."""
    out_std = std / math.sqrt(2 * n_layers)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            last = name.rsplit(".", 1)[-1]
            nn.init.normal_(m.weight, std=out_std if last in ("o_proj", "w_down") else std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)


@dataclass
class LMOutput:
    """What `LanguageModel.forward` returns.

    Attributes:
        logits: `[B, T, vocab]` (or the kept positions' with logits_to_keep).
        aux_loss: A scalar, 0 without MoE.
        cache: The decoding cache (None unless decoding).
        loss: The cross-entropy against `targets`, when they are given.
    """
    logits: torch.Tensor
    aux_loss: torch.Tensor
    cache: Optional[Cache] = None
    loss: Optional[torch.Tensor] = None


def mixer_kwargs(config: LMConfig, name: str, layer_idx: int) -> dict:
    """The keyword arguments `config` gives mixer `name` in layer `layer_idx`: the config fields
    the mixer declares (see `registry.mixer_config_kwargs`), then `config.mixer_kwargs[name]`."""
    return mixer_config_kwargs(name, config, layer_idx)


def make_norm(config: LMConfig) -> nn.Module:
    """The norm `config.norm` names over d_model: RMSNorm, or LayerNorm with a bias (RWKV-7's)."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.d_model, eps=config.norm_eps)
    return RMSNorm(config.d_model, eps=config.norm_eps)


class Block(nn.Module):
    """One layer: mixer, FFN (SwiGLU / MoE / none) and an optional memory lobe."""

    def __init__(self, config: LMConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.mixer_name = c.mixer_list()[layer_idx]
        self.residual = c.residual
        self.hyperlink_ffn_skip = c.hyperlink_ffn_skip
        self.mixer = build_mixer(self.mixer_name, c.d_model, c.n_heads, **mixer_kwargs(c, self.mixer_name, layer_idx))
        # packed documents (cu_seqlens) only reach a mixer that says it keeps them apart
        self.mixer_packs = bool(getattr(self.mixer, "supports_cu_seqlens", False))
        self.norm1 = make_norm(c)
        # RWKV-7's norm of the embeddings (its ln0), kept in the first block as fla does
        self.pre_norm = make_norm(c) if c.embed_norm and layer_idx == 0 else None
        out_std = c.init_std / math.sqrt(2 * c.n_layers)
        if c.ffn == "swiglu":
            self.ffn = SwiGLU(c.d_model, c.ffn_hidden)
        elif c.ffn == "moe":
            self.ffn = MoE(c.d_model, c.n_experts, c.top_k, c.expert_hidden, bias=c.moe_bias,
                           aux_loss_coef=c.aux_loss_coef, init_std=c.init_std, out_std=out_std)
        elif c.ffn == "rwkv7":
            self.ffn = RWKV7ChannelMix(c.d_model, c.ffn_hidden)
        else:
            self.ffn = None
        self.norm2 = make_norm(c) if (c.residual == "prenorm" and self.ffn is not None) else None
        self.lobe = (MemoryLobe(c.d_model, c.memory_lobe, c.lobe_heads, c.lobe_feature_map, chunk_size=c.chunk_size)
                     if c.memory_lobe else None)

    @property
    def causal(self) -> bool:
        return getattr(self.mixer, "causal", True) and (self.lobe is None or self.lobe.causal)

    def _ffn(self, h: torch.Tensor, cache: Optional[Cache] = None, cu_seqlens: Optional[torch.Tensor] = None):
        if self.ffn is None:
            return h, None
        if isinstance(self.ffn, MoE):
            return self.ffn(h)
        if isinstance(self.ffn, RWKV7ChannelMix):   # its token shift keeps a state and sees document starts
            return self.ffn(h, cache.layer(self.layer_idx, "ffn") if cache is not None else None,
                            cu_seqlens=cu_seqlens), None
        return self.ffn(h), None

    def decode_description(self, dtype: torch.dtype) -> Optional[BlockDescription]:
        """This block as a decode plan sees it (models/decode_plan.py), for weights in dtype (float32, float64,
        bfloat16), or None when a decoded token must run `forward`'s usual path: not pre-norm, a memory lobe, an FFN
        other than SwiGLU, norms / FFN not exactly the library's or not in dtype, a hook on one of them."""
        mods = self._modules
        n1, n2, ffn = mods["norm1"], mods.get("norm2"), mods.get("ffn")
        if (self.residual != "prenorm" or mods.get("lobe") is not None or mods.get("pre_norm") is not None
                or dtype not in (torch.float32, torch.float64, torch.bfloat16)):
            return None
        if ffn is not None and type(ffn) is not SwiGLU:
            return None
        parts = (n1, n2) if ffn is None else (n1, n2, ffn, ffn._modules["w_gate_up"], ffn._modules["w_down"])
        if ffn is not None and not (plan_linear(parts[3], dtype) and plan_linear(parts[4], dtype)):
            return None
        if hooked(*parts):
            return None
        for n in (n1, n2):
            if n is not None and (type(n) is not RMSNorm or (n.weight is not None and n.weight.dtype != dtype)):
                return None
        step_kind = getattr(self.mixer, "fast_step_kind", None)
        return BlockDescription(self.mixer, step_kind() if step_kind is not None else None, n1, n2,
                                None if ffn is None else "swiglu", *parts[3:5] if ffn is not None else (None, None),
                                modules=parts)

    def forward(self, x: torch.Tensor, cache: Optional[Cache] = None, cu_seqlens: Optional[torch.Tensor] = None):
        """x `[B, T, d]` -> (out `[B, T, d]`, aux loss or None). cu_seqlens (packed documents) goes
        to the mixer and the memory lobe; the FFN / MoE works per token (RWKV-7's channel mix sees them too)."""
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        mc = cache.layer(self.layer_idx, "mixer") if cache is not None else None
        if mc is not None and x.shape[1] == 1 and cu_seqlens is None and not torch.is_grad_enabled():
            out = block_token(self, x, mc)   # one decoded token (models/decode_plan.py); None: the lines below
            if out is not None:
                return out, None
        if cu_seqlens is not None and not self.mixer_packs:
            raise LinattnError(f"mixer {self.mixer_name!r} (layer {self.layer_idx}) does not accept cu_seqlens, so it "
                               f"cannot keep packed documents apart; run one document per row instead")
        h = self.norm1(x)
        a = self.mixer(h, cache=mc) if cu_seqlens is None else self.mixer(h, cache=mc, cu_seqlens=cu_seqlens)
        if self.residual == "prenorm":
            h = x + a
            if self.ffn is None:
                f, aux, out = a, None, h
            else:
                f, aux = self._ffn(self.norm2(h), cache, cu_seqlens)
                out = h + f
        else:
            f, aux = self._ffn(a, cache, cu_seqlens)
            if self.hyperlink_ffn_skip and self.ffn is not None:
                f = f + a
            out = x + f
        if self.lobe is not None:
            out = out + self.lobe(f, cache=cache.layer(self.layer_idx, "lobe") if cache is not None else None,
                                  cu_seqlens=cu_seqlens)
        return out, aux


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Token ids must lie in [0, vocab_size): a value check, so it follows `linattn.set_checks` (CPU
    tensors in eager mode by default; never a host synchronisation on CUDA unless "full")."""
    if ids.numel() == 0 or not check_values(ids):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise LinattnError(f"input_ids must lie in [0, vocab_size) = [0, {vocab_size}), got values from {lo} to {hi}")


class LanguageModel(nn.Module, CausalLM):
    """A decoder-only language model built from an `LMConfig` (the "lm" family; a `CausalLM`).

    Calls: `model(ids)` (training: logits, aux_loss, and `.loss` with targets), `model(ids, use_cache=True)`
    (prefill: `out.cache` holds every layer's state), `model(next_ids, cache=out.cache)` (decode),
    `model.generate(ids, n)` (sampling), `model(packed_ids, cu_seqlens=offsets)` (`[1, T_total]` packed
    documents, kept apart).

    Args:
        config: The model's configuration.

    Raises:
        LinattnTypeError: config is not an `LMConfig`.
        ConfigError: The config is invalid.

    Examples:
        >>> import torch
        >>> from linattn import LanguageModel, LMConfig
        >>> model = LanguageModel(LMConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, mixer="gla"))
        >>> ids = torch.randint(0, 256, (2, 12))
        >>> out = model(ids)                       # out.logits [B, T, 256], out.aux_loss, out.cache (None)
        >>> out.logits.shape
        torch.Size([2, 12, 256])
        >>> out = model(ids[:, :11], use_cache=True)      # prefill: out.cache holds every layer's state
        >>> step = model(ids[:, 11:], cache=out.cache)    # decode the 12th token
        >>> torch.allclose(step.logits[:, -1], model(ids).logits[:, -1], atol=1e-4)
        True
        >>> model.generate(ids[0, :4], 8, temperature=0.8, top_p=0.9, generator=0).shape
        torch.Size([12])
        >>> offsets = torch.tensor([0, 5, 12])             # two packed documents
        >>> model(ids[:1], cu_seqlens=offsets).logits.shape
        torch.Size([1, 12, 256])
    """

    #: forward accepts cu_seqlens (packed documents)
    supports_cu_seqlens = True
    #: recompute each block in the backward pass instead of keeping its activations (training only)
    activation_checkpointing = False
    #: one decoded token through the whole model in one compiled call where every block has a compiled block step
    #: (models/decode_plan.model_step); False: block by block
    compiled_decode = True

    def __init__(self, config: LMConfig):
        super().__init__()
        if not isinstance(config, LMConfig):
            raise LinattnTypeError(f"config must be an LMConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        if config.memory_lobe == "bidirectional":
            warnings.warn("memory_lobe='bidirectional' (allow_future_leak=True): every position sees later "
                          "tokens, so training losses are not those of a causal language model and "
                          "incremental decoding is impossible (generate() re-runs the whole sequence).",
                          UserWarning, stacklevel=2)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layers)])
        shared = None   # mixers that share tensors across layers (RWKV-7's value residual) are linked in block order
        for block in self.blocks:
            if hasattr(block.mixer, "link_layers"):
                shared = block.mixer.link_layers(shared)
        self.norm = make_norm(config) if config.final_norm else None
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_lm_weights(self, config.init_std, config.n_layers)

    # -- setup -------------------------------------------------------------------------------

    @property
    def is_causal(self) -> bool:
        """False when some position depends on later tokens (a bidirectional memory lobe)."""
        return all(b.causal for b in self.blocks)

    def decode_description(self) -> Optional[ModelDescription]:
        """This model as the whole-model decode plan sees it (models/decode_plan.py): the embedding, every block's
        `Block.decode_description` in the embedding's dtype, the final norm (an RMSNorm or none) and the head; None
        when a part is not what the plan computes (a block subclass, another norm, a block that cannot describe
        itself)."""
        mods = self._modules
        embed, norm = mods["embed"], mods.get("norm")
        if norm is not None and type(norm) is not RMSNorm:
            return None
        blocks = []
        for b in self.blocks:
            if type(b) is not Block:
                return None
            blocks.append(b.decode_description(embed.weight.dtype))
            if blocks[-1] is None:
                return None
        return ModelDescription(embed, blocks, norm, mods.get("lm_head"))

    def new_cache(self, rollback: int = 0) -> Cache:
        """An empty decoding cache.

        A new cache starts a new generation, so the layers' fused single-token weights (`FusedParams`) are rebuilt
        from the parameters as they are now: a change their version keys cannot see (a write through `p.data`) is
        picked up by the next prefill.

        Args:
            rollback: k: `cache.crop(n)` may later remove up to k tokens (speculative decoding). The model then runs
                the last min(T, k) tokens of every call one at a time and records the states after each
                (`Cache.record`; the memory it costs: docs/states.md). rollback=0 records nothing.

        Returns:
            A `Cache` for `forward(..., cache=)`.
        """
        for m in self.modules():
            fused = getattr(m, "_fused", None)
            if isinstance(fused, FusedParams):
                fused.clear()
        cache = Cache(self.config.n_layers, rollback=rollback)
        cache.model_layout = model_layout(self.config, self.embed.weight.dtype)  # for restore()'s check
        return cache

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (shared ones counted once); optionally without the embedding/head.

        Args:
            exclude_embeddings: Leave out the embedding and the (untied) output head.

        Returns:
            The count.
        """
        return count_parameters(self, exclude_embeddings)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: Optional[Cache] = None, *, use_cache: bool = False,
                targets: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                logits_to_keep: Union[int, torch.Tensor] = 0) -> LMOutput:
        """Run the model on token ids: training, prefill or decoding.

        With `activation_checkpointing` set, training recomputes each block in the backward pass.

        Args:
            input_ids: Token ids `[B, T]` (int64 or int32).
            cache: a `Cache` from an earlier call (continued and updated in place).
            use_cache: True starts a new cache (prefill).
            targets: `[B, T]` (aligned with the logits; -100 ignored) adds `.loss`.
            cu_seqlens: (int64 `[N+1]`, input_ids `[1, T_total]`): N packed documents, each run as if
                alone (every mixer's state, short convolution and positions restart at each document;
                the MoE routes per token as always). Not combined with a cache.
            logits_to_keep: 0 computes the logits of every position; n > 0 those of the last n only;
                a 1-D index tensor those positions (decoding needs only the last one). Not with targets.

        Returns:
            LMOutput(logits `[B, T, vocab]`, aux_loss, cache[, loss]).

        Raises:
            LinattnError: Bad ids, targets or offsets, or cu_seqlens combined with a cache.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
                torch.int64, torch.int32):
            raise LinattnError(f"input_ids must be an int64 tensor [B, T], got "
                               f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                               f"{tuple(getattr(input_ids, 'shape', ()))}")
        if input_ids.shape[1] == 0:
            raise LinattnError("input_ids must hold at least one token")
        if cache is not None and input_ids.shape[1] == 1 and targets is None and cu_seqlens is None:
            out = model_step(self, input_ids, cache, logits_to_keep)   # None: not covered
            if out is not None:
                return LMOutput(logits=out[0], aux_loss=out[1], cache=cache)
        check_token_ids(input_ids, self.config.vocab_size)
        if cu_seqlens is not None and (cache is not None or use_cache):
            raise LinattnError("cu_seqlens (packed documents) cannot be combined with a decoding cache "
                               "(cache / use_cache); decode a [B, T] batch instead")
        cu_seqlens = check_cu_seqlens(cu_seqlens, input_ids.shape[0], input_ids.shape[1])
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape != input_ids.shape):
            raise LinattnError(f"targets must be a tensor of the shape of input_ids {tuple(input_ids.shape)}, "
                               f"got {tuple(getattr(targets, 'shape', ())) or type(targets).__name__}")
        if cache is None and use_cache:
            cache = self.new_cache()
        if cache is not None:
            if not isinstance(cache, Cache) or len(cache) != self.config.n_layers:
                raise LinattnError(f"cache must be a linattn Cache with {self.config.n_layers} layers "
                                   f"(model.new_cache()), got {cache!r}")
        if cache is not None and cache.rollback:
            logits, aux = self._forward_recorded(input_ids, cache)
            if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                if targets is not None:
                    raise LinattnError("logits_to_keep cannot be combined with targets (the loss needs every logit)")
                logits = logits[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else logits[:, logits_to_keep]
        else:
            logits, aux = self._forward_blocks(input_ids, cache, cu_seqlens, targets, logits_to_keep)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=-100)
        return LMOutput(logits=logits, aux_loss=aux, cache=cache, loss=loss)

    def _forward_recorded(self, input_ids: torch.Tensor, cache: Cache):
        """A call on a cache with rollback k: the first T - min(T, k) tokens at once, then the rest one at
        a time, the states recorded after each (`Cache.record`), so `crop` can go back to any of them.
        Returns every position's logits and the token-weighted mean of the parts' aux losses."""
        T, k = input_ids.shape[1], cache.rollback
        head = T - min(T, k)
        parts = ([input_ids[:, :head]] if head else []) + [input_ids[:, t:t + 1] for t in range(head, T)]
        logits, aux = [], 0.0
        for ids in parts:
            lg, a = self._forward_blocks(ids, cache, None, None, 0)
            cache.record()
            logits.append(lg)
            aux = aux + a * (ids.shape[1] / T)
        return torch.cat(logits, dim=1), aux

    def run_blocks(self, x: torch.Tensor, cache: Optional[Cache] = None, cu_seqlens: Optional[torch.Tensor] = None,
                   *, hidden: Optional[List[torch.Tensor]] = None, checkpoint: Optional[Callable] = None,
                   checkpoint_every: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
        """The blocks over embeddings: the stack between the embedding and the final norm (what `forward` runs, and
        the transformers models of `linattn.hf`).

        Args:
            x: Embeddings `[B, T, d_model]`.
            cache: A `Cache` (continued and updated in place; `seen_tokens` counts the T positions), or None.
            cu_seqlens: Packed documents (as in `forward`), or None.
            hidden: A list that receives every block's input (transformers' hidden states), or None.
            checkpoint: Recompute blocks in the backward pass through this function (called as
                `checkpoint(block, x, None, cu_seqlens)`, like `torch.utils.checkpoint.checkpoint`); only without a
                cache.
            checkpoint_every: Recompute every this-many-th block (transformers' `every_n_layers`).

        Returns:
            (the last block's output `[B, T, d_model]` before the final norm, the summed aux loss).

        Raises:
            LinattnError: A cache with a bidirectional memory lobe (it cannot decode incrementally).
        """
        if cache is not None and not self.is_causal:
            raise LinattnError("this model has a bidirectional memory lobe: it cannot decode incrementally "
                               "with a cache (call it on the whole sequence instead)")
        aux = torch.zeros((), dtype=torch.float32, device=x.device)
        for i, block in enumerate(self.blocks):
            if hidden is not None:
                hidden.append(x)
            if checkpoint is not None and cache is None and i % checkpoint_every == 0:
                x, a = checkpoint(block, x, None, cu_seqlens)
            else:
                x, a = block(x, cache, cu_seqlens)
            if a is not None:
                aux = aux + a
        if cache is not None:
            cache.seen_tokens += x.shape[1]
        return x, aux

    def _forward_blocks(self, input_ids, cache, cu_seqlens, targets, logits_to_keep):
        """The embedding, blocks, final norm and head (forward's body) -> (logits, aux loss)."""
        recompute = self.activation_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        x, aux = self.run_blocks(self.embed(input_ids), cache, cu_seqlens,
                                 checkpoint=partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
                                 if recompute else None)
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            if targets is not None:
                raise LinattnError("logits_to_keep cannot be combined with targets (the loss needs every logit)")
            x = x[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else x[:, logits_to_keep]
        if self.norm is not None:
            x = self.norm(x)
        logits = self.lm_head(x) if self.lm_head is not None else F.linear(x, self.embed.weight)
        return logits, aux

    # -- generation --------------------------------------------------------------------------
    def stream(self, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
               top_k: Optional[int] = None, top_p: Optional[float] = None,
               generator: Union[torch.Generator, int, None] = None, seed: Optional[int] = None,
               eos_token_id: Optional[int] = None) -> Iterator[Union[int, torch.Tensor]]:
        """Yield generated tokens one step at a time (what `generate` collects).

        Stops after max_new_tokens, or once every sequence has produced eos_token_id (which is yielded).

        Args:
            input_ids: The prompt: a list of ids or a `[T]` tensor, or a `[B, T]` tensor.
            max_new_tokens: The most tokens to generate.
            temperature: 0 is greedy.
            top_k: Keep the k most likely tokens (None: all).
            top_p: Keep the smallest set of tokens whose probability reaches p (None: all).
            generator: a torch.Generator or an int seed, to make sampling reproducible.
            seed: An int seed (as generator=int).
            eos_token_id: Stop once every sequence has produced it.

        Yields:
            An int per step for a 1-D prompt, a `[B]` tensor for a `[B, T]` prompt.

        Examples:
            >>> from linattn import LanguageModel, LMConfig
            >>> model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mixer="gla"))
            >>> tokens = list(model.stream([1, 2, 3], 5, temperature=0))
            >>> len(tokens), all(isinstance(t, int) for t in tokens)
            (5, True)
        """
        causal = self.is_causal
        seen = []  # without an incremental form (bidirectional lobe): the whole sequence each step

        def forward(new_ids, out):
            if causal:  # only the last position's logits are sampled from
                return (self(new_ids, use_cache=True, logits_to_keep=1) if out is None
                        else self(new_ids, cache=out.cache, logits_to_keep=1))
            seen.append(new_ids)
            return self(torch.cat(seen, dim=1))

        return stream_tokens(self, input_ids, max_new_tokens, forward, temperature, top_k, top_p, generator, seed,
                             eos_token_id)

    def generate(self, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 generator: Union[torch.Generator, int, None] = None, seed: Optional[int] = None,
                 eos_token_id: Optional[int] = None) -> torch.Tensor:
        """Sample a continuation of a prompt.

        Decoding is incremental: one prefill, then one token at a time from each layer's cached state. Greedy
        decoding (temperature 0) of a model the compiled whole-model step covers runs every token after the first in
        one compiled call (`decode_plan.model_greedy`): the tokens `stream` yields, without Python between them.

        Args:
            input_ids: The prompt, `[T]` (or a list of ints) or `[B, T]`.
            max_new_tokens: The most tokens to sample.
            temperature: 0 is greedy.
            top_k: Keep the k most likely tokens (None: all).
            top_p: Keep the smallest set of tokens whose probability reaches p (None: all).
            generator: a torch.Generator or an int seed, to make sampling reproducible.
            seed: An int seed (as generator=int).
            eos_token_id: Stop after this token.

        Returns:
            Prompt followed by up to max_new_tokens sampled tokens (`[T + n]` or `[B, T + n]`).
        """
        if temperature == 0 and self.is_causal:   # greedy: the tokens after the first in one compiled call
            def forward(new_ids, out):   # (as `stream`'s)
                return (self(new_ids, use_cache=True, logits_to_keep=1) if out is None
                        else self(new_ids, cache=out.cache, logits_to_keep=1))

            def rest(tok, out, n, eos):   # (None: not covered, the stream's per-token steps)
                if eos is not None and (type(eos) is not int or eos < 0):
                    return None
                got = decode_plan.model_greedy(self, tok, out.cache, n, eos)
                return None if got is None else got[0]

            return join_generated(self, input_ids, greedy_tokens(self, input_ids, max_new_tokens, forward, rest, top_k,
                                                                 top_p, generator, seed, eos_token_id))
        return join_generated(self, input_ids, list(self.stream(input_ids, max_new_tokens, temperature, top_k, top_p,
                                                                generator, seed, eos_token_id)))


def _tiny_config(vocab_size: int) -> LMConfig:
    """A small hybrid LM (the family registry's example, built by the tests): a delta-rule and a
    softmax layer, MoE, Hyper-Link and a causal memory lobe."""
    return LMConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=2, mixer=["gated-deltanet", "softmax"],
                    memory_lobe="causal", residual="hyperlink", ffn="moe", n_experts=3, top_k=2)


register_family("lm", LMConfig, LanguageModel, "decoder-only LM: a mixer per layer (linear, delta, softmax, hybrids)",
                tiny_config=_tiny_config)
