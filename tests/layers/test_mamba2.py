"""Mamba2's own block (`mixer="mamba2"`, layers/mamba2.py) against transformers' Mamba2Mixer, and the old name.

transformers' PyTorch fallbacks compute the SSD scan, the decode step and both RMSNorms in fp32 whatever the
model's dtype (`.float()` / `.to(torch.float32)`), the mixer passes them A = -exp(A_log.float()) (fp32), and the
block adds the residual in fp32. For the fp64 comparisons those four functions are replaced, in transformers'
modeling module, by fp64 versions written here from Mamba2's equations (h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,
y_t = h_t C_t + D x_t; RMSNorm(y * silu(z)) per group) that take A from the mixer's A_log in fp64, and
residual_in_fp32 is off; everything else (projections, conv, splits, gating, model) is transformers' own code.
transformers' unpatched code is compared in fp32."""
import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.errors import ConfigError, LinattnError
from linattn.layers import LayerCache, LinearAttention
from linattn.layers.mamba2 import HF_NAMES, Mamba2Block, mamba2_block_kwargs_from_hf, mamba2_state_dict_from_hf
from linattn.models import LanguageModel, LMConfig
from linattn.models.registry import build_mixer

transformers = pytest.importorskip("transformers")
mm = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")

V = 64
HF = dict(vocab_size=V, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, expand=2,
          conv_kernel=4, num_hidden_layers=2, chunk_size=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
          residual_in_fp32=False)


# ------------------------------------------------------------------ fp64 versions of transformers' fp32 fallbacks

#: the transformers mixers of the models built here: the fp64 references find the A_log behind an fp32 A
_MIXERS = []


def _fp64_A(A: torch.Tensor) -> torch.Tensor:
    """-exp(A_log) in fp64 for the mixer whose fp32 A = -exp(A_log.float()) is `A` ([H] or expanded [H, P, N])."""
    a = A.reshape(A.shape[0], -1)[:, 0]
    for m in _MIXERS:
        if m.A_log.shape == a.shape and torch.equal(-torch.exp(m.A_log.float()), a.float()):
            full = -torch.exp(m.A_log)
            return full.view(-1, *([1] * (A.dim() - 1))).expand(A.shape)
    raise AssertionError("no mixer of this test has this A")


def _scan_ref(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
              dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """mamba_chunk_scan_combined's meaning, one token at a time: x [b, T, H, P], dt [b, T, H], B, C [b, T, G, N]."""
    b, T, H, P = hidden_states.shape
    A = _fp64_A(A)
    rep = H // B.shape[2]
    B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    h = hidden_states.new_zeros(b, H, P, B.shape[-1]) if initial_states is None else initial_states
    ys = []
    for t in range(T):
        h = h * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * hidden_states[:, t])[..., None] \
            * B[:, t, :, None, :]
        ys.append((h * C[:, t, :, None, :]).sum(-1) + (0 if D is None else D[:, None] * hidden_states[:, t]))
    y = torch.stack(ys, 1)
    return (y, h) if return_final_states else y


def _step_ref(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
    """selective_state_update's meaning (per-channel expanded dt, A, D as transformers passes them)."""
    rep = hidden_states.shape[1] // B.shape[1]
    A = _fp64_A(A)
    B, C = B.repeat_interleave(rep, dim=1), C.repeat_interleave(rep, dim=1)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    new = state * torch.exp(dt[..., None] * A) + (dt * hidden_states)[..., None] * B[:, :, None, :]
    state.copy_(new)
    y = (new * C[:, :, None, :]).sum(-1)
    return y if D is None else y + D * hidden_states


def _gated_norm_ref(self, hidden_states, gate=None):
    x = hidden_states if gate is None else hidden_states * F.silu(gate)
    xg = x.unflatten(-1, (-1, self.group_size))
    return self.weight * (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).flatten(-2)


def _norm_ref(self, x):
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.fixture
def hf_fp64(monkeypatch):
    monkeypatch.setattr(mm, "mamba2_chunk_scan", _scan_ref)
    monkeypatch.setattr(mm, "mamba2_selective_state_update", _step_ref)
    monkeypatch.setattr(mm.MambaRMSNormGated, "forward", _gated_norm_ref)
    monkeypatch.setattr(mm.Mamba2RMSNorm, "forward", _norm_ref)
    _MIXERS.clear()


def _hf_model(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**{**HF, **kw})).to(dtype).eval()
    with torch.no_grad():   # transformers' init: dt_bias, A = 1..H and D = 1 would hide mistakes in them
        for layer in model.backbone.layers:
            m = layer.mixer
            m.dt_bias.normal_(0, 0.5)
            m.A_log.uniform_(-1, 1.5)
            m.D.normal_(1, 0.5)
            m.norm.weight.normal_(1, 0.2)
            m.conv1d.bias.normal_(0, 0.2)
            _MIXERS.append(m)
    return model


