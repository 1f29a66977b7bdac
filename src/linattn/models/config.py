"""`LMConfig`: every hyper-parameter of a `LanguageModel`, as a JSON-serialisable dataclass."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from ..errors import ConfigError
from ..io import atomic_write_text
from ..ops.l2norm import L2NORM_CONVENTIONS
from .registry import mixers

FFNS = ("swiglu", "moe", "none", "rwkv7")
NORMS = ("rmsnorm", "layernorm")
MOE_BIASES = ("none", "eq14", "eq15")
RESIDUALS = ("prenorm", "hyperlink")
LOBES = (None, "causal", "bidirectional")
#: the meaning of the mixer names (`LMConfig.mixer_names`): the renames from each older version
MIXER_NAMES_VERSION = 2
MIXER_RENAMES = {1: {"mamba2": "mamba2-gla"}}


class JsonConfig:
    """JSON round-trip shared by the model configs (dataclasses): unknown fields are an error."""

    def to_dict(self) -> Dict[str, Any]:
        """The config as a plain dict (every field; JSON-serialisable).

        Returns:
            {field name: value}.
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]):
        """The config from a dict (unknown fields are an error).

        Args:
            d: {field name: value}; missing fields take their defaults.

        Returns:
            The config.

        Raises:
            ConfigError: An unknown field, or a field with a bad value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.__name__} fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)

    def to_json(self, path: Optional[Union[str, os.PathLike]] = None, indent: int = 2) -> str:
        """The config as JSON text; also written to `path` when given.

        Args:
            path: A file to write (atomically: a crash never leaves half a file), or None.
            indent: The JSON indentation.

        Returns:
            The JSON text.
        """
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            atomic_write_text(path, text + "\n")   # linattn.io's writer: a crash never leaves half a file
        return text

    @classmethod
    def from_json(cls, text_or_path: Union[str, os.PathLike]):
        """The config from JSON text or from a file path.

        Args:
            text_or_path: JSON text (starting with "{"), or the path of a JSON file.

        Returns:
            The config.

        Raises:
            ConfigError: An unknown field, or a field with a bad value.
        """
        s = os.fspath(text_or_path)
        if not s.lstrip().startswith("{"):
            with open(s, "r", encoding="utf-8") as f:
                s = f.read()
        return cls.from_dict(json.loads(s))

    def replace(self, **changes):
        """A copy with some fields changed (`dataclasses.replace`: the new config is built, and checked, anew).

        Args:
            **changes: {field name: new value}.

        Returns:
            The new config.
        """
        return dataclasses.replace(self, **changes)


@dataclass
class LMConfig(JsonConfig):
    """Configuration of a `LanguageModel`: a JSON-serialisable dataclass (`to_dict` / `from_dict`).

    A block is a mixer (`mixer`) and an FFN (`ffn`) with their norms and residuals; the model is an embedding,
    n_layers blocks, a final norm and the output head. Every field is validated on construction.

    Args:
        vocab_size: The vocabulary size (in training: the tokenizer's).
        d_model: The model width.
        n_layers: The number of blocks (mixer + FFN).
        n_heads: Heads per mixer.
        mixer: a registry name (`linattn.mixers()`) for every layer, or a list with one name per
            layer (hybrids, e.g. ["gated-deltanet", "softmax"] * 2).
        head_dim: The per-head width (default d_model // n_heads).
        mixer_kwargs: {mixer name: {kwarg: value}} passed to that mixer's layer (e.g.
            {"linear-elu+1": {"output_gate": True}}).
        rope: None = each mixer's default (softmax and ela-* use RoPE), True/False forces it.
        rope_base: The RoPE base.
        short_conv: None = each mixer's default (delta rule and mamba2 use it), True/False forces it.
        window: sliding window of softmax mixers (None: full; `swa` defaults to 256).
        max_seq_len: RoPE table size (extended on demand) and cosFormer's horizon.
        chunk_size: chunk length of the linear operators in training and prefill.
        ffn: "swiglu" | "moe" | "none" | "rwkv7" (RWKV-7's channel mixing, `layers.rwkv7.RWKV7ChannelMix`).
        ffn_hidden: SwiGLU width, default 8/3 d rounded to 32; rwkv7: 4 d rounded to 32.
        n_experts: MoE experts.
        top_k: MoE experts per token.
        expert_hidden: MoE expert width (default d_model, ELA's non-expanding experts).
        moe_bias: "none" | "eq14" (X = S_e f_e(X) + B_e) | "eq15" (X = S_e (f_e(X) + B_e)), with B_e
            the expert's label vector = its row of the router's weight (ELA section V-A).
        aux_loss_coef: weight of the load-balancing loss (returned as `output.aux_loss`).
        residual: "prenorm" (x + mixer(norm(x)), then + ffn(norm(.))) or "hyperlink" (ELA: one
            norm, no residual around the mixer: out = x + ffn(mixer(norm(x))) [+ lobe]).
        hyperlink_ffn_skip: add the mixer output to the FFN output in hyperlink blocks (what the
            ELA public code's MoE does internally; the paper omits it).
        memory_lobe: None | "causal" | "bidirectional": attention over the layer's flow (FFN
            output), added to the block output. "bidirectional" (the paper's form) lets position
            t see later tokens; it needs allow_future_leak=True.
        lobe_feature_map: the lobe's kernel (ELA: hadamard_exp).
        lobe_heads: the lobe's heads (ELA: 1).
        allow_future_leak: Allow a bidirectional memory lobe (it leaks the targets; for the ablation).
        tie_embeddings: Share the input embedding with the output head.
        final_norm: A norm before the output head.
        norm_eps: The norms' epsilon.
        norm: "rmsnorm" (default) or "layernorm" (with bias: RWKV-7's) for the blocks' and the final norm.
        embed_norm: one more norm of that kind on the embeddings, in the first block (RWKV-7's ln0, fla's pre_norm).
        init_std: The std of the normal init (output projections scaled by 1/sqrt(2 n_layers)).
        n_value_heads: grouped value heads (Qwen3-Next, Mamba2 groups), HV = n * n_heads; None: n_heads. Passed
            to the mixers that support it (linear attention; DeltaNet, Gated DeltaNet, EFLA, KDA).
        l2norm_convention: the delta-rule layers' q/k L2 normalisation inside the operator, "rsqrt"
            (x * rsqrt(sum x^2 + 1e-6), flash-linear-attention's and transformers' form, the default) or
            "clamp" (x / max(||x||, 1e-6), the only form before this field existed). A config dict saved by
            such a version (every field of that time present, this one absent) loads with "clamp", so an old
            checkpoint gives the outputs it gave (`from_dict`); a partial dict (CLI flags, a hand-written
            --model-config) gets the default.
        mixer_names: the version of the mixer names. 2 (today): `mamba2` is Mamba2's own block and `mamba2-gla`
            the gated linear attention that version 1 called `mamba2`. A config of version
            1 (a saved dict without this field, like l2norm_convention above, or mixer_names=1 given) has its
            names mapped on construction (`MIXER_RENAMES`) and holds version 2 afterwards.

    Raises:
        ConfigError: A field with a bad value (the message names it and the valid values).

    Examples:
        >>> from linattn import LMConfig
        >>> config = LMConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4,
        ...                   mixer=["gated-deltanet", "gated-deltanet", "gated-deltanet", "softmax"])
        >>> LMConfig.from_dict(config.to_dict()) == config
        True
    """

    vocab_size: int = field(metadata={"help": "vocabulary size (in training: the tokenizer's)"})
    d_model: int = field(default=256, metadata={"help": "model width"})
    n_layers: int = field(default=4, metadata={"help": "number of blocks (mixer + FFN)"})
    n_heads: int = field(default=4, metadata={"help": "heads per mixer"})
    mixer: Union[str, List[str]] = field(default="linear-elu+1", metadata={
        "help": "sequence mixer of every layer (see linattn.mixers()), or a comma list with one per layer"})
    head_dim: Optional[int] = field(default=None, metadata={"help": "per-head width; none: d_model / n_heads"})
    mixer_kwargs: Dict[str, Dict[str, Any]] = field(default_factory=dict, metadata={
        "help": "JSON {mixer name: {kwarg: value}} passed to that mixer's layers"})
    rope: Optional[bool] = field(default=None, metadata={
        "help": "force RoPE on or off; none: each mixer's default (softmax and ela-* use it)"})
    rope_base: float = field(default=10000.0, metadata={"help": "RoPE base"})
    short_conv: Optional[bool] = field(default=None, metadata={
        "help": "force the short causal convolution on or off; none: each mixer's default (delta rule, mamba2)"})
    window: Optional[int] = field(default=None, metadata={
        "help": "sliding window of softmax mixers; none: full attention (swa: 256)"})
    max_seq_len: int = field(default=2048, metadata={
        "help": "RoPE table size (extended on demand) and cosFormer's horizon; training raises it to seq_len"})
    chunk_size: int = field(default=64, metadata={"help": "chunk length of the linear operators (training, prefill)"})
    ffn: str = field(default="swiglu", metadata={"help": "feed-forward block", "choices": FFNS})
    ffn_hidden: Optional[int] = field(default=None, metadata={"help": "SwiGLU width; none: 8/3 d_model rounded to 32"})
    n_experts: int = field(default=4, metadata={"help": "MoE experts"})
    top_k: int = field(default=2, metadata={"help": "MoE experts per token"})
    expert_hidden: Optional[int] = field(default=None, metadata={
        "help": "MoE expert width; none: d_model (ELA's non-expanding experts)"})
    moe_bias: str = field(default="none", metadata={
        "help": "ELA expert label bias: eq14 (S_e f_e(X) + B_e) or eq15 (S_e (f_e(X) + B_e)); needs ffn moe",
        "choices": MOE_BIASES})
    aux_loss_coef: float = field(default=0.01, metadata={"help": "weight of the MoE load-balancing loss"})
    residual: str = field(default="prenorm", metadata={
        "help": "prenorm: x + mixer(norm(x)), then + ffn(norm(.)); hyperlink (ELA): x + ffn(mixer(norm(x)))",
        "choices": RESIDUALS})
    hyperlink_ffn_skip: bool = field(default=False, metadata={
        "help": "hyperlink blocks: add the mixer output to the FFN output (as the ELA code's MoE does)"})
    memory_lobe: Optional[str] = field(default=None, metadata={
        "help": "attention over the layer's FFN output, added to the block output; bidirectional sees later "
                "tokens (needs allow_future_leak)", "choices": ("causal", "bidirectional")})
    lobe_feature_map: str = field(default="hadamard_exp", metadata={"help": "feature map of the memory lobe"})
    lobe_heads: int = field(default=1, metadata={"help": "heads of the memory lobe"})
    allow_future_leak: bool = field(default=False, metadata={
        "help": "allow a bidirectional memory lobe (it leaks the targets; for the ablation)"})
    tie_embeddings: bool = field(default=True, metadata={"help": "share the input embedding with the output head"})
    final_norm: bool = field(default=True, metadata={"help": "RMSNorm before the output head"})
    norm_eps: float = field(default=1e-6, metadata={"help": "RMSNorm epsilon"})
    norm: str = field(default="rmsnorm", metadata={
        "help": "the blocks' and the final norm: rmsnorm, or layernorm (with bias; RWKV-7's)", "choices": NORMS})
    embed_norm: bool = field(default=False, metadata={
        "help": "a norm on the embeddings (in the first block; RWKV-7's ln0)"})
    init_std: float = field(default=0.02, metadata={
        "help": "std of the normal init (output projections scaled by 1/sqrt(2 n_layers))"})
    n_value_heads: Optional[int] = field(default=None, metadata={
        "help": "value heads HV = n * n_heads (grouped value heads: value head j reads q/k head j // n; linear "
                "attention and the delta rule's layers); none: n_heads"})
    l2norm_convention: str = field(default="rsqrt", metadata={
        "help": "delta-rule q/k L2 norm: rsqrt = x*rsqrt(sum x^2+1e-6) (fla, transformers); clamp = "
                "x/max(|x|,1e-6) (checkpoints written before this field)", "choices": L2NORM_CONVENTIONS})
    mixer_names: int = field(default=MIXER_NAMES_VERSION, metadata={
        "help": "what the mixer names mean: 2 = today's; 1 = the first names (`mamba2` named today's `mamba2-gla`; "
                "saved configs without this field); a version-1 config is mapped to version 2 on construction"})

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "LMConfig":
        """The config from a dict (unknown fields are an error).

        A dict written by `to_dict` before a convention field existed (it holds every field of the first version,
        `_FIRST_FIELDS`) gets that field's old value (`LEGACY_VALUES`), so that a checkpoint keeps computing what it
        computed when it was saved.

        Args:
            d: {field name: value}.

        Returns:
            The `LMConfig`.

        Raises:
            ConfigError: An unknown field, or a field with a bad value.
        """
        if isinstance(d, dict) and all(f in d for f in _FIRST_FIELDS):
            d = {**{k: v for k, v in LEGACY_VALUES.items() if k not in d}, **d}
        return super().from_dict(d)

    def __post_init__(self):
        if isinstance(self.mixer, tuple):
            self.mixer = list(self.mixer)
        self._rename_old_mixers()
        self.validate()

    @classmethod
    def upgrade_architecture(cls, arch: Dict[str, Any]) -> Dict[str, Any]:
        """An architecture recorded with a checkpoint, in today's mixer names.

        An architecture recorded with a checkpoint (`checkpoint.architecture`) before `mixer_names` existed
        names its mixers the old way (`mamba2` for today's `mamba2-gla`): this gives the same architecture in
        today's names, so that the weights-vs-config check compares like with like.

        Args:
            arch: The recorded architecture.

        Returns:
            The architecture (the same dict when it already has `mixer_names`).
        """
        if "mixer_names" in arch:
            return arch
        arch = dict(arch)
        for v in range(1, MIXER_NAMES_VERSION):
            ren = MIXER_RENAMES.get(v, {})
            if isinstance(arch.get("mixers"), list):
                arch["mixers"] = [ren.get(m, m) if isinstance(m, str) else m for m in arch["mixers"]]
            if isinstance(arch.get("mixer_kwargs"), dict):
                arch["mixer_kwargs"] = {ren.get(k, k): kw for k, kw in arch["mixer_kwargs"].items()}
        arch["mixer_names"] = MIXER_NAMES_VERSION
        return arch

    def _rename_old_mixers(self) -> None:
        """Map a config of an older `mixer_names` version to today's names (mixer and mixer_kwargs), so that
        it builds the layers it built when it was saved; the config then holds version MIXER_NAMES_VERSION."""
        v = self.mixer_names
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MIXER_NAMES_VERSION:
            raise ConfigError(f"LMConfig.mixer_names must be an int in [1, {MIXER_NAMES_VERSION}], got {v!r}")
        for old in range(v, MIXER_NAMES_VERSION):
            ren = MIXER_RENAMES.get(old, {})
            if isinstance(self.mixer, str):
                self.mixer = ren.get(self.mixer, self.mixer)
            elif isinstance(self.mixer, list):
                self.mixer = [ren.get(m, m) if isinstance(m, str) else m for m in self.mixer]
            if isinstance(self.mixer_kwargs, dict):
                self.mixer_kwargs = {ren.get(k, k): kw for k, kw in self.mixer_kwargs.items()}
        self.mixer_names = MIXER_NAMES_VERSION

    # -- checks ------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError (a ValueError) naming the first bad field."""
        def pos_int(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"LMConfig.{name} must be a positive int, got {v!r}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "chunk_size", "lobe_heads"):
            pos_int(name)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"LMConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                             f"unless head_dim is given")
        if self.head_dim is not None:
            pos_int("head_dim")
        valid = mixers()
        names = self.mixer_list()
        for n in names:
            if n not in valid:
                raise ConfigError(f"unknown mixer {n!r}; valid mixers are: {', '.join(valid)}")
        if not isinstance(self.mixer_kwargs, dict) or any(k not in valid for k in self.mixer_kwargs):
            bad = [k for k in self.mixer_kwargs] if isinstance(self.mixer_kwargs, dict) else self.mixer_kwargs
            raise ConfigError(f"LMConfig.mixer_kwargs must map mixer names to kwargs dicts; got keys {bad}; "
                              f"valid mixers are: {', '.join(valid)}")
        for name, kw in self.mixer_kwargs.items():
            if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
                raise ConfigError(f"LMConfig.mixer_kwargs[{name!r}] must be a dict of keyword arguments, got {kw!r}")
        if self.ffn not in FFNS:
            raise ConfigError(f"LMConfig.ffn must be one of {FFNS}, got {self.ffn!r}")
        if self.ffn == "moe":
            pos_int("n_experts")
            pos_int("top_k")
            if self.top_k > self.n_experts:
                raise ConfigError(f"LMConfig.top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        if self.moe_bias not in MOE_BIASES:
            raise ConfigError(f"LMConfig.moe_bias must be one of {MOE_BIASES}, got {self.moe_bias!r}")
        if self.moe_bias != "none" and self.ffn != "moe":
            raise ConfigError(f"LMConfig.moe_bias={self.moe_bias!r} needs ffn='moe', got ffn={self.ffn!r}")
        if self.norm not in NORMS:
            raise ConfigError(f"LMConfig.norm must be one of {NORMS}, got {self.norm!r}")
        if self.residual not in RESIDUALS:
            raise ConfigError(f"LMConfig.residual must be one of {RESIDUALS}, got {self.residual!r}")
        if self.memory_lobe not in LOBES:
            raise ConfigError(f"LMConfig.memory_lobe must be one of {LOBES}, got {self.memory_lobe!r}")
        if self.memory_lobe == "bidirectional" and not self.allow_future_leak:
            raise ConfigError(
                "memory_lobe='bidirectional' lets position t attend to later tokens: in a causal language "
                "model that leaks the targets (the ELA paper's 'sudden drop'). Use memory_lobe='causal', or "
                "pass allow_future_leak=True to build it anyway (for the ablation).")
        if self.d_model % self.lobe_heads:
            raise ConfigError(f"LMConfig.d_model ({self.d_model}) must be divisible by lobe_heads ({self.lobe_heads})")
        if self.window is not None:
            pos_int("window")
        for name in ("ffn_hidden", "expert_hidden"):
            if getattr(self, name) is not None:
                pos_int(name)
        for name, low_open in (("aux_loss_coef", False), ("rope_base", True), ("norm_eps", True), ("init_std", True)):
            v = getattr(self, name)
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                    or (v <= 0 if low_open else v < 0)):
                raise ConfigError(f"LMConfig.{name} must be a finite number {'>' if low_open else '>='} 0, got {v!r}")
        for name in ("rope", "short_conv"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(f"LMConfig.{name} must be true, false or none, got {getattr(self, name)!r}")
        if self.n_value_heads is not None:
            pos_int("n_value_heads")
            if self.n_value_heads % self.n_heads:
                raise ConfigError(f"LMConfig.n_value_heads ({self.n_value_heads}) must be a multiple of n_heads "
                                  f"({self.n_heads})")
        if self.l2norm_convention not in L2NORM_CONVENTIONS:
            raise ConfigError(f"LMConfig.l2norm_convention must be one of {L2NORM_CONVENTIONS}, "
                              f"got {self.l2norm_convention!r}")
        for name in ("hyperlink_ffn_skip", "allow_future_leak", "tie_embeddings", "final_norm", "embed_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"LMConfig.{name} must be true or false, got {getattr(self, name)!r}")

    def mixer_list(self) -> List[str]:
        """One mixer name per layer."""
        if isinstance(self.mixer, str):
            return [self.mixer] * self.n_layers
        if not isinstance(self.mixer, list) or not all(isinstance(m, str) for m in self.mixer):
            raise ConfigError(f"LMConfig.mixer must be a name or a list of names, got {self.mixer!r}")
        if len(self.mixer) != self.n_layers:
            raise ConfigError(f"LMConfig.mixer lists {len(self.mixer)} mixers for n_layers = {self.n_layers}")
        return list(self.mixer)

    # -- presets -----------------------------------------------------------------------------
    @classmethod
    def ela_gpt(cls, vocab_size: int = 6400, kernel: str = "hadamard_exp", **overrides) -> "LMConfig":
        """The ELA paper's GPT.

        d 256, 4 layers, 4 heads, MoE with 4 experts top-2 (non-expanding SwiGLU experts), Hyper-Link residual,
        ELA attention (RoPE, no 1/sqrt(d), no output norm) with the `kernel` ("hadamard_exp" or "sum_sq_euclid"),
        no final norm, tied head.

        No memory lobe unless asked (memory_lobe="causal"; the paper's own lobe is bidirectional,
        see LMConfig). With vocab 6400 it has 5,838,864 parameters with residual="prenorm" and
        6,624,272 with Hyper-Link + a memory lobe, the counts the paper reports.

        Args:
            vocab_size: The vocabulary.
            kernel: "hadamard_exp" or "sum_sq_euclid".
            **overrides: Further LMConfig fields.

        Returns:
            The `LMConfig`.
        """
        if kernel not in ("hadamard_exp", "sum_sq_euclid"):
            raise ConfigError(f"kernel must be 'hadamard_exp' or 'sum_sq_euclid', got {kernel!r}")
        args: Dict[str, Any] = dict(
            vocab_size=vocab_size, d_model=256, n_layers=4, n_heads=4, mixer=f"ela-{kernel}", ffn="moe",
            n_experts=4, top_k=2, expert_hidden=None, residual="hyperlink", final_norm=False,
            tie_embeddings=True, max_seq_len=512)
        args.update(overrides)
        return cls(**args)


#: the fields every `LMConfig.to_dict()` has written since the first version (a dict holding all of them is a
#: saved config, not a partial one)
_FIRST_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "mixer", "head_dim", "mixer_kwargs", "rope",
                 "rope_base", "short_conv", "window", "max_seq_len", "chunk_size", "ffn", "ffn_hidden", "n_experts",
                 "top_k", "expert_hidden", "moe_bias", "aux_loss_coef", "residual", "hyperlink_ffn_skip",
                 "memory_lobe", "lobe_feature_map", "lobe_heads", "allow_future_leak", "tie_embeddings",
                 "final_norm", "norm_eps", "init_std")
#: fields added later whose default changes what a saved config computes: the value such a config meant
LEGACY_VALUES = {"l2norm_convention": "clamp", "mixer_names": 1}

PRESETS = {
    "ela-gpt": LMConfig.ela_gpt,
    "ela-gpt-sum_sq_euclid": lambda vocab_size=6400, **kw: LMConfig.ela_gpt(vocab_size, "sum_sq_euclid", **kw),
}
