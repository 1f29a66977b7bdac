"""Run flash-linear-attention (fla) models on the CPU in fp64, for the fla-import tests (a helper, not a test file).

fla's layers call Triton kernels (fused norms, short convolution, rotary, l2norm, activations, flash-attn), which
do not run on the CPU. Inside `fla_cpu(...)` those are replaced by plain torch forms of the same formulas, and
the layer modules' operators by what the caller passes (fla's own naive references, fla/ops/<op>/naive.py, or
linattn's fp64 references):

    fla = pytest.importorskip("fla")
    from tests.fla_cpu import fla_cpu, build_fla, check_import
    pytestmark = pytest.mark.usefixtures("one_thread_module")   # tiny fp64 tensors: 2 threads only contend (5x)

    def test_gla(tmp_path):
        with fla_cpu({"fla.layers.gla.chunk_gla": naive_gla}):        # dotted path of the name fla's layer calls
            model = build_fla(GLAConfig(hidden_size=64, num_hidden_layers=3, num_heads=2, vocab_size=100,
                                        attn={"layers": [1], "num_heads": 4}))
            res = check_import(model, tmp_path)                        # save_pretrained, import_fla, compare
        assert res.max_err <= 1e-10 and res.greedy_equal

A replaced function is replaced under every name any loaded fla module holds it by (`from x import f` copies),
and everything is restored on exit. One difference from fla's own numerics, on purpose: fla builds its RoPE
cos/sin tables in fp32; here they are computed in fp64 (as linattn's), so an fp64 comparison tests the mapping
and not fla's fp32 angle table.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------- torch forms of fla's kernels


def _norm(x, weight, bias, residual, eps, prenorm, is_rms):
    if residual is not None:
        x = x + residual
    xf = x
    if is_rms:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = F.layer_norm(xf, xf.shape[-1:], eps=eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return (y, x) if prenorm else y


def _layer_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    return _norm(x, weight, bias, residual, eps, prenorm, is_rms_norm)


def _rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    return _norm(x, weight, bias, residual, eps, prenorm, True)


def _group_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False,
                num_groups=1):
    if residual is not None:
        x = x + residual
    xg = x.unflatten(-1, (num_groups, x.shape[-1] // num_groups))
    if is_rms_norm:
        y = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = F.layer_norm(xg, xg.shape[-1:], eps=eps)
    y = y.flatten(-2)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return (y, x) if prenorm else y


def _act(name: str, g):
    return torch.sigmoid(g) if name == "sigmoid" else F.silu(g)


def _rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                    eps=1e-6):
    y = _norm(x, weight, bias, residual, eps, prenorm, True)
    return (y[0] * _act(activation, g), y[1]) if prenorm else y * _act(activation, g)


def _layer_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                      eps=1e-6):
    y = _norm(x, weight, bias, residual, eps, prenorm, False)
    return (y[0] * _act(activation, g), y[1]) if prenorm else y * _act(activation, g)


def _l2norm(x, eps=1e-6, output_dtype=None):
    y = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
    return y if output_dtype is None else y.to(output_dtype)


def _rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, chunk_indices=None):
    if cu_seqlens is not None:
        raise NotImplementedError("fla_cpu: rotary with cu_seqlens")
    T, ro = x.shape[1], cos.shape[-1] * 2
    if isinstance(seqlen_offsets, torch.Tensor):
        pos = seqlen_offsets.view(-1, 1) + torch.arange(T)                       # [B, T]
        c, s = cos[pos][:, :, None], sin[pos][:, :, None]
    else:
        o = int(seqlen_offsets)
        c, s = cos[o:o + T][None, :, None], sin[o:o + T][None, :, None]
    xr = x[..., :ro]
    if interleaved:
        x1, x2 = xr[..., ::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([out, x[..., ro:]], dim=-1)


def _rotary_tables(self, seqlen, device=None, dtype=None):
    """fla's RotaryEmbedding._update_cos_sin_cache with the angles in fp64 (module docstring)."""
    if seqlen > self._seq_len_cached or self._cos_cached is None or self._cos_cached.dtype != dtype:
        self._seq_len_cached = seqlen
        inv = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = torch.outer(torch.arange(seqlen, dtype=torch.float64), inv)
        if self.scale is not None:
            raise NotImplementedError("fla_cpu: XPos rotary (scale_base)")
        self._cos_cached, self._sin_cached = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def depthwise_causal_taps(xp, w, bias=None):
    """The depthwise convolution of a left-padded xp [B, D, T + W - 1] with w [D, W] as W multiply-adds: F.conv1d
    has no fast fp64 depthwise path on the CPU (~1 s a call at d 64, T 70)."""
    W = w.shape[-1]
    T = xp.shape[-1] - W + 1
    y = sum(xp[..., j:j + T] * w[:, j, None] for j in range(W))
    return y if bias is None else y + bias[:, None]


