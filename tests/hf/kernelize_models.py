"""Tiny random transformers models of every architecture linattn.hf.kernelize serves (no downloads), and the
(unpatched, kernelized) pairs the kernelize tests compare: tests/hf/test_kernelize*.py."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.hf import kernelize  # noqa: E402
from linattn.hf.kernelize import torch_fallbacks  # noqa: E402


@pytest.fixture(autouse=True)
def transformers_torch_code():
    """The unpatched models run transformers' PyTorch fallbacks, also where flash-linear-attention is installed
    (transformers then binds fla's Triton kernels, which cannot run on CPU). Autouse where a test module imports it."""
    with torch_fallbacks():
        yield


V = 97          # vocabulary
T = 21          # not a multiple of any chunk size used on either side


def _cfg(name, **kw):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"the installed transformers ({transformers.__version__}) has no {name}")
    return cls(**kw)


def _model(name, cfg):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"the installed transformers ({transformers.__version__}) has no {name}")
    return cls(cfg)


GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
           linear_conv_kernel_dim=4)
ATTN = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=True)
MAMBA_H = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
               mamba_expand=2, mamba_chunk_size=8)


def build(arch):
    torch.manual_seed(0)
    if arch == "qwen3_next":
        cfg = _cfg("Qwen3NextConfig", **ATTN, **GDN, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=1,
                   layer_types=["linear_attention", "full_attention"])
        return _model("Qwen3NextForCausalLM", cfg)
    if arch == "qwen3_5":
        cfg = _cfg("Qwen3_5TextConfig", **ATTN, **GDN, num_hidden_layers=2,
                   layer_types=["linear_attention", "full_attention"])
        return _model("Qwen3_5ForCausalLM", cfg)
    if arch == "olmo_hybrid":
        cfg = _cfg("OlmoHybridConfig", **{k: v for k, v in ATTN.items() if k != "head_dim"}, **GDN,
                   num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                   linear_allow_neg_eigval=True)
        return _model("OlmoHybridForCausalLM", cfg)
    if arch == "kimi_linear":
        cfg = _cfg("KimiLinearConfig", **dict(ATTN, num_key_value_heads=4, head_dim=None), num_hidden_layers=2,
                   moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                   kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                   linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])
        return _model("KimiLinearForCausalLM", cfg)
    if arch == "glm5_next":
        cfg = _cfg("Glm5NextTextConfig", **dict(ATTN, num_key_value_heads=4), num_hidden_layers=2,
                   moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                   kv_lora_rank=16, q_lora_rank=16,
                   qk_rope_head_dim=0, v_head_dim=8, qk_nope_head_dim=8, linear_head_dim=8, linear_num_heads=4,
                   linear_conv_kernel_dim=4, index_head_dim=8, index_n_heads=2, index_topk=32, index_kpool=4,
                   layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                      projection_intermediate_size=16, patch_size=2, image_size=8)
        return _model("Glm5NextForConditionalGeneration", _cfg("Glm5NextConfig", text_config=cfg.to_dict(),
                                                               vision_config=vision))
    if arch == "minimax":
        cfg = _cfg("MiniMaxConfig", **ATTN, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                   block_size=8, layer_types=["linear_attention", "full_attention"])
        return _model("MiniMaxForCausalLM", cfg)
    if arch == "mamba2":
        cfg = _cfg("Mamba2Config", vocab_size=V, hidden_size=32, num_heads=4, head_dim=16, state_size=8,
                   n_groups=2, expand=2, conv_kernel=4, num_hidden_layers=2, chunk_size=8, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)
        return _model("Mamba2ForCausalLM", cfg)
    if arch == "bamba":
        cfg = _cfg("BambaConfig", **{k: v for k, v in ATTN.items() if k != "head_dim"}, num_hidden_layers=2,
                   attn_layer_indices=[1], **MAMBA_H)
        return _model("BambaForCausalLM", cfg)
    if arch == "falcon_h1":
        cfg = _cfg("FalconH1Config", **{k: v for k, v in ATTN.items() if k != "head_dim"}, num_hidden_layers=2,
                   mamba_d_ssm=64, **MAMBA_H)
        return _model("FalconH1ForCausalLM", cfg)
    if arch == "granitemoehybrid":
        cfg = _cfg("GraniteMoeHybridConfig", **{k: v for k, v in ATTN.items() if k != "head_dim"},
                   num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
                   layer_types=["mamba", "attention"], **MAMBA_H)
        return _model("GraniteMoeHybridForCausalLM", cfg)
    if arch == "nemotron_h":
        cfg = _cfg("NemotronHConfig", **ATTN, layers_block_type=["mamba", "attention"], ssm_state_size=8,
                   mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=8)
        return _model("NemotronHForCausalLM", cfg)
    if arch == "qwen3_5_moe":
        cfg = _cfg("Qwen3_5MoeTextConfig", **{k: v for k, v in ATTN.items() if k != "intermediate_size"}, **GDN,
                   num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])
        return _model("Qwen3_5MoeForCausalLM", cfg)
    if arch == "bailing_hybrid":
        cfg = _cfg("BailingHybridConfig", **dict(ATTN, num_key_value_heads=4), num_hidden_layers=2,
                   moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                   kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                   short_conv_kernel_size=4, n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"],
                   layer_types=["linear_attention", "full_attention"])
        return _model("BailingHybridForCausalLM", cfg)
    if arch == "zamba2":
        cfg = _cfg("Zamba2Config", **{k: v for k, v in ATTN.items() if k not in ("head_dim", "num_key_value_heads")},
                   num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_d_conv=4,
                   mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=8, num_mem_blocks=1,
                   use_mem_eff_path=False)
        return _model("Zamba2ForCausalLM", cfg)
    if arch == "lara_mini":
        cfg = _cfg("LaraMiniConfig", **{k: v for k, v in ATTN.items() if k != "intermediate_size"}, **GDN,
                   num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=16, sliding_window=8,
                   layer_types=["linear_attention", "sliding_attention", "full_attention"])
        return _model("LaraMiniForCausalLM", cfg)
    if arch == "nemotron_h_omni":   # the multimodal wrapper, text-only inputs: its language model is Nemotron-H's
        text = _cfg("NemotronHConfig", **ATTN, layers_block_type=["mamba", "attention"], ssm_state_size=8,
                    mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=8)
        vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=4, image_size=16,
                      max_img_size=32, num_registers=1, num_cls_tokens=1, video_temporal_patch_size=2)
        cfg = _cfg("NemotronH_Omni_Reasoning_V3_Config", text_config=text.to_dict(), vision_config=vision,
                   audio_config=None, projector_hidden_size=16)
        return _model("NemotronH_Omni_Reasoning_V3", cfg)
    raise AssertionError(arch)


