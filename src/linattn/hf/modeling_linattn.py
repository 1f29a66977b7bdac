"""`LinattnForCausalLM`: a transformers `PreTrainedModel` + `GenerationMixin` around a linattn
`LanguageModel` (the model itself, under `.model`; its weights are `model.*` in the state dict).

Decoding state lives in transformers' own cache: `DynamicCache(config=...)` builds one layer per
block from `config.layer_types` (see `configuration_linattn`): `LinearAttentionLayer` for linear and
delta-rule mixers, `LinearAttentionAndFullAttentionLayer` (or its sliding-window twin) for softmax
mixers. Every tensor of a block's linattn `LayerCache` gets a numbered state slot of that layer:
short-convolution states (`conv_q`, `conv_k`, `conv_v`) go through `update_conv_state`, recurrent
states (a delta-rule state, or the fields of a `LinearAttentionState`) through
`update_recurrent_state`, and a softmax mixer's keys/values through the layer's own `update`. The
tokens each row has consumed are one more slot of layer 0. So `reorder_cache` (beam search),
`reset` and `batch_select_indices` of transformers act on all of it.

Padding (`attention_mask` with zeros, left padding for batched generation) never enters a state:

* without a cache, the real tokens of every row are packed into one row and run with `cu_seqlens`,
  so every row is computed exactly as if it were alone (one forward call);
* a prefill with a cache runs every row on its own real tokens (one call per row) and merges the
  per-row states into the batch; keys/values are left-padded, and the softmax layers mask the
  padded slots with the rows' own positions (`SoftmaxAttention._row_mask`);
* later steps decode the whole batch at once, every row from its own state and position.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache as HFCache, DynamicLayer, LinearAttentionCacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import ConfigError, LinattnError
from ..layers.cache import Cache, KVCache
from ..models.lm import LanguageModel
from .configuration_linattn import STATE_SLOTS, LinattnConfig, layer_types_of

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` (the old
# name is still accepted with a warning); we take either and answer in the installed version's name.
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"
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
    """{(module, key): where the value lives} of a transformers cache layer (kept on the layer)."""
    if not hasattr(layer, "_linattn_slots"):
        layer._linattn_slots = {}
    return layer._linattn_slots


def _free_slot(slots: Dict, need: int = 1) -> int:
    used = [i for spec in slots.values() for i in _spec_indices(spec)]
    n = max(used) + 1 if used else 0
    if n + need > STATE_SLOTS:
        raise LinattnError(f"a block keeps more than {STATE_SLOTS} state tensors; raise STATE_SLOTS in "
                           f"linattn.hf.configuration_linattn")
    return n


# A slot spec: ("conv", i) | ("rec", i) for a tensor; ("tree", node) for a tuple / NamedTuple / list of
# tensors, None and such containers, node = ("t", i) | ("none",) | ("seq", type, [nodes]) |
# ("ints", i, type): a tuple of Python ints is one int per row, kept as an int64 tensor [B] (so that
# beam search reorders it with the rest).


def _is_ints(value) -> bool:
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)

def _spec_indices(spec) -> List[int]:
    if spec[0] in ("conv", "rec"):
        return [spec[1]]
    out: List[int] = []

    def walk(node):
        if node[0] in ("t", "ints"):
            out.append(node[1])
        elif node[0] == "seq":
            for child in node[2]:
                walk(child)
    walk(spec[1])
    return out


def _tree_spec(value, module: str, key: str, counter: List[int]):
    if value is None:
        return ("none",)
    if isinstance(value, torch.Tensor):
        counter[0] += 1
        return ("t", counter[0] - 1)
    if _is_ints(value):
        counter[0] += 1
        return ("ints", counter[0] - 1, type(value))
    if isinstance(value, (tuple, list)):
        return ("seq", type(value), [_tree_spec(v, module, key, counter) for v in value])
    raise LinattnError(f"cannot keep {module}.{key} (holding a {type(value).__name__}) in a transformers cache")


def _tree_leaves(value, node) -> List[Tuple[int, torch.Tensor]]:
    if node[0] == "t":
        return [(node[1], value)]
    if node[0] == "ints":
        return [(node[1], torch.tensor(list(value), dtype=torch.int64))]
    if node[0] == "seq":
        return [leaf for v, child in zip(value, node[2]) for leaf in _tree_leaves(v, child)]
    return []


def _tree_build(layer, node):
    if node[0] == "t":
        return layer.recurrent_states[node[1]]
    if node[0] == "ints":
        return node[2](int(v) for v in layer.recurrent_states[node[1]].tolist())
    if node[0] == "none":
        return None
    cls, items = node[1], [_tree_build(layer, child) for child in node[2]]
    return cls(*items) if hasattr(cls, "_fields") else cls(items)


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


def _put(layer, module: str, key: str, value) -> None:
    """Store one LayerCache entry in a transformers cache layer (allocating its slots once)."""
    slots = _slots(layer)
    spec = slots.get((module, key))
    if isinstance(value, torch.Tensor):
        if spec is None:
            kind = "conv" if key.startswith("conv") and value.dim() == 3 else "rec"
            spec = slots[(module, key)] = (kind, _free_slot(slots))
        _put_tensor(layer, spec[0], spec[1], value)
        return
    if spec is None:
        counter = [0]
        node = _tree_spec(value, module, key, counter)
        start = _free_slot(slots, counter[0])
        spec = slots[(module, key)] = ("tree", _shift(node, start))
    for idx, t in _tree_leaves(value, spec[1]):
        _put_tensor(layer, "rec", idx, t)


def _shift(node, start: int):
    if node[0] in ("t", "ints"):
        return (node[0], node[1] + start) + tuple(node[2:])
    if node[0] == "seq":
        return ("seq", node[1], [_shift(child, start) for child in node[2]])
    return node


def _get(layer, spec):
    if spec[0] == "conv":
        return layer.conv_states[spec[1]]
    if spec[0] == "rec":
        return layer.recurrent_states[spec[1]]
    return _tree_build(layer, spec[1])


def _is_empty(hf_cache: HFCache) -> bool:
    if len(hf_cache.layers) == 0:
        return True
    layer = hf_cache.layers[0]
    spec = _slots(layer).get(_OFFSETS)
    return spec is None or not layer.has_previous_state[spec[1]]


def _offsets(hf_cache: HFCache) -> torch.Tensor:
    layer = hf_cache.layers[0]
    return layer.recurrent_states[_slots(layer)[_OFFSETS][1]]


def _check_layers(hf_cache: HFCache, n_layers: int, config: LinattnConfig) -> None:
    if len(hf_cache.layers) == 0 and getattr(hf_cache, "layer_class_to_replicate", None) is not None:
        hf_cache.layers = DynamicCache(config=config).layers   # a DynamicCache() made without the config
        hf_cache.layer_class_to_replicate = None
    if len(hf_cache.layers) != n_layers or not all(isinstance(la, LinearAttentionCacheLayerMixin)
                                                   for la in hf_cache.layers):
        raise LinattnError(f"past_key_values must be a transformers cache built from this model's config "
                           f"(DynamicCache(config=model.config): {n_layers} linear-attention / hybrid layers), "
                           f"got {hf_cache!r}")


def _to_linattn(hf_cache: HFCache, n_layers: int, keeps_kv: List[bool]) -> Cache:
    """A linattn `Cache` whose entries are the transformers cache's tensors (keys/values through _HFKV)."""
    offsets = _offsets(hf_cache)
    cache = Cache(n_layers)
    for i, layer in enumerate(hf_cache.layers):
        for (module, key), spec in _slots(layer).items():
            if module:
                cache.layer(i, module)[key] = _get(layer, spec)
        if keeps_kv[i]:
            cache.layer(i, "mixer")["kv"] = _HFKV(layer)
        for lc in cache.layers[i].values():
            lc["offset"] = offsets
    return cache


