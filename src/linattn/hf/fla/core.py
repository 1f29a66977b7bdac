"""Import a flash-linear-attention (fla) model folder as a linattn checkpoint: the registry and the skeleton.

Interface for a model type (one module per type in this package, each registering itself):

    @register_fla("gated_deltanet")
    def convert_gated_deltanet(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
        ...

`cfg` is the folder's config.json; `p` holds the fla mixer parameters of layer `layer_idx`, named relative to
`model.layers.{i}.attn.` (`p["q_proj.weight"]`; a missing name raises a CheckpointError naming the full key,
and every tensor of `p` must be read, else the import fails naming the unused ones). The result names the
linattn mixer, its mixer_kwargs, its parameters (`state`, named relative to the block's mixer module) and the
LMConfig fields the type sets (`config`: head_dim, n_value_heads, short_conv, ...). Every layer of one type
must give the same mixer, kwargs and config.

Everything else is done here: the embedding, the norms around each mixer (attn_norm, mlp_norm), fla's GatedMLP
(gate/up/down, swish), the final norm, the head (tied or not), fla's softmax `Attention` layers of hybrid
layouts (config.json's `attn`: {"layers": [...], "num_heads", "num_kv_heads", "qkv_bias", "window_size",
"rope_theta"}), reading (sharded) safetensors, the strict check that every fla tensor is used and every linattn
tensor filled, and writing the checkpoint.

A type whose model does not follow the `model.layers.{i}.attn` layout passes `layout=FlaLayout(...)` to
`register_fla` (e.g. Mamba2's `backbone.layers.{i}.mixer`, `norm`, no MLP, `backbone.norm_f`).
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from ... import checkpoint as ckpt
from ...errors import CheckpointError
from ...models.config import LMConfig
from ...models.family import config_to_dict
from ...models.lm import LanguageModel
from ..import_target import write_import

Tensor = torch.Tensor
PathLike = Union[str, os.PathLike]

#: the linattn mixer of fla's softmax `Attention` (the transformer type, and the `attn` layers of hybrids)
ATTENTION_MIXER = "softmax"


@dataclass
class MixerConversion:
    """What a model type's converter returns for one layer (module docstring)."""
    mixer: str
    kwargs: Dict[str, Any]
    state: Dict[str, Tensor]
    config: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FlaLayout:
    """Where a fla model keeps its tensors ({i}: the layer index). mlp / mlp_norm None: no feed-forward block."""
    embed: str = "model.embeddings.weight"
    layer: str = "model.layers.{i}."
    mixer: str = "attn."
    attn_norm: str = "attn_norm.weight"
    mlp_norm: Optional[str] = "mlp_norm.weight"
    mlp: Optional[str] = "mlp."
    final_norm: str = "model.norm.weight"
    head: str = "lm_head.weight"
    #: (F3) block tensors beyond these (RWKV-7's norm biases, pre_norm and channel mix): extra(cfg, take) ->
    #: {linattn name: tensor}, take(fla name) reads one fla tensor (counted as used)
    extra: Optional[Callable[[Dict[str, Any], Callable[[str], Tensor]], Dict[str, Tensor]]] = None


Converter = Callable[[Dict[str, Any], int, "LayerParams"], MixerConversion]
#: config.json sizes the converters divide by or multiply with: when present (not None), numbers > 0
POSITIVE_SIZES = ("hidden_size", "num_hidden_layers", "vocab_size", "num_heads", "num_kv_heads", "num_v_heads",
                  "head_dim", "expand_k", "expand_v", "conv_size", "intermediate_size", "hidden_ratio", "state_size",
                  "n_groups", "num_householder")
_CONVERTERS: Dict[str, Tuple[Converter, FlaLayout]] = {}


def register_fla(model_type: str, *, layout: Optional[FlaLayout] = None) -> Callable[[Converter], Converter]:
    """Decorator: `fn(cfg, layer_idx, p) -> MixerConversion` converts the mixer of fla's `model_type`."""
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"model_type must be a non-empty string, got {model_type!r}")

    def deco(fn: Converter) -> Converter:
        if model_type in _CONVERTERS:
            raise CheckpointError(f"fla model type {model_type!r} is already registered")
        _CONVERTERS[model_type] = (fn, layout or FlaLayout())
        return fn

    return deco


