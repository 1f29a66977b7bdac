"""`LinattnForCausalLM`: a transformers `PreTrainedModel` + `GenerationMixin` around a linattn
`LanguageModel` (the model itself, under `.model`; its weights are `model.*` in the state dict);
`LinattnModel` (`AutoModel`: the stack without the head, parameters named like `LanguageModel`'s) and
`LinattnForSequenceClassification` (`.model` a LinattnModel, `.score` a linear head), so an LM folder
loads into both. All three run the blocks through `LanguageModel.run_blocks` (the stack `LanguageModel.forward`
runs), which takes embeddings (`inputs_embeds`), collects hidden states and takes transformers' activation
checkpointing (`gradient_checkpointing_func`, `every_n_layers`).

Decoding state lives in transformers' own cache: `DynamicCache(config=...)` builds one layer per
block from `config.layer_types` (see `configuration_linattn`): `LinearAttentionLayer` for linear and
delta-rule mixers, `LinearAttentionAndFullAttentionLayer` (or its sliding-window twin) for softmax
mixers. Every tensor of a block's linattn `LayerCache` (the leaves of its fields, `flatten_state`) gets a
numbered state slot of that layer: the convolution windows (`conv`) go through `update_conv_state`, the rest
(a delta-rule state, the fields of a `LinearAttentionState`, a token shift) through
`update_recurrent_state`, and a softmax mixer's keys/values through the layer's own `update`. The
tokens each row has consumed are one more slot of layer 0. So `reorder_cache` (beam search),
`reset` and `batch_select_indices` of transformers act on all of it.

Past recording (`cache.activate_past_recording()`, what assisted generation does): the cache layers
get linattn's rollback (`_RollbackLayer`): while recording, the last `past_recording_window` tokens of
every call run one at a time and every layer's slots are recorded after each (`Cache.record` of a one-layer
linattn `Cache`), so `crop(-n)` restores the state of n tokens back (`Cache.crop`) and cuts the keys/values
(docs/states.md). Hence `_is_stateful = False`.

Padding (`attention_mask` with zeros, left padding for batched generation) never enters a state:

* without a cache, the real tokens of every row are packed into one row and run with `cu_seqlens`,
  so every row is computed exactly as if it were alone (one forward call);
* a prefill with a cache runs every row on its own real tokens (one call per row) and merges the
  per-row states into the batch (`Cache.insert_rows`); keys/values are left-padded, and the softmax layers mask the
  padded slots with the rows' own positions (`SoftmaxAttention._row_mask`);
* later steps decode the whole batch at once, every row from its own state and position.
"""
from __future__ import annotations

import functools
import warnings
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.cache_utils import (
    Cache as HFCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)
from transformers.loss.loss_utils import ForCausalLMLoss, ForSequenceClassificationLoss
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)

