"""`linattn bench gpu`: the prepared GPU check (issue 32), one command within a time budget: the machine
and its measured matmul rate and copy bandwidth, every Triton kernel compiled against the PyTorch forms,
compute-sanitizer, timings against SDPA and flash-linear-attention, and LM training and decoding steps.

    PYTHONPATH=src python -m linattn bench gpu --out DIR [--budget-min 7] [--steps ...] [--wheels DIR]
                                                [--dry-run] [--overwrite]

The steps run in this order, each within its share of the budget (time a step does not use passes to
the next ones); DIR/gpu.json and DIR/gpu.md are rewritten after every step and every case, so a run
that is cut short (budget, kill) still reports, and the cases or steps that did not fit are listed as
skipped with the reason. A step that fails is recorded (its traceback's last lines) and the run goes
on. The report's status is "finished" (every step ran to its end), "incomplete" (cases or steps did
not fit) or "cut short" (the budget ran out inside a step, or SIGTERM). Exit code 0 when every case
that ran passed, 1 when one failed or raised.

  machine      GPU name, driver, CUDA, torch, triton (and fla when it imports); bf16 / fp32 matmul
               rate (fp32 without tf32) and device-to-device copy bandwidth, measured
  correctness  backend="triton" against backend="torch" on the same device: linear attention (chunk,
               recurrent), DeltaNet / Gated DeltaNet (qk_l2norm) / EFLA / KDA (per-channel gates; chunk,
               recurrent), GLA (recurrent: per-channel gates); B=4 H=16,
               K=V=64 and 128, T in 1, 63, 64, 65, 2048, 8192, fp32 and bf16, with and without gates,
               initial_state, uneven cu_seqlens; outputs, final states, gradients of every input;
               tolerances of docs/triton.md (ratio of RMS errors: fp32 1e-3, bf16 1e-2); grouped value
               heads (entry points, grouped against expanded q/k)
  sanitizer    compute-sanitizer memcheck, then racecheck, on one small forward + backward per kernel
               (a subprocess running a generated script; PyTorch's caching allocator is off so that
               memcheck sees the real bounds of every tensor); skipped when the tool is missing
  timing       forward and forward + backward, B=4 H=16 K=V=128 bf16, T in 16k, 2k, 8k, 32k (16k first:
               the targets are stated there): linattn Triton, linattn PyTorch on the GPU, SDPA, fla
               (chunk_simple_gla, chunk_delta_rule, chunk_gated_delta_rule, chunk_kda) when it imports;
               TFLOP/s of the chunk algorithm's matmuls as a fraction of the measured bf16 rate
  lm           one training step (AdamW, bf16 autocast) and decoding (ms/token) of a small LM per mixer:
               softmax, linear (elu+1), Gated DeltaNet, EFLA; tokens/s and peak memory

`--dry-run` runs every step on CPU under Triton's interpreter (TRITON_INTERPRET=1, set in a child
process when triton is already imported) with tiny shapes: it checks the command, not the GPU.
The command needs only torch, triton and numpy (no tqdm, safetensors, tokenizers, matplotlib,
transformers): it never imports the trainer or the plotting code.
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from ..cli_support import UsageError
from ..errors import LinattnError
from ..io import atomic_write_text, write_json
from . import common

DESCRIPTION = __doc__
PROG = "linattn bench gpu"
STEPS = ("machine", "correctness", "sanitizer", "timing", "lm")
# shares of the budget; a step's deadline is its share of what is left when it starts
SHARES = {"machine": 0.06, "correctness": 0.32, "sanitizer": 0.14, "timing": 0.34, "lm": 0.14}
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
_STEP_TITLES = {
    "machine": "machine and its measured rates",
    "correctness": "Triton kernels against the PyTorch forms (same device)",
    "sanitizer": "compute-sanitizer",
    "timing": "timings (ms; TFLOP/s of the chunk algorithm's matmuls, % of the measured bf16 matmul rate)",
    "lm": "LM training step and decoding",
}


class BudgetExceeded(BaseException):
    """The run's time budget ran out in the middle of a step. A BaseException, like KeyboardInterrupt,
    so that no `except Exception` on the way (ours, torch's, fla's) swallows it."""


class Terminated(BaseException):
    """SIGTERM: record what is done and stop (a BaseException, as above)."""


class NotCovered(LinattnError):
    """A timing case the Triton kernels do not cover (reported as such, not as an error)."""


def add_arguments(p):
    """The options of `linattn bench gpu`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--out", required=True, help="output folder: DIR/gpu.json and DIR/gpu.md")
    p.add_argument("--budget-min", type=float, default=7.0, help="time budget of the whole run, minutes (default 7)")
    p.add_argument("--steps", nargs="+", default=list(STEPS), metavar="STEP",
                   help="which steps, in the fixed order (default: all): " + " ".join(STEPS))
    p.add_argument("--dry-run", action="store_true",
                   help="every step on CPU under TRITON_INTERPRET=1 with tiny shapes (checks the command)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR/gpu.json and DIR/gpu.md if they exist")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--wheels", default=None, metavar="DIR",
                   help="a folder of pure-Python wheels (fla-core, einops) to use without installing them: "
                        "unpacked to a temporary folder put first on sys.path")


def use_wheels(folder: str) -> List[str]:
    """Unpack every *.whl in `folder` into a temporary folder (removed at exit) and put it first on
    sys.path, so that a machine without network or write access to site-packages can import them.
    -> the wheels' file names."""
    import atexit
    import zipfile

    wheels = sorted(Path(folder).glob("*.whl"))
    if not wheels:
        raise UsageError(f"--wheels: no *.whl file in {folder}", prog=PROG)
    site = tempfile.mkdtemp(prefix="linattn-wheels-")
    atexit.register(shutil.rmtree, site, True)
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    sys.path.insert(0, site)
    return [w.name for w in wheels]


# ----------------------------------------------------------------------------------------------
# plans: the GPU shapes, and the dry run's tiny ones
# ----------------------------------------------------------------------------------------------

def gpu_plan() -> Dict[str, Any]:
    return dict(device="cuda", B=4, H=16, Ks=(64, 128), Ts=(65, 1, 63, 64, 2048, 8192), dtypes=(torch.float32,
                torch.bfloat16), chunk=64, varlen=(1, 63, 64, 65, 700, 2048 - 1 - 63 - 64 - 65 - 700),
                rec_max_T=2048, matmul_n=8192, copy_mb=1024,
                san=dict(H=2, K=64, V=64, lens=(1, 63, 66), dtypes=("float32", "bfloat16")), reps=(2, 5, 0.2),
                time=dict(B=4, H=16, K=128, V=128, Ts=(16384, 2048, 8192, 32768), dtype=torch.bfloat16),
                lm=dict(vocab=32000, d_model=1024, n_layers=4, n_heads=8, B=8, T=2048, prompt=1024,
                        decode=32, steps=3))