def supported_types() -> List[str]:
    """The fla `model_type`s `import_fla` converts.

    Returns:
        The model types, sorted.

    Examples:
        >>> from linattn.hf.fla import supported_types
        >>> {"gated_deltanet", "kda", "mamba2"} <= set(supported_types())
        True
    """
    return sorted(_CONVERTERS)


def is_fla_folder(folder: PathLike) -> bool:
    """Whether `folder`'s config.json names a registered fla model type."""
    cfg = _read_config(Path(folder), quiet=True)
    return isinstance(cfg, dict) and cfg.get("model_type") in _CONVERTERS


class LayerParams(dict):
    """The fla tensors of one layer's mixer, named relative to `prefix`; remembers which were read, and a
    missing name is a CheckpointError naming the full key."""

    def __init__(self, prefix: str, tensors: Dict[str, Tensor]):
        super().__init__(tensors)
        self.prefix = prefix
        self.used: set = set()

    def __getitem__(self, name: str) -> Tensor:
        if not dict.__contains__(self, name):
            raise CheckpointError(f"the fla weights lack the tensor {self.prefix + name!r}; have "
                                  f"{sorted(self.prefix + k for k in self)[:12]}")
        self.used.add(name)
        return dict.__getitem__(self, name)

    def get(self, name: str, default=None):
        return self[name] if dict.__contains__(self, name) else default

    def unused(self) -> List[str]:
        return sorted(self.prefix + k for k in self if k not in self.used)


def cfg_get(cfg: Dict[str, Any], name: str, default: Any = None) -> Any:
    """cfg[name], or `default` when it is absent or None (fla's configs write None for 'the default')."""
    v = cfg.get(name)
    return default if v is None else v


def require(cond: bool, cfg: Dict[str, Any], what: str) -> None:
    """A CheckpointError naming the model type when an fla option has no linattn counterpart."""
    if not cond:
        raise CheckpointError(f"fla model type {cfg.get('model_type')!r}: {what} is not supported by the import")


# --------------------------------------------------------------------------- fla's softmax Attention

def attention_specs(cfg: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    """{layer index: its `attn` spec} of a hybrid layout (config.json's `attn`, a dict or a list of dicts)."""
    attn = cfg.get("attn")
    if attn is None:
        return {}
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) and isinstance(s.get("layers"), list)
                                              for s in specs):
        raise CheckpointError(f"config.json: attn must be a dict or a list of dicts with a 'layers' list, got {attn!r}")
    out: Dict[int, Dict[str, Any]] = {}
    for s in specs:
        for i in s["layers"]:
            out[int(i)] = s
    return out