def _from_linattn(cache: Cache, hf_cache: HFCache, offsets: torch.Tensor, T: int, count_positions: bool) -> None:
    """Write a linattn `Cache` (after a forward over T positions) into the transformers cache, and the
    new offsets; with count_positions, T zero-width keys into layer 0 (configuration_linattn)."""
    for i, (modules, layer) in enumerate(zip(cache.layers, hf_cache.layers)):
        for module, lc in modules.items():
            for key, value in lc.items():
                if key == "offset" or value is None or isinstance(value, _HFKV):
                    continue
                if isinstance(value, KVCache):
                    if not isinstance(layer, DynamicLayer):
                        raise LinattnError(f"block {i} keeps keys/values but its transformers cache layer "
                                           f"({type(layer).__name__}) has none; config.layer_types is wrong")
                    if value.length:
                        layer.update(value.k[:, :value.length].transpose(1, 2).contiguous(),
                                     value.v[:, :value.length].transpose(1, 2).contiguous())
                    continue
                _put(layer, module, key, value)
    _put(hf_cache.layers[0], *_OFFSETS, offsets)
    if count_positions:
        marker = offsets.new_zeros((offsets.shape[0], 1, T, 0), dtype=torch.float32)
        hf_cache.layers[0].update(marker, marker)


def _merge_rows(caches: List[Cache]) -> Cache:
    """One batched linattn Cache from per-row caches (B = 1 each): tensors are concatenated on the
    batch dimension; keys/values are left-padded to the longest row."""
    merged = Cache(len(caches[0]))
    for i in range(len(merged)):
        for module, lc0 in caches[0].layers[i].items():
            out = merged.layer(i, module)
            for key, v0 in lc0.items():
                if key == "offset":
                    continue
                vals = [c.layers[i][module][key] for c in caches]
                out[key] = _left_pad_kv(vals) if isinstance(v0, KVCache) else _cat_tree(vals, i, module, key)
    return merged


