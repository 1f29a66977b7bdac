"""`linattn.hf.kernelize(model)`: serve a transformers model's linear mixers with linattn's operators, in place.

    from linattn.hf import kernelize
    report = kernelize(model)          # a Qwen3-Next / Qwen3.5 / OLMo-Hybrid / LaRA-mini / Kimi-Linear /
                                       # GLM-5-Next / Bailing / MiniMax / Mamba2 / Falcon-H1 / Granite-4.0-H /
                                       # Bamba / Nemotron-H (Omni) / Zamba2 model
    report.patched                     # names of the modules now served by linattn
    report.unserved                    # {} here: a module that cannot be served raises (never a partial patch)

How (see docs/kernelize.md). transformers 5.24's own mechanism, `use_kernel_func_from_hub_with_fallback` /
`use_kernelized_func`, resolves each kernel function once, at import time of the modeling file (the hub's
`kernels` package, else the original package such as fla or mamba_ssm, else the PyTorch fallback); without the
`kernels` package its decorators are no-ops, and with it a provider must be a hub or local *kernel repository*
(a built package with per-device variants), not a Python callable. Neither can take linattn at run time for
one model, so kernelize does this:
- each served mixer gets, as an instance attribute, its class's own `forward` (decorators included) rebuilt
  over a copy of its modeling module's globals in which the kernel functions (`torch_chunk_gated_delta_rule`,
  `chunk_kimi_delta_attention`, `mamba2_chunk_scan`, `causal_conv1d_fn`, ...) are linattn's adapters: the modeling
  module itself is never changed, so other models of the same class keep transformers' code, compiled or not;
  MiniMax's lightning attention is inline PyTorch with no kernel hook, so its forward is replaced outright;
- packing: forward pre-hooks on the model and its base model (the forward itself, and so its signature, stay
  transformers') turn restarting `position_ids` (DataCollatorWithFlattening, batch 1, no mask, no cache) into
  transformers' `cu_seq_lens_*` kwargs, which the layers pass down to every mixer and which gradient
  checkpointing keeps for its recomputation (a model with the compiled decode hook runs the model's two hook
  functions in that hook's forward instead: `_hook_packing`); the softmax layers get a varlen-aware sdpa
  registered in transformers' AttentionInterface as "linattn_sdpa".
The mixers' projections, gates and norms stay transformers' own code; only the sequence cores and the short
convolutions change.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LinattnError
from ..layers.common import ShortConv
from ..ops import LinearAttentionState, delta_rule, linear_attention
from ..ops._common import compute_dtype

__all__ = ["kernelize", "KernelizeReport", "SERVED_CLASSES", "ATTN_IMPLEMENTATION", "torch_fallbacks"]

ATTN_IMPLEMENTATION = "linattn_sdpa"

# mixer class name -> (the modeling module it ships in, kind)
SERVED_CLASSES: Dict[str, tuple] = {
    "Qwen3NextGatedDeltaNet": ("transformers.models.qwen3_next.modeling_qwen3_next", "gdn"),
    "Qwen3_5GatedDeltaNet": ("transformers.models.qwen3_5.modeling_qwen3_5", "gdn"),
    "Qwen3_5MoeGatedDeltaNet": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "gdn"),
    "OlmoHybridGatedDeltaNet": ("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "gdn"),
    "LaraMiniGatedDeltaNet": ("transformers.models.lara_mini.modeling_lara_mini", "gdn"),
    "KimiLinearDeltaAttention": ("transformers.models.kimi_linear.modeling_kimi_linear", "kda"),
    "Glm5NextTextLinearAttention": ("transformers.models.glm5_next.modeling_glm5_next", "kda"),
    "BailingHybridDeltaAttention": ("transformers.models.bailing_hybrid.modeling_bailing_hybrid", "kda"),
    "MiniMaxLightningAttention": ("transformers.models.minimax.modeling_minimax", "lightning"),
    "Mamba2Mixer": ("transformers.models.mamba2.modeling_mamba2", "mamba2"),
    "FalconH1Mixer": ("transformers.models.falcon_h1.modeling_falcon_h1", "mamba2"),
    "GraniteMoeHybridMambaLayer": ("transformers.models.granitemoehybrid.modeling_granitemoehybrid", "mamba2"),
    "BambaMixer": ("transformers.models.bamba.modeling_bamba", "mamba2"),
    "NemotronHMamba2Mixer": ("transformers.models.nemotron_h.modeling_nemotron_h", "mamba2"),
    "Zamba2MambaMixer": ("transformers.models.zamba2.modeling_zamba2", "mamba2"),
}

# Recognised by name but not served, with the reason (kernelize raises on them unless skip_unserved=True).
UNSERVED_CLASSES: Dict[str, str] = {
    "MambaMixer": "Mamba1's selective scan has a per-channel state (d_inner x d_state) with input-dependent "
                  "per-channel decays; linattn has no operator of that shape",
    "FalconMambaMixer": "Mamba1 selective scan (see MambaMixer)",
    "JambaMambaMixer": "Mamba1 selective scan (see MambaMixer)",
    "ZambaMambaMixer": "Mamba1 selective scan (see MambaMixer)",
    "xLSTMLayer": "mLSTM's exponential input gate with max stabiliser and normaliser is not a linattn operator",
    "RecurrentGemmaRglru": "RG-LRU (a diagonal RNN) is not a linattn operator",
    "RwkvSelfAttention": "RWKV-4's WKV is not a linattn operator",
}


@dataclass
class KernelizeReport:
    """What `kernelize` did.

    Attributes:
        patched: The patched module names (in model order).
        unserved: {name: reason} of the linear mixers left as they were (skip_unserved=True).
        kinds: The kind of each patched module ({name: "gdn" | "kda" | "lightning" | "mamba2" ...}).
        attn_implementation: The attention implementation now set.
        packing_wrapped: The modules given the packing hooks ("" is the model itself; with `compiled_decode`
            its decode hook's forward runs them instead of hooks on it); their forwards are left as they were.
        compiled_decode: Whether the model decodes a cached token through the compiled plan (hf/kernelize_plan.py).
    """
    patched: List[str] = field(default_factory=list)
    unserved: Dict[str, str] = field(default_factory=dict)
    kinds: Dict[str, str] = field(default_factory=dict)
    attn_implementation: Optional[str] = None
    packing_wrapped: List[str] = field(default_factory=list)   # modules whose forward recognises packed batches
    compiled_decode: bool = False

    def __iter__(self):                   # `for name in kernelize(model)` walks the patched names
        return iter(self.patched)

    def __len__(self):
        return len(self.patched)


# ------------------------------------------------------------------------------------------------------------
# Helpers shared by the adapters
# ------------------------------------------------------------------------------------------------------------

def _cu_seqlens(kwargs, T: int, device) -> Optional[torch.Tensor]:
    """transformers' packed-sequence kwargs -> linattn's int64 cu_seqlens (or None)."""
    cu = kwargs.get("cu_seqlens")
    if cu is None:
        cu = kwargs.get("cu_seq_lens_q")
    if cu is None and kwargs.get("seq_idx") is not None:
        seq_idx = kwargs["seq_idx"].reshape(-1)          # mamba_ssm's convention: document index per token
        cu = _cu_of_starts(torch.diff(seq_idx) != 0, seq_idx.numel())
    if cu is None:
        return None
    cu = cu.to(device=device, dtype=torch.int64)
    if int(cu[-1]) != T:
        raise LinattnError(f"cu_seq_lens_q must end at the packed length {T}, got {int(cu[-1])}")
    return cu


# ------------------------------------------------------------------------------------------------------------
# Adapters: each takes exactly the arguments of the transformers function it replaces
# ------------------------------------------------------------------------------------------------------------

class _BorrowedConv:
    """linattn's ShortConv over transformers' conv weights [C, W], without a module of its own: building an
    nn.Module inside a compiled forward is not traceable (torch.compile), and borrowed tensors (not copies,
    not Parameters) let gradients reach transformers' own weights."""
    forward, _taps, _packed = ShortConv.forward, ShortConv._taps, ShortConv._packed

    def __init__(self, weight: torch.Tensor, bias, activation):
        self.dim, self.kernel_size = weight.shape
        self.activation = "silu" if activation in ("silu", "swish") else None
        self.weight = weight.unsqueeze(1)
        self.bias = bias

    __call__ = forward


def _act_rest(y: torch.Tensor, activation) -> torch.Tensor:
    if activation is None or activation in ("silu", "swish"):
        return y
    from transformers.activations import ACT2FN
    return ACT2FN[activation](y)


def conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """causal_conv1d_fn: x [B, C, T] -> [B, C, T], documents kept apart with cu_seq_lens_q."""
    cu = _cu_seqlens(kwargs, hidden_states.shape[-1], hidden_states.device)
    conv = _BorrowedConv(weight, bias, activation)
    x = hidden_states.to(weight.dtype).transpose(1, 2)
    y, _ = conv(x, None, cu)
    return _act_rest(y.transpose(1, 2), activation).to(hidden_states.dtype)


def conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
    """causal_conv1d_update: the decode step; conv_state [B, C, W] is updated in place (transformers' layout)."""
    conv = _BorrowedConv(weight, bias, activation)
    W = weight.shape[-1]
    # linattn's ShortConv continues from the last W - 1 inputs (transformers' conv_state may hold more)
    y, _ = conv(hidden_states.to(weight.dtype).transpose(1, 2), conv_state[..., conv_state.shape[-1] - (W - 1):],
                None)
    full = torch.cat([conv_state.to(hidden_states.dtype), hidden_states], dim=-1)
    conv_state.copy_(full[..., -conv_state.shape[-1]:])
    return _act_rest(y.transpose(1, 2), activation).to(hidden_states.dtype)


# transformers' two signatures of a delta-rule kernel (the chunk one takes a chunk size, which linattn picks itself)
_DELTA_SIGNATURES = {
    "chunk": inspect.signature(lambda query, key, value, g, beta, chunk_size=64, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs: None),
    "recurrent": inspect.signature(lambda query, key, value, g, beta, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, **kwargs: None),
}
_DELTA_USE = {"chunk": "chunk form: training and prefill", "recurrent": "recurrent form: decoding, any T"}
_DELTA_DOC = """transformers' `{replaces}`, served by `delta_rule` ({use}).

    `kernelize` installs it in place of transformers' function; it takes that function's arguments and returns
    what it returns.

    Args:
        query: Queries `[B, T, H, K]`.
        key: Keys `[B, T, H, K]`.
        value: Values `[B, T, HV, V]` (HV a multiple of H: grouped value heads).
        g: {gate}
        beta: Write strengths `[B, T, HV]`.{chunk_arg}
        initial_state: The state `[N, HV, K, V]` to start from, or None.
        output_final_state: Also return the final state.
        use_qk_l2norm_in_kernel: L2-normalise q and k inside the operator (the "rsqrt" form).
        **kwargs: transformers' packed-sequence arguments (`cu_seqlens`, `cu_seq_lens_q`), or none.

    Returns:
        (o `[B, T, HV, V]` in the input dtype, the final state `[N, HV, K, V]` in fp32 (fp64 for fp64 inputs)
        or None).
{example}"""
_GDN_EXAMPLE = """
    Examples:
        >>> import torch
        >>> from linattn.hf.kernelize import gdn_chunk, gdn_recurrent
        >>> q, k = torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8)
        >>> v, g, beta = torch.randn(1, 9, 4, 8), -torch.rand(1, 9, 4), torch.rand(1, 9, 4)
        >>> o, S = gdn_chunk(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        >>> o.shape, S.shape
        (torch.Size([1, 9, 4, 8]), torch.Size([1, 4, 8, 8]))
        >>> o_rec, _ = gdn_recurrent(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        >>> torch.allclose(o, o_rec, atol=1e-5)
        True
"""


def _delta_adapter(name: str, mode: str, replaces: str, gate: str, example: str = "") -> Callable:
    """One delta-rule adapter: transformers' kernel signature of `mode` over `delta_rule` in that form."""
    signature = _DELTA_SIGNATURES[mode]

    def adapter(*args, **kwargs):
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        p = a.arguments
        query, s0 = p["query"], p["initial_state"]
        cu = _cu_seqlens(p["kwargs"], query.shape[1], query.device)
        dt, sdt = query.dtype, compute_dtype(query.dtype)
        return delta_rule(query, p["key"], p["value"].to(dt), p["beta"].to(dt), g=p["g"].to(sdt),
                          qk_l2norm="rsqrt" if p["use_qk_l2norm_in_kernel"] else False, mode=mode,
                          initial_state=None if s0 is None else s0.to(sdt),
                          output_final_state=bool(p["output_final_state"]), cu_seqlens=cu)

    adapter.__name__ = adapter.__qualname__ = name
    adapter.__signature__ = signature
    chunk_arg = ("\n        chunk_size: Accepted for the signature; linattn picks its own chunk." if mode == "chunk"
                 else "")
    adapter.__doc__ = _DELTA_DOC.format(replaces=replaces, use=_DELTA_USE[mode], gate=gate, chunk_arg=chunk_arg,
                                        example=example)
    return adapter


_GDN_GATE = "The log-gate per value head `[B, T, HV]` (<= 0)."
_KDA_GATE = "The per-channel log-gates `[B, T, HV, K]` (<= 0)."
gdn_chunk = _delta_adapter("gdn_chunk", "chunk", "torch_chunk_gated_delta_rule", _GDN_GATE, _GDN_EXAMPLE)
gdn_recurrent = _delta_adapter("gdn_recurrent", "recurrent", "torch_recurrent_gated_delta_rule", _GDN_GATE)
kda_chunk = _delta_adapter("kda_chunk", "chunk", "chunk_kimi_delta_attention", _KDA_GATE)
kda_recurrent = _delta_adapter("kda_recurrent", "recurrent", "recurrent_kimi_delta_attention", _KDA_GATE)


def _kv_state(kv: torch.Tensor) -> LinearAttentionState:
    """linattn's state of an unnormalised linear attention (Mamba2's, lightning attention's) from kv
    [N, H, K, V] (mamba_ssm's state [N, H, P, N_state] is that transposed)."""
    return LinearAttentionState(kv=kv, z=kv.new_zeros(kv.shape[:-1]), log_scale=None,
                                offset=torch.zeros(kv.shape[0], dtype=torch.int64, device=kv.device))


def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                      dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """mamba_chunk_scan_combined: x [B, T, H, P], dt [B, T, H], A [H], B, C [B, T, G, N] -> y [B, T, H, P].
    Mamba2 is linear attention with q = C, k = B, v = dt x, the log-gate dt A per head, plus D x."""
    if kwargs.get("z") is not None:
        raise LinattnError("mamba2_chunk_scan: z (the fused output gate) is not served; the mixers apply it in "
                           "their norm")
    cd = compute_dtype(hidden_states.dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).to(cd)
    x = hidden_states.to(cd)
    cu = _cu_seqlens(kwargs, x.shape[1], x.device)
    s0 = None if initial_states is None else _kv_state(initial_states.to(cd).transpose(-1, -2))
    y, state = linear_attention(C.to(cd), B.to(cd), x * dt[..., None], feature_map=None, normalize=False,
                                g=A.to(cd) * dt, scale=1.0, mode="chunk", chunk_size=64, initial_state=s0,
                                output_final_state=bool(return_final_states), cu_seqlens=cu)
    if D is not None:
        y = y + D.to(cd)[:, None] * x
    if return_final_states:
        return y, state.kv.transpose(-1, -2)
    return y


def _per_head(t: torch.Tensor, keep: int, name: str) -> torch.Tensor:
    """transformers expands dt / A / D / dt_bias over the head dim (A also over the state) for mamba_ssm's
    kernel: take one value per head, after checking that it really is one (per-channel values: not Mamba2).
    An `expand`ed tensor (stride 0 there) is one by construction: no look at the values, so a compiled decode
    step has no data-dependent branch."""
    if all(t.stride(d) == 0 or t.shape[d] == 1 for d in range(keep, t.dim())):
        return t.reshape(*t.shape[:keep], -1)[..., 0]
    flat = t.reshape(*t.shape[:keep], -1)
    col = flat[..., :1]
    if not torch.equal(flat, col.expand_as(flat)):
        raise LinattnError(f"mamba2_selective_state_update: {name} varies inside a head; linattn serves one "
                           f"value per head (Mamba2), got shape {tuple(t.shape)}")
    return col[..., 0]


def mamba2_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None,
                        **kwargs):
    """selective_state_update: one decoded token; state [B, H, P, N] is updated in place."""
    cd = compute_dtype(hidden_states.dtype)
    dt = _per_head(dt, 2, "dt").to(cd)                                       # [B, H]
    if dt_bias is not None:
        dt = dt + _per_head(dt_bias, 1, "dt_bias").to(cd)
    if dt_softplus:
        dt = F.softplus(dt)
    a = _per_head(A, 1, "A").to(cd)                                          # [H]
    x = hidden_states.to(cd)
    s0 = _kv_state(state.to(cd).transpose(-1, -2))
    y, new = linear_attention(C.to(cd)[:, None], B.to(cd)[:, None], (x * dt[..., None])[:, None],
                              feature_map=None, normalize=False, g=(a * dt)[:, None], scale=1.0,
                              mode="recurrent", initial_state=s0, output_final_state=True)
    state.copy_(new.kv.transpose(-1, -2).to(state.dtype))
    y = y[:, 0]
    if D is not None:
        y = y + _per_head(D, 1, "D").to(cd)[:, None] * x
    if z is not None:
        y = y * F.silu(z.to(cd))
    return y.to(hidden_states.dtype)