def convert_attention(cfg: Dict[str, Any], layer_idx: int, p: LayerParams, *, num_heads: int,
                      num_kv_heads: Optional[int] = None, qkv_bias: bool = False, qk_norm: bool = False,
                      window_size: Optional[int] = None, rope_theta: Optional[float] = 10000.0) -> MixerConversion:
    """fla's `Attention` (fla/layers/attn.py) as linattn's SoftmaxAttention: q/k/v/o projections (optional
    biases), grouped k/v heads, optional per-head q/k RMSNorm (eps 1e-5), RoPE (rotate-half, base rope_theta)
    on q and k, causal (sliding-window) softmax with the 1/sqrt(head_dim) scale."""
    d = int(cfg["hidden_size"])
    require(d % num_heads == 0, cfg, f"hidden_size {d} not divisible by the attention's num_heads {num_heads}")
    require(rope_theta is not None, cfg, "attention without RoPE (rope_theta None)")
    kv = num_heads if num_kv_heads is None else int(num_kv_heads)
    kwargs: Dict[str, Any] = {"heads": int(num_heads), "head_dim": d // num_heads, "rope": True,
                              "rope_base": float(rope_theta), "short_conv": False, "window": window_size,
                              "qkv_bias": bool(qkv_bias)}
    if kv != num_heads:
        kwargs["n_kv_heads"] = kv
    state = {f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvo"}
    biases_and_qk_norm(p, kwargs, state, qkv_bias, qk_norm)
    return MixerConversion(ATTENTION_MIXER, kwargs, state)


def biases_and_qk_norm(p: LayerParams, kwargs: Dict[str, Any], state: Dict[str, Tensor], qkv_bias: bool,
                       qk_norm: bool, **norm_kwargs) -> None:
    """fla's optional q/k/v projection biases and q/k norm weights (attention, FoX, DeltaFormer), into the layer's
    kwargs (`norm_kwargs`: the norm's form) and state."""
    if qkv_bias:
        kwargs["qkv_bias"] = True
        state.update({f"{n}_proj.bias": p[f"{n}_proj.bias"] for n in "qkv"})
    if qk_norm:
        kwargs.update(qk_norm=True, **norm_kwargs)
        state["q_norm.weight"], state["k_norm.weight"] = p["q_norm.weight"], p["k_norm.weight"]


def _hybrid_attention(cfg: Dict[str, Any], spec: Dict[str, Any], layer_idx: int, p: LayerParams) -> MixerConversion:
    return convert_attention(cfg, layer_idx, p, num_heads=int(spec["num_heads"]),
                             num_kv_heads=spec.get("num_kv_heads"), qkv_bias=bool(spec.get("qkv_bias", False)),
                             window_size=spec.get("window_size"), rope_theta=spec.get("rope_theta", 10000.0))


# --------------------------------------------------------------------------- reading the folder

def _read_config(folder: Path, quiet: bool = False) -> Optional[Dict[str, Any]]:
    f = folder / "config.json"
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        if quiet:
            return None
        raise CheckpointError(f"{folder} is not a model folder: cannot read {f}: {e}") from None
    if not isinstance(cfg, dict):
        if quiet:
            return None
        raise CheckpointError(f"{f} does not hold a JSON object")
    return cfg


def read_fla_weights(folder: PathLike) -> Dict[str, Tensor]:
    """Every tensor of a model folder: model.safetensors, or the shards its model.safetensors.index.json lists."""
    from safetensors.torch import load_file

    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = [folder / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"cannot read {index}: {type(e).__name__}: {e}") from None
    else:
        raise CheckpointError(f"{folder} holds no safetensors weights (model.safetensors or "
                              f"model.safetensors.index.json); save the fla model with save_pretrained(..., "
                              f"safe_serialization=True)")
    out: Dict[str, Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f), device="cpu"))
        except Exception as e:  # OSError, or safetensors' own errors on a corrupt file
            raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    for name, t in out.items():
        refuse_non_float(name, t.dtype, folder)
        if t.dtype.itemsize == 1:  # fp8 (e4m3, e5m2, ...): few of torch's ops take it; float32 holds it exactly
            out[name] = t.to(torch.float32)
    return out


def refuse_non_float(name: str, dtype: Any, folder: Path) -> None:
    """A CheckpointError naming a weight that is not floating point (ints, bool, complex: casting them to float
    would import something that was never a weight). `dtype`: a torch dtype or safetensors' name of one."""
    ok = dtype.is_floating_point if isinstance(dtype, torch.dtype) else str(dtype).startswith(("F", "BF"))
    if not ok:
        raise CheckpointError(f"{folder}: the tensor {name!r} is {str(dtype).replace('torch.', '')}, not floating "
                              f"point; weights must be float tensors (fp64 ... fp8)")


