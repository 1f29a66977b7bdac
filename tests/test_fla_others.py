"""fla's mesa_net, forgetting_transformer, path_attn, deltaformer, rwkv7 and mamba2 checkpoints (issue 37 point 1):
the options their layers needed in linattn's (tested here without fla), then fla's OWN tiny models in fp64, saved
with save_pretrained, converted by `linattn.hf.import_fla`, whose linattn checkpoints must give fla's logits
(<= 1e-10) and greedy generations. fla's Triton kernels do not run on CPU: its layers call fla's naive references
or, where fla has none, linattn's fp64 references (each patch says which)."""
import pytest
import torch

from linattn.errors import ConfigError
from linattn.models import LMConfig, LanguageModel


def _perturbed(model, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _rwkv_lm(**kw):
    c = dict(vocab_size=50, d_model=32, n_layers=3, n_heads=2, mixer="rwkv7", norm="layernorm", embed_norm=True,
             ffn="rwkv7", ffn_hidden=48, mixer_kwargs={"rwkv7": {"kk_norm": "rsqrt"}})
    c.update(kw)
    torch.manual_seed(0)
    return _perturbed(LanguageModel(LMConfig(**c)).double())


# -- options added for fla's models (no fla needed) ---------------------------------------------------------------

def test_rwkv7_block_options_decode_and_pack():
    # layernorm (with bias), the embeddings' norm in block 0 and RWKV-7's channel mix: decoding token by token and
    # packed documents give the full forward's logits (the channel mix's token shift keeps a state / restarts)
    m = _rwkv_lm()
    names = dict(m.named_parameters())
    assert "blocks.0.pre_norm.bias" in names and "blocks.1.pre_norm.weight" not in names
    assert "blocks.1.ffn.x_k" in names and "norm.bias" in names and names["blocks.0.ffn.key.weight"].shape == (48, 32)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    full = m(ids).logits
    out = m(ids[:, :5], use_cache=True)
    steps = [out.logits]
    for t in range(5, 9):
        out = m(ids[:, t:t + 1], cache=out.cache)
        steps.append(out.logits)
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-12
    packed = m(ids.reshape(1, -1), cu_seqlens=torch.tensor([0, 9, 18])).logits
    assert (packed.reshape(2, 9, -1) - full).abs().max() < 1e-12
    # a document alone gives its own logits: the shift does not reach across the boundary
    assert (m(ids[1:]).logits - full[1:]).abs().max() < 1e-12


def test_rwkv7_block_options_defaults_keep_old_models():
    c = LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, mixer="rwkv7")
    assert c.norm == "rmsnorm" and not c.embed_norm
    d = c.to_dict()
    del d["norm"], d["embed_norm"]                     # a config saved before the fields existed
    assert LMConfig.from_dict(d) == c
    m = LanguageModel(c)
    assert all(type(b.norm1).__name__ == "RMSNorm" and b.pre_norm is None for b in m.blocks)
    with pytest.raises(ConfigError, match="norm must be one of"):
        LMConfig(vocab_size=50, norm="batchnorm")
    with pytest.raises(ConfigError, match="kk_norm"):
        LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, mixer="rwkv7",
                               mixer_kwargs={"rwkv7": {"kk_norm": "l1"}}))