def dry_plan() -> Dict[str, Any]:
    return dict(device="cpu", B=1, H=1, Ks=(16,), Ts=(17,), dtypes=(torch.float32,), chunk=16,
                varlen=(1, 16, 3), few_ops=("linear-chunk", "gated-deltanet-chunk"), rec_max_T=17, matmul_n=128,
                copy_mb=4,
                san=dict(H=1, K=16, V=16, lens=(1, 17), dtypes=("float32",)), reps=(0, 1, 0.0),
                time=dict(B=1, H=1, K=16, V=16, Ts=(16,), dtype=torch.float32),
                lm=dict(vocab=64, d_model=32, n_layers=1, n_heads=2, B=1, T=16, prompt=8, decode=2, steps=1))


# ----------------------------------------------------------------------------------------------
# report: gpu.json and gpu.md, rewritten whenever something is recorded
# ----------------------------------------------------------------------------------------------

class Report:
    def __init__(self, paths, config: Dict[str, Any], steps: List[str]):
        self.paths = paths
        self.data: Dict[str, Any] = {
            "benchmark": "gpu", "status": "running", "config": config,
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "elapsed_s": 0.0,
            "steps": {s: {"status": "pending" if s in steps else "skipped",
                          **({} if s in steps else {"reason": "not in --steps"})} for s in STEPS},
        }
        self.t0 = time.monotonic()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        write_json(self.paths["json"], self.data)
        atomic_write_text(self.paths["md"], render_md(self.data))


def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        if x != x:
            return "nan"
        return f"{x:.3g}" if (abs(x) < 1e-2 or abs(x) >= 1e4) and x != 0 else f"{x:.3f}".rstrip("0").rstrip(".")
    return str(x)


