"""The transformers model of `linattn bench infer` (kept under linattn.hf: only this package imports transformers):
a Qwen3.5-shaped causal LM (Gated DeltaNet and gated softmax layers, 3 : 1) with random weights."""
from __future__ import annotations

from typing import Any, Dict

import torch
import transformers as tf

from .kernelize import kernelize


def qwen35_model(shape: Dict[str, Any], dtype: torch.dtype = torch.float32, seed: int = 0,
                 kernelized: bool = False) -> torch.nn.Module:
    """A `Qwen3_5ForCausalLM` of `shape` (the keys of `linattn.bench.infer.SHAPES`) with random weights, in dtype,
    eval mode; `kernelized`: served by `linattn.hf.kernelize`.

    Args:
        shape: d, layers, every (one softmax layer per `every` layers, the last of each group), vocab, inter,
            lin_heads, lin_dim, attn_heads, kv_heads, attn_dim.
        dtype: The weights' dtype.
        seed: The seed of the random weights.
        kernelized: Patch the model with `kernelize`.

    Returns:
        The model.
    """
    s = shape
    torch.manual_seed(seed)
    types = ["full_attention" if (i + 1) % s["every"] == 0 else "linear_attention" for i in range(s["layers"])]
    cfg = tf.Qwen3_5TextConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=s["vocab"],
                               hidden_size=s["d"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                               num_attention_heads=s["attn_heads"], num_key_value_heads=s["kv_heads"],
                               head_dim=s["attn_dim"], linear_num_key_heads=s["lin_heads"],
                               linear_num_value_heads=s["lin_heads"], linear_key_head_dim=s["lin_dim"],
                               linear_value_head_dim=s["lin_dim"], linear_conv_kernel_dim=4, layer_types=types,
                               tie_word_embeddings=True)
    model = tf.Qwen3_5ForCausalLM(cfg).to(dtype).eval()
    if kernelized:
        kernelize(model)
    return model


def write_stand_in_tokenizer(folder: str, vocab: int) -> None:
    """Writes a byte-level BPE tokenizer of at most `vocab` tokens (the characters of a fixed sentence and the
    merges learnt from it: llama.cpp refuses a BPE vocabulary without merges) into `folder` as transformers saves
    one: what llama.cpp's converter needs beside a random model's weights (it converts the vocabulary too; ids the
    tokenizer lacks become padding tokens; llama-bench feeds token ids, never text).

    Args:
        folder: The saved model's folder.
        vocab: The model's vocabulary size (at least 256).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 320), show_progress=False)
    tok.train_from_iterator(["linear attention decodes a token in constant time and memory"] * 4, trainer)
    tf.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