def mamba2_split_conv1d_scan_combined(*args, **kwargs):
    """The fused training path of mamba_ssm: None makes the mixers take their unfused path (served above)."""
    return None


# kernel function name in the modeling modules -> linattn adapter
_ADAPTERS: Dict[str, Callable] = {
    "causal_conv1d_fn": conv1d_fn,
    "causal_conv1d_update": conv1d_update,
    "torch_chunk_gated_delta_rule": gdn_chunk,
    "torch_recurrent_gated_delta_rule": gdn_recurrent,
    "chunk_kimi_delta_attention": kda_chunk,
    "recurrent_kimi_delta_attention": kda_recurrent,
    "mamba2_chunk_scan": mamba2_chunk_scan,
    "mamba2_selective_state_update": mamba2_state_update,
    "mamba2_split_conv1d_scan_combined": mamba2_split_conv1d_scan_combined,
}

_KIND_NEEDS = {
    "gdn": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
            "causal_conv1d_update"),
    "kda": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
            "causal_conv1d_update"),
    "mamba2": ("mamba2_chunk_scan", "mamba2_selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"),
    "lightning": (),
}


def _fallback_of(orig: Callable) -> Callable:
    """transformers' PyTorch function behind its hub wrapper (kept as `__wrapped__`), called as the wrapper calls it
    where the kernel package is absent: packed sequences refused, only the keywords the function takes."""
    fn = inspect.unwrap(orig)
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(orig)
    def fallback(*args, **kwargs):
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"{orig.__name__}: transformers' PyTorch fallback cannot keep packed sequences apart "
                             f"(kernelize the model to run packed documents on linattn)")
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return fn(*args, **kwargs)
    return fallback