def _cat_tree(vals: List[Any], i: int, module: str, key: str):
    """Per-row values (tensors, None, or tuples / lists of them) concatenated on the batch dimension."""
    v0 = vals[0]
    if v0 is None:
        return None
    if isinstance(v0, torch.Tensor):
        return _cat_rows(vals, i, module, key)
    if _is_ints(v0):   # one int per row
        return type(v0)(x for v in vals for x in v)
    if isinstance(v0, (tuple, list)):
        items = [_cat_tree(list(parts), i, module, key) for parts in zip(*vals)]
        return type(v0)(*items) if hasattr(v0, "_fields") else type(v0)(items)
    raise LinattnError(f"cannot batch the cache entry {module}.{key} ({type(v0).__name__})")


def _cat_rows(tensors: List[torch.Tensor], i: int, module: str, key: str) -> torch.Tensor:
    if any(t.shape[1:] != tensors[0].shape[1:] for t in tensors):
        raise LinattnError(f"block {i} ({module}) keeps a per-token state ({key!r}) that differs in length between "
                           f"the rows of a padded batch; this mixer cannot decode a left-padded batch: generate "
                           f"the prompts one at a time, or give them the same length")
    return torch.cat(tensors, 0)


def _left_pad_kv(kvs: List[KVCache]) -> KVCache:
    L = max(kv.length for kv in kvs)
    ks, vs = [], []
    for kv in kvs:
        k, v = kv.k[:, :kv.length], kv.v[:, :kv.length]
        pad = L - kv.length
        ks.append(F.pad(k, (0, 0, 0, 0, pad, 0)))
        vs.append(F.pad(v, (0, 0, 0, 0, pad, 0)))
    out = KVCache(chunk=kvs[0].chunk, window=kvs[0].window)
    out.k, out.v, out.length = torch.cat(ks, 0), torch.cat(vs, 0), L
    return out


# --------------------------------------------------------------------------- the model

class LinattnPreTrainedModel(PreTrainedModel):
    config_class = LinattnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _is_stateful = True          # recurrent states cannot be rolled back (no assisted decoding)
    _supports_sdpa = True

    def _init_weights(self, module):
        """linattn initialises its own weights (`LanguageModel`); loading replaces them."""

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None, **kwargs):
        """transformers' activation_checkpointing_enable / disable: LanguageModel recomputes each block."""
        self.model.activation_checkpointing = bool(enable)


