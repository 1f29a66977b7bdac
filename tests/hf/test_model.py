"""linattn.hf as a complete transformers model: resize_token_embeddings + save/load,
hidden states and output_attentions, inputs_embeds (forward, generate, a prompt-tuning prefix), AutoModel and
AutoModelForSequenceClassification (from an LM folder, with `import linattn.hf` and with trust_remote_code),
activation checkpointing flags and recomputation, cache_implementation refused. Tiny models, no downloads."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import linattn.hf as lh  # noqa: E402
from linattn import LanguageModel, LMConfig  # noqa: E402
from linattn.errors import ConfigError, LinattnError  # noqa: E402

HYBRID = ["gated-deltanet", "softmax"]
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny(mixer=HYBRID, vocab=64, **kw) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(LMConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, mixer=mixer, **kw)).eval()


def ids_of(B=2, T=6, vocab=64, seed=1):
    return torch.randint(1, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def left_pad_mask(B, T, pad):
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :pad] = 0
    return mask


# ---------------------------------------------------------------- the runner is LanguageModel.forward

@pytest.mark.parametrize("kw", [dict(mixer=HYBRID), dict(mixer="efla", memory_lobe="causal"),
                                dict(mixer="gla", ffn="moe", n_experts=3, tie_embeddings=False),
                                dict(mixer="kda", residual="hyperlink", final_norm=False)])
def test_forward_is_the_linattn_forward(kw):
    """The HF models run the blocks themselves (for inputs_embeds and hidden states): the same numbers."""
    m = tiny(**kw)
    hf = lh.LinattnForCausalLM.from_linattn(m)
    ids = ids_of()
    assert torch.equal(hf(ids).logits, m(ids).logits)
    out = hf(ids, use_cache=True, logits_to_keep=1)
    assert torch.equal(out.logits, m(ids, use_cache=True, logits_to_keep=1).logits)


# ---------------------------------------------------------------- 1. resize_token_embeddings

@pytest.mark.parametrize("tie", [True, False])
def test_resize_token_embeddings_then_save_loads_back(tmp_path, tie):
    m = tiny(tie_embeddings=tie)
    hf = lh.LinattnForCausalLM.from_linattn(m)
    hf.resize_token_embeddings(70)
    assert hf.config.vocab_size == 70 and hf.config.linattn["vocab_size"] == 70 and m.config.vocab_size == 70
    assert m.embed.weight.shape == (70, 32)
    if tie:
        assert m.lm_head is None
    else:
        assert m.lm_head.weight.shape == (70, 32)
    ids = torch.tensor([[1, 69, 5, 68]])   # ids of the new rows are accepted
    logits = hf(ids).logits
    assert logits.shape == (1, 4, 70) and torch.equal(logits, m(ids).logits)
    hf.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.config.vocab_size == 70 and (back.model.lm_head is None) == tie
    assert torch.equal(back(ids).logits, logits)
    hf.resize_token_embeddings(60)   # and shrinking
    hf.save_pretrained(tmp_path / "small")
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "small").model.embed.num_embeddings == 60


# ---------------------------------------------------------------- 2. hidden states, attentions

def test_output_hidden_states_follow_transformers_convention():
    m = tiny()
    hf = lh.LinattnForCausalLM.from_linattn(m)
    ids = ids_of()
    out = hf(ids, output_hidden_states=True)
    hs = out.hidden_states
    assert isinstance(hs, tuple) and len(hs) == m.config.n_layers + 1
    x = m.embed(ids)
    assert torch.equal(hs[0], x)
    for i, block in enumerate(m.blocks):
        x, _ = block(x)
        if i < len(m.blocks) - 1:
            assert torch.equal(hs[i + 1], x)
    assert torch.equal(hs[-1], m.norm(x))                   # the last one is after the final norm
    assert torch.equal(out.logits, F.linear(hs[-1], m.embed.weight))
    assert hf(ids).hidden_states is None
    hf.config.output_hidden_states = True                    # the config default, as in transformers
    assert len(hf(ids).hidden_states) == 3


def test_hidden_states_of_a_padded_batch_are_each_row_alone():
    m = tiny()
    hf = lh.LinattnForCausalLM.from_linattn(m)
    ids, mask = ids_of(), left_pad_mask(2, 6, 2)
    for use_cache in (False, True):
        hs = hf(ids, attention_mask=mask, use_cache=use_cache, output_hidden_states=True).hidden_states
        alone = hf(ids[:1, 2:], output_hidden_states=True).hidden_states
        for h, a in zip(hs, alone):
            torch.testing.assert_close(h[0, 2:], a[0], rtol=1e-5, atol=1e-6)
            assert not h[0, :2].any()                        # zeros at padding


def test_output_attentions_warns_and_returns_none():
    hf = lh.LinattnForCausalLM.from_linattn(tiny())
    with pytest.warns(UserWarning, match="output_attentions"):
        out = hf(ids_of(), output_attentions=True)
    assert out.attentions is None and out.logits.shape == (2, 6, 64)


def test_generate_returns_hidden_states():
    hf = lh.LinattnForCausalLM.from_linattn(tiny())
    out = hf.generate(ids_of(), max_new_tokens=3, output_hidden_states=True, return_dict_in_generate=True, **GREEDY)
    assert len(out.hidden_states) == 3 and len(out.hidden_states[0]) == 3
    assert out.hidden_states[0][0].shape == (2, 6, 32) and out.hidden_states[1][-1].shape == (2, 1, 32)


# ---------------------------------------------------------------- 3. inputs_embeds

def test_inputs_embeds_in_forward_equal_input_ids():
    m = tiny()
    hf = lh.LinattnForCausalLM.from_linattn(m)
    ids, mask = ids_of(), left_pad_mask(2, 6, 2)
    assert torch.equal(hf(inputs_embeds=m.embed(ids)).logits, hf(ids).logits)
    a = hf(inputs_embeds=m.embed(ids), attention_mask=mask, labels=ids)
    b = hf(ids, attention_mask=mask, labels=ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    with pytest.raises(LinattnError, match="exactly one"):
        hf(ids, inputs_embeds=m.embed(ids))
    with pytest.raises(LinattnError, match="inputs_embeds"):
        hf(inputs_embeds=torch.zeros(1, 3, 31))


@pytest.mark.parametrize("num_beams", [1, 2])
def test_generate_from_inputs_embeds_returns_the_new_tokens(num_beams):
    m = tiny()
    hf = lh.LinattnForCausalLM.from_linattn(m)
    ids, mask = ids_of(), left_pad_mask(2, 6, 2)
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=num_beams, **GREEDY)
    new = hf.generate(inputs_embeds=m.embed(ids), attention_mask=mask, max_new_tokens=5, num_beams=num_beams,
                      **GREEDY)
    assert new.shape == (2, 5) and torch.equal(new, ref[:, 6:])


def test_prompt_tuning_prefix_trains_and_generates():
    """What PEFT's prompt tuning does: learned virtual-token embeddings before the prompt's embeddings,
    labels -100 on them; the loss trains the prefix and generate continues from the embeddings."""
    m = tiny()
    hf = lh.LinattnForCausalLM.from_linattn(m)
    for p in hf.parameters():
        p.requires_grad_(False)
    prefix = torch.nn.Parameter(torch.randn(4, 32, generator=torch.Generator().manual_seed(2)) * 0.02)
    ids = ids_of(B=2, T=5)
    embeds = torch.cat([prefix.expand(2, -1, -1), m.embed(ids)], 1)
    labels = torch.cat([torch.full((2, 4), -100), ids], 1)
    out = hf(inputs_embeds=embeds, labels=labels)
    out.loss.backward()
    assert prefix.grad is not None and prefix.grad.abs().sum() > 0
    opt = torch.optim.Adam([prefix], lr=0.1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = hf(inputs_embeds=torch.cat([prefix.expand(2, -1, -1), m.embed(ids)], 1), labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        embeds = torch.cat([prefix.expand(2, -1, -1), m.embed(ids)], 1)
        new = hf.generate(inputs_embeds=embeds, max_new_tokens=4, **GREEDY)
        x, want = embeds, []   # greedy by hand, from full forwards over the growing embeddings
        for _ in range(4):
            want.append(hf(inputs_embeds=x, use_cache=False).logits[:, -1].argmax(-1))
            x = torch.cat([x, m.embed(want[-1])[:, None]], 1)
    assert new.shape == (2, 4) and torch.equal(new, torch.stack(want, 1))


# ---------------------------------------------------------------- 4. AutoModel, sequence classification

@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    lh.LinattnForCausalLM.from_linattn(tiny(tie_embeddings=False), pad_token_id=0).save_pretrained(d)
    return d


def test_auto_model_loads_the_stack_of_an_lm_folder(lm_folder):
    lm = transformers.AutoModelForCausalLM.from_pretrained(lm_folder)
    base = transformers.AutoModel.from_pretrained(lm_folder)
    assert type(base).__name__ == "LinattnModel" and not hasattr(base, "lm_head")
    ids, mask = ids_of(), left_pad_mask(2, 6, 2)
    out = base(ids, attention_mask=mask)
    assert isinstance(out, transformers.modeling_outputs.BaseModelOutputWithPast)
    want = lm(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(out.last_hidden_state, want)
    assert torch.equal(lm.model.lm_head(out.last_hidden_state), lm(ids, attention_mask=mask).logits)
    assert len(base(ids, output_hidden_states=True).hidden_states) == 3


def test_sequence_classification_scores_the_last_real_token(lm_folder, tmp_path):
    cls = transformers.AutoModelForSequenceClassification.from_pretrained(lm_folder, num_labels=3).eval()
    assert type(cls).__name__ == "LinattnForSequenceClassification"
    assert torch.isfinite(cls.score.weight).all() and cls.score.weight.abs().sum() > 0   # drawn, not empty
    ids = ids_of()
    alone = [cls(ids[b:b + 1, :4 + b]).logits[0] for b in range(2)]   # rows of length 4 and 5
    left = torch.zeros(2, 5, dtype=torch.long)
    left[0, 1:], left[1] = ids[0, :4], ids[1, :5]
    right = torch.zeros(2, 5, dtype=torch.long)
    right[0, :4], right[1] = ids[0, :4], ids[1, :5]
    for batch in (left, right):
        mask = (batch != 0).long()
        out = cls(batch, attention_mask=mask)
        by_mask = out.logits
        assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None  # no cache
        by_pad = cls(batch).logits                          # config.pad_token_id == 0 finds the same tokens
        for b in range(2):
            torch.testing.assert_close(by_mask[b], alone[b], rtol=1e-5, atol=1e-6)
        if batch is right:                                  # right padding: pad tokens run but are not read
            torch.testing.assert_close(by_pad, by_mask, rtol=1e-5, atol=1e-6)
    assert cls(inputs_embeds=cls.model.embed(ids)).logits.shape == (2, 3)
    cls.save_pretrained(tmp_path)                           # the trained head is kept, not drawn again
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert back.config.num_labels == 3 and torch.equal(back.score.weight, cls.score.weight)
    mask = (left != 0).long()
    assert torch.equal(back(left, attention_mask=mask).logits, cls(left, attention_mask=mask).logits)


@pytest.mark.parametrize("num_labels,labels,kind", [
    (1, torch.tensor([0.5, -1.0]), "regression"),
    (3, torch.tensor([0, 2]), "single_label_classification"),
    (3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]), "multi_label_classification")])
def test_sequence_classification_loss_by_problem_type(num_labels, labels, kind):
    cfg = lh.LinattnConfig.from_lm_config(tiny().config, num_labels=num_labels)
    torch.manual_seed(0)
    cls = lh.LinattnForSequenceClassification(cfg)
    ids = ids_of()
    out = cls(ids, labels=labels)
    assert cls.config.problem_type == kind and out.logits.shape == (2, num_labels)
    h = cls.model(ids).last_hidden_state[:, -1]
    logits = cls.score(h)
    want = {"regression": lambda: F.mse_loss(logits[:, 0], labels),
            "single_label_classification": lambda: F.cross_entropy(logits, labels),
            "multi_label_classification": lambda: F.binary_cross_entropy_with_logits(logits, labels)}[kind]()
    torch.testing.assert_close(out.loss, want)
    out.loss.backward()
    assert cls.score.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("num_labels,labels,kind", [
    (1, torch.tensor([1, -2]), "regression"),                                      # integer regression targets
    (3, torch.tensor([[1, 0, 1], [0, 1, 0]]), "multi_label_classification")])      # integer multi-hot targets
def test_sequence_classification_loss_takes_integer_targets(num_labels, labels, kind):
    cfg = lh.LinattnConfig.from_lm_config(tiny().config, num_labels=num_labels, problem_type=kind)
    torch.manual_seed(0)
    cls = lh.LinattnForSequenceClassification(cfg)
    out = cls(ids_of(), labels=labels)
    logits = cls.score(cls.model(ids_of()).last_hidden_state[:, -1])
    want = F.mse_loss(logits[:, 0], labels.float()) if kind == "regression" else \
        F.binary_cross_entropy_with_logits(logits, labels.float())
    torch.testing.assert_close(out.loss, want)
    cls.config.problem_type = "ordinal"
    with pytest.raises(ConfigError, match="problem_type"):
        cls(ids_of(), labels=labels)


def test_trust_remote_code_loads_every_head(lm_folder, tmp_path):
    code = ("from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification\n"
            f"d = {str(lm_folder)!r}\n"
            "names = [type(c.from_pretrained(d, trust_remote_code=True, **kw)).__name__ for c, kw in ("
            "(AutoModel, {}), (AutoModelForCausalLM, {}), (AutoModelForSequenceClassification, {'num_labels': 2}))]\n"
            "print(' '.join(names))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.stdout.strip().endswith("LinattnModel LinattnForCausalLM LinattnForSequenceClassification"), \
        res.stderr[-2000:]


# ---------------------------------------------------------------- 5. activation checkpointing

def _count_calls(blocks, calls):
    """Wrap each block's forward to record its index (forward hooks do not fire in checkpoint's recompute)."""
    for k, b in enumerate(blocks):
        def counted(*args, _forward=b.forward, _k=k, **kwargs):
            calls.append(_k)
            return _forward(*args, **kwargs)
        b.forward = counted


def _block_calls(hf, m, ids):
    calls = []
    _count_calls(m.blocks, calls)
    try:
        hf(ids, labels=ids).loss.backward()
    finally:
        for b in m.blocks:
            del b.forward
    return calls


def test_gradient_checkpointing_flag_and_recompute():
    m = tiny()
    hf = lh.LinattnForCausalLM.from_linattn(m).train()
    ids = ids_of()
    assert not hf.is_gradient_checkpointing
    assert _block_calls(hf, m, ids) == [0, 1]
    plain = [p.grad.clone() for p in hf.parameters()]
    hf.zero_grad()
    hf.gradient_checkpointing_enable()
    assert hf.is_gradient_checkpointing and m.activation_checkpointing
    assert _block_calls(hf, m, ids) == [0, 1, 1, 0]         # each block runs again in the backward pass
    for p, g in zip(hf.parameters(), plain):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    hf.gradient_checkpointing_disable()
    assert not hf.is_gradient_checkpointing and not m.activation_checkpointing
    assert _block_calls(hf, m, ids) == [0, 1]
    if "every_n_layers" in inspect.signature(hf.activation_checkpointing_enable).parameters:   # transformers 5.24
        hf.activation_checkpointing_enable(every_n_layers=2)   # only block 0 is recomputed
        assert hf.is_activation_checkpointing and _block_calls(hf, m, ids) == [0, 1, 0]
    hf.eval()
    assert _block_calls(hf, m, ids) == [0, 1]                # nothing to recompute outside training


def test_gradient_checkpointing_on_the_task_models():
    cls = lh.LinattnForSequenceClassification(lh.LinattnConfig.from_lm_config(tiny().config, num_labels=2)).train()
    cls.gradient_checkpointing_enable()
    assert cls.is_gradient_checkpointing and cls.model.gradient_checkpointing
    calls = []
    _count_calls(cls.model.blocks, calls)
    cls(ids_of(), labels=torch.tensor([0, 1])).loss.backward()
    assert calls == [0, 1, 1, 0]
    cls.gradient_checkpointing_disable()
    assert not cls.is_gradient_checkpointing


# ---------------------------------------------------------------- 6. cache_implementation

@pytest.mark.parametrize("impl", ["static", "offloaded"])
def test_static_cache_is_refused_clearly(impl):
    hf = lh.LinattnForCausalLM.from_linattn(tiny())
    with pytest.raises(LinattnError, match=f"cache_implementation='{impl}'"):
        hf.generate(ids_of(), max_new_tokens=2, cache_implementation=impl, **GREEDY)
    out = hf.generate(ids_of(), max_new_tokens=2, cache_implementation="dynamic", **GREEDY)
    assert torch.equal(out, hf.generate(ids_of(), max_new_tokens=2, **GREEDY))
    with pytest.raises(LinattnError, match="attention_mask"):   # a compiled-cache mask dict is named, not .dim()
        hf(ids_of(), attention_mask={"full_attention": torch.ones(2, 1, 6, 6)})