def torch_fallback_function(name: str = "torch_chunk_gated_delta_rule",
                            module_name: str = "transformers.models.qwen3_next.modeling_qwen3_next") -> Callable:
    """transformers' own PyTorch function `name` of a modeling module, whatever it is bound to now.

    transformers wraps such functions in a hub-kernel dispatcher that, with flash-linear-attention installed,
    calls fla's Triton kernel (which cannot take CPU tensors); `torch_fallbacks` may put its own wrapper on top.
    Each wrapper keeps what it wraps as `__wrapped__` (functools.wraps), so the function itself is at the end of
    that chain. `linattn bench ops` times it as a peer row.

    Args:
        name: The function's name in the module.
        module_name: The modeling module (imported if it is not yet).

    Returns:
        The unwrapped PyTorch function.

    Raises:
        ImportError: transformers (or that model) is not installed.
        AttributeError: the module has no such function.
    """
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    return inspect.unwrap(getattr(module, name))


# (modeling module, kernel name) -> the function transformers bound there, while `torch_fallbacks` runs
_SWAPPED: Dict[tuple, Callable] = {}
_SWAP_DEPTH = [0]
_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def torch_fallbacks():
    """Run transformers' own PyTorch kernels in the linear mixers that are not kernelized, while the context lasts.

    transformers binds a mixer's kernel functions once, when its modeling file is imported: to
    flash-linear-attention's (or mamba_ssm's) kernels whenever that package is installed, else to its PyTorch
    fallback (`torch_chunk_gated_delta_rule`, ...). fla's kernels are Triton-only, so with fla installed a CPU model
    of Qwen3-Next, Kimi Linear, ... fails with "0 active drivers". Inside this context the modeling modules of
    `SERVED_CLASSES` have those names bound to the PyTorch fallback, which is what transformers runs where fla is
    absent; on exit the original bindings come back. The binding is per module, not per thread: it is a tool for
    tests and benchmarks (nested uses are counted). The modeling files are imported on entry, so a model built
    inside the context is covered too. Kernelized modules are unaffected (their forwards read linattn's
    functions from their own globals). `linattn bench hf` measures its unpatched baseline this way.

    Example:
        >>> from linattn.hf.kernelize import torch_fallbacks
        >>> with torch_fallbacks():
        ...     pass  # model(ids) of an unpatched transformers model runs the PyTorch fallback here
    """
    with _SWAP_LOCK:
        if _SWAP_DEPTH[0] == 0:
            for module_name in sorted({m for m, _kind in SERVED_CLASSES.values()}):
                try:
                    module = sys.modules.get(module_name) or importlib.import_module(module_name)
                except ImportError:  # a transformers version without that model
                    continue
                for name in _ADAPTERS:
                    orig = getattr(module, name, None)
                    if callable(orig) and hasattr(orig, "__wrapped__"):
                        _SWAPPED[(module, name)] = orig
                        setattr(module, name, _fallback_of(orig))
        _SWAP_DEPTH[0] += 1
    try:
        yield
    finally:
        with _SWAP_LOCK:
            _SWAP_DEPTH[0] -= 1
            if _SWAP_DEPTH[0] == 0:
                for (module, name), orig in _SWAPPED.items():
                    setattr(module, name, orig)
                _SWAPPED.clear()


