"""Step `machine`: the GPU, driver and versions (torch, triton, fla), the measured bf16 / fp32 matmul rate and
the device-to-device copy bandwidth."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, Optional

import torch

from .. import common
from .base import Ctx
from .fla_ops import fla_summary


def _nvidia_smi() -> Optional[Dict[str, str]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        vals = [x.strip() for x in r.stdout.strip().splitlines()[0].split(",")]
        return dict(zip(("name", "driver", "memory", "max_sm_clock", "power_limit"), vals))
    except Exception as e:  # the tool is a nicety: the torch fields below stand without it
        return {"error": repr(e)}


def versions() -> Dict[str, Any]:
    v: Dict[str, Any] = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                         "python": sys.version.split()[0]}
    for name in ("triton", "numpy", "transformers"):
        try:
            v[name] = __import__(name).__version__
        except Exception as e:
            v[name] = f"not importable: {type(e).__name__}"
    v["fla"] = fla_summary()
    return v


def find_tool(name: str) -> Optional[str]:
    """`name` on PATH, else under CUDA_HOME / /usr/local/cuda."""
    exe = shutil.which(name)
    if exe:
        return exe
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", name), os.X_OK):
            return os.path.join(root, "bin", name)
    return None


def copy_bandwidth(mb: int, device: str) -> Dict[str, Any]:
    """Device-to-device copy of `mb` MiB: (bytes read + bytes written) / time."""
    n = mb * 2 ** 20 // 4
    a = torch.empty(n, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    t = common.time_fn(lambda: b.copy_(a), warmup=2, repeats=10, min_time_s=0.3, max_repeats=100, budget_s=10.0,
                       device=device)
    return {"MiB": mb, "GB_per_s": 2 * a.numel() * 4 / (t.median_ms * 1e-3) / 1e9, "timing": t.to_dict()}


def step_machine(ctx: Ctx, rec: Dict[str, Any], deadline: float) -> None:
    plan, dev = ctx.plan, ctx.device
    info = common.machine_info(dev)
    info["versions"] = versions()
    info["nvidia_smi"] = _nvidia_smi()
    info["compute_sanitizer"] = find_tool("compute-sanitizer")
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        info["gpu_properties"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                                  "memory_GiB": round(p.total_memory / 2 ** 30, 1), "sms": p.multi_processor_count}
        info["allow_tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    rec["info"] = info
    vs = info["versions"]
    rows = [["device", info.get("gpu") or f"CPU: {info['cpu']}"],
            ["driver", (info["nvidia_smi"] or {}).get("driver", "no nvidia-smi")],
            ["torch / CUDA", f"{vs['torch']} / {vs['cuda_runtime']}"], ["triton", vs["triton"]],
            ["fla", vs["fla"]], ["transformers", vs["transformers"]],
            ["CPU cores", os.cpu_count()], ["TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "unset")],
            ["TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR", "unset")]]
    rec["table"] = {"headers": ["what", "value"], "rows": rows}
    ctx.report.save()
    rates = {}
    for dt in (torch.bfloat16, torch.float32):
        if time.monotonic() > deadline:
            break
        # fp32 is measured as fp32 (tf32 off: PyTorch's default for matmuls)
        r = common.matmul_rate(n=plan["matmul_n"], dtype=dt, device=dev, repeats=5)
        rates[str(dt).replace("torch.", "")] = r
        rows.append([f"matmul {r['dtype']} n={r['n']}",
                     f"{r['gflops'] / 1e3:.1f} TFLOP/s (best {r['gflops_best'] / 1e3:.1f})"])
        ctx.report.save()
    rec["matmul"] = rates
    if time.monotonic() < deadline:
        bw = copy_bandwidth(plan["copy_mb"], dev)
        rec["copy"] = bw
        rows.append([f"copy {bw['MiB']} MiB", f"{bw['GB_per_s']:.0f} GB/s (read + write)"])