def _short_conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None,
                        chunk_indices=None, **kwargs):
    """fla's ShortConvolution.forward (causal depthwise conv, optional SiLU): (y, final state [B, D, W] or None)."""
    if cu_seqlens is not None:
        raise NotImplementedError("fla_cpu: short convolution with cu_seqlens")
    if mask is not None:
        x = x * mask.unsqueeze(-1)
    W = self.kernel_size[0]
    xt = x.transpose(1, 2)                                                         # [B, D, T]
    prev = cache[..., 1:] if cache is not None else xt.new_zeros(xt.shape[0], xt.shape[1], W - 1)
    xp = torch.cat([prev.to(xt.dtype), xt], dim=-1)
    y = depthwise_causal_taps(xp, self.weight.view(xt.shape[1], W), self.bias).transpose(1, 2)
    if self.activation is not None:
        y = F.silu(y)
    if residual is not None:
        y = y + residual
    state = None
    if output_final_state or cache is not None:
        state = F.pad(xp, (max(0, W - xp.shape[-1]), 0))[..., -W:]
        if cache is not None and not torch.is_grad_enabled():
            cache.copy_(state)
            state = cache
    return y, state


def _flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **kwargs):
    """flash_attn_func on [B, T, H, D] (grouped k/v heads, causal aligned to the end, sliding window)."""
    Tq, Tk = q.shape[1], k.shape[1]
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    qpos = torch.arange(Tq)[:, None] + (Tk - Tq)
    diff = qpos - torch.arange(Tk)[None, :]
    mask = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        mask &= diff >= 0
    if window_size[0] >= 0:
        mask &= diff <= window_size[0]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=softmax_scale)
    return o.transpose(1, 2)


def _swiglu(x, y):
    return F.silu(x) * y


def _swiglu_linear(x, y, weight, bias):
    return F.linear(F.silu(x) * y, weight, bias)


def _logsigmoid(x, temperature=1.0):
    return F.logsigmoid(x) / temperature


#: fla's kernels (dotted path of the original) -> torch forms; each replaced under every name fla modules hold it by
_FUNCTIONS: Dict[str, Callable] = {
    "fla.modules.activations.swish": F.silu,
    "fla.modules.activations.sigmoid": torch.sigmoid,
    "fla.modules.activations.logsigmoid": _logsigmoid,
    "fla.modules.activations.elu_p1": lambda x: F.elu(x) + 1.0,
    "fla.modules.activations.sqrelu": lambda x: F.relu(x).pow(2),
    "fla.modules.activations.swiglu": _swiglu,
    "fla.modules.activations.swiglu_linear": _swiglu_linear,
    "fla.modules.norm.l2norm.l2norm": _l2norm,
    "fla.modules.norm.layernorm.layer_norm": _layer_norm,
    "fla.modules.norm.layernorm.rms_norm": _rms_norm,
    "fla.modules.norm.layernorm.group_norm": _group_norm,
    "fla.modules.norm.fused_norm_gate.rms_norm_gated": _rms_norm_gated,
    "fla.modules.norm.fused_norm_gate.layer_norm_gated": _layer_norm_gated,
    "fla.modules.rotary.ops.rotary_embedding": _rotary,
    "fla.layers.attn.flash_attn_func": _flash_attn,
}
#: methods replaced on fla's classes
_METHODS: Dict[str, Callable] = {
    "fla.modules.causal_conv1d.ops.ShortConvolution.forward": _short_conv_forward,
    "fla.modules.rotary.ops.RotaryEmbedding._update_cos_sin_cache": _rotary_tables,
}