class LinattnForCausalLM(LinattnPreTrainedModel, GenerationMixin):
    """A linattn `LanguageModel` as a transformers causal LM (module docstring).

    >>> hf = LinattnForCausalLM.from_linattn(language_model)   # shares its parameters
    >>> hf.generate(ids, attention_mask=mask, max_new_tokens=20, num_beams=2)
    >>> hf.save_pretrained("hf_dir")     # loads with AutoModelForCausalLM after `import linattn.hf`,
    >>>                                  # or with trust_remote_code=True without it
    """

    def __init__(self, config: LinattnConfig, model: Optional[LanguageModel] = None):
        super().__init__(config)
        self.model = model if model is not None else LanguageModel(config.lm_config())
        self._keeps_kv = [t != "linear_attention" for t in layer_types_of(self.model.config)]
        self.post_init()

    # -- conversions ----------------------------------------------------------------------------
    @classmethod
    def from_linattn(cls, model: LanguageModel, **config_kwargs) -> "LinattnForCausalLM":
        """Wrap a linattn `LanguageModel` (its parameters are shared, not copied)."""
        if not isinstance(model, LanguageModel):
            raise ConfigError(f"from_linattn needs a linattn LanguageModel (the 'lm' family), got "
                              f"{type(model).__name__}")
        hf = cls(LinattnConfig.from_lm_config(model.config, **config_kwargs), model=model)
        p = next(model.parameters(), None)
        return hf.to(p.device) if p is not None else hf

    def to_linattn(self) -> LanguageModel:
        """The wrapped linattn `LanguageModel` (the same module, not a copy)."""
        return self.model

    # -- transformers' accessors ----------------------------------------------------------------
    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    # -- saving -----------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus the two small modules and `auto_map` that let
        `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` load the folder
        without `import linattn.hf` (they import linattn, which must be installed)."""
        from .remote import write_remote_code

        self.config.auto_map = {"AutoConfig": "configuration_linattn.LinattnConfig",
                                "AutoModelForCausalLM": "modeling_linattn.LinattnForCausalLM"}
        out = super().save_pretrained(save_directory, *args, **kwargs)
        write_remote_code(save_directory)
        return out

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[HFCache] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, use_cache: Optional[bool] = None,
                logits_to_keep: Union[int, torch.Tensor] = 0, return_dict: Optional[bool] = None,
                cache: Optional[HFCache] = None, **kwargs) -> Union[CausalLMOutputWithPast, tuple]:
        """input_ids [B, T] -> CausalLMOutputWithPast(loss, logits [B, T or kept, vocab], past_key_values).

        attention_mask [B, T] or [B, past + T] (1 = token, 0 = padding; padding never enters a
        state, module docstring); labels [B, T] give the mean next-token loss (shifted inside,
        -100 ignored, padding ignored; `num_items_in_batch` from transformers' Trainer divides
        the summed loss instead); logits_to_keep as in transformers (0: all, n: the last n).
        """
        if cache is not None and past_key_values is not None:
            raise LinattnError("give the cache as `cache` or `past_key_values` (its pre-5.24 name), not both")
        past_key_values = cache if cache is not None else past_key_values
        if inputs_embeds is not None:
            raise LinattnError("LinattnForCausalLM takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise LinattnError("input_ids is required")
        if input_ids.dim() != 2:
            raise LinattnError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        input_ids = input_ids.long()
        B, T = input_ids.shape
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise LinattnError(f"attention_mask must be 2-D [batch, past + seq] with batch {B} and at least "
                                   f"{T} columns, got {tuple(attention_mask.shape)}")
            mask = attention_mask[:, -T:].to(input_ids.device).bool()
            if bool(mask.all()):
                mask = None
        keep = 0 if labels is not None else logits_to_keep
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if past_key_values is not None and (use_cache or not _is_empty(past_key_values)):
            logits = self._forward_cached(input_ids, mask, past_key_values, keep)
        elif mask is not None:
            logits = self._forward_padded(input_ids, mask)
            if keep is not None and not (isinstance(keep, int) and keep == 0):
                logits = logits[:, -keep:] if isinstance(keep, int) else logits[:, keep]
        else:
            logits = self.model(input_ids, logits_to_keep=keep).logits
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels, mask, kwargs.get("num_items_in_batch"))
            if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                logits = logits[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else logits[:, logits_to_keep]
        out = CausalLMOutputWithPast(loss=loss, logits=logits,
                                     **{_CACHE_FIELD: past_key_values if use_cache else None})
        return out if return_dict is not False else out.to_tuple()

    @staticmethod
    def _loss(logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor], num_items=None):
        labels = labels.to(logits.device).long()
        if mask is not None:
            labels = labels.masked_fill(~mask, -100)
        shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
        shift_labels = labels[:, 1:].reshape(-1)
        if num_items is None:
            return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        total = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
        return total / (num_items.to(total.device) if isinstance(num_items, torch.Tensor) else num_items)

    def _rows(self, input_ids: torch.Tensor, mask: torch.Tensor) -> List[torch.Tensor]:
        rows = [input_ids[b][mask[b]] for b in range(input_ids.shape[0])]
        if any(r.numel() == 0 for r in rows):
            raise LinattnError("every row needs at least one token that is not padding (attention_mask 1)")
        return rows

    def _forward_padded(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of a padded batch without a cache: the real tokens of all rows packed in
        one row with cu_seqlens (one call), or row by row if a mixer cannot pack; 0 at padding."""
        rows = self._rows(input_ids, mask)
        if all(getattr(b, "mixer_packs", False) for b in self.model.blocks):
            lens = torch.tensor([0] + [r.numel() for r in rows], device=input_ids.device)
            packed = self.model(torch.cat(rows)[None], cu_seqlens=lens.cumsum(0)).logits[0]
            parts = packed.split([r.numel() for r in rows])
        else:
            parts = [self.model(r[None]).logits[0] for r in rows]
        logits = parts[0].new_zeros(*input_ids.shape, parts[0].shape[-1])
        for b, part in enumerate(parts):
            logits[b][mask[b]] = part
        return logits

    def _forward_cached(self, input_ids: torch.Tensor, mask: Optional[torch.Tensor], hf_cache: HFCache,
                        keep) -> torch.Tensor:
        n = self.config.num_hidden_layers
        _check_layers(hf_cache, n, self.config)
        B, T = input_ids.shape
        if _is_empty(hf_cache):   # prefill
            if mask is None:
                out = self.model(input_ids, use_cache=True, logits_to_keep=keep)
                cache, logits = out.cache, out.logits
                lengths = torch.full((B,), T, dtype=torch.long, device=input_ids.device)
            else:
                rows = self._rows(input_ids, mask)
                outs = [self.model(r[None], use_cache=True) for r in rows]
                cache = _merge_rows([o.cache for o in outs])
                logits = outs[0].logits.new_zeros(B, T, outs[0].logits.shape[-1])
                for b, o in enumerate(outs):
                    logits[b][mask[b]] = o.logits[0]
                if not (isinstance(keep, int) and keep == 0):
                    logits = logits[:, -keep:] if isinstance(keep, int) else logits[:, keep]
                lengths = mask.sum(1).long()
            _from_linattn(cache, hf_cache, lengths, T, not self._keeps_kv[0])
            return logits
        if mask is not None:
            raise LinattnError("padding (attention_mask 0) among the new tokens of a running cache is not "
                               "supported: pad the prompt on the left and let generate() continue it")
        offsets = _offsets(hf_cache).clone()
        cache = _to_linattn(hf_cache, n, self._keeps_kv)
        logits = self.model(input_ids, cache=cache, logits_to_keep=keep).logits
        _from_linattn(cache, hf_cache, offsets + T, T, not self._keeps_kv[0])
        return logits


__all__ = ["LinattnForCausalLM", "LinattnPreTrainedModel"]
