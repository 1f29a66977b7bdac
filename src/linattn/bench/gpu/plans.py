"""The shapes of `linattn bench gpu`: the GPU's, and the dry run's tiny ones (CPU, Triton's interpreter)."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch


def gpu_backends() -> Tuple[str, ...]:
    """The GPU implementations the correctness step checks: the fla backend where linattn has it, then Triton."""
    from ...ops.backend import BACKENDS

    return ("fla", "triton") if "fla" in BACKENDS else ("triton",)


def gpu_plan() -> Dict[str, Any]:
    """The GPU run: correctness at T in 65, 1, 2048 (K 128 first, then 64), fp32 / bf16, the fla
    backend and the Triton kernels; timing at B*H = 64, K = V = 128, bf16, T = 8k first (the targets), then 2k,
    32k; a 12-layer d 1024 LM at T = 8k; the compiled CPU kernels at T = 16k on 1-16 threads."""
    return dict(device="cuda", B=4, H=16, Ks=(128, 64), Ts=(65, 1, 2048), dtypes=(torch.float32, torch.bfloat16),
                backends=gpu_backends(), chunk=64, varlen=(1, 63, 64, 65, 700, 2048 - 1 - 63 - 64 - 65 - 700),
                rec_max_T=2048, matmul_n=8192, copy_mb=1024,
                san=dict(H=2, K=64, V=64, lens=(1, 63, 66), dtypes=("float32", "bfloat16")), reps=(2, 5, 0.2),
                time=dict(B=4, H=16, K=128, V=128, Ts=(8192, 2048, 32768), dtype=torch.bfloat16),
                lm=dict(vocab=32000, d_model=1024, n_layers=12, n_heads=8, B=2, T=8192, prompt=1024,
                        decode=32, steps=3),
                cpu=dict(B=1, H=16, K=64, V=64, T=16384, threads=(1, 2, 4, 8, 16), repeats=3))


def dry_plan() -> Dict[str, Any]:
    """Every step on CPU with tiny shapes: checks the command, not the GPU (`make test` runs it)."""
    return dict(device="cpu", B=1, H=1, Ks=(16,), Ts=(17,), dtypes=(torch.float32,), backends=gpu_backends(),
                chunk=16, varlen=(1, 16, 3), few_ops=("linear-chunk", "gated-deltanet-chunk"), rec_max_T=17,
                matmul_n=128, copy_mb=4,
                san=dict(H=1, K=16, V=16, lens=(1, 17), dtypes=("float32",)), reps=(0, 1, 0.0),
                time=dict(B=1, H=1, K=16, V=16, Ts=(16,), dtype=torch.float32),
                lm=dict(vocab=64, d_model=32, n_layers=1, n_heads=2, B=1, T=16, prompt=8, decode=2, steps=1),
                cpu=dict(B=1, H=2, K=16, V=16, T=64, threads=(1, 2), repeats=1))
