"""`LMConfig`: every hyper-parameter of a `LanguageModel`, as a JSON-serialisable dataclass."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from .registry import mixers

FFNS = ("swiglu", "moe", "none")
MOE_BIASES = ("none", "eq14", "eq15")
RESIDUALS = ("prenorm", "hyperlink")
LOBES = (None, "causal", "bidirectional")


class JsonConfig:
    """JSON round-trip shared by the model configs (dataclasses): unknown fields are an error."""

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)

    def to_json(self, path: Optional[Union[str, os.PathLike]] = None, indent: int = 2) -> str:
        """The config as JSON text; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: Union[str, os.PathLike]):
        """From JSON text or from a file path."""
        s = os.fspath(text_or_path)
        if not s.lstrip().startswith("{"):
            with open(s, "r", encoding="utf-8") as f:
                s = f.read()
        return cls.from_dict(json.loads(s))

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass
class LMConfig(JsonConfig):
    """Configuration of a `LanguageModel`.

    Model:
        vocab_size, d_model, n_layers, n_heads; head_dim (default d_model // n_heads).
        mixer: a registry name (`linattn.mixers()`) for every layer, or a list with one name per
            layer (hybrids, e.g. ["gated-deltanet", "softmax"] * 2).
        mixer_kwargs: {mixer name: {kwarg: value}} passed to that mixer's layer (e.g.
            {"linear-elu+1": {"output_gate": True}}).
        rope: None = each mixer's default (softmax and ela-* use RoPE), True/False forces it.
        short_conv: None = each mixer's default (delta rule and mamba2 use it), True/False forces it.
        window: sliding window of softmax mixers (None: full; `swa` defaults to 256).
        max_seq_len: RoPE table size (extended on demand) and cosFormer's horizon.
        chunk_size: chunk length of the linear operators in training and prefill.
    FFN:
        ffn: "swiglu" | "moe" | "none"; ffn_hidden (SwiGLU width, default 8/3 d rounded to 32).
        n_experts, top_k, expert_hidden (default d_model, ELA's non-expanding experts),
        moe_bias: "none" | "eq14" (X = S_e f_e(X) + B_e) | "eq15" (X = S_e (f_e(X) + B_e)), with B_e
            the expert's label vector = its row of the router's weight (ELA section V-A);
        aux_loss_coef: weight of the load-balancing loss (returned as `output.aux_loss`).
    Residual:
        residual: "prenorm" (x + mixer(norm(x)), then + ffn(norm(.))) or "hyperlink" (ELA: one
            norm, no residual around the mixer: out = x + ffn(mixer(norm(x))) [+ lobe]).
        hyperlink_ffn_skip: add the mixer output to the FFN output in hyperlink blocks (what the
            ELA public code's MoE does internally; the paper omits it).
        memory_lobe: None | "causal" | "bidirectional": attention over the layer's flow (FFN
            output), added to the block output. "bidirectional" (the paper's form) lets position
            t see later tokens; it needs allow_future_leak=True.
        lobe_feature_map, lobe_heads: the lobe's kernel and heads (ELA: hadamard_exp, 1).
    Head: tie_embeddings, final_norm, norm_eps, init_std.
    """

    vocab_size: int
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mixer: Union[str, List[str]] = "linear-elu+1"
    head_dim: Optional[int] = None
    mixer_kwargs: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    rope: Optional[bool] = None
    rope_base: float = 10000.0
    short_conv: Optional[bool] = None
    window: Optional[int] = None
    max_seq_len: int = 2048
    chunk_size: int = 64
    ffn: str = "swiglu"
    ffn_hidden: Optional[int] = None
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: Optional[int] = None
    moe_bias: str = "none"
    aux_loss_coef: float = 0.01
    residual: str = "prenorm"
    hyperlink_ffn_skip: bool = False
    memory_lobe: Optional[str] = None
    lobe_feature_map: str = "hadamard_exp"
    lobe_heads: int = 1
    allow_future_leak: bool = False
    tie_embeddings: bool = True
    final_norm: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self):
        if isinstance(self.mixer, tuple):
            self.mixer = list(self.mixer)
        self.validate()

    # -- checks ------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        def pos_int(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LMConfig.{name} must be a positive int, got {v!r}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "chunk_size", "lobe_heads"):
            pos_int(name)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"LMConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                             f"unless head_dim is given")
        if self.head_dim is not None:
            pos_int("head_dim")
        valid = mixers()
        names = self.mixer_list()
        for n in names:
            if n not in valid:
                raise ValueError(f"unknown mixer {n!r}; valid mixers are: {', '.join(valid)}")
        if not isinstance(self.mixer_kwargs, dict) or any(k not in valid for k in self.mixer_kwargs):
            bad = [k for k in self.mixer_kwargs] if isinstance(self.mixer_kwargs, dict) else self.mixer_kwargs
            raise ValueError(f"LMConfig.mixer_kwargs must map mixer names to kwargs dicts; got keys {bad}; "
                             f"valid mixers are: {', '.join(valid)}")
        if self.ffn not in FFNS:
            raise ValueError(f"LMConfig.ffn must be one of {FFNS}, got {self.ffn!r}")
        if self.ffn == "moe":
            pos_int("n_experts")
            pos_int("top_k")
            if self.top_k > self.n_experts:
                raise ValueError(f"LMConfig.top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        if self.moe_bias not in MOE_BIASES:
            raise ValueError(f"LMConfig.moe_bias must be one of {MOE_BIASES}, got {self.moe_bias!r}")
        if self.moe_bias != "none" and self.ffn != "moe":
            raise ValueError(f"LMConfig.moe_bias={self.moe_bias!r} needs ffn='moe', got ffn={self.ffn!r}")
        if self.residual not in RESIDUALS:
            raise ValueError(f"LMConfig.residual must be one of {RESIDUALS}, got {self.residual!r}")
        if self.memory_lobe not in LOBES:
            raise ValueError(f"LMConfig.memory_lobe must be one of {LOBES}, got {self.memory_lobe!r}")
        if self.memory_lobe == "bidirectional" and not self.allow_future_leak:
            raise ValueError(
                "memory_lobe='bidirectional' lets position t attend to later tokens: in a causal language "
                "model that leaks the targets (the ELA paper's 'sudden drop'). Use memory_lobe='causal', or "
                "pass allow_future_leak=True to build it anyway (for the ablation).")
        if self.d_model % self.lobe_heads:
            raise ValueError(f"LMConfig.d_model ({self.d_model}) must be divisible by lobe_heads ({self.lobe_heads})")
        if self.window is not None:
            pos_int("window")
        for name in ("ffn_hidden", "expert_hidden"):
            if getattr(self, name) is not None:
                pos_int(name)
        if self.aux_loss_coef < 0:
            raise ValueError(f"LMConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    def mixer_list(self) -> List[str]:
        """One mixer name per layer."""
        if isinstance(self.mixer, str):
            return [self.mixer] * self.n_layers
        if not isinstance(self.mixer, list) or not all(isinstance(m, str) for m in self.mixer):
            raise ValueError(f"LMConfig.mixer must be a name or a list of names, got {self.mixer!r}")
        if len(self.mixer) != self.n_layers:
            raise ValueError(f"LMConfig.mixer lists {len(self.mixer)} mixers for n_layers = {self.n_layers}")
        return list(self.mixer)

    # -- presets -----------------------------------------------------------------------------
    @classmethod
    def ela_gpt(cls, vocab_size: int = 6400, kernel: str = "hadamard_exp", **overrides) -> "LMConfig":
        """The ELA paper's GPT: d 256, 4 layers, 4 heads, MoE with 4 experts top-2 (non-expanding
        SwiGLU experts), Hyper-Link residual, ELA attention (RoPE, no 1/sqrt(d), no output norm)
        with the `kernel` ("hadamard_exp" or "sum_sq_euclid"), no final norm, tied head.

        No memory lobe unless asked (memory_lobe="causal"; the paper's own lobe is bidirectional,
        see LMConfig). With vocab 6400 it has 5,838,864 parameters with residual="prenorm" and
        6,624,272 with Hyper-Link + a memory lobe, the counts the paper reports.
        """
        if kernel not in ("hadamard_exp", "sum_sq_euclid"):
            raise ValueError(f"kernel must be 'hadamard_exp' or 'sum_sq_euclid', got {kernel!r}")
        args: Dict[str, Any] = dict(
            vocab_size=vocab_size, d_model=256, n_layers=4, n_heads=4, mixer=f"ela-{kernel}", ffn="moe",
            n_experts=4, top_k=2, expert_hidden=None, residual="hyperlink", final_norm=False,
            tie_embeddings=True, max_seq_len=512)
        args.update(overrides)
        return cls(**args)


PRESETS = {
    "ela-gpt": LMConfig.ela_gpt,
    "ela-gpt-sum_sq_euclid": lambda vocab_size=6400, **kw: LMConfig.ela_gpt(vocab_size, "sum_sq_euclid", **kw),
}