def render_md(d: Dict[str, Any]) -> str:
    cfg = d["config"]
    out = [f"# linattn bench gpu{' (dry run: CPU, Triton interpreter, tiny shapes)' if cfg.get('dry_run') else ''}",
           "",
           f"started {d['started']}; status **{d['status']}**; {d['elapsed_s']:.0f} s of a "
           f"{cfg['budget_s']:.0f} s budget", "",
           f"command: `{cfg['command']}`", ""]
    counts = d.get("counts")
    if counts:
        out += ["cases: " + ", ".join(f"{k} {v}" for k, v in counts.items()), ""]
    for i, name in enumerate(STEPS, 1):
        s = d["steps"][name]
        head = f"## {i}. {name}: {_STEP_TITLES[name]}"
        out += [head, "", f"status: **{s['status']}**" + (f" ({s['seconds']:.1f} s)" if "seconds" in s else "")
                + (f"; {s['reason']}" if s.get("reason") else ""), ""]
        if s.get("error"):
            out += ["```", s["error"].rstrip(), "```", ""]
        for n in s.get("notes", []):
            out.append(f"- {n}")
        if s.get("notes"):
            out.append("")
        tab = s.get("table")
        if tab and tab["rows"]:
            out.append("| " + " | ".join(tab["headers"]) + " |")
            out.append("|" + "---|" * len(tab["headers"]))
            for r in tab["rows"]:
                out.append("| " + " | ".join(_fmt(c) for c in r) + " |")
            out.append("")
    out += ["## reading this file", "",
            "docs/triton.md, section 'GPU run (runbook)', says what each status means and what to do about it.",
            ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _tail(text: str, n: int = 12) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join(lines[-n:])


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


class Ctx:
    def __init__(self, plan, report: Report, log: Callable[[str], None], hard_end: float):
        self.plan, self.report, self.log, self.hard_end = plan, report, log, hard_end
        self.device = plan["device"]

    def left(self, deadline: float) -> float:
        return deadline - time.monotonic()


# ----------------------------------------------------------------------------------------------
# step 1: the machine
# ----------------------------------------------------------------------------------------------

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


def _versions() -> Dict[str, Any]:
    v: Dict[str, Any] = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                         "python": sys.version.split()[0]}
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception as e:
        v["triton"] = f"not importable: {e!r}"
    try:
        import numpy
        v["numpy"] = numpy.__version__
    except Exception:
        v["numpy"] = None
    fv = fla_version()
    ops = import_fla_ops()
    bad = {n: f"{type(e).__name__}: {e}" for n, e in ops.items() if isinstance(e, Exception)}
    if len(set(bad.values())) == 1 and len(bad) == len(ops):  # one cause (typically: not installed)
        v["fla"] = f"{fv or 'no wheel installed'}; ops not importable: {next(iter(bad.values()))}"
    else:
        v["fla"] = (fv or "on PYTHONPATH") + ("; ops import" if not bad else "; not importable: "
                                               + "; ".join(f"{n}: {e}" for n, e in bad.items()))
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
    info["versions"] = _versions()
    info["nvidia_smi"] = _nvidia_smi()
    info["compute_sanitizer"] = find_tool("compute-sanitizer")
    info["ncu"] = find_tool("ncu")
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        info["gpu_properties"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                                  "memory_GiB": round(p.total_memory / 2 ** 30, 1), "sms": p.multi_processor_count}
        info["allow_tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    rec["info"] = info
    rows = [["device", info.get("gpu") or f"CPU: {info['cpu']}"],
            ["driver", (info["nvidia_smi"] or {}).get("driver", "no nvidia-smi")],
            ["torch / CUDA", f"{info['versions']['torch']} / {info['versions']['cuda_runtime']}"],
            ["triton", info["versions"]["triton"]], ["fla", info["versions"]["fla"]],
            ["compute-sanitizer", info["compute_sanitizer"] or "not found"], ["ncu", info["ncu"] or "not found"],
            ["TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "unset")]]
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


# ----------------------------------------------------------------------------------------------
# step 2: correctness
# ----------------------------------------------------------------------------------------------

OPS = ("linear-chunk", "deltanet-chunk", "gated-deltanet-chunk", "kda-chunk", "efla-chunk", "linear-recurrent",
       "gated-deltanet-recurrent", "kda-recurrent", "gla-recurrent")
# grouped value heads (q/k heads = H // GROUP): the Triton entry points with grouped q, k against the
# same entry points with q, k expanded to H heads (the plain case, checked against PyTorch above)
GROUPED_OPS = ("linear-chunk-grouped", "delta-chunk-grouped")
GROUP = 4


def correctness_cases(plan) -> List[Dict[str, Any]]:
    """The grid, cheapest and most telling first (every kernel compiles in the first rounds)."""
    cases = []

    def add(op, K, dt, T, gate=True, state=True, varlen=False):
        if op.endswith("recurrent") and T > plan["rec_max_T"]:
            return
        cases.append(dict(op=op, K=K, dtype=dt, T=T, gate=gate, state=state, varlen=varlen))

    Ts = list(plan["Ts"])
    for T in Ts[:1]:
        for op in OPS:
            for K in plan["Ks"]:
                for dt in plan["dtypes"]:
                    add(op, K, dt, T)
    few = plan.get("few_ops")  # the dry run: the extra rounds on two ops only (time in `make test`)
    for op in few or OPS:  # uneven packed sequences, then without gates or states
        for K in plan["Ks"]:
            for dt in plan["dtypes"]:
                add(op, K, dt, sum(plan["varlen"]), varlen=True)
    for op in few or ("linear-chunk", "linear-recurrent", "deltanet-chunk"):
        for K in plan["Ks"]:
            for dt in plan["dtypes"]:
                add(op, K, dt, Ts[0], gate=False, state=False)
    for op in GROUPED_OPS:
        for K in plan["Ks"]:
            for dt in plan["dtypes"]:
                add(op, K, dt, Ts[0])
                if not few:
                    add(op, K, dt, sum(plan["varlen"]), varlen=True)
    for T in Ts[1:]:
        for op in OPS:
            for K in plan["Ks"]:
                for dt in plan["dtypes"]:
                    add(op, K, dt, T)
    return cases


def _case_id(c) -> str:
    return (f"{c['op']} K={c['K']} {str(c['dtype']).replace('torch.', '')} T={c['T']}"
            + ("" if c["gate"] else " no-gate") + ("" if c["state"] else " no-state")
            + (" varlen" if c["varlen"] else ""))


def _make_inputs(c, plan, device, seed=0):
    """Leaves (fp32, requires_grad where gradients are checked) and the operator's keyword arguments."""
    import linattn

    g = _gen(seed)
    H, K = plan["H"], c["K"]
    V = K
    B = 1 if c["varlen"] else plan["B"]
    T = c["T"]
    N = len(plan["varlen"]) if c["varlen"] else B
    chunk = c["op"].endswith("chunk")
    linear = c["op"].startswith(("linear", "gla"))

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device)

    leaves = {"q": rnd(B, T, H, K), "k": rnd(B, T, H, K), "v": rnd(B, T, H, V)}
    kw: Dict[str, Any] = {"chunk_size": plan["chunk"], "output_final_state": True}
    if c["varlen"]:
        cu = [0]
        for n in plan["varlen"]:
            cu.append(cu[-1] + n)
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64, device=device)
    if linear:
        leaves["q"] = leaves["q"] * 0.5
        leaves["k"] = leaves["k"] * 0.5
        kw.update(feature_map="elu+1", normalize=True, mode="chunk" if chunk else "recurrent")
        if c["gate"]:  # scalar, or diagonal (GLA: one per feature)
            shape = (B, T, H, K) if c["op"].startswith("gla") else (B, T, H)
            leaves["g"] = -torch.rand(*shape, generator=g).to(device) * 0.3
        if c["state"]:
            leaves["kv0"] = rnd(N, H, K, V)
            leaves["z0"] = (torch.rand(N, H, K, generator=g) + 0.5).to(device)
    else:
        leaves["beta"] = torch.rand(B, T, H, generator=g).to(device)
        kw.update(mode="chunk" if chunk else "recurrent")
        if c["op"].startswith("efla"):
            kw["exact"] = True
            leaves["k"] = leaves["k"] * 0.3
        else:
            kw["qk_l2norm"] = True
        if c["gate"] and c["op"].startswith("gated"):
            leaves["g"] = -torch.rand(B, T, H, generator=g).to(device) * 0.3
        elif c["gate"] and c["op"].startswith("kda"):  # per-channel gates
            leaves["g"] = -torch.rand(B, T, H, K, generator=g).to(device) * 0.3
        if c["state"]:
            leaves["S0"] = rnd(N, H, K, V, scale=0.1)
    for x in leaves.values():
        x.requires_grad_(chunk)

    def call(backend):
        dt = c["dtype"]
        q, k, v = (leaves[n].to(dt) for n in ("q", "k", "v"))
        a = dict(kw)
        if "g" in leaves:
            a["g"] = leaves["g"]
        if linear:
            if "kv0" in leaves:
                a["initial_state"] = linattn.LinearAttentionState(
                    leaves["kv0"], leaves["z0"], None, torch.zeros(N, dtype=torch.int64, device=device))
            o, st = linattn.linear_attention(q, k, v, backend=backend, **a)
            return o, ([st.kv, st.z] if st is not None else [])
        if "S0" in leaves:
            a["initial_state"] = leaves["S0"]
        o, st = linattn.delta_rule(q, k, v, leaves["beta"], backend=backend, **a)
        return o, ([st] if st is not None else [])

    return leaves, call, chunk


def _make_grouped_inputs(c, plan, device, seed=0):
    """Entry-point inputs [TT, H, D] with q, k on H // GROUP heads; call("triton") runs them grouped,
    call("torch") with q, k expanded to H heads (repeat_interleave: autograd sums the q/k gradients)."""
    from ..triton import delta as TD, linear as TL

    g = _gen(seed)
    H, K = plan["H"], c["K"]
    HQ, V = max(1, H // GROUP), K
    H = HQ * GROUP
    lens = list(plan["varlen"]) if c["varlen"] else [c["T"]] * plan["B"]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    TT, N = starts[-1], len(lens)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device).requires_grad_()

    leaves = {"q": rnd(TT, HQ, K, scale=0.5), "k": rnd(TT, HQ, K, scale=0.5), "v": rnd(TT, H, V),
              "g": (-torch.rand(TT, H, generator=g) * 0.3).to(device).requires_grad_()}
    linear = c["op"].startswith("linear")
    if linear:
        leaves["h0"], leaves["z0"] = rnd(N, H, K, V), (torch.rand(N, H, K, generator=g) + 0.5).to(device)
        leaves["z0"].requires_grad_()
    else:
        leaves["b"] = torch.rand(TT, H, generator=g).to(device).requires_grad_()
        leaves["h0"] = rnd(N, H, K, V, scale=0.1)
        leaves["k"] = (leaves["k"].detach() / leaves["k"].detach().norm(dim=-1, keepdim=True)).requires_grad_()

    def call(mode):
        dt = c["dtype"]
        q, k, v = (leaves[n].to(dt) for n in ("q", "k", "v"))
        if mode == "torch":  # the expanded call
            q, k = q.repeat_interleave(GROUP, dim=1), k.repeat_interleave(GROUP, dim=1)
        if linear:
            num, den, ht, zt = TL.chunk_linear_attention(
                q, k, v, leaves["g"], leaves["h0"], leaves["z0"], fused="elu+1", scale=K ** -0.5, norm=True,
                starts=starts, chunk_size=plan["chunk"], output_final_state=True)
            return num, [den, ht, zt]
        o, ht = TD.chunk_delta_rule(q * K ** -0.5, k, v, leaves["b"], leaves["g"], leaves["h0"], starts=starts,
                                    chunk_size=plan["chunk"], output_final_state=True)
        return o, [ht]

    return leaves, call, True


def run_correctness_case(c, plan, device) -> Dict[str, Any]:
    make = _make_grouped_inputs if c["op"] in GROUPED_OPS else _make_inputs
    leaves, call, with_grad = make(c, plan, device)
    tol = TOL[c["dtype"]]
    res: Dict[str, Any] = {}
    outs = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backend in ("triton", "torch"):
            o, st = call(backend)
            parts = [o] + st
            grads = []
            if with_grad:
                gen = _gen(1)
                loss = sum((t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum() for t in parts)
                names = list(leaves)
                gl = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
                grads = list(zip(names, gl))
            outs[backend] = (parts, grads)
    fell = [str(w.message) for w in caught if "falling back" in str(w.message)]
    if fell:
        res["fallback"] = fell[0]
    (pa, ga), (pb, gb) = outs["triton"], outs["torch"]
    errs = {"o": _rel(pa[0], pb[0])}
    for i, (x, y) in enumerate(zip(pa[1:], pb[1:])):
        errs[f"state{i}"] = _rel(x, y)
    finite = all(torch.isfinite(t).all().item() for t in pa)
    for (n, x), (_, y) in zip(ga, gb):
        if x is None or y is None:
            continue
        errs[f"d{n}"] = _rel(x, y)
        finite = finite and bool(torch.isfinite(x).all().item())
    worst = max(errs, key=lambda k: errs[k] if errs[k] == errs[k] else math.inf)
    ok = finite and all(e <= tol for e in errs.values()) and not fell
    res.update(errors=errs, worst=worst, max_err=errs[worst], tol=tol, finite=finite,
               status="ok" if ok else "FAIL")
    return res


def step_correctness(ctx: Ctx, rec: Dict[str, Any], deadline: float) -> None:
    plan, dev = ctx.plan, ctx.device
    cases = correctness_cases(plan)
    rows: List[List[Any]] = []
    rec["cases"] = []
    rec["table"] = {"headers": ["case", "status", "worst", "max rel err", "tol", "s"], "rows": rows}
    rec["notes"] = [f"{len(cases)} cases planned; B={plan['B']} H={plan['H']} chunk {plan['chunk']}; uneven "
                    f"cu_seqlens lengths {list(plan['varlen'])}; recurrent (decoding) forms up to "
                    f"T={plan['rec_max_T']}, forward only"]
    for i, c in enumerate(cases):
        cid = _case_id(c)
        if time.monotonic() > deadline:
            left = len(cases) - i
            rec["notes"].append(f"{left} cases skipped: the step's budget ran out (first skipped: {cid})")
            rec["skipped_cases"] = [_case_id(x) for x in cases[i:]]
            rec["partial"] = True
            break
        t0 = time.monotonic()
        try:
            r = run_correctness_case(c, plan, dev)
        except Exception as e:
            r = {"status": "error", "error": _tail(traceback.format_exc(), 8), "max_err": None,
                 "worst": type(e).__name__}
        finally:
            if dev == "cuda":
                torch.cuda.empty_cache()
        r["case"], r["seconds"] = cid, round(time.monotonic() - t0, 2)
        rec["cases"].append(r)
        rows.append([cid, r["status"], r.get("worst"), r.get("max_err"), r.get("tol"), r["seconds"]])
        ctx.log(f"  {cid}: {r['status']} {r.get('worst')} {_fmt(r.get('max_err'))} ({r['seconds']} s)")
        ctx.report.save()
    rec["passed"] = sum(r["status"] == "ok" for r in rec["cases"])
    rec["failed"] = sum(r["status"] == "FAIL" for r in rec["cases"])


# ----------------------------------------------------------------------------------------------
# step 3: compute-sanitizer
# ----------------------------------------------------------------------------------------------

SANITIZER_SCRIPT = '''\
"""One small forward + backward of every Triton kernel (generated by `linattn bench gpu`)."""
import torch
import linattn

dev, H, K, V, lens = {device!r}, {H}, {K}, {V}, {lens!r}
torch.manual_seed(0)
cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], device=dev)
N = len(lens)

def rnd(*s):
    return torch.randn(*s, device=dev)

def step(x):  # one decoding token per sequence: [N, 1, ...]
    return x.detach()[0, :N].unsqueeze(1)

for dt in (getattr(torch, d) for d in {dtypes!r}):
    q, k, v = (rnd(1, sum(lens), H, d).to(dt).requires_grad_() for d in (K, K, V))
    g = (-torch.rand(1, sum(lens), H, device=dev) * 0.3).requires_grad_()
    st = linattn.LinearAttentionState(rnd(N, H, K, V).requires_grad_(), (torch.rand(N, H, K, device=dev) + .5)
                                      .requires_grad_(), None, torch.zeros(N, dtype=torch.int64, device=dev))
    o, s = linattn.linear_attention(q, k, v, g=g, initial_state=st, output_final_state=True, cu_seqlens=cu,
                                    backend="triton")
    (o.float().sum() + s.kv.sum() + s.z.sum()).backward()
    with torch.no_grad():
        linattn.linear_attention(step(q), step(k), step(v), g=step(g), mode="recurrent", backend="triton",
                                 initial_state=s, output_final_state=True)
    beta = torch.rand(1, sum(lens), H, device=dev).requires_grad_()
    S0 = (rnd(N, H, K, V) * 0.1).requires_grad_()
    gk = (-torch.rand(1, sum(lens), H, K, device=dev) * 0.3).requires_grad_()  # KDA: per-channel gates
    for kw in ({{"g": g, "qk_l2norm": True}}, {{"exact": True}}, {{"g": gk, "qk_l2norm": True}}):
        o, S = linattn.delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu,
                                  backend="triton", **kw)
        (o.float().sum() + S.sum()).backward()
        with torch.no_grad():
            kw1 = {{n: (step(x) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}}
            linattn.delta_rule(step(q), step(k), step(v), step(beta), mode="recurrent", backend="triton",
                               initial_state=S, output_final_state=True, **kw1)
if dev == "cuda":
    torch.cuda.synchronize()
print("sanitizer script: done")
'''


def step_sanitizer(ctx: Ctx, rec: Dict[str, Any], deadline: float) -> None:
    plan, dev = ctx.plan, ctx.device
    s = plan["san"]
    tool = find_tool("compute-sanitizer")
    src_root = str(Path(__file__).resolve().parents[2])  # the folder holding the linattn package
    rows: List[List[Any]] = []
    rec["table"] = {"headers": ["run", "status", "errors reported", "s"], "rows": rows}
    rec["runs"] = []
    with tempfile.TemporaryDirectory(prefix="linattn-sanitizer-") as tmp:
        script = Path(tmp) / "sanitizer_case.py"
        script.write_text(SANITIZER_SCRIPT.format(device=dev, H=s["H"], K=s["K"], V=s["V"], lens=list(s["lens"]),
                                                  dtypes=list(s["dtypes"])))
        env = dict(os.environ)
        env["PYTHONPATH"] = src_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # one cudaMalloc per tensor: memcheck sees the real bounds
        runs = []
        if dev != "cuda":
            rec["notes"] = ["dry run: the script runs without compute-sanitizer (CPU tensors, interpreter)"
                            + ("" if tool is None else f"; the tool exists at {tool}")]
            runs.append(("script (no sanitizer)", [sys.executable, str(script)]))
        elif tool is None:
            rec["status_override"] = "skipped"
            rec["reason"] = "compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
            return
        else:
            for t in ("memcheck", "racecheck"):
                runs.append((t, [tool, "--tool", t, "--error-exitcode", "1", "--target-processes", "all",
                                 sys.executable, str(script)]))
        for name, cmd in runs:
            left = deadline - time.monotonic()
            if left < 5:
                rows.append([name, "skipped", "", ""])
                rec["runs"].append({"run": name, "status": "skipped", "reason": "step budget ran out"})
                rec["partial"] = True
                continue
            t0 = time.monotonic()
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
                out = r.stdout + r.stderr
                summary = [ln for ln in out.splitlines() if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln]
                status = "ok" if r.returncode == 0 and "sanitizer script: done" in out else "FAIL"
                run = {"run": name, "status": status, "returncode": r.returncode, "summary": summary,
                       "output_tail": _tail(out, 30)}
            except subprocess.TimeoutExpired:
                run = {"run": name, "status": "timeout", "reason": f"cut after {left:.0f} s (step budget)"}
                rec["partial"] = True
            run["seconds"] = round(time.monotonic() - t0, 1)
            rec["runs"].append(run)
            rows.append([name, run["status"], "; ".join(run.get("summary", [])) or run.get("reason", ""),
                         run["seconds"]])
            ctx.log(f"  {name}: {run['status']} ({run['seconds']} s)")
            ctx.report.save()
    rec["failed"] = sum(r["status"] == "FAIL" for r in rec["runs"])
    rec["passed"] = sum(r["status"] == "ok" for r in rec["runs"])


# ----------------------------------------------------------------------------------------------
# step 4: timings
# ----------------------------------------------------------------------------------------------

def chunk_flops(op: str, B: int, T: int, H: int, K: int, V: int, C: int = 64) -> float:
    """Matmul flops of one forward pass of the chunk algorithm (tile C), per the kernels' structure:
    linear: intra-chunk Q K^T and A V (2 C (K + V) per token), inter-chunk Q h and the state update
    K^T V (4 K V per token); the delta rule adds the UT transform (K K^T, Tm V, Tm K: 2 C (2K + V))
    and the pseudo-values W h (2 K V); softmax (causal): 2 T^2 (K + V) / 2 per head."""
    if op == "sdpa":
        return B * H * T * T * (K + V)
    per_tok = 2 * C * (K + V) + 4 * K * V
    if op != "linear":
        per_tok += 2 * C * (2 * K + V) + 2 * K * V
    return float(B * T * H * per_tok)


# forward + backward as a multiple of the forward's matmul flops (the usual conventions)
BWD_FACTOR = {"sdpa": 3.5, "default": 3.0}


def fla_version() -> Optional[str]:
    """The installed fla-core (fla's ops; flash-linear-attention adds its layers and models)."""
    from importlib.metadata import version

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return version(dist)
        except Exception:
            continue
    return None


def _fla_init_version(origin: Optional[str]) -> str:
    """`__version__ = '...'` read from fla/__init__.py without running it (fla's ops compare versions)."""
    import re

    try:
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", Path(origin).read_text())
        return m.group(1) if m else "0.0.0"
    except Exception:
        return "0.0.0"


def import_fla_ops(names=("simple_gla", "delta_rule", "gated_delta_rule", "kda")) -> Dict[str, Any]:
    """fla's op modules, without running fla/__init__.py, which imports fla's layers and models and
    through them transformers (absent on the GPU machine); the ops need torch, triton, einops and
    packaging only. -> {name: module or the exception its import raised}."""
    import importlib
    import importlib.util
    import types

    if sys.modules.get("fla") is None:
        spec = importlib.util.find_spec("fla")
        if spec is None or not spec.submodule_search_locations:
            err = ImportError("fla (flash-linear-attention) is not installed and not on PYTHONPATH")
            return {n: err for n in names}
        pkg = types.ModuleType("fla")  # a bare package object: its submodules import, its __init__ never runs
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__file__, pkg.__spec__ = spec.origin, spec
        pkg.__version__ = fla_version() or _fla_init_version(spec.origin)
        sys.modules["fla"] = pkg
    out: Dict[str, Any] = {}
    for n in names:
        try:
            out[n] = importlib.import_module(f"fla.ops.{n}")
        except Exception as e:
            out[n] = e
    return out


def _fla_fns() -> Dict[str, Any]:
    mods = import_fla_ops()
    fns: Dict[str, Any] = {}
    for name, mod in (("chunk_simple_gla", "simple_gla"), ("chunk_delta_rule", "delta_rule"),
                      ("chunk_gated_delta_rule", "gated_delta_rule"), ("chunk_kda", "kda")):
        m = mods[mod]
        fns[name] = getattr(m, name, None) if not isinstance(m, Exception) else m
        if fns[name] is None:
            fns[name] = AttributeError(f"fla.ops.{mod} has no {name}")
    return fns


def timing_cases(plan, fla) -> List[Dict[str, Any]]:
    cases = []
    for T in plan["time"]["Ts"]:
        for op, impls in (("linear", ("triton", "torch", "fla:chunk_simple_gla")),
                          ("deltanet", ("triton", "torch", "fla:chunk_delta_rule")),
                          ("gated-deltanet", ("triton", "torch", "fla:chunk_gated_delta_rule")),
                          ("kda", ("triton", "torch", "fla:chunk_kda")),
                          ("efla", ("triton", "torch")),
                          ("sdpa", ("flash" if plan["device"] == "cuda" else "sdpa",))):
            for impl in impls:
                cases.append(dict(op=op, impl=impl, T=T))
    return cases


def _timing_fn(c, plan, fla, device):
    """-> (zero-argument forward, the inputs to differentiate, backend note)."""
    import linattn

    tp = plan["time"]
    B, H, K, V, T, dt = tp["B"], tp["H"], tp["K"], tp["V"], c["T"], tp["dtype"]
    g = _gen(0)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dt).requires_grad_()

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    note = ""
    if c["op"] == "sdpa":
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        ctx_mgr = None
        if device == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            ctx_mgr = lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])  # noqa: E731

        def fwd():
            if ctx_mgr is None:
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            with ctx_mgr():
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return fwd, [qt, kt, vt], "SDPA flash" if device == "cuda" else "SDPA (CPU)"
    beta = torch.rand(B, T, H, generator=g).to(device).requires_grad_()
    gate = (F.logsigmoid(torch.randn(B, T, H, generator=g) + 4)).to(device).requires_grad_()
    gk = (F.logsigmoid(torch.randn(B, T, H, K, generator=g) + 4)).to(device).requires_grad_()
    if c["impl"].startswith("fla:"):
        fn = fla.get(c["impl"][4:])
        if not callable(fn):
            raise RuntimeError(f"fla not importable: {fn!r}")
        if c["op"] == "linear":
            return (lambda: fn(q, k, v, g=gate)[0]), [q, k, v, gate], ""
        if c["op"] == "deltanet":
            return (lambda: fn(q, k, v, beta, use_qk_l2norm_in_kernel=True)[0]), [q, k, v, beta], ""
        if c["op"] == "gated-deltanet":
            return (lambda: fn(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)[0]), [q, k, v, gate, beta], ""
        return (lambda: fn(q, k, v, gk, beta, use_qk_l2norm_in_kernel=True)[0]), [q, k, v, gk, beta], ""
    backend = c["impl"]
    if c["op"] == "linear":
        kw = dict(feature_map="identity", normalize=False, g=gate)
        prob = linattn.prepare_linear_attention(q, k, v, **kw)
        fwd = lambda: linattn.linear_attention(q, k, v, backend=backend, **kw)[0]  # noqa: E731
        ins = [q, k, v, gate]
    else:
        kw: Dict[str, Any] = {"qk_l2norm": True}
        ins = [q, k, v, beta]
        if c["op"] == "efla":
            kw = {"exact": True}
        elif c["op"] == "gated-deltanet":
            kw["g"] = gate
            ins.append(gate)
        elif c["op"] == "kda":
            kw["g"] = gk
            ins.append(gk)
        prep = {k2: v2 for k2, v2 in kw.items() if k2 != "exact"}
        prob = linattn.prepare_delta(q, k, v, beta, channel_gate=c["op"] == "kda", **prep)
        fwd = lambda: linattn.delta_rule(q, k, v, beta, backend=backend, **kw)[0]  # noqa: E731
    if backend == "triton":
        why = prob.triton_unsupported()
        if why is not None:
            raise NotCovered(f"not covered by the Triton kernels: {why}")
    return fwd, ins, note