# ------------------------------------------------------------------------------------------------------------
# Serving a mixer: its class's own forward, rebuilt over globals in which the kernel names are linattn's
# ------------------------------------------------------------------------------------------------------------

_SERVED_GLOBALS: Dict[str, dict] = {}        # modeling module name -> its globals, kernel names on linattn
_SERVED_FORWARDS: Dict[type, Callable] = {}  # mixer class -> its forward rebuilt over those globals


def _served_globals(module_globals: dict) -> dict:
    """A copy of a modeling module's globals with the kernel names on linattn's adapters: the namespace of a
    module of its own, registered in sys.modules, because torch.compile guards on a function's globals through
    the module named by their `__name__` (under the modeling module's name it would guard on transformers'
    functions instead of these)."""
    name = module_globals["__name__"]
    served = _SERVED_GLOBALS.get(name)
    if served is None:
        twin = types.ModuleType("_linattn_served_" + name.replace(".", "_"))
        served = twin.__dict__
        served.update({k: v for k, v in module_globals.items() if k not in ("__name__", "__spec__", "__loader__")})
        served.update({k: fn for k, fn in _ADAPTERS.items() if k in served})
        sys.modules[twin.__name__] = twin
        _SERVED_GLOBALS[name] = served
    return served


def _rebind(fn: types.FunctionType) -> types.FunctionType:
    """A copy of `fn` whose code looks the kernel names up in linattn's globals. Decorators made with
    functools.wraps are kept: each one's closure cell that holds the function it wraps gets the rebuilt one."""
    inner = getattr(fn, "__wrapped__", None)
    new_inner = _rebind(inner) if isinstance(inner, types.FunctionType) else inner
    cells, found = [], inner is None
    for cell in fn.__closure__ or ():
        try:
            hit = inner is not None and cell.cell_contents is inner
        except ValueError:  # an empty cell
            hit = False
        found = found or hit
        cells.append(types.CellType(new_inner) if hit else cell)
    if not found:
        raise LinattnError(f"kernelize: the decorator {fn.__qualname__} ({fn.__globals__.get('__name__')}) does "
                           f"not hold the function it wraps in its closure; kernelize cannot serve through it")
    own = set(fn.__code__.co_names) & _ADAPTERS.keys()
    glob = _served_globals(fn.__globals__) if own else fn.__globals__
    new = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__,
                             tuple(cells) if fn.__closure__ is not None else None)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    if inner is not None:
        new.__wrapped__ = new_inner
    return new