def _block_from(mixer, cfg) -> Mamba2Block:
    blk = Mamba2Block(cfg.hidden_size, cfg.num_heads, **mamba2_block_kwargs_from_hf(cfg)).to(mixer.A_log.dtype)
    blk.load_state_dict(mamba2_state_dict_from_hf(mixer.state_dict()), strict=True)
    return blk


def _lm_from(hf) -> LanguageModel:
    """A linattn LanguageModel holding a transformers Mamba2ForCausalLM's weights (renaming only)."""
    c = hf.config
    kw = {k: v for k, v in mamba2_block_kwargs_from_hf(c).items() if k not in ("head_dim", "chunk_size")}
    lm = LanguageModel(LMConfig(vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
                                n_heads=c.num_heads, head_dim=c.head_dim, chunk_size=c.chunk_size, mixer="mamba2",
                                mixer_kwargs={"mamba2": kw}, ffn="none", norm_eps=c.layer_norm_epsilon,
                                tie_embeddings=c.tie_word_embeddings))
    sd = hf.state_dict()
    new = {"embed.weight": sd["backbone.embeddings.weight"], "norm.weight": sd["backbone.norm_f.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        new[f"blocks.{i}.norm1.weight"] = sd[f"backbone.layers.{i}.norm.weight"]
        for k, v in mamba2_state_dict_from_hf(sd, f"backbone.layers.{i}.mixer.").items():
            new[f"blocks.{i}.mixer.{k}"] = v
    lm = lm.to(next(hf.parameters()).dtype)
    lm.load_state_dict(new, strict=True)
    return lm.eval()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


# ------------------------------------------------------------------ the block against transformers' Mamba2Mixer

@pytest.mark.parametrize("T", [1, 13, 16])
def test_block_matches_mamba2_mixer_fp64_outputs_and_gradients(hf_fp64, T):
    hf = _hf_model()
    mixer = hf.backbone.layers[0].mixer
    blk = _block_from(mixer, hf.config)
    x = torch.randn(2, T, 32, dtype=torch.float64, requires_grad=True)
    xb = x.detach().clone().requires_grad_(True)
    ref, out = mixer(x), blk(xb)
    assert (out - ref).abs().max().item() <= 1e-10
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    (out * w).sum().backward()
    assert (xb.grad - x.grad).abs().max().item() <= 1e-10
    blk_params = dict(blk.named_parameters())
    for hname, p in mixer.named_parameters():
        q = blk_params[HF_NAMES[hname]]
        assert (q.grad - p.grad).abs().max().item() <= 1e-10 * max(1.0, p.grad.abs().max().item()), hname


def test_block_matches_transformers_own_fp32_code():
    # no patch: transformers' real chunked scan and norms (fp32) against the block in fp32
    hf = _hf_model(dtype=torch.float32)
    mixer = hf.backbone.layers[1].mixer
    blk = _block_from(mixer, hf.config)
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        assert rel(blk(x), mixer(x)) <= 1e-5


def test_language_model_logits_and_greedy_generation_match_transformers(hf_fp64):
    hf = _hf_model(seed=1)
    lm = _lm_from(hf)
    ids = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # Mamba2ForCausalLM returns logits .float(): the fp64 logits are its head on its backbone's output
        ref, out = hf.lm_head(hf.backbone(ids).last_hidden_state), lm(ids).logits
    assert (out - ref).abs().max().item() <= 1e-10
    prompt = ids[:1]
    want = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    got = lm.generate(prompt, max_new_tokens=12, temperature=0)
    assert torch.equal(got.view(1, -1), want)


def test_cached_decode_equals_forward_and_transformers_cache(hf_fp64):
    hf = _hf_model(seed=2)
    mixer = hf.backbone.layers[0].mixer
    blk = _block_from(mixer, hf.config)
    x = torch.randn(2, 15, 32, dtype=torch.float64)
    with torch.no_grad():
        full = blk(x)
        cache = LayerCache()
        steps = torch.cat([blk(x[:, :9], cache)] + [blk(x[:, t:t + 1], cache) for t in range(9, 15)], 1)
        assert (steps - full).abs().max().item() <= 1e-12
        assert cache.offset == 15
        # the state is transformers' ssm state [B, H, P, N] transposed: compare with the reference scan's final state
        _, h = mixer_ssm_final_state(mixer, x)
        assert (cache["state"].kv.transpose(-1, -2) - h).abs().max().item() <= 1e-12
        # transformers' own cached decoding (the step function) gives the same tokens' outputs
        ids = torch.randint(3, V, (1, 10), generator=torch.Generator().manual_seed(5))
        lm = _lm_from(hf)
        out = hf.backbone(ids[:, :6], use_cache=True)
        hf_steps, past = [out.last_hidden_state], out.cache
        for t in range(6, 10):
            hf_steps.append(hf.backbone(ids[:, t:t + 1], cache=past, use_cache=True).last_hidden_state)
        lc = lm.new_cache(1)
        lm_steps = [lm(ids[:, :6], cache=lc).logits] + [lm(ids[:, t:t + 1], cache=lc).logits for t in range(6, 10)]
        assert (torch.cat(lm_steps, 1) - hf.lm_head(torch.cat(hf_steps, 1))).abs().max().item() <= 1e-10


def mixer_ssm_final_state(mixer, x):
    """The reference scan's output and final state for the mixer's own projections and conv of x."""
    H, P, G, N = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    _, xbc, dt = mixer.in_proj(x).split([mixer.intermediate_size, mixer.conv_dim, H], dim=-1)
    xbc = F.silu(mixer.conv1d(xbc.transpose(1, 2))[..., :x.shape[1]]).transpose(1, 2)
    xs, b, c = xbc.split([H * P, G * N, G * N], dim=-1)
    return _scan_ref(xs.unflatten(-1, (H, P)), dt, -torch.exp(mixer.A_log.float()), b.unflatten(-1, (G, N)),
                     c.unflatten(-1, (G, N)), 8, D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True,
                     return_final_states=True)


def test_block_keeps_packed_documents_apart():
    torch.manual_seed(0)
    blk = build_mixer("mamba2", 32, 4, state_size=8, n_groups=2, chunk_size=4)
    x = torch.randn(1, 11, 32)
    cu = torch.tensor([0, 4, 11])
    with torch.no_grad():
        packed = blk(x, cu_seqlens=cu)
        alone = torch.cat([blk(x[:, :4]), blk(x[:, 4:])], 1)
    assert (packed - alone).abs().max().item() <= 1e-5


def test_block_bad_arguments_name_them():
    with pytest.raises(LinattnError, match="n_groups"):
        Mamba2Block(32, 4, n_groups=3)
    with pytest.raises(LinattnError, match="state_size"):
        Mamba2Block(32, 4, state_size=7, rope=True)
    with pytest.raises(LinattnError, match=r"\[B, T, 32\]"):
        Mamba2Block(32, 4)(torch.randn(2, 5, 16))
    with pytest.raises(LinattnError, match="conv1d.weightx"):
        mamba2_state_dict_from_hf({"m.conv1d.weightx": torch.zeros(1)}, "m.")
    with pytest.raises(LinattnError, match="prefix"):
        mamba2_state_dict_from_hf({"a.D": torch.zeros(1)}, "b.")


# ------------------------------------------------------------------ the old name: `mamba2` in mixer names version 1

def _old_dict(**kw):
    """A config dict as the code before this change wrote it: every field up to l2norm_convention, no mixer_names."""
    d = LMConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, **kw).to_dict()
    del d["mixer_names"]
    return d


def test_new_name_is_the_block_and_old_block_is_mamba2_gla():
    assert isinstance(build_mixer("mamba2", 32, 2), Mamba2Block)
    gla = build_mixer("mamba2-gla", 32, 2)
    assert isinstance(gla, LinearAttention) and gla.gate == "scalar"
    assert {"mamba2", "mamba2-gla"} <= set(linattn.mixers())
    assert LMConfig(vocab_size=V, mixer="mamba2").to_dict()["mixer_names"] == 2


def test_saved_config_naming_mamba2_loads_with_the_old_meaning():
    d = _old_dict(mixer=["mamba2-gla", "softmax"], mixer_kwargs={"mamba2-gla": {"output_gate": False}})
    d["mixer"], d["mixer_kwargs"] = ["mamba2", "softmax"], {"mamba2": {"output_gate": False}}   # as written then
    cfg = LMConfig.from_dict(d)
    assert cfg.mixer == ["mamba2-gla", "softmax"] and cfg.mixer_kwargs == {"mamba2-gla": {"output_gate": False}}
    assert cfg.mixer_names == 2 and LMConfig.from_dict(cfg.to_dict()) == cfg
    assert isinstance(LanguageModel(cfg).blocks[0].mixer, LinearAttention)
    # a partial dict (a hand-written --model-config, CLI flags) means today's names
    assert LMConfig.from_dict({"vocab_size": V, "mixer": "mamba2"}).mixer == "mamba2"
    # mixer_names given explicitly
    assert LMConfig(vocab_size=V, mixer="mamba2", mixer_names=1).mixer == "mamba2-gla"
    with pytest.raises(ConfigError, match="mixer_names"):
        LMConfig(vocab_size=V, mixer_names=3)


def test_old_checkpoint_naming_mamba2_loads_and_gives_its_outputs(tmp_path):
    from linattn.checkpoint import load_checkpoint, save_checkpoint
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, mixer="mamba2-gla")
    model = LanguageModel(cfg).eval()
    d = cfg.to_dict()
    del d["mixer_names"]
    d["mixer"] = "mamba2"                      # the dict (and recorded architecture) the old code wrote
    save_checkpoint(tmp_path / "run", 1, model, model_config=d)
    ck = load_checkpoint(tmp_path / "run")
    assert ck.model_config.mixer == "mamba2-gla"
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        assert torch.equal(ck.model(ids).logits, model(ids).logits)