def _mlp_hidden(cfg: Dict[str, Any]) -> int:
    """fla's GatedMLP width: intermediate_size, else 2/3 hidden_ratio (default 4) hidden_size rounded up to 256."""
    if cfg.get("intermediate_size") is not None:
        return int(cfg["intermediate_size"])
    h = int(int(cfg["hidden_size"]) * cfg_get(cfg, "hidden_ratio", 4) * 2 / 3)
    return 256 * ((h + 255) // 256)


def _layer_conversions(cfg: Dict[str, Any], weights: Dict[str, Tensor], convert: Converter,
                       layout: FlaLayout) -> Iterator[Tuple[int, MixerConversion, LayerParams]]:
    specs = attention_specs(cfg)
    for i in range(int(cfg["num_hidden_layers"])):
        prefix = layout.layer.format(i=i) + layout.mixer
        p = LayerParams(prefix, {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
        try:
            conv = _hybrid_attention(cfg, specs[i], i, p) if i in specs else convert(cfg, i, p)
        except (ZeroDivisionError, TypeError, KeyError, AttributeError) as e:  # a config value of the wrong kind
            raise CheckpointError(f"fla type {cfg.get('model_type')!r}, layer {i}: config.json does not fit the "
                                  f"converter ({type(e).__name__}: {e})") from None
        if not isinstance(conv, MixerConversion):
            raise CheckpointError(f"the converter of fla type {cfg.get('model_type')!r} returned "
                                  f"{type(conv).__name__}, not a MixerConversion")
        yield i, conv, p


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def fla_to_linattn(cfg: Dict[str, Any], weights: Dict[str, Tensor]) -> Tuple[LMConfig, Dict[str, Tensor]]:
    """The LMConfig and the linattn state dict of a fla model (its config.json dict and its tensors)."""
    model_type = cfg.get("model_type")
    if model_type not in _CONVERTERS:
        raise CheckpointError(f"unsupported fla model_type {model_type!r}; the fla import supports: "
                              f"{', '.join(supported_types())}")
    convert, layout = _CONVERTERS[model_type]
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if not isinstance(cfg.get(key), int):
            raise CheckpointError(f"config.json of fla type {model_type!r}: {key} must be an int, got {cfg.get(key)!r}")
    for key in POSITIVE_SIZES:  # (a 0 here was a ZeroDivisionError in the converters)
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise CheckpointError(f"config.json of fla type {model_type!r}: {key} must be a number > 0, got {v!r}")
    require(cfg.get("attnres_block_size") is None, cfg, "attention residuals (attnres_block_size)")
    require(cfg_get(cfg, "hidden_act", "swish") in ("swish", "silu") or layout.mlp is None, cfg,
            f"hidden_act {cfg.get('hidden_act')!r} (only swish)")
    every = LayerParams("", weights)   # every tensor of the folder, by full name; what is read is marked used
    state: Dict[str, Tensor] = {}
    mixers: List[str] = []
    mixer_kwargs: Dict[str, Dict[str, Any]] = {}
    overrides: Optional[Dict[str, Any]] = None
    for i, conv, p in _layer_conversions(cfg, weights, convert, layout):
        bad = p.unused()
        if bad:
            raise CheckpointError(f"fla type {model_type!r}: the import does not use the tensors {bad} of layer {i}")
        every.used.update(p.prefix + k for k in p)
        if conv.mixer in mixer_kwargs and not _same(mixer_kwargs[conv.mixer], conv.kwargs):
            raise CheckpointError(f"fla type {model_type!r}: layer {i} needs mixer {conv.mixer!r} with "
                                  f"{conv.kwargs}, an earlier layer with {mixer_kwargs[conv.mixer]}; linattn "
                                  f"gives one mixer name one set of options")
        mixer_kwargs[conv.mixer] = dict(conv.kwargs)
        if conv.mixer != ATTENTION_MIXER or not attention_specs(cfg):
            if overrides is not None and not _same(overrides, conv.config):
                raise CheckpointError(f"fla type {model_type!r}: layer {i} sets the model config {conv.config}, an "
                                      f"earlier layer {overrides}")
            overrides = dict(conv.config)
        mixers.append(conv.mixer)
        for k, v in conv.state.items():
            state[f"blocks.{i}.mixer.{k}"] = v
        lp = layout.layer.format(i=i)
        state[f"blocks.{i}.norm1.weight"] = every[lp + layout.attn_norm]
        if layout.mlp is not None:
            mlp = lp + layout.mlp
            state[f"blocks.{i}.ffn.w_gate_up.weight"] = torch.cat([every[mlp + "gate_proj.weight"],
                                                                   every[mlp + "up_proj.weight"]], dim=0)
            state[f"blocks.{i}.ffn.w_down.weight"] = every[mlp + "down_proj.weight"]
            state[f"blocks.{i}.norm2.weight"] = every[lp + layout.mlp_norm]
    if layout.extra is not None:
        state.update(layout.extra(cfg, every.__getitem__))
    state["embed.weight"] = every[layout.embed]
    state["norm.weight"] = every[layout.final_norm]
    tied = bool(cfg_get(cfg, "tie_word_embeddings", False))
    if not tied:
        state["lm_head.weight"] = every[layout.head]
    elif layout.head in weights:   # a tied head saved anyway: the embedding's copy
        if not torch.equal(every[layout.head], state["embed.weight"]):
            raise CheckpointError(f"config.json ties the embeddings, but {layout.head!r} differs from "
                                  f"{layout.embed!r}")
    left = every.unused()
    if left:
        raise CheckpointError(f"fla type {model_type!r}: the import does not use the tensors {left[:12]}"
                              + (f" (and {len(left) - 12} more)" if len(left) > 12 else ""))
    fields: Dict[str, Any] = dict(
        vocab_size=int(cfg["vocab_size"]), d_model=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
        n_heads=int(cfg_get(cfg, "num_heads", 1)),
        mixer=mixers[0] if len(set(mixers)) == 1 else mixers, mixer_kwargs=mixer_kwargs,
        ffn="swiglu" if layout.mlp is not None else "none",
        ffn_hidden=_mlp_hidden(cfg) if layout.mlp is not None else None,
        tie_embeddings=tied, final_norm=True, norm_eps=float(cfg_get(cfg, "norm_eps", 1e-6)),
        max_seq_len=int(cfg_get(cfg, "max_position_embeddings", 2048)))
    fields.update(overrides or {})
    try:
        config = LMConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"fla type {model_type!r}: the converted model config is not valid: {e}") from None
    _check_state(config, state)
    return config, state


def _check_state(config: LMConfig, state: Dict[str, Tensor]) -> None:
    """Every linattn tensor filled with the right shape, nothing else (the model is built on the meta device)."""
    try:
        with torch.device("meta"):
            model = LanguageModel(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot build the linattn model of the converted config: {e}") from None
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        raise CheckpointError(f"the converted weights do not fit the linattn model: missing {missing[:12]}, "
                              f"unexpected {extra[:12]}")
    for k, t in want.items():
        if tuple(state[k].shape) != tuple(t.shape):
            raise CheckpointError(f"the converted tensor {k!r} has shape {tuple(state[k].shape)}, the linattn "
                                  f"model needs {tuple(t.shape)}")


def import_fla(folder: PathLike, out: PathLike, *, overwrite: bool = False, step: int = 0,
               tokenizer: Optional[PathLike] = None) -> Path:
    """Write a flash-linear-attention model folder as a linattn checkpoint in the run folder `out`.

    The folder holds config.json with a supported `model_type` (`supported_types()`), safetensors weights, and
    optionally a tokenizer (tokenizer.json, or a SentencePiece tokenizer.model). The folder's tokenizer linattn
    cannot use is left out with a warning. The weights keep their dtype (an fp64 fla model gives an fp64
    checkpoint; fp8 becomes fp32).

    Args:
        folder: The fla model folder.
        out: The linattn run folder to write into.
        overwrite: Replace the checkpoints `out` already holds.
        step: The step number of the checkpoint.
        tokenizer: The tokenizer to keep (a folder, tokenizer.json or tokenizer.model; None: the folder's own, see
            `linattn.hf.tokenizer_import`).

    Returns:
        The step folder.

    Raises:
        CheckpointError: An unsupported model_type, unreadable weights, or `out` holding a checkpoint without
            overwrite.
    """
    folder, out = Path(folder), Path(out)
    cfg = _read_config(folder)
    if cfg.get("model_type") not in _CONVERTERS:
        raise CheckpointError(f"unsupported fla model_type {cfg.get('model_type')!r} in {folder / 'config.json'}; "
                              f"the fla import supports: {', '.join(supported_types())}")

    def write(run: Path) -> Path:
        config, state = fla_to_linattn(cfg, read_fla_weights(folder))
        tok = _fla_tokenizer(folder, config.vocab_size, tokenizer)
        n_params = sum(t.numel() for t in state.values())
        return ckpt.save_checkpoint(run, int(step), None, state_dict={k: v.contiguous() for k, v in state.items()},
                                    model_config=config_to_dict(config), tokenizer=tok, keep_last=None,
                                    extra={"imported_from": str(folder), "fla_model_type": cfg["model_type"],
                                           "n_params": n_params})

    return write_import(folder, out, overwrite, write)


def _fla_tokenizer(folder: Path, vocab_size: int, explicit: Optional[PathLike]):
    """`import_tokenizer`'s; the folder's own tokenizer that linattn cannot use is left out with a warning."""
    from ...data.tokenizer import TokenizerError
    from ..tokenizer_import import import_tokenizer

    try:
        return import_tokenizer(folder, vocab_size, explicit)
    except TokenizerError as e:
        # the weights are what is imported; a tokenizer linattn cannot use (e.g. one without an end-of-text token)
        # leaves the checkpoint without one, said out loud
        warnings.warn(f"{e}: the checkpoint is written without a tokenizer (pass one with --tokenizer)",
                      UserWarning, stacklevel=3)
        return None

__all__ = ["MixerConversion", "FlaLayout", "LayerParams", "register_fla", "supported_types", "is_fla_folder",
           "import_fla", "fla_to_linattn", "read_fla_weights", "convert_attention", "attention_specs", "cfg_get",
           "require", "refuse_non_float", "biases_and_qk_norm", "ATTENTION_MIXER"]
