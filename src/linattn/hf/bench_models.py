"""The models of `linattn bench hf` (kept under linattn.hf: only this package imports transformers)."""
from __future__ import annotations

import copy

import torch
import transformers as tf

from ..errors import LinattnError
from .infer_models import qwen35_model
from .kernelize import kernelize

KINDS = ("gdn", "kda", "mamba2", "lightning", "bamba", "granite", "nemotron_h", "qwen3.5-530m")


def build_model(kind: str, quick: bool, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A causal LM of `kind` with random weights (fp32, eval mode): the mixer layer (+ a minimal softmax layer), or
    for qwen3.5-530m the whole model of `linattn bench infer`'s shape of that name (its own vocabulary, not
    vocab_size; quick: the registry's tiny shape)."""
    if kind == "qwen3.5-530m":
        from ..bench.infer import SHAPES  # the one definition of the shape (bench infer's registry)

        return qwen35_model(SHAPES["tiny" if quick else kind], torch.float32, seed)
    torch.manual_seed(seed)
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "gdn":
        d, hk, hv, dk = (64, 2, 4, 16) if quick else (1024, 16, 32, 128)
        cfg = tf.Qwen3_5TextConfig(**ids, vocab_size=vocab_size, hidden_size=d, intermediate_size=2 * d,
                                   num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                                   head_dim=16, linear_num_key_heads=hk, linear_num_value_heads=hv,
                                   linear_key_head_dim=dk, linear_value_head_dim=dk, linear_conv_kernel_dim=4,
                                   layer_types=["linear_attention", "full_attention"])
        model = tf.Qwen3_5ForCausalLM(cfg)
    elif kind == "kda":
        # Kimi Linear's KDA layer (dense MLP), then its MLA layer (Kimi-Linear-48B's heads: 32, latent 512, nope
        # 128, rope 64, v 128) with an MoE feed-forward (its expert size 1024 and router: sigmoid, correction bias,
        # scaling 2.446; 8 experts, top 2, one shared, where the checkpoint has 256, top 8)
        d, h, dk = (64, 4, 16) if quick else (2304, 32, 128)
        ha, r, nope, rope, dv, hid = (2, 16, 16, 8, 16, 16) if quick else (32, 512, 128, 64, 128, 1024)
        cfg = tf.KimiLinearConfig(**ids, vocab_size=vocab_size, hidden_size=d, intermediate_size=2 * d,
                                  num_hidden_layers=2, num_attention_heads=ha, num_key_value_heads=ha,
                                  linear_num_heads=h, linear_head_dim=dk, linear_conv_kernel_dim=4,
                                  kv_lora_rank=r, q_lora_rank=None, qk_rope_head_dim=rope, v_head_dim=dv,
                                  qk_nope_head_dim=nope, moe_intermediate_size=hid, num_local_experts=8,
                                  num_experts_per_tok=2, num_shared_experts=1, routed_scaling_factor=2.446,
                                  layer_types=["linear_attention", "full_attention"],
                                  mlp_layer_types=["dense", "sparse"])
        model = tf.KimiLinearForCausalLM(cfg)
    elif kind == "mamba2":
        d, h, p, n = (64, 4, 32, 16) if quick else (1024, 32, 64, 128)
        cfg = tf.Mamba2Config(**ids, vocab_size=vocab_size, hidden_size=d, num_heads=h, head_dim=p, state_size=n,
                              n_groups=1, expand=2, conv_kernel=4, num_hidden_layers=1, chunk_size=256)
        model = tf.Mamba2ForCausalLM(cfg)
    elif kind == "lightning":
        # MiniMax's lightning attention (a block-wise decayed linear attention; MiniMax-Text-01 is hidden 6144,
        # 64 heads x 128: here 16 heads x 128), its MoE feed-forward with 2 experts, top 1
        d, h, dk = (64, 4, 16) if quick else (2048, 16, 128)
        cfg = tf.MiniMaxConfig(**ids, vocab_size=vocab_size, hidden_size=d, intermediate_size=2 * d,
                               num_hidden_layers=2, num_attention_heads=h, num_key_value_heads=h, head_dim=dk,
                               num_local_experts=2, num_experts_per_tok=1, block_size=256,
                               layer_types=["linear_attention", "full_attention"])
        model = tf.MiniMaxForCausalLM(cfg)
    elif kind == "bamba":
        # a Mamba2 hybrid: Bamba's Mamba2 layer as the mamba2 kind's, then a minimal softmax layer (1 head)
        d, h, p, n = (64, 4, 32, 16) if quick else (1024, 32, 64, 128)
        cfg = tf.BambaConfig(**ids, vocab_size=vocab_size, hidden_size=d, intermediate_size=2 * d,
                             num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                             attn_layer_indices=[1], mamba_n_heads=h, mamba_d_head=p, mamba_n_groups=1,
                             mamba_d_state=n, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256)
        model = tf.BambaForCausalLM(cfg)
    elif kind == "granite":
        # Granite-4.0-H: the mamba2 kind's layer, then a minimal softmax layer, each with the shared SwiGLU MLP
        # (dense, as Granite-4.0-H-micro; intermediate 2 x hidden) and Granite's multipliers
        d, h, p, n = (64, 4, 32, 16) if quick else (1024, 32, 64, 128)
        cfg = tf.GraniteMoeHybridConfig(**ids, vocab_size=vocab_size, hidden_size=d, shared_intermediate_size=2 * d,
                                        num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                                        num_local_experts=0, layer_types=["linear_attention", "full_attention"],
                                        mamba_n_heads=h, mamba_d_head=p, mamba_n_groups=1, mamba_d_state=n,
                                        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
                                        embedding_multiplier=12.0, residual_multiplier=0.22,
                                        attention_multiplier=0.0078125, logits_scaling=4.0)
        model = tf.GraniteMoeHybridForCausalLM(cfg)
    elif kind == "nemotron_h":
        # Nemotron-H: the mamba2 kind's layer (a block of its own), a MoE block (8 relu^2 experts of hidden / 2,
        # top 2, a relu^2 shared expert of hidden, the grouped sigmoid router), a minimal softmax block, a relu^2
        # MLP block (2 x hidden)
        d, h, p, n = (64, 4, 32, 16) if quick else (1024, 32, 64, 128)
        cfg = tf.NemotronHConfig(**ids, vocab_size=vocab_size, hidden_size=d, intermediate_size=2 * d,
                                 layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                                 num_attention_heads=1, num_key_value_heads=1, head_dim=16, mamba_num_heads=h,
                                 mamba_head_dim=p, n_groups=1, ssm_state_size=n, conv_kernel=4, expand=2,
                                 chunk_size=256, n_routed_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=d // 2, moe_shared_expert_intermediate_size=d, n_group=1,
                                 topk_group=1)
        model = tf.NemotronHForCausalLM(cfg)
    else:
        raise LinattnError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return model.float().eval()


def pair(kind: str, quick: bool, vocab_size: int, seed: int = 0):
    """(unpatched, patched) copies of one model that share its parameters (kernelize replaces code, not weights):
    one copy of the weights in memory and one of a training step's gradients (each step first frees the last
    one's), 2.1 GB each for the 530M model."""
    ref = build_model(kind, quick, vocab_size, seed)
    fast = copy.deepcopy(ref, {id(p): p for p in ref.parameters()})
    kernelize(fast)
    return ref, fast