def test_old_run_naming_mamba2_resumes_with_the_old_meaning(tmp_path, corpus):
    import json

    from safetensors.torch import load_file, save_file

    from linattn.checkpoint import ARCH_KEY, architecture, find_latest_checkpoint, load_checkpoint
    from linattn.training import TrainConfig, train
    cfg = TrainConfig(data=str(corpus), out=str(tmp_path / "run"), vocab_size=260, seq_len=16, batch_size=2, steps=2,
                      save_every=0, eval_every=0, eval_batches=1, progress=False, warmup=1, threads=1)
    train(cfg, LMConfig(vocab_size=260, d_model=32, n_layers=1, n_heads=2, mixer="mamba2-gla", max_seq_len=16))
    ck = find_latest_checkpoint(tmp_path / "run")
    # rewrite the checkpoint as the code before the rename wrote it: "mamba2", no mixer_names, in both places
    meta = json.loads((ck / "config.json").read_text())
    del meta["model"]["mixer_names"]
    meta["model"]["mixer"] = "mamba2"
    (ck / "config.json").write_text(json.dumps(meta))
    weights = load_file(str(ck / "model.safetensors"))
    save_file(weights, str(ck / "model.safetensors"),
              metadata={"format": meta["format"], "step": str(meta["step"]),
                        ARCH_KEY: json.dumps(architecture(meta["model"]), sort_keys=True)})
    assert load_checkpoint(ck).model_config.mixer == "mamba2-gla"
    res = train(TrainConfig(**{**cfg.to_dict(), "steps": 3}), resume=True)
    assert res.step == 3 and load_checkpoint(tmp_path / "run").model_config.mixer == "mamba2-gla"