from ..errors import ConfigError, LinattnError, UsageError
from ..layers.cache import Cache, KVCache, LayerCache, flatten_state, per_row_ints
from ..models.lm import LanguageModel, check_token_ids
from .configuration_linattn import STATE_SLOTS, LinattnConfig, layer_types_of

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` (the old
# name is still accepted with a warning); we take either and answer in the installed version's name (_cache_field).
_OFFSETS = ("", "offsets")   # the (module, key) of the per-row token counts, in layer 0


# --------------------------------------------------------------------------- the cache bridge

class _HFKV:
    """linattn's `KVCache.append` over a transformers attention cache layer, which holds the keys
    and values ([B, H, L, D] there, [B, L, H, D] in linattn)."""

    def __init__(self, layer: DynamicLayer):
        self.layer = layer

    def append(self, k: torch.Tensor, v: torch.Tensor):
        keys, values = self.layer.update(k.transpose(1, 2), v.transpose(1, 2))
        return keys.transpose(1, 2), values.transpose(1, 2), 0   # start: unused with per-row offsets

    def nbytes(self) -> int:
        return 0 if self.layer.keys is None else 2 * self.layer.keys.numel() * self.layer.keys.element_size()


def _slots(layer) -> Dict[Tuple[str, str], Any]:
    """{(module, field): (structure, leaf slots)} of a transformers cache layer (kept on the layer): where the
    leaves of one LayerCache field (`flatten_state`) live, each ("conv" | "rec", slot index) or ("ints", slot
    index, tuple / list) for a per-row int tuple, kept as an int64 tensor [B] (so that beam search reorders it)."""
    return layer.__dict__.setdefault("_linattn_slots", {})


def _put_tensor(layer, kind: str, idx: int, t: torch.Tensor) -> None:
    if kind == "conv":
        layer.update_conv_state(t, state_idx=idx)
    else:
        old = layer.recurrent_states[idx]
        if old is not None and old.shape == t.shape and old.dtype == t.dtype:
            layer.update_recurrent_state(t, state_idx=idx)   # in place (a fixed-size state)
        else:   # first write, or a state that grows with the tokens (e.g. cached keys of FoX / PaTH)
            layer.recurrent_states[idx] = t
            layer.is_recurrent_states_initialized[idx] = True
        layer.has_previous_state[idx] = True   # our validity mark; reset() clears it
    if layer.device is None:   # reorder_cache moves beam indices to layer.device
        layer.device, layer.dtype = t.device, t.dtype


def _put(layer, module: str, field: str, value) -> None:
    """Store one LayerCache field in a transformers cache layer (allocating its slots once): convolution windows
    through `update_conv_state`, the rest through the recurrent-state slots."""
    slots = _slots(layer)
    leaves, spec = flatten_state(value)
    if (module, field) not in slots:
        bad = next((t for t in leaves if not (t is None or isinstance(t, torch.Tensor) or per_row_ints(t))), None)
        if bad is not None:
            raise LinattnError(f"cannot keep {module}.{field} (holding a {type(bad).__name__}) in a transformers cache")
        n = 1 + max((p[1] for _, places in slots.values() for p in places if p[0] != "none"), default=-1)
        places = []
        for t in leaves:
            places.append(("none",) if t is None else ("ints", n, type(t)) if per_row_ints(t) else
                          ("conv" if field == "conv" and t.dim() == 3 else "rec", n))
            n += t is not None
        if n > STATE_SLOTS:
            raise LinattnError(f"a block keeps more than {STATE_SLOTS} state tensors; raise STATE_SLOTS in "
                               f"linattn.hf.configuration_linattn")
        slots[(module, field)] = (spec, places)
    for place, t in zip(slots[(module, field)][1], leaves):
        if place[0] != "none":
            t = torch.tensor(list(t), dtype=torch.int64) if place[0] == "ints" else t
            _put_tensor(layer, "conv" if place[0] == "conv" else "rec", place[1], t)


def _get(layer, spec, places):
    leaves = [None if p[0] == "none" else layer.conv_states[p[1]] if p[0] == "conv" else
              layer.recurrent_states[p[1]] for p in places]
    leaves = [p[2](int(v) for v in t.tolist()) if p[0] == "ints" else t for p, t in zip(places, leaves)]
    return pytree.tree_unflatten(leaves, spec)


def _offsets_slot(hf_cache: HFCache) -> Optional[int]:
    found = _slots(hf_cache.layers[0]).get(_OFFSETS) if len(hf_cache.layers) else None
    return None if found is None else found[1][0][1]


def _is_empty(hf_cache: HFCache) -> bool:
    idx = _offsets_slot(hf_cache)
    return idx is None or not hf_cache.layers[0].has_previous_state[idx]


def _offsets(hf_cache: HFCache) -> torch.Tensor:
    return hf_cache.layers[0].recurrent_states[_offsets_slot(hf_cache)]


# --------------------------------------------------------------------------- past recording (rollback)

class _RollbackLayer:
    """The methods mixed into our transformers cache layers (`_rollback_class`): transformers' past recording
    (`activate_past_recording()`, then `crop(-n)`) for linattn's states. transformers' own linear-attention
    layers can only cut convolution windows (`is_croppable` is False once a recurrent state exists); here,
    while recording, the model runs the last tokens of each call one at a time and `_record_layer` keeps a
    copy of every state slot after each, `crop(-n)` puts the copy from n tokens back and cuts the keys/values
    as transformers does (docs/states.md). The layer objects change class in place, so the class is the
    transformers class plus these functions (a mixin base would change the object layout)."""

    _linattn_rollback = True

    @staticmethod
    def _base(layer) -> type:
        return type(layer).__bases__[0]

    @property
    def is_croppable(self) -> bool:
        attr = _RollbackLayer._base(self).is_croppable   # the transformers class's own answer
        return getattr(self, "record_past", False) or (attr.__get__(self) if isinstance(attr, property) else bool(attr))

    def update_conv_state(self, conv_states, state_idx: int = 0, **kwargs):
        # our conv slots hold exactly linattn's window: recording keeps copies instead of growing the window
        rec, self.record_past = self.record_past, False
        try:
            return _RollbackLayer._base(self).update_conv_state(self, conv_states, state_idx=state_idx, **kwargs)
        finally:
            self.record_past = rec

    def crop(self, tokens_to_remove: int) -> None:
        record = self.__dict__.get("_linattn_record")
        if not getattr(self, "record_past", False) or record is None:
            return _RollbackLayer._base(self).crop(self, tokens_to_remove)
        if tokens_to_remove > 0:
            raise LinattnError(f"crop({tokens_to_remove}): a linattn cache layer takes a negative number "
                               f"(the tokens to remove), as transformers' linear-attention layers")
        if tokens_to_remove < 0:   # (crop(0) removes nothing: only a sliding window's keys are trimmed below)
            try:
                record.crop(int(tokens_to_remove))   # linattn's own rollback: the slots recorded n tokens back
            except UsageError as e:
                raise UsageError(f"{e}; raise the model's past_recording_window") from None
            for name, slots in record.layers[0]["layer"].state.items():
                setattr(self, name, dict(slots))
        if isinstance(self, DynamicSlidingWindowLayer):
            DynamicSlidingWindowLayer.crop(self, tokens_to_remove)
        elif isinstance(self, DynamicLayer):
            DynamicLayer.crop(self, tokens_to_remove)


@functools.cache
def _rollback_class(cls: type) -> type:
    own = {k: v for k, v in vars(_RollbackLayer).items() if not k.startswith("__")}
    return type(f"Linattn{cls.__name__}", (cls,), {**own, "__module__": __name__})


# the dicts of a transformers linear-attention cache layer that hold its state (slot index -> tensor or flag)
_LAYER_STATE = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                "is_recurrent_states_initialized")


def _record_layer(layer, seq: int, window: int) -> None:
    """Record every state slot of `layer` after `seq` positions, forgetting those older than window: a one-layer
    linattn `Cache` with rollback keeps the records (`Cache.record`) and rolls back to one (`Cache.crop`)."""
    record = layer.__dict__.get("_linattn_record")
    if record is None:
        record = layer._linattn_record = Cache(1)   # no record of the empty state: crop starts where recording did
    record.rollback = window
    record.layers = [{"layer": LayerCache(state={name: dict(getattr(layer, name)) for name in _LAYER_STATE})}]
    record.seen_tokens = seq
    record.record()


def _position(hf_cache: HFCache) -> int:
    """The positions consumed (the longest row's tokens): what a recorded state is keyed by."""
    return int(_offsets(hf_cache).max())


def _check_layers(hf_cache: HFCache, n_layers: int, config: LinattnConfig) -> None:
    if len(hf_cache.layers) == 0 and getattr(hf_cache, "layer_class_to_replicate", None) is not None:
        hf_cache.layers = DynamicCache(config=config).layers   # a DynamicCache() made without the config
        hf_cache.layer_class_to_replicate = None
    if len(hf_cache.layers) != n_layers or not all(isinstance(la, LinearAttentionCacheLayerMixin)
                                                   for la in hf_cache.layers):
        raise LinattnError(f"past_key_values must be a transformers cache built from this model's config "
                           f"(DynamicCache(config=model.config): {n_layers} linear-attention / hybrid layers), "
                           f"got {hf_cache!r}")
    for layer in hf_cache.layers:   # past recording that can roll linattn's states back (_RollbackLayer)
        if not getattr(layer, "_linattn_rollback", False):
            layer.__class__ = _rollback_class(type(layer))


def _to_linattn(hf_cache: HFCache, n_layers: int, keeps_kv: List[bool]) -> Cache:
    """A linattn `Cache` whose entries are the transformers cache's tensors (keys/values through _HFKV)."""
    offsets = _offsets(hf_cache)
    cache = Cache(n_layers)
    for i, layer in enumerate(hf_cache.layers):
        for (module, field), (spec, places) in _slots(layer).items():
            if module:
                setattr(cache.layer(i, module), field, _get(layer, spec, places))
        if keeps_kv[i]:
            cache.layer(i, "mixer").kv = _HFKV(layer)
        for lc in cache.layers[i].values():
            lc.offset = offsets
    return cache


def _from_linattn(cache: Cache, hf_cache: HFCache, offsets: torch.Tensor, T: int, count_positions: bool) -> None:
    """Write a linattn `Cache` (after a forward over T positions) into the transformers cache, and the
    new offsets; with count_positions, T zero-width keys into layer 0 (configuration_linattn)."""
    for i, (modules, layer) in enumerate(zip(cache.layers, hf_cache.layers)):
        for module, lc in modules.items():
            kv = lc.kv
            if isinstance(kv, KVCache):
                if not isinstance(layer, DynamicLayer):
                    raise LinattnError(f"block {i} keeps keys/values but its transformers cache layer "
                                       f"({type(layer).__name__}) has none; config.layer_types is wrong")
                if kv.length:
                    layer.update(kv.k[:, :kv.length].transpose(1, 2).contiguous(),
                                 kv.v[:, :kv.length].transpose(1, 2).contiguous())
            for field in ("state", "conv", "shift", "extra"):   # (the offsets: one slot of layer 0, below)
                if any(t is not None for t in flatten_state(getattr(lc, field))[0]):
                    _put(layer, module, field, getattr(lc, field))
    _put(hf_cache.layers[0], *_OFFSETS, offsets)
    if count_positions:
        marker = offsets.new_zeros((offsets.shape[0], 1, T, 0), dtype=torch.float32)
        hf_cache.layers[0].update(marker, marker)


def _merge_rows(caches: List[Cache]) -> Cache:
    """One batched linattn Cache from per-row caches (B = 1 each), through `Cache.insert_rows` (keys/values
    left-padded to the longest row)."""
    merged = caches[0]
    for cache in caches[1:]:
        snap = cache.snapshot()
        problem = merged.rows_mergeable(snap)
        if problem:
            raise LinattnError(f"the rows of this padded batch cannot share one cache ({problem}); this model cannot "
                               f"decode a left-padded batch: generate the prompts one at a time, or give them the "
                               f"same length")
        merged.insert_rows(snap)
    return merged


# --------------------------------------------------------------------------- running the stack

def _cache_field(output_cls) -> str:
    return "cache" if "cache" in getattr(output_cls, "__dataclass_fields__", {}) else "past_key_values"


def _embed(stack, input_ids: Optional[torch.Tensor], inputs_embeds: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, T, d] from token ids (looked up in `stack.embed`) or from given embeddings (PEFT prompt tuning,
    multimodal wrappers): exactly one of the two."""
    if (input_ids is None) == (inputs_embeds is None):
        raise LinattnError("give exactly one of input_ids [batch, seq] or inputs_embeds [batch, seq, hidden_size]")
    d = stack.embed.embedding_dim
    if inputs_embeds is not None:
        if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != d:
            raise LinattnError(f"inputs_embeds must be a tensor [batch, seq, {d}], got "
                               f"{tuple(getattr(inputs_embeds, 'shape', ())) or type(inputs_embeds).__name__}")
        if inputs_embeds.shape[1] == 0:
            raise LinattnError("inputs_embeds must hold at least one position")
        return inputs_embeds
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise LinattnError(f"input_ids must be [batch, seq], got shape {tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.shape[1] == 0:
        raise LinattnError("input_ids must hold at least one token")
    input_ids = input_ids.long()
    check_token_ids(input_ids, stack.embed.num_embeddings)   # the live size, also after a resize
    return stack.embed(input_ids)


def _padding_mask(attention_mask, B: int, T: int, device) -> Optional[torch.Tensor]:
    """The [B, T] bool mask of the new positions, or None when every position is a token."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.shape[0] != B \
            or attention_mask.shape[1] < T:
        raise LinattnError(f"attention_mask must be a 2-D tensor [batch, past + seq] with batch {B} and at least "
                           f"{T} columns (1 = token, 0 = padding), got "
                           f"{tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask).__name__}")
    mask = attention_mask[:, -T:].to(device).bool()
    return None if bool(mask.all()) else mask


def _real_rows(x: torch.Tensor, mask: torch.Tensor) -> List[torch.Tensor]:
    """Each row's real (not padding) positions of x [B, T, d]."""
    rows = [x[b][mask[b]] for b in range(x.shape[0])]
    if any(r.shape[0] == 0 for r in rows):
        raise LinattnError("every row needs at least one token that is not padding (attention_mask 1)")
    return rows


def _scatter(parts: List[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Per-row outputs over the real tokens -> [B, T, d] with zeros at padding."""
    first = parts[0]
    out = first.new_zeros(*mask.shape, first.shape[-1])
    out[mask] = torch.cat(parts)   # row-major order of mask = the rows' tokens one after the other
    return out


#: recomputing a block in the backward pass when transformers gave no function of its own
_RECOMPUTE = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def _keep(x: torch.Tensor, keep) -> torch.Tensor:
    if isinstance(keep, int):
        return x if keep == 0 else x[:, -keep:]
    return x[:, keep]


class LinattnPreTrainedModel(PreTrainedModel):
    """The shared part of linattn's transformers models: running the blocks of `_stack()` (an object with
    `embed`, `blocks` and `norm`: the `LanguageModel` itself, or `LinattnModel`) over padded batches and
    transformers' cache, hidden states, inputs_embeds, activation checkpointing, saving."""
    config_class = LinattnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    # states roll back under transformers' past recording (_RollbackLayer), so assisted decoding may run
    _is_stateful = False
    #: with past recording on, the last this-many tokens of each call run one at a time and their states are
    #: kept, so `crop` can remove up to this many tokens (assisted decoding: the rejected draft tokens)
    past_recording_window = 64
    _supports_sdpa = True
    #: transformers' flag (read by is_activation_checkpointing / is_gradient_checkpointing, the Trainer, PEFT)
    gradient_checkpointing = False

    def _stack(self):
        raise NotImplementedError

    def get_input_embeddings(self):
        return self._stack().embed

    def set_input_embeddings(self, value):
        self._stack().embed = value

    def _init_weights(self, module):
        """linattn initialises its own weights (`LanguageModel`); loading replaces them. A task head that a
        checkpoint lacks (`score` of the classifier) is drawn like linattn's linear layers."""
        if module is getattr(self, "score", None):
            nn.init.normal_(module.weight, std=float(self.config.linattn.get("init_std", 0.02)))

    # -- activation checkpointing ---------------------------------------------------------------
    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1, **kwargs):
        """transformers' activation_checkpointing_enable / disable (and the deprecated gradient_* names):
        blocks are recomputed in the backward pass through `gradient_checkpointing_func` (transformers'
        `checkpoint` with its kwargs), every `every_n_layers`-th block."""
        func = gradient_checkpointing_func or _RECOMPUTE
        if int(every_n_layers) < 1:
            raise LinattnError(f"every_n_layers must be >= 1, got {every_n_layers}")
        for m in self.modules():
            if isinstance(m, LinattnPreTrainedModel):
                m.gradient_checkpointing = bool(enable)
                m._gradient_checkpointing_func = func
                m._checkpoint_every = int(every_n_layers)
            elif isinstance(m, LanguageModel):   # linattn's own flag, for to_linattn() and linattn's trainer
                m.activation_checkpointing = bool(enable)

    def _checkpoint(self, cache) -> Tuple[Optional[Callable], int]:
        """(the function recomputing blocks in the backward pass or None, every how many blocks)."""
        on = bool(self.gradient_checkpointing or getattr(self._stack(), "activation_checkpointing", False))
        if not (on and self.training and cache is None and torch.is_grad_enabled()):
            return None, 1
        return getattr(self, "_gradient_checkpointing_func", None) or _RECOMPUTE, getattr(self, "_checkpoint_every", 1)

    # -- vocabulary -------------------------------------------------------------------------------
    def _sync_vocab_size(self) -> None:
        """Keep the vocabulary size of config.linattn (what loading builds) and of the linattn model's
        config equal to the live embedding (after resize_token_embeddings / set_input_embeddings)."""
        n = int(self.get_input_embeddings().num_embeddings)
        self.config.linattn["vocab_size"] = n
        self.config.vocab_size = n
        for m in self.modules():
            if isinstance(m, LanguageModel):
                m.config.vocab_size = n

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        out = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self._sync_vocab_size()
        return out

    # -- saving -----------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus the two small modules and `auto_map` that let
        `AutoModelForCausalLM` / `AutoModel` / `AutoModelForSequenceClassification.from_pretrained(DIR,
        trust_remote_code=True)` load the folder without `import linattn.hf` (they import linattn, which
        must be installed)."""
        from .remote import write_remote_code

        self._sync_vocab_size()
        self.config.auto_map = dict(AUTO_MAP)
        out = super().save_pretrained(save_directory, *args, **kwargs)
        write_remote_code(save_directory)
        return out

    # -- the forward pass shared by every head -----------------------------------------------------
    def _language_model(self) -> LanguageModel:
        return self._stack()   # LinattnModel: an unregistered LanguageModel over its own blocks

    def _run_blocks(self, x: torch.Tensor, cache: Optional[Cache], cu_seqlens: Optional[torch.Tensor],
                    hidden: Optional[List[torch.Tensor]]) -> torch.Tensor:
        """`LanguageModel.run_blocks` over embeddings x [B, T, d] (the same calls, so the same numbers), with
        transformers' activation checkpointing. Returns the last block's output (no final norm)."""
        func, every = self._checkpoint(cache)
        return self._language_model().run_blocks(x, cache, cu_seqlens, hidden=hidden, checkpoint=func,
                                                  checkpoint_every=every)[0]

    def _run_padded(self, x: torch.Tensor, mask: torch.Tensor, hidden: Optional[List[torch.Tensor]]) -> torch.Tensor:
        """A padded batch without a cache: the real positions of all rows packed in one row with cu_seqlens
        (one call), or row by row if a mixer cannot pack; zeros at padding (also in `hidden`)."""
        rows = _real_rows(x, mask)
        if all(getattr(b, "mixer_packs", False) for b in self._stack().blocks):
            cu = torch.tensor([0] + [r.shape[0] for r in rows], device=x.device).cumsum(0)
            return self._run_rows([torch.cat(rows)], mask, [None], hidden, cu)
        return self._run_rows(rows, mask, [None] * len(rows), hidden)

    def _run_rows(self, rows: List[torch.Tensor], mask: torch.Tensor, caches: List[Optional[Cache]],
                  hidden: Optional[List[torch.Tensor]], cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's real tokens alone (with its own cache of `caches`; or every row's, packed in one with
        cu_seqlens), scattered back to [B, T, d] with zeros at padding (also in `hidden`)."""
        subs = [[] if hidden is not None else None for _ in rows]
        outs = [self._run_blocks(r[None], c, cu_seqlens, s)[0] for r, c, s in zip(rows, caches, subs)]
        if hidden is not None:
            hidden.extend(_scatter([s[j][0] for s in subs], mask) for j in range(len(subs[0])))
        return _scatter(outs, mask)

    def _run_cached(self, x: torch.Tensor, mask: Optional[torch.Tensor], hf_cache: HFCache,
                    hidden: Optional[List[torch.Tensor]]) -> torch.Tensor:
        _check_layers(hf_cache, self.config.num_hidden_layers, self.config)
        if not any(getattr(layer, "record_past", False) for layer in hf_cache.layers):
            return self._run_cached_once(x, mask, hf_cache, hidden)
        # past recording: the first tokens at once (all padding among them), the last ones one at a time, every
        # layer's slots copied after each piece, so that crop(-n) can go back n tokens
        T, window = x.shape[1], int(self.past_recording_window)
        head = T - min(T, window)
        if mask is not None and not bool(mask[:, head:].all()):
            head = int((~mask).nonzero()[:, 1].max()) + 1
        record = hf_cache.layers[0].__dict__.get("_linattn_record")
        if not _is_empty(hf_cache) and (record is None or record.seen_tokens != _position(hf_cache)):
            for layer in hf_cache.layers:   # the state before this call (recording began after the last one)
                _record_layer(layer, _position(hf_cache), window)
        outs, subs = [], []
        for a, b in ([(0, head)] if head else []) + [(t, t + 1) for t in range(head, T)]:
            sub: Optional[List[torch.Tensor]] = [] if hidden is not None else None
            outs.append(self._run_cached_once(x[:, a:b], mask[:, a:b] if (mask is not None and a == 0) else None,
                                              hf_cache, sub))
            subs.append(sub)
            for layer in hf_cache.layers:
                _record_layer(layer, _position(hf_cache), window)
        if hidden is not None:
            hidden.extend(torch.cat([s[j] for s in subs], 1) for j in range(len(subs[0])))
        return torch.cat(outs, 1)

    def _run_cached_once(self, x: torch.Tensor, mask: Optional[torch.Tensor], hf_cache: HFCache,
                         hidden: Optional[List[torch.Tensor]]) -> torch.Tensor:
        B, T = x.shape[:2]
        lm = self._language_model()
        if _is_empty(hf_cache):   # prefill
            if mask is None:
                cache = lm.new_cache()
                out = self._run_blocks(x, cache, None, hidden)
                lengths = torch.full((B,), T, dtype=torch.long, device=x.device)
            else:
                caches = [lm.new_cache() for _ in range(B)]
                out = self._run_rows(_real_rows(x, mask), mask, caches, hidden)
                cache = _merge_rows(caches)
                lengths = mask.sum(1).long()
            _from_linattn(cache, hf_cache, lengths, T, not self._keeps_kv[0])
            return out
        if mask is not None:
            raise LinattnError("padding (attention_mask 0) among the new tokens of a running cache is not "
                               "supported: pad the prompt on the left and let generate() continue it")
        offsets = _offsets(hf_cache).clone()
        cache = _to_linattn(hf_cache, self.config.num_hidden_layers, self._keeps_kv)
        out = self._run_blocks(x, cache, None, hidden)
        _from_linattn(cache, hf_cache, offsets + T, T, not self._keeps_kv[0])
        return out

    def _hidden_states(self, input_ids, inputs_embeds, attention_mask, past_key_values, cache, use_cache, keep,
                       output_hidden_states, output_attentions):
        """-> (h [B, T or kept, d] after the final norm, hidden states tuple or None, padding mask or None,
        the transformers cache to return or None)."""
        if cache is not None and past_key_values is not None:
            raise LinattnError("give the cache as `cache` or `past_key_values` (its pre-5.24 name), not both")
        past_key_values = cache if cache is not None else past_key_values
        if output_attentions if output_attentions is not None else getattr(self.config, "output_attentions", False):
            warnings.warn(f"{type(self).__name__}: output_attentions=True is not supported: linattn's mixers are "
                          f"recurrent (linear attention, delta rule, ...) and form no attention-weight matrix, so "
                          f"`attentions` is None", UserWarning, stacklevel=3)
        stack = self._stack()
        x = _embed(stack, input_ids, inputs_embeds)
        B, T = x.shape[:2]
        mask = _padding_mask(attention_mask, B, T, x.device)
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if output_hidden_states is None:   # the config's default, as in transformers
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        hidden: Optional[List[torch.Tensor]] = [] if output_hidden_states else None
        if past_key_values is not None and (use_cache or not _is_empty(past_key_values)):
            x = self._run_cached(x, mask, past_key_values, hidden)
        elif mask is not None:
            x = self._run_padded(x, mask, hidden)
        else:
            x = self._run_blocks(x, None, None, hidden)
        # the norm on the kept positions only (decoding needs one), unless the hidden states are returned: their last
        # one is after the final norm (transformers' convention)
        x = _keep(x, keep) if hidden is None else x
        x = stack.norm(x) if stack.norm is not None else x
        if hidden is not None:
            hidden.append(x)
            x = _keep(x, keep)
        return x, (tuple(hidden) if hidden is not None else None), mask, (past_key_values if use_cache else None)


# --------------------------------------------------------------------------- the models

class LinattnModel(LinattnPreTrainedModel):
    """The linattn stack without the LM head (`AutoModel`): embeddings, blocks, final norm.

    forward -> BaseModelOutputWithPast(last_hidden_state [B, T, d] after the final norm, cache, hidden_states).
    Its parameters are named like `LanguageModel`'s (`embed`, `blocks`, `norm`), so `from_pretrained` of a
    LinattnForCausalLM folder loads the stack (the `model.` prefix is dropped, the head left out).

    Args:
        config: The transformers config (wrapping an `LMConfig`).
    """

    # an untied LM head in a LinattnForCausalLM folder is not part of the stack
    _keys_to_ignore_on_load_unexpected = [r"lm_head\.weight$"]

    def __init__(self, config: LinattnConfig):
        super().__init__(config)
        lm = LanguageModel(config.lm_config())   # its embed / blocks / norm, initialised as linattn does
        self.embed, self.blocks, self.norm = lm.embed, lm.blocks, lm.norm
        lm.lm_head = None   # the stack has no head; the LanguageModel is kept (unregistered) to run the blocks
        object.__setattr__(self, "_blocks_runner", lm)
        self._keeps_kv = [t != "linear_attention" for t in layer_types_of(lm.config)]
        self.post_init()

    def _stack(self):
        return self

    def _language_model(self) -> LanguageModel:
        lm = self._blocks_runner
        lm.blocks = self.blocks   # the stack's blocks, also after someone replaced them
        return lm

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[HFCache] = None, inputs_embeds: Optional[torch.Tensor] = None,
                use_cache: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                output_attentions: Optional[bool] = None, return_dict: Optional[bool] = None,
                cache: Optional[HFCache] = None, **kwargs) -> Union[BaseModelOutputWithPast, tuple]:
        """Run the stack without the head: padding and the cache as in `LinattnForCausalLM.forward`.

        Args:
            input_ids: `[B, T]` token ids (or pass inputs_embeds).
            attention_mask: `[B, T]` or `[B, past + T]` (1 = token, 0 = padding).
            past_key_values: transformers' cache from an earlier call.
            inputs_embeds: `[B, T, d]` instead of input_ids.
            use_cache: Return a cache.
            output_hidden_states: Also return every block's input and the final output.
            output_attentions: warns and returns None (no attention weights).
            return_dict: False returns a tuple.
            cache: Another name for past_key_values.
            **kwargs: transformers' extra arguments.

        Returns:
            BaseModelOutputWithPast(last_hidden_state [B, T, d] after the final norm, past_key_values, hidden_states).
        """
        h, hidden, _, pkv = self._hidden_states(input_ids, inputs_embeds, attention_mask, past_key_values, cache,
                                                use_cache, 0, output_hidden_states, output_attentions)
        out = BaseModelOutputWithPast(last_hidden_state=h, hidden_states=hidden,
                                      **{_cache_field(BaseModelOutputWithPast): pkv})
        return out if return_dict is not False else out.to_tuple()


class LinattnForCausalLM(LinattnPreTrainedModel, GenerationMixin):
    """A linattn `LanguageModel` as a transformers causal LM (module docstring).

    `save_pretrained` writes a folder that loads with AutoModelForCausalLM after `import linattn.hf`,
    or with trust_remote_code=True without it.

    Args:
        config: The transformers config (wrapping an `LMConfig`).
        model: The `LanguageModel` to wrap (its parameters are shared, not copied); None builds one from config.

    Examples:
        >>> import torch
        >>> from linattn import LanguageModel, LMConfig
        >>> from linattn.hf import LinattnForCausalLM
        >>> language_model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer="gla"))
        >>> hf = LinattnForCausalLM.from_linattn(language_model)   # shares its parameters
        >>> ids, mask = torch.randint(3, 64, (2, 6)), torch.ones(2, 6, dtype=torch.long)
        >>> hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_beams=2).shape
        torch.Size([2, 10])
    """

    def __init__(self, config: LinattnConfig, model: Optional[LanguageModel] = None):
        super().__init__(config)
        self.model = model if model is not None else LanguageModel(config.lm_config())
        self._keeps_kv = [t != "linear_attention" for t in layer_types_of(self.model.config)]
        self.post_init()

    def _stack(self):
        return self.model

    # -- conversions ----------------------------------------------------------------------------
    @classmethod
    def from_linattn(cls, model: LanguageModel, **config_kwargs) -> "LinattnForCausalLM":
        """Wrap a linattn `LanguageModel` (its parameters are shared, not copied).

        Args:
            model: The language model (the 'lm' family).
            **config_kwargs: transformers config options (eos_token_id, pad_token_id, ...).

        Returns:
            The `LinattnForCausalLM`, on the model's device and dtype.

        Raises:
            ConfigError: model is not a linattn `LanguageModel`.
        """
        if not isinstance(model, LanguageModel):
            raise ConfigError(f"from_linattn needs a linattn LanguageModel (the 'lm' family), got "
                              f"{type(model).__name__}")
        hf = cls(LinattnConfig.from_lm_config(model.config, **config_kwargs), model=model)
        p = next(model.parameters(), None)
        return hf.to(p.device) if p is not None else hf

    def to_linattn(self) -> LanguageModel:
        """The wrapped linattn `LanguageModel` (the same module, not a copy).

        Returns:
            The `LanguageModel`.
        """
        return self.model

    # -- transformers' accessors ----------------------------------------------------------------
    def get_output_embeddings(self):
        return self.model.lm_head   # None when tied: the head is the embedding itself (resized with it)

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    # -- generation -------------------------------------------------------------------------------
    def _prepare_cache_for_generation(self, generation_config, *args, **kwargs):
        impl = getattr(generation_config, "cache_implementation", None)
        if impl not in SUPPORTED_CACHE_IMPLEMENTATIONS:
            # a static cache pre-allocates keys/values for every layer (for torch.compile); linattn's layers keep
            # recurrent states that are constant-size already, in its own DynamicCache layers (module docstring)
            raise LinattnError(f"cache_implementation={impl!r} is not supported by linattn models: their states live "
                               f"in transformers' DynamicCache, in linear-attention cache layers (constant-size "
                               f"recurrent states; growing keys/values only for softmax blocks), which the static, "
                               f"offloaded and quantized caches cannot hold; leave cache_implementation unset "
                               f"(or 'dynamic')")
        return super()._prepare_cache_for_generation(generation_config, *args, **kwargs)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[HFCache] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, use_cache: Optional[bool] = None,
                logits_to_keep: Union[int, torch.Tensor] = 0, output_hidden_states: Optional[bool] = None,
                output_attentions: Optional[bool] = None, return_dict: Optional[bool] = None,
                cache: Optional[HFCache] = None, **kwargs) -> Union[CausalLMOutputWithPast, tuple]:
        """Run the model on token ids (or embeddings): transformers' causal-LM forward.

        Padding never enters a state (module docstring).

        Args:
            input_ids: `[B, T]` token ids (or pass inputs_embeds).
            attention_mask: `[B, T]` or `[B, past + T]` (1 = token, 0 = padding).
            past_key_values: transformers' cache from an earlier call (continued and updated in place).
            inputs_embeds: `[B, T, d]` instead of input_ids.
            labels: `[B, T]` give the mean next-token loss (shifted inside, -100 ignored, padding ignored;
                `num_items_in_batch` from transformers' Trainer divides the summed loss instead).
            use_cache: Return a cache (a new one when past_key_values is None).
            logits_to_keep: as in transformers (0: all, n: the last n).
            output_hidden_states: n_layers + 1 tensors [B, T, d] (the embeddings, the output of every block
                but the last, and the last block's output after the final norm, as transformers' models return
                them; zeros at padding).
            output_attentions: warns and returns None (no attention weights).
            return_dict: False returns a tuple.
            cache: Another name for past_key_values.
            **kwargs: transformers' extra arguments (`num_items_in_batch`, ...).

        Returns:
            CausalLMOutputWithPast(loss, logits [B, T or kept, vocab], past_key_values, hidden_states).
        """
        keep = 0 if labels is not None else logits_to_keep
        h, hidden, mask, pkv = self._hidden_states(input_ids, inputs_embeds, attention_mask, past_key_values, cache,
                                                   use_cache, keep, output_hidden_states, output_attentions)
        head = self.model.lm_head
        logits = head(h) if head is not None else F.linear(h, self.model.embed.weight)
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels, mask, kwargs.get("num_items_in_batch"))
            logits = _keep(logits, logits_to_keep)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden,
                                     **{_cache_field(CausalLMOutputWithPast): pkv})
        return out if return_dict is not False else out.to_tuple()

    @staticmethod
    def _loss(logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor], num_items=None):
        labels = labels.to(logits.device).long()
        if labels.shape != logits.shape[:2]:
            raise LinattnError(f"labels must be [batch, seq] = {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
        labels = labels.masked_fill(~mask, -100) if mask is not None else labels
        return ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch=num_items)


class LinattnForSequenceClassification(LinattnPreTrainedModel):
    """`AutoModelForSequenceClassification`: the stack (`LinattnModel`, under `.model`) and a linear `score`
    head read at each row's last token (transformers' convention for decoder-only models).

    The last token is the last position with attention_mask 1; without a mask, the last position that is not
    `config.pad_token_id`; without either, the last position. labels give the loss by `config.problem_type`
    (set from the labels when None, as transformers does): "regression" (MSE; num_labels == 1),
    "single_label_classification" (cross-entropy, integer labels), "multi_label_classification"
    (BCE with logits, float labels [B, num_labels]). `from_pretrained` of a LinattnForCausalLM folder loads
    the stack (the LM head is left out, `score` is drawn new).

    Args:
        config: The transformers config (wrapping an `LMConfig`; `num_labels`, `problem_type`, `pad_token_id`).
    """

    _keys_to_ignore_on_load_unexpected = [r"lm_head\.weight$"]

    def __init__(self, config: LinattnConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LinattnModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def _stack(self):
        return self.model

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[HFCache] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, use_cache: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, output_attentions: Optional[bool] = None,
                return_dict: Optional[bool] = None, cache: Optional[HFCache] = None,
                **kwargs) -> Union[SequenceClassifierOutputWithPast, tuple]:
        """Classify each row from its last token (class docstring).

        No cache unless use_cache=True (a classifier reads one position; a padded batch then runs packed).

        Args:
            input_ids: `[B, T]` token ids (or pass inputs_embeds).
            attention_mask: `[B, T]` (1 = token, 0 = padding).
            past_key_values: transformers' cache from an earlier call.
            inputs_embeds: `[B, T, d]` instead of input_ids.
            labels: The targets: integer class ids, regression values, or float multi-label targets
                `[B, num_labels]`; the loss follows `config.problem_type` (class docstring).
            use_cache: Return a cache.
            output_hidden_states: Also return the hidden states.
            output_attentions: warns and returns None (no attention weights).
            return_dict: False returns a tuple.
            cache: Another name for past_key_values.
            **kwargs: transformers' extra arguments.

        Returns:
            SequenceClassifierOutputWithPast(loss, logits [B, num_labels]).
        """
        use_cache = bool(use_cache) or past_key_values is not None or cache is not None
        base = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                          inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
                          output_attentions=output_attentions, cache=cache, return_dict=True)
        h = base.last_hidden_state
        B, T = h.shape[:2]
        real = None
        if attention_mask is not None:
            real = attention_mask[:, -T:].to(h.device).bool()
        elif input_ids is not None and getattr(self.config, "pad_token_id", None) is not None:
            real = input_ids.to(h.device) != self.config.pad_token_id
        last = (torch.arange(T, device=h.device) * real).argmax(-1) if real is not None else \
            torch.full((B,), T - 1, device=h.device, dtype=torch.long)
        logits = self.score(h)[torch.arange(B, device=h.device), last]
        loss = self._loss(logits, labels) if labels is not None else None
        out = SequenceClassifierOutputWithPast(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                               **{_cache_field(SequenceClassifierOutputWithPast):
                                                  getattr(base, _cache_field(BaseModelOutputWithPast))})
        return out if return_dict is not False else out.to_tuple()

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        kind = self.config.problem_type
        if kind not in (None, "regression", "single_label_classification", "multi_label_classification"):
            raise ConfigError(f"config.problem_type must be 'regression', 'single_label_classification' or "
                              f"'multi_label_classification', got {kind!r}")
        # the targets in the loss's dtype (transformers' losses take them as they come): class ids or floats
        single = kind == "single_label_classification" or (kind is None and self.num_labels > 1
                                                            and labels.dtype in (torch.long, torch.int))
        return ForSequenceClassificationLoss(labels.long() if single else labels.float(), logits.float(), self.config)


#: the cache_implementation values generate() accepts (module docstring of LinattnForCausalLM)
SUPPORTED_CACHE_IMPLEMENTATIONS = (None, "dynamic")
#: config.auto_map of a saved folder (trust_remote_code entry points written by remote.py)
AUTO_MAP = {"AutoConfig": "configuration_linattn.LinattnConfig",
            "AutoModel": "modeling_linattn.LinattnModel",
            "AutoModelForCausalLM": "modeling_linattn.LinattnForCausalLM",
            "AutoModelForSequenceClassification": "modeling_linattn.LinattnForSequenceClassification"}

__all__ = ["LinattnForCausalLM", "LinattnForSequenceClassification", "LinattnModel", "LinattnPreTrainedModel",
           "AUTO_MAP", "SUPPORTED_CACHE_IMPLEMENTATIONS"]