def _served_forward(cls: type) -> Callable:
    """`cls.forward` (transformers' code, decorators included) with its kernel calls on linattn (cached per class)."""
    fn = _SERVED_FORWARDS.get(cls)
    if fn is None:
        fn = _rebind(cls.forward)
        served = {id(g) for g in _SERVED_GLOBALS.values()}
        f, reached = fn, False
        while isinstance(f, types.FunctionType):
            reached = reached or id(f.__globals__) in served
            f = getattr(f, "__wrapped__", None)
        if not reached:
            raise LinattnError(f"kernelize: {cls.__name__}.forward calls none of the kernel functions by name")
        _SERVED_FORWARDS[cls] = fn
    return fn


def _instance_forward_problem(mod: nn.Module) -> Optional[str]:
    """Why an instance-level forward already on `mod` cannot be served (None: none there, or accelerate's hook,
    whose `_old_forward` is replaced instead)."""
    if "forward" not in mod.__dict__ or "_old_forward" in mod.__dict__:
        return None
    return f"{type(mod).__name__}: an instance-level forward ({mod.__dict__['forward']!r}) replaces the class's"


def _serve(mod: nn.Module, kind: str) -> None:
    fn = _lightning_forward if kind == "lightning" else _served_forward(type(mod))
    bound = types.MethodType(fn, mod)            # bound methods deep-copy onto the copy
    if "_old_forward" in mod.__dict__:           # accelerate's hook calls module._old_forward
        mod._old_forward = bound
    else:
        mod.forward = bound
    mod._linattn_kind = kind
    mod._linattn_kernelized = True