def step_timing(ctx: Ctx, rec: Dict[str, Any], deadline: float) -> None:
    plan, dev = ctx.plan, ctx.device
    tp = plan["time"]
    fla = _fla_fns()
    rates = ctx.report.data["steps"]["machine"].get("matmul", {})
    peak = rates.get("bfloat16" if tp["dtype"] == torch.bfloat16 else "float32", {}).get("gflops")
    cases = timing_cases(plan, fla)
    rows: List[List[Any]] = []
    rec["cases"] = []
    rec["table"] = {"headers": ["op", "impl", "T", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd %peak",
                                "f+b TFLOP/s", "f+b %peak", "peak MiB", "note"], "rows": rows}
    rec["notes"] = [f"B={tp['B']} H={tp['H']} K={tp['K']} V={tp['V']} {str(tp['dtype']).replace('torch.', '')}; "
                    "linear = identity map, unnormalised, scalar gate (fla's chunk_simple_gla); deltanet / gated / "
                    "kda with qk_l2norm; flops: `linattn.bench.gpu.chunk_flops` (C=64), fwd+bwd = 3x fwd (SDPA 3.5x)",
                    "peak: " + (f"{peak / 1e3:.1f} TFLOP/s measured bf16 matmul" if peak else "no matmul rate (step 1 "
                                                                                            "did not run)")]
    fla_missing = {n: repr(e) for n, e in fla.items() if not callable(e)}
    if fla_missing:
        rec["notes"].append("fla cases skipped: " + "; ".join(f"{n}: {e}" for n, e in fla_missing.items()))
    if dev != "cuda" and len(fla_missing) < len(fla):  # imported (checked), but fla's kernels need a GPU
        ok = ", ".join(n for n in fla if n not in fla_missing)
        rec["notes"].append(f"fla imports; its cases skipped on CPU: {ok}")
        fla_missing = {n: "CPU" for n in fla}
    for i, c in enumerate(cases):
        label = [c["op"], c["impl"], c["T"]]
        if c["impl"].startswith("fla:") and c["impl"][4:] in fla_missing:
            continue
        if time.monotonic() > deadline:
            rec["notes"].append(f"{len(cases) - i} cases skipped: the step's budget ran out (from {label})")
            rec["partial"] = True
            break
        r: Dict[str, Any] = {"op": c["op"], "impl": c["impl"], "T": c["T"]}
        t0 = time.monotonic()
        try:
            fwd, ins, note = _timing_fn(c, plan, fla, dev)
            r["note"] = note
            budget = max(1.0, min(8.0, (deadline - time.monotonic()) / 4))
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            warm, reps, min_s = plan["reps"]
            with torch.no_grad():
                tf = common.time_fn(fwd, warmup=warm, repeats=reps, min_time_s=min_s, max_repeats=50,
                                    budget_s=budget, device=dev)
            r["fwd_ms"] = tf.median_ms

            def fb():
                o = fwd()
                torch.autograd.grad(o, ins, grad_outputs=torch.ones_like(o), allow_unused=True)

            tb = common.time_fn(fb, warmup=warm, repeats=reps, min_time_s=min_s, max_repeats=50, budget_s=budget,
                                device=dev)
            r["fwdbwd_ms"] = tb.median_ms
            if dev == "cuda":
                r["peak_MiB"] = torch.cuda.max_memory_allocated() / 2 ** 20
            fl = chunk_flops("sdpa" if c["op"] == "sdpa" else ("linear" if c["op"] == "linear" else "delta"),
                             tp["B"], c["T"], tp["H"], tp["K"], tp["V"])
            r["fwd_tflops"] = fl / (tf.median_ms * 1e-3) / 1e12
            factor = BWD_FACTOR["sdpa" if c["op"] == "sdpa" else "default"]
            r["fwdbwd_tflops"] = fl * factor / (tb.median_ms * 1e-3) / 1e12
            if peak:
                r["fwd_pct"] = 100 * r["fwd_tflops"] * 1e3 / peak
                r["fwdbwd_pct"] = 100 * r["fwdbwd_tflops"] * 1e3 / peak
            r["status"] = "ok"
        except NotCovered as e:
            r["status"], r["note"] = "not covered", str(e)[:160]
        except Exception as e:
            r["status"] = "error"
            r["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            r["error"] = _tail(traceback.format_exc(), 6)
        finally:
            if dev == "cuda":
                torch.cuda.empty_cache()
        r["seconds"] = round(time.monotonic() - t0, 2)
        rec["cases"].append(r)
        rows.append(label + [r.get("fwd_ms"), r.get("fwdbwd_ms"), r.get("fwd_tflops"), r.get("fwd_pct"),
                             r.get("fwdbwd_tflops"), r.get("fwdbwd_pct"), r.get("peak_MiB"), r.get("note", "")])
        ctx.log(f"  {label}: {r['status']} fwd {_fmt(r.get('fwd_ms'))} ms, f+b {_fmt(r.get('fwdbwd_ms'))} ms")
        ctx.report.save()


# ----------------------------------------------------------------------------------------------
# step 5: LM training step and decoding
# ----------------------------------------------------------------------------------------------

LM_MIXERS = (("softmax", "softmax"), ("linear", "linear-elu+1"), ("gated-deltanet", "gated-deltanet"),
             ("efla", "efla"))


def run_lm_case(mixer: str, plan, device) -> Dict[str, Any]:
    from ..models import LanguageModel, LMConfig

    p = plan["lm"]
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=p["vocab"], d_model=p["d_model"], n_layers=p["n_layers"], n_heads=p["n_heads"],
                   mixer=mixer)
    model = LanguageModel(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = device == "cuda"
    ids = torch.randint(0, p["vocab"], (p["B"], p["T"] + 1), device=device)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def train_step():
        with autocast():
            loss = model(ids[:, :-1], targets=ids[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    r: Dict[str, Any] = {"params_M": sum(x.numel() for x in model.parameters()) / 1e6}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = common.time_fn(train_step, warmup=1, repeats=p["steps"], min_time_s=0.0, max_repeats=p["steps"],
                       budget_s=None, device=device)
    r["train_ms"] = t.median_ms
    r["train_tok_s"] = p["B"] * p["T"] / (t.median_ms * 1e-3)
    if cuda:
        r["train_peak_MiB"] = torch.cuda.max_memory_allocated() / 2 ** 20
    model.eval()
    prompt = ids[:1, :p["prompt"]]
    with torch.no_grad(), autocast():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        _sync(device)
        t0 = time.perf_counter()
        out = model(prompt, use_cache=True, logits_to_keep=1)
        _sync(device)
        r["prefill_ms"] = (time.perf_counter() - t0) * 1e3
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = []
        for _ in range(p["decode"]):
            _sync(device)
            t0 = time.perf_counter()
            out = model(nxt, cache=out.cache, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            steps.append(time.perf_counter() - t0)
        steps.sort()
        r["decode_ms_per_token"] = steps[len(steps) // 2] * 1e3
        if cuda:
            r["decode_peak_MiB"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return r


def step_lm(ctx: Ctx, rec: Dict[str, Any], deadline: float) -> None:
    plan, dev = ctx.plan, ctx.device
    p = plan["lm"]
    rows: List[List[Any]] = []
    rec["cases"] = []
    rec["table"] = {"headers": ["mixer", "params M", "train ms/step", "train tok/s", "train peak MiB",
                                "prefill ms", "decode ms/token", "decode peak MiB", "status"], "rows": rows}
    rec["notes"] = [f"d_model {p['d_model']}, {p['n_layers']} layers, {p['n_heads']} heads, vocab {p['vocab']}; "
                    f"train: B={p['B']} T={p['T']}, AdamW, bf16 autocast on CUDA, median of {p['steps']} steps after "
                    f"1 warm-up; decode: B=1, prompt {p['prompt']} tokens, median of {p['decode']} greedy steps; "
                    "backend='auto' (Triton for CUDA tensors where covered)"]
    for i, (label, mixer) in enumerate(LM_MIXERS):
        if time.monotonic() > deadline:
            rec["notes"].append(f"skipped (step budget ran out): {', '.join(m for m, _ in LM_MIXERS[i:])}")
            rec["partial"] = True
            break
        t0 = time.monotonic()
        try:
            r = run_lm_case(mixer, plan, dev)
            r["status"] = "ok"
        except Exception as e:
            r = {"status": "error", "error": _tail(traceback.format_exc(), 16), "note": f"{type(e).__name__}: {e}"}
        finally:
            if dev == "cuda":
                torch.cuda.empty_cache()
        r["mixer"], r["seconds"] = label, round(time.monotonic() - t0, 2)
        rec["cases"].append(r)
        rows.append([label, r.get("params_M"), r.get("train_ms"), r.get("train_tok_s"), r.get("train_peak_MiB"),
                     r.get("prefill_ms"), r.get("decode_ms_per_token"), r.get("decode_peak_MiB"),
                     r["status"] if r["status"] == "ok" else r.get("note", r["status"])[:120]])
        ctx.log(f"  {label}: {r['status']} ({r['seconds']} s)")
        ctx.report.save()


STEP_FNS = {"machine": step_machine, "correctness": step_correctness, "sanitizer": step_sanitizer,
            "timing": step_timing, "lm": step_lm}


# ----------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------

def _validate(args) -> None:
    bad = [s for s in args.steps if s not in STEPS]
    if bad:
        raise UsageError(f"--steps: unknown step(s) {', '.join(bad)}; choose from {' '.join(STEPS)}", prog=PROG)
    if not (args.budget_min > 0) or not math.isfinite(args.budget_min):
        raise UsageError(f"--budget-min must be a positive number of minutes, got {args.budget_min}", prog=PROG)


def _reexec_interpreted(argv: List[str]) -> int:
    """The dry run in a child process with TRITON_INTERPRET=1 (triton is already imported here)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    src_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.call([sys.executable, "-m", "linattn", "bench", "gpu"] + argv, env=env)


def run(args) -> int:
    """Run the `linattn bench gpu` benchmark (module docstring).

    Args:
        args: The options parsed with `add_arguments` (`linattn bench gpu --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    _validate(args)
    from .. import triton as lt

    if args.dry_run and not lt.interpret_mode():
        if "triton" in sys.modules:  # the interpreter must be chosen before triton is imported
            argv = ["--out", args.out, "--budget-min", str(args.budget_min), "--steps", *args.steps, "--dry-run"]
            argv += ["--overwrite"] * args.overwrite + ["--quiet"] * args.quiet
            argv += ["--wheels", args.wheels] if args.wheels else []
            return _reexec_interpreted(argv)
        os.environ["TRITON_INTERPRET"] = "1"
    if not args.dry_run:
        if not torch.cuda.is_available():
            raise UsageError("no CUDA device here; `--dry-run` checks the command on CPU", prog=PROG)
        if lt.interpret_mode():
            raise UsageError("TRITON_INTERPRET is set: unset it for the GPU run (or use --dry-run)", prog=PROG)
    wheels = use_wheels(args.wheels) if args.wheels else []
    out = Path(args.out)
    paths = {"json": out / "gpu.json", "md": out / "gpu.md"}
    if not args.overwrite and any(p.exists() for p in paths.values()):
        raise UsageError(f"{paths['json']} or {paths['md']} exists; pass --overwrite to replace them", prog=PROG)
    out.mkdir(parents=True, exist_ok=True)
    plan = dry_plan() if args.dry_run else gpu_plan()
    budget_s = args.budget_min * 60
    command = (f"linattn bench gpu --out {args.out} --budget-min {args.budget_min:g} --steps {' '.join(args.steps)}"
               + " --dry-run" * args.dry_run + " --overwrite" * args.overwrite
               + (f" --wheels {args.wheels}" if args.wheels else ""))
    config = {"dry_run": bool(args.dry_run), "budget_s": budget_s, "wheels": wheels, "steps": list(args.steps),
              "device": plan["device"],
              "command": command}
    report = Report(paths, config, list(args.steps))
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    start = time.monotonic()
    end = start + budget_s
    ctx = Ctx(plan, report, log, end)
    report.save()

    def on_alarm(signum, frame):
        raise BudgetExceeded(f"the run's budget of {budget_s:.0f} s ran out")

    def on_term(signum, frame):
        raise Terminated(f"signal {signum}")

    old = {}
    try:
        if hasattr(signal, "SIGALRM"):
            try:
                old[signal.SIGALRM] = signal.signal(signal.SIGALRM, on_alarm)
                old[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_term)
                signal.setitimer(signal.ITIMER_REAL, budget_s + 5)  # a step stuck past the end is cut
            except ValueError:  # not the main thread: the soft deadlines still hold
                old = {}
        _run_steps(ctx, report, args.steps, start, end)
    finally:
        if old:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for s, h in old.items():
                signal.signal(s, h)
    counts = report.data.get("counts", {})
    return 1 if counts.get("failed", 0) or counts.get("errors", 0) else 0


def _run_steps(ctx: Ctx, report: Report, steps: List[str], start: float, end: float) -> None:
    todo = [s for s in STEPS if s in steps]
    stop_reason = None
    for i, name in enumerate(todo):
        rec = report.data["steps"][name]
        if stop_reason is not None:
            rec.update(status="skipped", reason=stop_reason)
            continue
        now = time.monotonic()
        left = end - now
        if left <= 1:
            rec.update(status="skipped", reason=f"did not fit: the budget ran out after {now - start:.0f} s")
            continue
        share = SHARES[name] / sum(SHARES[s] for s in todo[i:])
        deadline = now + share * left
        rec.update(status="running", budget_s=round(deadline - now, 1))
        ctx.log(f"[{name}] {deadline - now:.0f} s")
        report.save()
        t0 = time.monotonic()
        try:
            STEP_FNS[name](ctx, rec, deadline)
            status = rec.pop("status_override", None) or ("failed" if rec.get("failed") else
                                                          "partial" if rec.get("partial") else "done")
            rec["status"] = status
        except BudgetExceeded as e:
            rec.update(status="cut", reason=str(e))
            stop_reason = f"not run: {e}"
        except Terminated as e:
            rec.update(status="cut", reason=f"terminated ({e})")
            stop_reason = f"not run: terminated ({e})"
        except Exception as e:
            rec.update(status="error", error=_tail(traceback.format_exc(), 12), reason=f"{type(e).__name__}: {e}")
        rec["seconds"] = round(time.monotonic() - t0, 2)
        _count(report)
        report.save()
    incomplete = any(report.data["steps"][n]["status"] in ("skipped", "partial") for n in todo)
    report.data["status"] = "cut short" if stop_reason is not None else "incomplete" if incomplete else "finished"
    _count(report)
    report.save()


def _count(report: Report) -> None:
    c = {"passed": 0, "failed": 0, "errors": 0}
    for name in ("correctness", "sanitizer"):
        s = report.data["steps"][name]
        c["passed"] += s.get("passed", 0)
        c["failed"] += s.get("failed", 0)
    for s in report.data["steps"].values():
        if s.get("status") == "error":
            c["errors"] += 1
        c["errors"] += sum(1 for r in s.get("cases", []) if r.get("status") == "error")
    report.data["counts"] = c