def _resolve(path: str) -> Tuple[Any, str]:
    """(owner object, attribute name) of a dotted path `package.module[.Class].attr`."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(f"fla_cpu: cannot resolve {path!r}")


@contextlib.contextmanager
def fla_cpu(ops: Optional[Mapping[str, Callable]] = None) -> Iterator[None]:
    """Inside: fla's models build and run on the CPU (module docstring). ops: {dotted path of a function a fla
    module calls (e.g. "fla.layers.gla.chunk_gla"): its replacement}, replaced everywhere that object is held."""
    import fla  # noqa: F401 - loads the modules whose names are patched

    undo: List[Tuple[Any, str, Any]] = []
    try:
        for path, new in {**_FUNCTIONS, **dict(ops or {})}.items():
            owner, name = _resolve(path)
            old = getattr(owner, name, None)
            targets = [(owner, name)]
            if old is not None:
                for mod_name, mod in list(sys.modules.items()):
                    if mod is None or not (mod_name == "fla" or mod_name.startswith("fla.")):
                        continue
                    for attr, value in list(vars(mod).items()):
                        if value is old and (mod, attr) != (owner, name):
                            targets.append((mod, attr))
                        elif isinstance(value, dict) and attr.isupper():   # ACT2FN-style tables
                            for key, fn in list(value.items()):
                                if fn is old:
                                    undo.append((value, key, fn))
                                    value[key] = new
            for obj, attr in targets:
                undo.append((obj, attr, getattr(obj, attr, None)))
                setattr(obj, attr, new)
        for path, new in _METHODS.items():
            owner, name = _resolve(path)
            undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)
        yield
    finally:
        for obj, attr, old in reversed(undo):
            if isinstance(obj, dict):
                obj[attr] = old
            else:
                setattr(obj, attr, old)


# --------------------------------------------------------------------------- the strong test


def perturb(model: torch.nn.Module, seed: int = 0, scale: float = 0.1) -> torch.nn.Module:
    """Add N(0, scale) noise to every parameter whose values are all equal (norm weights at 1, biases and D at
    0, ...), so that a mapping that drops or swaps one cannot pass; returns the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return model


def build_fla(config, seed: int = 0, model_cls=None) -> torch.nn.Module:
    """fla's own causal LM of `config` (AutoModelForCausalLM's class for it, or model_cls), random, perturbed, fp64,
    eval mode. Call inside `fla_cpu()`."""
    if model_cls is None:
        import fla  # noqa: F401 - registers fla's model types with transformers
        from transformers import AutoModelForCausalLM

        model_cls = AutoModelForCausalLM._model_mapping[type(config)]
    torch.manual_seed(seed)
    config.fuse_cross_entropy = False
    model = model_cls(config).double().eval()
    return perturb(model, seed)


@dataclass
class ImportResult:
    max_err: float              # max |logits linattn - logits fla| (fp64)
    greedy_equal: bool          # the 10 greedy tokens agree
    fla_tokens: List[int]
    linattn_tokens: List[int]
    model: torch.nn.Module      # the loaded linattn model (fp64)
    step_dir: Path


def fla_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def fla_greedy(model: torch.nn.Module, ids: torch.Tensor, n: int) -> List[int]:
    """fla's greedy continuation by re-running the whole sequence each step (fla's cache paths need its kernels)."""
    seq = ids
    for _ in range(n):
        nxt = fla_logits(model, seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq[0, ids.shape[1]:].tolist()


def load_linattn(run_dir) -> torch.nn.Module:
    """The linattn checkpoint in `run_dir`, built in fp64 (so fp64 weights load without rounding)."""
    from linattn import checkpoint as ckpt

    def build(d):
        return ckpt.build_model(ckpt.model_config_from_dict(d)).double()

    ck = ckpt.load_checkpoint(run_dir, model_factory=build)
    return ck.model.eval()


def save_unshared(model: torch.nn.Module, folder) -> None:
    """config.json + model.safetensors with every tensor stored under each of its names (what save_pretrained would
    write, for models whose shared tensors it refuses, e.g. fla's linear_attn with tie_feature_map_qk)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})


def check_import(model: torch.nn.Module, tmp_path, *, T: int = 70, n_new: int = 10, seed: int = 0,
                 save: Optional[Callable] = None) -> ImportResult:
    """save_pretrained(model) -> import_fla -> load the linattn checkpoint in fp64; compare the logits of a random
    batch [2, T] (T=70 crosses linattn's chunk of 64) and 10 greedy tokens. Call inside `fla_cpu()`. save(model,
    folder): another way to write the folder than save_pretrained (e.g. `save_unshared`)."""
    from linattn.hf import import_fla

    tmp_path = Path(tmp_path)
    folder, run = tmp_path / "fla_model", tmp_path / "run"
    if save is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        save(model, folder)
    step_dir = import_fla(folder, run)
    lm = load_linattn(run)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, T), generator=gen)
    ref = fla_logits(model, ids)
    with torch.no_grad():
        got = lm(ids).logits
    err = float((got - ref).abs().max())
    prompt = ids[:1, :7]
    want = fla_greedy(model, prompt, n_new)
    with torch.no_grad():
        mine = lm.generate(prompt, n_new, temperature=0)[0, prompt.shape[1]:].tolist()
    return ImportResult(err, want == mine, want, mine, lm, step_dir)