# ------------------------------------------------------------------------------------------------------------
# MiniMax's lightning attention: inline PyTorch, so its forward is replaced
# ------------------------------------------------------------------------------------------------------------

def lightning_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, kv: torch.Tensor):
    """One decoded token of lightning attention, (kv', o): kv' = gamma kv + k^T v per head, o = q kv' (q, k, v
    `[B, 1, H, D]`, gamma `[H]`, kv `[B, H, D, D]` in the compute dtype). The same arithmetic as `linear_attention`'s
    recurrent form with these options (tests/hf/test_kernelize.py compares the bits), without its per-call
    checks, which cost more than this step itself (~0.5 ms against ~0.4 ms at 16 heads of 128)."""
    cd = kv.dtype
    q1, k1, v1 = (t[:, 0].to(cd) for t in (q, k, v))
    kv = gamma.view(1, -1, 1, 1) * kv + k1.unsqueeze(-1) * v1.unsqueeze(-2)
    o = torch.einsum("bhd,bhde->bhe", q1, kv)
    return kv, o.unsqueeze(1).to(q.dtype)


def _lightning_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """MiniMaxLightningAttention.forward on linattn: o_i = sum_{j<=i} exp(-slope (i - j)) (q_i . k_j) v_j, the
    RetNet form of `linear_attention` (gamma = exp(-slope) per head, identity features, no normaliser)."""
    from transformers.models.minimax.modeling_minimax import apply_mask_to_padding_states
    if cache is None and "past_key_values" in kwargs:
        cache = kwargs.pop("past_key_values")
    Bn, T, _ = hidden_states.shape
    H, Dh = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    qkv = apply_mask_to_padding_states(qkv, attention_mask)
    q, k, v = torch.split(qkv.reshape(Bn, T, H, 3 * Dh), Dh, dim=3)
    cd = compute_dtype(q.dtype)
    gamma = torch.exp(-self.slope_rate.reshape(H).to(cd))
    kv0 = cache.get_linear_cache(self.layer_idx) if cache is not None else None
    cu = _cu_seqlens(kwargs, T, q.device)
    if T == 1 and kv0 is not None and cu is None:
        kv, o = lightning_step(q, k, v, gamma, kv0.to(cd))
    else:
        o, state = linear_attention(q, k, v, feature_map=None, normalize=False, gamma=gamma, scale=1.0,
                                    mode="recurrent" if T == 1 and kv0 is not None else "chunk",
                                    initial_state=None if kv0 is None else _kv_state(kv0.to(cd)),
                                    output_final_state=cu is None, cu_seqlens=cu)
        kv = None if state is None else state.kv
    o = o.reshape(Bn, T, H * Dh)
    o = self.norm(o)
    o = F.sigmoid(self.output_gate(hidden_states)) * o
    o = self.out_proj(o)
    kv = None if kv is None else kv.to(v.dtype)
    if cache is not None and kv is not None:
        cache.set_linear_cache(self.layer_idx, kv)
    return o, kv


# ------------------------------------------------------------------------------------------------------------
# Packing: restarting position_ids -> cu_seq_lens_*, and a varlen-aware sdpa for the softmax layers
# ------------------------------------------------------------------------------------------------------------

