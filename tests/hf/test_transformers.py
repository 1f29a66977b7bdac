"""linattn.hf: transformers models (config, save/load, generate with transformers' cache layers,
left padding, loss, export/import with the tokenizer, pipeline, Trainer). Skipped without transformers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import linattn.hf as lh  # noqa: E402
from linattn import (  # noqa: E402
    LanguageModel,
    LMConfig,
    checkpoint as ckpt,  # noqa: E402
)
from linattn.cli import main as cli_main  # noqa: E402
from linattn.data.tokenizer import train_tokenizer  # noqa: E402
from linattn.errors import LinattnError  # noqa: E402
from linattn.models.family import config_to_dict  # noqa: E402
from tests.helpers import import_graph_once  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"
MIXERS = {"softmax": "softmax", "linear": "linear-elu+1", "delta": "gated-deltanet",
          "hybrid": ["gated-deltanet", "softmax"]}
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny(mixer, vocab=64, **kw) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(LMConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, mixer=mixer, **kw)).eval()


def test_only_linattn_hf_imports_transformers():
    graph = import_graph_once()
    users = sorted(m for m, ts in graph.items() if any(t.startswith("linattn.hf") for t in ts)
                   and not m.startswith("linattn.hf"))
    # lazily: `bench hf`; `bench infer`'s and `bench quant`'s transformers rows; `bench ops`'s transformers peer
    # row; the export-hf / import-hf commands; quantizing a kernelized transformers model
    assert users == ["linattn.bench.hf", "linattn.bench.infer", "linattn.bench.ops", "linattn.bench.quant",
                     "linattn.cli"]
    for path in (SRC / "linattn").rglob("*.py"):
        if "hf" not in path.relative_to(SRC / "linattn").parts:
            text = path.read_text(encoding="utf-8")
            assert "import transformers" not in text and "from transformers" not in text, path


def test_config_wraps_the_whole_lm_config():
    lm = LMConfig(vocab_size=100, d_model=32, n_layers=3, n_heads=2, mixer=["efla", "swa", "softmax"],
                  memory_lobe="causal", ffn="moe", n_experts=3)
    cfg = lh.LinattnConfig.from_lm_config(lm)
    assert cfg.model_type == "linattn" and cfg.lm_config() == lm
    assert cfg.layer_types == ["hybrid", "hybrid_sliding", "hybrid"] and cfg.sliding_window == 256
    again = lh.LinattnConfig.from_dict(cfg.to_dict())
    assert again.lm_config() == lm and transformers.AutoConfig.for_model("linattn").model_type == "linattn"


def test_save_load_round_trip(tmp_path):
    m = tiny(["gated-deltanet", "softmax"], memory_lobe="causal", ffn="moe", n_experts=3)
    hf = lh.LinattnForCausalLM.from_linattn(m).eval()
    hf.save_pretrained(tmp_path)
    assert {"configuration_linattn.py", "modeling_linattn.py", "model.safetensors"} <= set(os.listdir(tmp_path))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, lh.LinattnForCausalLM)
    ids = torch.randint(0, 64, (2, 9))
    assert torch.equal(loaded(ids).logits, m(ids).logits)
    assert torch.equal(hf(ids).logits, m(ids).logits)


@pytest.mark.parametrize("kind", list(MIXERS))
def test_greedy_generate_matches_linattn(kind):
    m = tiny(MIXERS[kind])
    hf = lh.LinattnForCausalLM.from_linattn(m)
    ids = torch.randint(1, 64, (2, 7))   # 0 is the pad token
    assert torch.equal(hf.generate(ids, max_new_tokens=8, **GREEDY), m.generate(ids, 8, temperature=0))


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_generate_scores_are_the_full_forward_logits(kind):
    # every step's scores must be the logits of a plain forward over the whole sequence so far: this
    # fails when the cache is not threaded between steps (transformers 5.24 renamed `past_key_values`
    # to `cache`, and a model that ignored the new name re-prefilled each new token alone)
    m = tiny(MIXERS[kind])
    hf = lh.LinattnForCausalLM.from_linattn(m)
    ids = torch.randint(1, 64, (2, 5))
    out = hf.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY)
    full = m(out.sequences).logits
    for i, scores in enumerate(out.scores):
        torch.testing.assert_close(scores, full[:, 4 + i], rtol=1e-5, atol=1e-5)


def test_cache_under_either_name():
    m = tiny(MIXERS["delta"])
    hf = lh.LinattnForCausalLM.from_linattn(m)
    ids = torch.randint(1, 64, (1, 6))
    for name in ("cache", "past_key_values"):
        c = transformers.DynamicCache(config=hf.config)
        hf(ids[:, :5], use_cache=True, **{name: c})
        step = hf(ids[:, 5:], use_cache=True, **{name: c}).logits
        torch.testing.assert_close(step[:, -1], m(ids).logits[:, -1], rtol=1e-5, atol=1e-5)
    with pytest.raises(LinattnError, match="not both"):
        hf(ids, cache=c, past_key_values=c)


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_left_padded_batch_equals_each_sequence_alone(kind):
    m = tiny(MIXERS[kind], memory_lobe="causal")
    hf = lh.LinattnForCausalLM.from_linattn(m)
    a, b = torch.randint(1, 64, (4,)), torch.randint(1, 64, (7,))
    ids = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), a]), b])
    mask = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), torch.ones(4, dtype=torch.long)]),
                        torch.ones(7, dtype=torch.long)])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    assert torch.equal(out[0, 3:], m.generate(a, 6, temperature=0))
    assert torch.equal(out[1], m.generate(b, 6, temperature=0))
    beams = hf.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, **GREEDY)
    assert torch.equal(beams[0, 3:], hf.generate(a[None], max_new_tokens=5, num_beams=3, **GREEDY)[0])
    sampled = hf.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=8, eos_token_id=None,
                          pad_token_id=0)
    assert sampled.shape == (2, 12)
    # the cache is transformers' own: linear-attention layers, and keys/values for the softmax layer
    cache = transformers.DynamicCache(config=hf.config)
    hf(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert all(isinstance(la, transformers.cache_utils.LinearAttentionCacheLayerMixin) for la in cache.layers)
    if kind == "hybrid":
        assert cache.layers[1].keys.shape[2] == 7   # [B, H, T, D], left-padded


def test_forward_padding_loss_and_logits_to_keep():
    m = tiny("efla", memory_lobe="causal")
    hf = lh.LinattnForCausalLM.from_linattn(m)
    a, b = torch.randint(0, 64, (5,)), torch.randint(0, 64, (8,))
    ids = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), a]), b])
    mask = (torch.arange(8) >= 3).long().expand(2, 8).clone()
    mask[1] = 1
    logits = hf(ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[0, 3:], m(a[None]).logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[1], m(b[None]).logits[0], rtol=1e-5, atol=1e-5)
    out = hf(b[None], labels=b[None], logits_to_keep=1)
    full = m(b[None]).logits
    ref = torch.nn.functional.cross_entropy(full[0, :-1], b[1:])
    torch.testing.assert_close(out.loss, ref)
    assert out.logits.shape == (1, 1, 64) and torch.allclose(out.logits[0, 0], full[0, -1], atol=1e-6)
    with pytest.raises(LinattnError):   # inputs_embeds are accepted (tests/hf/test_model.py), of hidden_size only
        hf(inputs_embeds=torch.zeros(1, 2, 31))


def test_export_tokenizer_pipeline_remote_code_and_back(tmp_path):
    text = ["def add(x, y):\n    return x + y\n" * 10, "class Point:\n    x = 0\n    y = 0\n" * 10]
    tok = train_tokenizer(text, vocab_size=300)
    m = tiny("gated-deltanet", vocab=tok.vocab_size)
    ckpt.save_checkpoint(tmp_path / "run", 7, m, model_config=config_to_dict(m.config), tokenizer=tok)
    hf_dir = tmp_path / "hf"
    assert cli_main(["export-hf", "--checkpoint", str(tmp_path / "run"), "--out", str(hf_dir)]) == 0
    assert cli_main(["export-hf", "--checkpoint", str(tmp_path / "run"), "--out", str(hf_dir)]) == 2  # no overwrite
    t = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert t("def add(x")["input_ids"] == tok.encode("def add(x") and t.eos_token == "<|endoftext|>"
    gen = transformers.pipeline("text-generation", model=str(hf_dir))
    out = gen("def add(", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert out.startswith("def add(") and len(out) > len("def add(")
    code = ("import sys; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(hf_dir)!r}, trust_remote_code=True); "
            "print(type(m).__name__)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.stdout.strip().endswith("LinattnForCausalLM"), res.stderr[-2000:]
    assert cli_main(["import-hf", "--model", str(hf_dir), "--out", str(tmp_path / "back")]) == 0
    back = ckpt.load_checkpoint(tmp_path / "back")
    ids = torch.randint(0, tok.vocab_size, (1, 6))
    assert back.step == 7 and torch.equal(back.model(ids).logits, m(ids).logits)
    assert back.tokenizer.encode("class") == tok.encode("class")


def test_hf_trainer_loss_falls(tmp_path):
    m = tiny(["gated-deltanet", "softmax"], vocab=16)
    hf = lh.LinattnForCausalLM.from_linattn(m)
    hf.activation_checkpointing_enable()
    assert m.activation_checkpointing
    seq = torch.arange(16) % 8
    data = [{"input_ids": seq.roll(i), "labels": seq.roll(i)} for i in range(16)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4,
                                          learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant")
    trainer = transformers.Trainer(model=hf, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0]
