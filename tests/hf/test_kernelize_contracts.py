"""linattn.hf.kernelize keeps transformers' contracts (issue 45): the model's forward keeps its exact signature, so
`generate` (position_ids, logits_to_keep), `pipeline("text-generation")` and the `Trainer` on a `datasets.Dataset`
(remove_unused_columns=True) behave as on the unpatched model, for every served architecture. The unpatched twin
runs transformers' PyTorch fallbacks (`torch_fallbacks`), also where fla is installed. Tiny random models from
tests/hf/test_kernelize.py; a tokenizer built offline (a `tokenizers` BPE in a PreTrainedTokenizerFast)."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.hf.kernelize_models import (  # noqa: E402
    ARCHS,
    V,
    ids as _ids,
    maxdiff as _maxdiff,
    pair,
    transformers_torch_code,  # noqa: E402, F401  (autouse)
)


def _tokenizer():
    """A character-level BPE over V ids (no merges), built in memory: no download."""
    tokenizers = pytest.importorskip("tokenizers")
    chars = [chr(c) for c in range(ord("!"), ord("!") + V - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_signature_and_generate(arch):
    """The exact signature, and generate's per-step logits (greedy, cached decode: position_ids passed, MiniMax
    decodes at its true RoPE positions) equal the unpatched model's; logits_to_keep still trims the prefill."""
    ref, fast, _ = pair(arch)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    assert inspect.signature(fast.base_model.forward) == inspect.signature(ref.base_model.forward)
    prompt = _ids(21, 9, 2)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    gr, gf = ref.generate(prompt, **kw), fast.generate(prompt, **kw)
    assert torch.equal(gr.sequences, gf.sequences), arch
    lr, lf = torch.stack(gr.logits), torch.stack(gf.logits)
    assert _maxdiff(lr, lf) <= 2e-5 * max(1.0, lr.abs().max().item()), arch
    if "logits_to_keep" in inspect.signature(ref.forward).parameters:
        with torch.no_grad():
            assert fast(prompt, logits_to_keep=1, use_cache=False).logits.shape[1] == 1


def test_generate_decodes_at_the_true_positions():
    """MiniMax's cache reports its length from a linear-attention layer (0): transformers' generate must pass the
    position_ids itself. A cached generate's logits equal the full forward of the whole sequence, step by step.
    The softmax layer's q, k and output are scaled up so that RoPE positions show in the logits (at init a wrong
    position moves them by only ~2e-5; by ~3e-3 here)."""
    _, fast, _ = pair("minimax")
    with torch.no_grad():
        for name, p in fast.named_parameters():
            if ".self_attn." in name and name.split(".")[-2] in ("q_proj", "k_proj", "o_proj"):
                p.mul_(10.0 if "o_proj" in name else 4.0)
    prompt = _ids(22, 7, 1)
    out = fast.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                        return_dict_in_generate=True)
    with torch.no_grad():
        full = fast(out.sequences, use_cache=False).logits[:, 6:-1]
    steps = torch.stack(out.logits, dim=1)
    assert _maxdiff(steps, full) <= 1e-6 * max(1.0, full.abs().max().item())


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_and_trainer(arch, tmp_path):
    """pipeline("text-generation") gives the unpatched model's text; the Trainer on a datasets.Dataset with its
    default remove_unused_columns=True (the extra "text" column dropped by the forward's signature) takes a step
    whose loss is the unpatched model's under the same Trainer (one batch of the whole dataset) and moves the
    weights."""
    datasets = pytest.importorskip("datasets")
    tok = _tokenizer()
    ref, fast, _ = pair(arch)
    texts = []
    for model in (ref, fast):
        pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
        texts.append(pipe("abcdefg", max_new_tokens=5, min_new_tokens=5, do_sample=False)[0]["generated_text"])
    assert texts[0] == texts[1] and len(texts[0]) >= len("abcdefg") + 5, (arch, texts)

    ids = _ids(23, 12, 2)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist(), "text": ["a", "b"]})
    before = {n: p.detach().clone() for n, p in fast.named_parameters()}
    losses = []
    for model in (ref, fast):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                              learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
                                              save_strategy="no", disable_tqdm=True)
        trainer = transformers.Trainer(model=model.train(), args=args, train_dataset=data)
        trainer.train()
        losses += [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-5), arch
    assert any(_maxdiff(p, before[n]) > 0 for n, p in fast.named_parameters()), arch


def test_instance_forward_is_never_silently_bypassed():
    """A forward already set on the instance (not accelerate's hook, whose `_old_forward` kernelize replaces) would
    hide the served one: kernelize names the module instead of patching around it."""
    from linattn.errors import LinattnError
    from linattn.hf import kernelize
    ref, _, _ = pair("qwen3_5")
    mixer = ref.get_submodule("model.layers.0.linear_attn")
    mixer.forward = lambda *a, **k: None
    with pytest.raises(LinattnError, match="model.layers.0.linear_attn.*instance-level forward"):
        kernelize(ref)
    assert kernelize(ref, skip_unserved=True).patched == []


def test_accelerate_hook_keeps_serving():
    """With accelerate's hook on the mixer (module.forward -> hook -> module._old_forward), kernelize serves
    through `_old_forward` and the hook still runs."""
    hooks = pytest.importorskip("accelerate.hooks")
    from linattn.hf import kernelize
    ref, fast, _ = pair("qwen3_5")
    twin = ref.__class__(ref.config)
    twin.load_state_dict(ref.state_dict())

    class Count(hooks.ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.calls += 1
            return args, kwargs
    hooks.add_hook_to_module(twin.get_submodule("model.layers.0.linear_attn"), Count())
    assert kernelize(twin).patched == ["model.layers.0.linear_attn"]
    ids = _ids(24, 11, 1)
    with torch.no_grad():
        assert _maxdiff(twin(ids, use_cache=False).logits, fast(ids, use_cache=False).logits) == 0
    assert Count.calls == 1


def test_mamba2_decode_values_per_head():
    """The decode step takes one dt / A / D per head: an expand (stride 0) is accepted without reading values,
    a tensor that varies inside a head is refused."""
    from linattn.errors import LinattnError
    from linattn.hf.kernelize import mamba2_state_update
    H, P, N = 2, 3, 4
    state = torch.zeros(1, H, P, N)
    x, B, C = torch.randn(1, H, P), torch.randn(1, 1, N), torch.randn(1, 1, N)
    dt = torch.rand(1, H)[..., None].expand(-1, -1, P)
    A = -torch.rand(H)[:, None, None].expand(-1, P, N)
    y = mamba2_state_update(state.clone(), x, dt, A, B, C)
    assert torch.allclose(y, mamba2_state_update(state.clone(), x, dt.contiguous(), A.contiguous(), B, C))
    with pytest.raises(LinattnError, match="dt varies inside a head"):
        mamba2_state_update(state.clone(), x, torch.rand(1, H, P), A, B, C)
