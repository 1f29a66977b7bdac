"""TLinFormer: shapes, gradients, window sliding, the two-mode cache, generation, causality,
full-context reachability, save/load and config validation."""
import math

import pytest
import torch

from linattn.audit import check_causality
from linattn.models import tlinformer as tl
from linattn.models.tlinformer import TLinFormerConfig, TLinFormerLM, auto_history_window

V = 53


pytestmark = pytest.mark.usefixtures("one_thread_module")


def tiny(**kw):
    args = dict(vocab_size=V, d_model=32, n_heads=4, n_blocks=2, inner_depth=4, history_window=3,
                generation_window=4, max_seq_len=64)
    args.update(kw)
    torch.manual_seed(0)
    return TLinFormerLM(TLinFormerConfig(**args)).eval()


def ids_(B=2, T=23, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def incremental(model, ids, prefill):
    """Logits of ids[:, prefill:] from a prefill of `prefill` tokens, then one token at a time."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        parts, cache = [out.logits], out.cache
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=cache)
            parts.append(out.logits)
    return torch.cat(parts, dim=1), cache


# ---------------------------------------------------------------------------------------------
# shapes, gradients, structure


@pytest.mark.parametrize("T", [1, 4, 7, 23])
def test_shapes(T):
    m = tiny()
    out = m(ids_(T=T))
    assert out.logits.shape == (2, T, V)
    assert out.aux_loss.shape == () and float(out.aux_loss) == 0.0
    assert out.cache is None and out.loss is None
    assert m(ids_(T=T), logits_to_keep=2).logits.shape == (2, min(2, T), V)


def test_structure_and_parameter_count():
    m = tiny(n_blocks=3, inner_depth=5)
    kinds = [lay.kind for lay in m.layers]
    assert kinds == (["compress"] + ["hidden"] * 3 + ["restore"]) * 3
    assert m.config.n_layers == 15 and m.config.n_hidden == 3
    # the same parameters as a 15-layer pre-norm transformer (tied embeddings): the two streams share weights
    d, hid = 32, m.layers[0].ffn.hidden
    per_layer = 2 * d + 3 * d * d + d * d + 3 * d * hid
    assert m.num_parameters() == V * d + 15 * per_layer + d
    assert m.num_parameters(exclude_embeddings=True) == 15 * per_layer + d


def test_backward_and_loss():
    m = tiny().train()
    ids = ids_(T=15)
    out = m(ids[:, :-1], targets=ids[:, 1:])
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_training_is_windowed_forward():
    """A forward over the sequence equals, window by window, the model run on (history, window)."""
    m = tiny()
    ids = ids_(T=14)
    full = m(ids).logits
    for c in range(4):  # windows [0,4) [4,8) [8,12) [12,14)
        lo, hi = 4 * c, min(4 * c + 4, 14)
        part = m(ids[:, :hi], logits_to_keep=hi - lo).logits
        torch.testing.assert_close(part, full[:, lo:hi], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# cache: miss / hit


@pytest.mark.parametrize("prefill", [1, 3, 4, 5, 8, 13])
def test_cached_decoding_matches_full_forward(prefill):
    m = tiny()
    ids = ids_(T=23)
    with torch.no_grad():
        full = m(ids).logits
    inc, cache = incremental(m, ids, prefill)
    assert (inc - full).abs().max() < 1e-5
    assert cache.seen_tokens == 23 and cache.context_len == 20 and cache.x_len == 3
    # one miss for the prefill, one at every later window start, hits for the rest
    starts = [t for t in range(prefill, 23) if t % 4 == 0]
    assert cache.misses == 1 + len(starts)
    assert cache.hits == 23 - prefill - len(starts)


def test_multi_token_continuation_and_logits_to_keep():
    m = tiny()
    ids = ids_(T=23)
    with torch.no_grad():
        full = m(ids).logits
        out = m(ids[:, :6], use_cache=True)
        c = out.cache
        o = m(ids[:, 6:7], cache=c)                # hit
        torch.testing.assert_close(o.logits, full[:, 6:7], rtol=0, atol=1e-5)
        o = m(ids[:, 7:15], cache=c)               # finishes the window, then two more (miss at 8, 12)
        torch.testing.assert_close(o.logits, full[:, 7:15], rtol=0, atol=1e-5)
        o = m(ids[:, 15:18], cache=c, logits_to_keep=1)
        torch.testing.assert_close(o.logits, full[:, 17:18], rtol=0, atol=1e-5)
        assert c.context_len == 16 and c.x_len == 2
        o = m(ids[:, 18:23], cache=c)
        torch.testing.assert_close(o.logits, full[:, 18:23], rtol=0, atol=1e-5)


def test_cache_hit_does_not_touch_the_history():
    m = tiny(history_window=5, generation_window=8)
    ids = ids_(T=30)
    with torch.no_grad():
        c = m(ids[:, :17], use_cache=True).cache        # history 16, window holds 1 token
        assert c.last_mode == "miss" and c.context_len == 16
        ctx = [(lay["ctx"]["k"], lay["ctx"]["v"]) for lay in c.layers]
        # the compress layers hold all 16 history keys, the others the W_oh = 5 compressed ones
        assert [k.shape[2] for k, _ in ctx] == [16, 5, 5, 5] * 2
        c.ids[:, :16] = 0                               # a hit must not even read the history tokens
        o = m(ids[:, 17:18], cache=c)
        assert c.last_mode == "hit"
        assert all(lay["ctx"]["k"] is k for lay, (k, _) in zip(c.layers, ctx))
    torch.testing.assert_close(o.logits, m(ids[:, :18]).logits[:, -1:], rtol=0, atol=1e-5)


def test_cache_bytes_linear_in_history():
    """The O(N) part of the cache is one key/value pair per block (compress layer): 2 * n_blocks * d."""
    m = tiny(generation_window=8, history_window=4, max_seq_len=256)
    sizes = {}
    with torch.no_grad():
        for N in (64, 128, 256):
            sizes[N] = m(ids_(T=N + 1), use_cache=True, logits_to_keep=1).cache.nbytes()
    per_token = 2 * m.config.n_blocks * m.config.d_model * 4 * 2   # k and v, fp32, batch 2
    assert sizes[128] - sizes[64] == 64 * per_token  # the ids buffer stays at its 256-token minimum
    assert sizes[256] - sizes[128] >= 128 * per_token


def test_bad_cache_and_inputs():
    m = tiny()
    with pytest.raises(ValueError, match="TLinFormerCache"):
        m(ids_(T=3), cache=tiny(n_blocks=1).new_cache())
    with pytest.raises(ValueError, match="int64"):
        m(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="at least one"):
        m(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="logits_to_keep"):
        m(ids_(T=3), logits_to_keep=-1)
    c = m(ids_(B=2, T=3), use_cache=True).cache
    with pytest.raises(ValueError, match="batch"):
        m(ids_(B=3, T=1), cache=c)


def test_errors_are_linattn_errors_and_packing_is_refused():
    from linattn.errors import ConfigError, LinattnError, LinattnTypeError
    from linattn.models import CausalLM, build_model, config_to_dict

    m = tiny()
    assert isinstance(m, CausalLM) and m.supports_cu_seqlens is False
    with pytest.raises(LinattnError, match="cu_seqlens"):
        m(ids_(B=1, T=9), cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ConfigError, match="W_og"):
        TLinFormerConfig(vocab_size=V, generation_window=0)
    with pytest.raises(LinattnTypeError):
        TLinFormerLM({"vocab_size": V})
    with pytest.raises(LinattnError, match="int64"):
        m(torch.zeros(2, 3))
    # the family registry builds it from its dict
    assert type(build_model(config_to_dict(m.config))) is TLinFormerLM


# ---------------------------------------------------------------------------------------------
# generation


@pytest.mark.parametrize("prompt", [1, 4, 6])
def test_generate_cached_equals_uncached(prompt):
    """Greedy tokens equal across several window slides (N crosses multiples of W_og = 4)."""
    m = tiny()
    ids = ids_(T=prompt)
    a = m.generate(ids, 14, temperature=0, use_cache=True)
    b = m.generate(ids, 14, temperature=0, use_cache=False)
    assert a.shape == (2, prompt + 14)
    assert torch.equal(a, b)
    assert torch.equal(a[:, :prompt], ids)
    # per-step logits of both paths agree to 1e-4 along the generated sequence
    with torch.no_grad():
        inc, cache = incremental(m, a, prompt)
        full = m(a).logits[:, prompt - 1:]
    assert (inc[:, prompt - 1:] - full).abs().max() < 1e-4
    assert cache.misses >= 4


def test_generate_1d_prompt_sampling_and_eos():
    m = tiny()
    p = [1, 2, 3, 4, 5]
    g = m.generate(p, 7, temperature=0)
    assert g.shape == (12,) and g[:5].tolist() == p
    s1 = m.generate(p, 9, temperature=0.8, top_k=10, seed=3)
    s2 = m.generate(p, 9, temperature=0.8, top_k=10, seed=3, use_cache=False)
    assert torch.equal(s1, s2)
    first = int(g[5])
    assert m.generate(p, 7, temperature=0, eos_token_id=first).tolist() == p + [first]
    assert m.generate(p, 0).tolist() == p
    assert m.training is False
    m.train()
    m.generate(p, 2, temperature=0)
    assert m.training is True


def test_generate_text_helper_uses_stream():
    from linattn.generate import stream_tokens

    m = tiny()
    got = list(stream_tokens(m, torch.tensor([[1, 2, 3]]), 6, temperature=0))
    assert got == m.generate([1, 2, 3], 6, temperature=0)[3:].tolist()


# ---------------------------------------------------------------------------------------------
# causality and reachability


def test_causality_audit():
    rep = check_causality(tiny(), seq_len=14)
    assert rep.ok, str(rep)


def test_causality_audit_catches_a_planted_leak(monkeypatch):
    real = tl.softmax_attention
    monkeypatch.setattr(tl, "softmax_attention", lambda q, k, v, causal=True: real(q, k, v, causal=False))
    rep = check_causality(tiny(), seq_len=10)
    assert not rep.ok


def test_full_context_reachability():
    """With W_oh = 3 and a history of 40 tokens, the newest token's logits still depend on token 0,
    through the compress layer (queries of the window attend to every history key)."""
    m = tiny(history_window=3, generation_window=4, n_blocks=1)
    ids = ids_(B=1, T=42)
    emb = m.embed(ids).detach().requires_grad_(True)
    # gradient of the last logits w.r.t. each input embedding, through the model's own forward
    orig = m.embed.forward
    m.embed.forward = lambda t: emb[:, : t.shape[1]] if t.shape[1] == 40 else orig(t)  # history = ids[:, :40]
    try:
        logits = m(ids, logits_to_keep=1).logits[0, -1]
    finally:
        m.embed.forward = orig
    logits.sum().backward()
    g = emb.grad[0].abs().sum(-1)
    assert (g[:40] > 0).all()  # every history token reaches position 41
    with torch.no_grad():
        other = ids.clone()
        other[0, 0] = (other[0, 0] + 1) % V
        assert (m(other).logits[0, -1] - m(ids).logits[0, -1]).abs().max() > 1e-6


# ---------------------------------------------------------------------------------------------
# config, save / load


def test_auto_history_window():
    assert auto_history_window(1000) == 88          # 12 ln 1000 = 82.9 -> 88
    assert auto_history_window(65536) == 8 * math.ceil(12 * math.log(65536) / 8)
    assert auto_history_window(1) == 8
    m = tiny(history_window="auto", generation_window=16)
    assert m.config.history_window_for(1000) == 88 and m.config.history_window_for(20) == 20
    assert m.config.history_window_for(64) == 56     # the last window below compresses 64 -> 56
    ids = ids_(T=75)
    inc, cache = incremental(m, ids, 9)
    assert cache.layers[1]["ctx"]["k"].shape[2] == 56
    assert (inc - m(ids).logits).abs().max() < 1e-5


@pytest.mark.parametrize("kw, match", [
    (dict(history_window=0), "W_oh"), (dict(history_window=-2), "W_oh"), (dict(history_window="big"), "W_oh"),
    (dict(history_window=2.5), "W_oh"), (dict(history_window=True), "W_oh"),
    (dict(generation_window=0), "W_og"), (dict(generation_window=-1), "W_og"), (dict(generation_window=None), "W_og"),
    (dict(generation_window=65, max_seq_len=64), "larger than max_seq_len"),
    (dict(inner_depth=1), "inner_depth"), (dict(n_blocks=0), "n_blocks"), (dict(n_heads=3), "divisible"),
    (dict(d_model=30, n_heads=6), "even"), (dict(arch="lm"), "arch"),
])
def test_bad_config(kw, match):
    args = dict(vocab_size=V, d_model=32, n_heads=4, history_window=3, generation_window=4, max_seq_len=64)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        TLinFormerConfig(**args)


def test_config_roundtrip(tmp_path):
    cfg = TLinFormerConfig(vocab_size=V, d_model=32, n_heads=4, history_window="auto", generation_window=8)
    d = cfg.to_dict()
    assert d["arch"] == "tlinformer"
    assert TLinFormerConfig.from_dict(d) == cfg
    assert TLinFormerConfig.from_json(cfg.to_json()) == cfg
    cfg.to_json(tmp_path / "c.json")
    assert TLinFormerConfig.from_json(tmp_path / "c.json") == cfg
    with pytest.raises(ValueError, match="unknown"):
        TLinFormerConfig.from_dict({**d, "mixer": "softmax"})
    with pytest.raises(TypeError):
        TLinFormerLM(d)


def test_save_load_checkpoint(tmp_path):
    from linattn import checkpoint as ck

    m = tiny()
    ids = ids_(T=11)
    path = ck.save_checkpoint(tmp_path / "run", 3, m, model_config=m.config.to_dict())
    factory = lambda d: TLinFormerLM(TLinFormerConfig.from_dict(d))  # noqa: E731
    loaded = ck.load_checkpoint(path, model_factory=factory)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, m(ids).logits, rtol=0, atol=0)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    m2 = TLinFormerLM(TLinFormerConfig.from_dict(m.config.to_dict()))
    m2.load_state_dict(sd)
    assert torch.equal(m2.eval().generate(ids, 5, temperature=0), m.generate(ids, 5, temperature=0))


# ---------------------------------------------------------------------------------------------
# the command line: train / resume / eval / generate like any other model


def test_cli_train_eval_generate(tmp_path, capsys):
    import json

    from linattn.checkpoint import load_checkpoint
    from linattn.cli import main

    words = ["alpha", "beta", "gamma", "delta", "window", "history", "token", "cache", "linear", "softmax"]
    g = torch.Generator().manual_seed(0)
    text = "\n\n".join(" ".join(words[int(i)] for i in torch.randint(0, 10, (60,), generator=g)) for _ in range(60))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    out = tmp_path / "run"
    argv = ["train", "--model", "tlinformer", "--data", str(corpus), "--out", str(out), "--vocab-size", "300",
            "--d-model", "32", "--n-heads", "2", "--n-blocks", "1", "--inner-depth", "3", "--history-window", "4",
            "--generation-window", "8", "--seq-len", "32", "--batch-size", "2", "--steps", "4", "--warmup", "1",
            "--eval-batches", "1", "--threads", "1", "--no-progress"]
    assert main(argv) == 0
    ck = load_checkpoint(out)
    assert isinstance(ck.model, TLinFormerLM) and ck.model_config.generation_window == 8
    i = argv.index("--steps")
    assert main(argv[:i + 1] + ["5"] + argv[i + 2:] + ["--resume"]) == 0
    assert load_checkpoint(out).step == 5
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--data", str(corpus), "--max-batches", "2", "--json"]) == 0
    assert math.isfinite(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"])
    assert main(["generate", "--checkpoint", str(out), "--prompt", "alpha beta", "--max-new-tokens", "12",
                 "--temperature", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == 12
    bad = argv[:argv.index("--generation-window") + 1] + ["64"] + argv[argv.index("--generation-window") + 2:]
    assert main(bad + ["--overwrite"]) == 2
    assert "W_og = 64" in capsys.readouterr().err


def test_bench_smoke(tmp_path, capsys):
    import json

    from linattn.cli import main

    rc = main(["bench", "tlinformer", "--N", "256", "512", "--d-model", "32", "--n-heads", "2", "--inner-depth", "3",
               "--history-window", "16", "--generation-window", "16", "--vocab-size", "64", "--decode-steps", "2",
               "--miss-repeats", "1", "--trace-N", "64", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "hit speedup" in out and "mem ratio" in out
    res = json.loads((tmp_path / "tlinformer.json").read_text())
    recs = {(r["model"], r["N"]): r for r in res["records"]}
    assert set(recs) == {(m, n) for m in ("tlinformer", "softmax", "linear") for n in (256, 512)}
    assert recs[("tlinformer", 512)]["hit_modes"] == ["hit"] and recs[("tlinformer", 512)]["miss_mode"] == "miss"
    assert recs[("softmax", 512)]["cache_bytes"] > recs[("tlinformer", 512)]["cache_bytes"]
    assert res["trace"]["modes"].count("miss") == 4  # the prompt, then windows starting at 64, 80, 96
    assert (tmp_path / "tlinformer.png").stat().st_size > 0
    assert main(["bench", "tlinformer", "--models", "nope"]) == 2