ARCHS = ["qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear", "glm5_next", "minimax", "mamba2", "bamba",
         "falcon_h1", "granitemoehybrid", "nemotron_h", "qwen3_5_moe", "bailing_hybrid", "zamba2", "lara_mini",
         "nemotron_h_omni"]


def pair(arch, dtype=torch.float32):
    ref = build(arch).to(dtype).eval()
    with torch.no_grad():
        for mod in ref.modules():
            # at init (dt ~1e-3, B and C ~1e-2 at hidden 32) the scan hardly shows next to the D skip: dt ~ 1 and
            # 10x larger projections make it count
            if type(mod).__name__ in ("Mamba2Mixer", "BambaMixer", "FalconH1Mixer", "GraniteMoeHybridMambaLayer",
                                      "NemotronHMamba2Mixer", "Zamba2MambaMixer"):
                mod.dt_bias.fill_(0.5)
                mod.in_proj.weight.mul_(10.0)
    if dtype == torch.float64 and hasattr(ref, "set_experts_implementation"):
        ref.set_experts_implementation("eager")          # torch._grouped_mm has no fp64
    fast = copy.deepcopy(ref)
    report = kernelize(fast)
    assert report.patched, f"{arch}: nothing patched"
    assert not report.unserved
    return ref, fast, report


def ids(seed, n=T, b=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (b, n), generator=g)


def maxdiff(a, b):
    return (a - b).abs().max().item()