def _varlen_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa, except that with cu_seq_lens_q (batch 1, no cache) each document attends only to
    itself (a block-diagonal mask, causal for causal layers; with the layer's sliding window if it has one)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    causal = bool(getattr(module, "is_causal", True))     # a VLM's vision tower passes its own, non-causal cu
    cu = kwargs.get("cu_seq_lens_q")
    T = query.shape[2]
    if cu is not None and query.shape[0] == 1 and key.shape[2] == T:
        cu = cu.to(device=query.device, dtype=torch.int64)
        doc = torch.zeros(T, dtype=torch.int64, device=query.device)
        doc[cu[1:-1]] = 1
        doc = doc.cumsum(0)
        i = torch.arange(T, device=query.device)
        mask = doc[:, None] == doc[None, :]
        if causal:
            mask = mask & (i[None, :] <= i[:, None])
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        if window:
            mask = mask & (i[:, None] - i[None, :] < int(window))
        attention_mask = mask[None, None]
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(ATTN_IMPLEMENTATION, _varlen_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _packed_cu(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Document starts where position_ids do not continue by one (DataCollatorWithFlattening: they restart)."""
    pos = position_ids.reshape(position_ids.shape[0], -1)
    if pos.shape[0] != 1:
        if (torch.diff(pos, dim=-1) != 1).any():
            raise LinattnError(f"packed sequences (restarting position_ids) need batch size 1, as transformers' "
                               f"DataCollatorWithFlattening makes them; got position_ids of shape "
                               f"{tuple(position_ids.shape)}")
        return None
    restart = torch.diff(pos[0]) != 1
    return _cu_of_starts(restart, pos.shape[1]).to(torch.int32) if bool(restart.any()) else None


def _cu_of_starts(new_doc: torch.Tensor, T: int) -> torch.Tensor:
    """cu_seqlens of T tokens from `new_doc` [T - 1] (whether token t + 1 starts a document)."""
    starts = torch.nonzero(new_doc).reshape(-1) + 1
    return torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), T)])


def _arg(module: nn.Module, args: tuple, kwargs: dict, name: str):
    """The argument `name` of a call to module.forward, by keyword or by position (None if not given)."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    params = module._linattn_params
    i = params.index(name) if name in params else len(args)
    return args[i] if i < len(args) else None


def _restart_cu(module: nn.Module, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """cu_seqlens from restarting position_ids: only without an attention mask and without a cache, transformers'
    own rule in masking_utils, so generation's padded position_ids are never taken for documents."""
    pos = _arg(module, args, kwargs, "position_ids")
    if pos is None or _arg(module, args, kwargs, "attention_mask") is not None:
        return None
    if _arg(module, args, kwargs, "cache") is not None or _arg(module, args, kwargs, "past_key_values") is not None:
        return None
    if torch.compiler.is_compiling():
        # documents would need data-dependent shapes: in a compiled graph restarting positions fail loudly
        torch._assert_async((torch.diff(pos, dim=-1) == 1).all(),
                            "linattn kernelize: packed sequences (restarting position_ids) are not served inside "
                            "torch.compile; run the packed batch eagerly")
        return None
    return _packed_cu(pos)


def _packing_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    """A forward pre-hook of the model (and its base model): a packed batch (transformers' cu_seq_lens_q, or
    restarting position_ids) becomes transformers' flash-attention kwargs, which the layers pass down to every
    mixer (and which gradient checkpointing keeps for the recomputation). A model that does not pass its kwargs to
    its base model (Mamba2ForCausalLM) hands them over through the base model's per-thread stash."""
    cu = kwargs.get("cu_seq_lens_q")
    stash = module.__dict__.get("_linattn_stash")
    if cu is None and stash:
        cu = stash.get(threading.get_ident())
    if cu is None:
        cu = _restart_cu(module, args, kwargs)
    if cu is None:
        return None
    if _arg(module, args, kwargs, "use_cache"):
        raise LinattnError("packed sequences (restarting position_ids or cu_seq_lens_q) cannot fill a cache: "
                           "pass use_cache=False (one state per document would not fit the cache's batch)")
    cu = torch.as_tensor(cu)
    if module._linattn_takes_kwargs and kwargs.get("cu_seq_lens_q") is None:
        longest = int(torch.diff(cu).max())
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    if "use_cache" in module._linattn_params or module._linattn_takes_kwargs:
        kwargs["use_cache"] = False
    base = getattr(module, "base_model", module)
    if base is not module and "_linattn_stash" in base.__dict__:
        base._linattn_stash[threading.get_ident()] = cu
    return args, kwargs


def _packing_post_hook(module: nn.Module, args: tuple, kwargs: dict, output):
    """Empties the base model's stash for this thread (also when the forward raised)."""
    base = getattr(module, "base_model", module)
    stash = base.__dict__.get("_linattn_stash")
    if stash:
        stash.pop(threading.get_ident(), None)


def _hook_packing(top: nn.Module, inline: bool = False) -> None:
    """The packing hooks on `top`; `inline`: handed to the model's decode hook instead (`_linattn_packing_calls`,
    which its forward calls around itself as the hooks would run around it), which `kernelize_plan.hook_model` gave
    this model: without a hook of its own the model's `__call__` takes torch's fast path (its hooked path costs ~0.07
    ms a decoded token on caches the weights' stream has emptied)."""
    params = inspect.signature(top.forward).parameters
    top._linattn_params = [n for n, p in params.items()
                           if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)]
    top._linattn_takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    top._linattn_stash = {}
    if inline:
        top._linattn_packing_calls = (_packing_pre_hook, _packing_post_hook)
    else:
        top.register_forward_pre_hook(_packing_pre_hook, with_kwargs=True)
        top.register_forward_hook(_packing_post_hook, with_kwargs=True, always_call=True)
    top._linattn_packing = True


# ------------------------------------------------------------------------------------------------------------
# kernelize
# ------------------------------------------------------------------------------------------------------------

def kernelize(model: nn.Module, *, packing: bool = True, skip_unserved: bool = False) -> KernelizeReport:
    """Serve every linear mixer of a transformers `model` with linattn's operators, in place.

    Chunk forms for prefill and training, the recurrent form for one-token decode (with the cache transformers
    passes), linattn's ShortConv for the short convolutions. Calling it twice is harmless (already served
    modules are skipped). See docs/kernelize.md.

    Args:
        model: A transformers model (Qwen3-Next / Qwen3.5 / OLMo-hybrid Gated DeltaNet, Kimi Linear's KDA,
            Mamba2, MiniMax's lightning attention, ...; docs/kernelize.md lists them).
        packing: True: restarting `position_ids` (batch 1, no attention mask, no cache) or transformers'
            `cu_seq_lens_q` keep documents apart in every layer, also under gradient checkpointing (forward
            pre-hooks pass them down as transformers' `cu_seq_lens_*` kwargs); the softmax layers switch to
            "linattn_sdpa" (transformers' sdpa plus a block-diagonal causal mask for packed batches).
        skip_unserved: A module whose class is a known linear mixer that linattn cannot serve (Mamba1, mLSTM,
            ...) raises `LinattnError` naming it and the reason, before anything is changed; with
            `skip_unserved=True` it is left as it is and listed in `unserved` instead.

    Returns:
        A `KernelizeReport`: `patched` (the module names changed), `unserved` ({name: reason}).

    Raises:
        LinattnError: A known linear mixer linattn cannot serve (without skip_unserved).

    Examples:
        >>> import torch
        >>> import transformers
        >>> from linattn.hf import kernelize
        >>> cfg = transformers.Qwen3_5TextConfig(
        ...     vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        ...     head_dim=8, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        ...     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
        >>> model = transformers.Qwen3_5ForCausalLM(cfg)
        >>> report = kernelize(model)
        >>> report.kinds, report.attn_implementation
        ({'model.layers.0.linear_attn': 'gdn'}, 'linattn_sdpa')
        >>> model(torch.randint(0, 97, (1, 21))).logits.shape
        torch.Size([1, 21, 97])
    """
    if not isinstance(model, nn.Module):
        raise LinattnError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    report = KernelizeReport()
    plan = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls in UNSERVED_CLASSES:
            report.unserved[name] = f"{cls}: {UNSERVED_CLASSES[cls]}"
            continue
        if cls not in SERVED_CLASSES:
            continue
        kind = SERVED_CLASSES[cls][1]
        # the module the class was defined in is where its forward looks its kernel functions up
        modeling = importlib.import_module(type(mod).__module__)
        absent = [n for n in _KIND_NEEDS[kind] if not callable(getattr(modeling, n, None))]
        if absent:
            report.unserved[name] = f"{cls}: its modeling module lacks {absent} (a transformers version kernelize " \
                                    f"does not know)"
            continue
        problem = None if getattr(mod, "_linattn_kernelized", False) else _instance_forward_problem(mod)
        if problem:
            report.unserved[name] = problem
            continue
        act = getattr(mod, "activation", None)
        if kind != "lightning" and act not in (None, "silu", "swish") and not isinstance(act, str):
            report.unserved[name] = f"{cls}: conv activation {act!r}"
            continue
        plan.append((name, mod, modeling, kind))
    if report.unserved and not skip_unserved:
        lines = "; ".join(f"{n}: {r}" for n, r in report.unserved.items())
        raise LinattnError(f"kernelize: {len(report.unserved)} module(s) cannot be served by linattn ({lines}); "
                           f"pass skip_unserved=True to serve the rest and leave these on transformers' code")
    for name, mod, _modeling, kind in plan:
        if not getattr(mod, "_linattn_kernelized", False):
            _serve(mod, kind)
        report.patched.append(name)
        report.kinds[name] = kind
    if plan:
        from .kernelize_plan import hook_model  # (imports models/: not at hf's import)
        report.compiled_decode = hook_model(model)
    if packing and plan:
        names = {id(m): n for n, m in model.named_modules()}
        base = getattr(model, "base_model", model)
        for top in {id(model): model, id(base): base}.values():
            if not getattr(top, "_linattn_packing", False):
                _hook_packing(top, inline=top is model and report.compiled_decode)
            report.packing_wrapped.append(names.get(id(top), ""))
        _register_attention()
        cfg = getattr(model, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) in (None, "sdpa", "eager"):
            _set_attn(model)
            report.attn_implementation = ATTN_IMPLEMENTATION
        elif cfg is not None:
            report.attn_implementation = cfg._attn_implementation
    return report


def _set_attn(model: nn.Module) -> None:
    """Point every (sub)config at linattn_sdpa; transformers reads config._attn_implementation at call time."""
    seen = set()
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
            continue
        seen.add(id(cfg))
        try:
            cfg._attn_implementation = ATTN_IMPLEMENTATION
        except Exception:  # pragma: no cover - a config that refuses the attribute keeps its own attention
            pass
        text = getattr(cfg, "text_config", None)
        if text is not None and hasattr(text, "_attn_implementation"):
            text._attn_implementation = ATTN_IMPLEMENTATION
