"""`linattn bench train`: training throughput (tokens/s) of one LM step per mixer, fwd + bwd + AdamW.

One `LanguageModel` per mixer (same width, depth, heads and SwiGLU FFN, random weights and tokens, fp32).
A step is forward with targets (cross-entropy), backward, AdamW step and zero_grad: what `linattn train`
does per optimizer step, with its optimizer (`training.make_optimizer`: the fused AdamW on the CPU), without data
loading. The steps of the mixers are interleaved in rounds
(`common.time_interleaved`), so a change of background load hits them alike and the ratios stay fair;
each model and its optimizer live for the whole run (the optimizer state exists after the warm-up step).
The report gives tokens/s (batch x seq-len over the median step) and each mixer's ratio to softmax's
(the issue-34 targets: Gated DeltaNet >= 1.5x softmax's tokens/s, linear attention >= 2x, on the CPU).

--free-mixer adds the row `free-mixer`: the softmax model with its attention replaced by o = q + k + v (two
additions, gradients still reach every projection). Everything else of the step (projections, FFN, head,
cross-entropy, AdamW) is softmax's, so its ratio to softmax is the most any mixer can gain over softmax at this
configuration: a mixer whose ratio target exceeds it cannot be met by a faster mixer alone. It also adds, for each
other listed mixer whose layer calls one of the operators in `FREE_CORES` (the delta family's `delta_rule`, linear
attention's `linear_attention`), the row `free:<mixer>`: that mixer's own model with only the operator call replaced by
an op of the same shapes that costs nothing (o = v; a backward that passes the output's gradient to v and zeros to
q, k, beta, the gate: every projection, the short convolutions, beta and the gate, the output norm and gate, the FFN,
head and AdamW stay the mixer's). That row is the mixer's own bound, and the column `of bound` gives each mixer's
tokens/s over it: the share of the step left to its operator (its preparation inside the call included: the q/k L2
norm, the key-norm rescaling, the layouts, the kernels forward and backward).

Model-FLOPs utilisation (the mfu column): each step's matmul FLOPs, counted once per mixer on an untimed step by
`torch.utils.flop_counter.FlopCounterMode` (matrix products and SDPA, forward and backward, SDPA's T x T products
counted in full as torch counts them; the compiled mixer kernels run as custom ops it does not see, and elementwise
work is not counted), over the median step time times the
fp32 matmul rate of this machine measured in the same run at the same thread count (`common.matmul_rate`, a
2048^3 product, measured before and after the steps; the higher of the two is used, so a burst of other load
during one of them cannot inflate the mfu).
--profile N adds, per mixer, a torch.profiler table of one step's top N operators by self CPU
time and the share of the step spent outside the matrix products (what the mixer's bound is made of).

--quick runs a tiny configuration in a few seconds (the test suite runs it).
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Dict, List, Optional

import torch

from ..cli_support import UsageError, int_at_least
from ..io import atomic_write_text, write_json
from . import common

DESCRIPTION = __doc__
DEFAULT_MIXERS = "softmax,linear-elu+1,deltanet,gated-deltanet"
FREE_MIXER = "free-mixer"
PROG = "linattn bench train"
QUICK = dict(d_model=32, n_layers=2, n_heads=2, seq_len=64, batch=2, vocab_size=64, repeats=2)


def add_arguments(p) -> None:
    """The options of `linattn bench train`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--mixers", default=DEFAULT_MIXERS, help=f"comma list of mixer names (default {DEFAULT_MIXERS})")
    p.add_argument("--d-model", type=int_at_least(1), default=256, help="width (default 256)")
    p.add_argument("--n-layers", type=int_at_least(1), default=4, help="layers (default 4)")
    p.add_argument("--n-heads", type=int_at_least(1), default=4, help="heads (default 4)")
    p.add_argument("--seq-len", type=int_at_least(1), default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--batch", type=int_at_least(1), default=4, help="sequences per step (default 4)")
    p.add_argument("--vocab-size", type=int_at_least(2), default=512, help="(default 512)")
    p.add_argument("--repeats", type=int_at_least(1), default=5, help="timed steps per mixer, at least (default 5)")
    p.add_argument("--budget-s", type=float, default=120.0, help="time budget of the timed rounds (default 120)")
    p.add_argument("--threads", type=int_at_least(0), default=0,
                   help="torch threads (default 0: torch's default, all cores: training uses them)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens (default 0)")
    p.add_argument("--free-mixer", action="store_true",
                   help="add the row free-mixer: softmax's model with attention replaced by o = q + k + v, the bound "
                        "on any mixer's gain over softmax at this configuration; and free:<mixer> for each listed "
                        "mixer whose operator FREE_CORES names: its own model with that operator costing nothing, "
                        "its own bound (column 'of bound')")
    p.add_argument("--profile", type=int_at_least(0), default=0, metavar="N",
                   help="print a torch.profiler table of one step per mixer, its top N operators by self CPU time "
                        "(default 0: none)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny configuration (d 32, 2 layers, seq 64, batch 2, 2 steps) for a smoke test")
    p.add_argument("--out", default=None, help="output folder (default results/bench/train/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _mixer_names(a) -> List[str]:
    from ..models import mixers

    names = [s.strip() for s in a.mixers.split(",") if s.strip()]
    bad = [n for n in names if n not in mixers()]
    if bad or not names:
        raise UsageError(f"--mixers: unknown {bad}; choose from {', '.join(mixers())}", prog=PROG)
    if getattr(a, "free_mixer", False):
        if FREE_MIXER not in names:
            names.append(FREE_MIXER)
        names += [FREE_CORE_PREFIX + n for n in list(names) if n != FREE_MIXER
                  and not n.startswith(FREE_CORE_PREFIX) and free_core_of(n) is not None]
    return names


def _free_mix(q, k, v, x, cache=None, cu_seqlens=None):
    """The free mixer's stand-in for softmax attention: no token mixing, every input still trained."""
    return q + k + v


#: the operators a mixer's own bound replaces: {layer module: the operator it calls, by that module's global name}
FREE_CORES = {"linattn.layers.delta": "delta_rule", "linattn.layers.linear_attention": "linear_attention"}
FREE_CORE_PREFIX = "free:"


class _FreeCore(torch.autograd.Function):
    """o = v (a copy), the same shape as the operator's output; backward: do to v, zeros to the other inputs (their
    producers' backward still runs, as under the real operator)."""

    @staticmethod
    def forward(ctx, v, *others):
        ctx.others = [(t.shape, t.dtype, t.device) for t in others]
        return v.clone()

    @staticmethod
    def backward(ctx, do):
        return (do, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.others))


def free_core(q, k, v, *args, **kwargs):
    """The stand-in for an operator called as op(q, k, v, ...) -> (o, state): o = v at no cost, no state."""
    others = [t for t in (q, k, *args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return _FreeCore.apply(v, *others), None


def free_core_of(name: str) -> Optional[str]:
    """The layer module (a `FREE_CORES` key) whose operator the model of mixer `name` calls, or None."""
    from ..models import mixer_spec

    module = getattr(mixer_spec(name).cls, "__module__", None)
    return module if module in FREE_CORES else None


@contextlib.contextmanager
def freed_core(module: str):
    """Within the block, the layers of `module` call `free_core` instead of their operator (the module's global;
    a step runs one model at a time, so only the free row's steps see it)."""
    mod = importlib.import_module(module)
    name = FREE_CORES[module]
    real = getattr(mod, name)
    setattr(mod, name, free_core)
    try:
        yield
    finally:
        setattr(mod, name, real)


def _free_mixer_model(model):
    """Replace the attention of every SoftmaxAttention layer of `model` by `_free_mix` (instance attribute,
    so only this model changes)."""
    from ..layers.softmax import SoftmaxAttention

    n = 0
    for m in model.modules():
        if isinstance(m, SoftmaxAttention):
            m._mix = _free_mix
            n += 1
    assert n, "the softmax model has no SoftmaxAttention layer"
    return model


def make_step(name: str, a):
    """(step, n_params): step() runs one fwd + bwd + AdamW step of a fresh model of mixer `name` on fixed random
    tokens; the model and optimizer are kept in the closure."""
    from ..models import LanguageModel, LMConfig
    from ..training import TrainConfig, make_optimizer

    torch.manual_seed(a.seed)
    mixer = "softmax" if name == FREE_MIXER else name.removeprefix(FREE_CORE_PREFIX)
    core = free_core_of(mixer) if name.startswith(FREE_CORE_PREFIX) else None
    model = LanguageModel(LMConfig(vocab_size=a.vocab_size, d_model=a.d_model, n_layers=a.n_layers,
                                   n_heads=a.n_heads, mixer=mixer, max_seq_len=max(2048, a.seq_len)))
    if name == FREE_MIXER:
        _free_mixer_model(model)
    model.train()
    opt = make_optimizer(model, TrainConfig(lr=1e-4))  # the optimizer `linattn train` builds
    gen = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(0, a.vocab_size, (a.batch, a.seq_len + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        with freed_core(core) if core is not None else contextlib.nullcontext():
            out = model(x, targets=y)
            loss = out.loss + out.aux_loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, sum(p.numel() for p in model.parameters())


# the operators whose time counts as matrix products in the profile (their FLOPs are what FlopCounterMode counts)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _cpu_sdpa_flops():
    """FlopCounterMode's SDPA formulas for the CPU flash-attention ops, which its registry lacks (torch 2.13): the
    full T x T products, as it counts SDPA elsewhere (a causal mask is not halved)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def fwd(query, key, value, *args, out_val=None, **kwargs):  # the counter passes shapes for tensors
        return sdpa_flop_count(query, key, value)

    def bwd(grad_out, query, key, value, *args, out_val=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: fwd,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd}


def step_flops(step) -> int:
    """The matmul FLOPs of one call of `step` (FlopCounterMode: matrix products and SDPA, forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_flops())
    with counter:
        step()
    return int(counter.get_total_flops())


def profile_step(step, rows: int) -> Dict[str, Any]:
    """One step under torch.profiler: the share of self CPU time in matrix products and the top `rows` operators."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev)
    mm = sum(e.self_cpu_time_total for e in ev if e.key in MATMUL_OPS)
    return {"self_cpu_ms": total / 1e3, "matmul_share": mm / total if total else 0.0,
            "table": ev.table(sort_by="self_cpu_time_total", row_limit=rows)}


def measure(names: List[str], a, log) -> List[Dict[str, Any]]:
    """One record per mixer: the step's Timing (or the error), tokens/s and the parameter count."""
    steps, records = [], []
    for n in names:
        try:
            fn, n_params = make_step(n, a)
        except Exception as e:  # reported per mixer; the others go on
            fn, n_params = e, None
        steps.append(fn)
        records.append({"model": n, "params": n_params})
        log(f"built {n}")

    def maker(fn):
        def make():
            if isinstance(fn, Exception):
                raise fn
            return fn
        return make

    timings = common.time_interleaved([maker(f) for f in steps], warmup=1, repeats=a.repeats, min_time_s=0.0,
                                      max_repeats=max(a.repeats, 50), budget_s=a.budget_s)
    tokens = a.batch * a.seq_len
    for rec, t in zip(records, timings):
        if isinstance(t, Exception):
            rec["error"] = f"{type(t).__name__}: {t}"
        else:
            rec["step"] = t.to_dict()
            rec["tokens_per_s"] = tokens / (t.median_ms / 1e3)
    for rec, fn in zip(records, steps):  # untimed: the counter and the profiler slow the step down
        if "error" in rec:
            continue
        rec["matmul_flops"] = step_flops(fn)
        if getattr(a, "profile", 0):
            rec["profile"] = profile_step(fn, a.profile)
            log(f"profiled {rec['model']}")
    return records


def add_mfu(records: List[Dict[str, Any]], rate_gflops: float) -> None:
    """mfu = the step's matmul FLOPs / (median step seconds x the measured fp32 matmul rate)."""
    for r in records:
        if "matmul_flops" in r and rate_gflops > 0:
            r["mfu"] = r["matmul_flops"] / (r["step"]["median_ms"] / 1e3) / (rate_gflops * 1e9)


def add_bound_ratios(records: List[Dict[str, Any]]) -> None:
    """of_bound = a mixer's tokens/s over its own free row's (`free:<mixer>`), where both were measured."""
    speed = {r["model"]: r.get("tokens_per_s") for r in records}
    for r in records:
        bound = speed.get(FREE_CORE_PREFIX + r["model"])
        if r.get("tokens_per_s") and bound:
            r["of_bound"] = r["tokens_per_s"] / bound


def _report(records: List[Dict[str, Any]]) -> str:
    soft = next((r.get("tokens_per_s") for r in records if r["model"] == "softmax"), None)
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["model"], "-", "-", "-", r["error"][:60]])
            continue
        ratio = f"{r['tokens_per_s'] / soft:.2f}x" if soft else "-"
        gflop = f"{r['matmul_flops'] / 1e9:.1f}" if "matmul_flops" in r else "-"
        rows.append([r["model"], f"{r['params']:,}", common.fmt_ms(r["step"]["median_ms"]),
                     f"{r['tokens_per_s']:,.0f}", ratio, f"{r['of_bound']:.2f}x" if "of_bound" in r else "-", gflop,
                     f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"])
    text = common.format_table(["mixer", "params", "step ms (median)", "tokens/s", "vs softmax", "of bound",
                                "matmul GFLOP", "mfu"], rows)
    for r in records:
        if "profile" in r:
            pr = r["profile"]
            text += (f"\n\n{r['model']}: one step under torch.profiler, {pr['self_cpu_ms']:.0f} ms self CPU time, "
                     f"{100 * pr['matmul_share']:.0f}% in matrix products, {100 * (1 - pr['matmul_share']):.0f}% "
                     f"outside\n{pr['table']}")
    return text


def run(a) -> int:
    """Run the `linattn bench train` benchmark (module docstring).

    Args:
        a: The options parsed with `add_arguments` (`linattn bench train --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    names = _mixer_names(a)
    a.threads, log = common.start_run(a.threads, "cpu", a.quiet)
    paths = common.output_paths("train", a.out, exts=("txt", "json"), overwrite=a.overwrite)
    info = common.machine_info("cpu")
    head = [PROG, common.describe_machine(info),
            f"models   d_model {a.d_model}, {a.n_heads} heads, {a.n_layers} layers, SwiGLU, fp32, vocab "
            f"{a.vocab_size}; batch {a.batch} x seq {a.seq_len} = {a.batch * a.seq_len} tokens per step",
            f"timing   fwd + cross-entropy + bwd + AdamW + zero_grad; median of >= {a.repeats} steps after 1 "
            f"warm-up, mixers interleaved; {torch.get_num_threads()} thread(s)"]
    print("\n".join(head) + "\n")
    n = 2048 if not a.quick else 256
    # the rate before and after the steps, the higher one used: a burst of load during one measurement would
    # otherwise lower the rate and so inflate every mfu (the steps' medians are robust to a burst, one rate is not)
    before = common.matmul_rate(n)
    records = measure(names, a, log)
    after = common.matmul_rate(n)
    rate = max(before, after, key=lambda r: r["gflops"])
    add_mfu(records, rate["gflops"])
    add_bound_ratios(records)
    print(f"matmul   fp32 {n}^3 product: {rate['gflops']:.1f} GFLOP/s (median; the higher of {before['gflops']:.1f} "
          f"before and {after['gflops']:.1f} after the steps) at {torch.get_num_threads()} thread(s); mfu = a step's "
          f"matmul FLOPs / (its median time x this rate)\n")
    head.append(f"matmul   fp32 {n}^3: {rate['gflops']:.1f} GFLOP/s (before the steps {before['gflops']:.1f}, after "
                f"{after['gflops']:.1f}: the higher); mfu = matmul FLOPs / (step time x rate)")
    text = _report(records)
    print(text)
    atomic_write_text(paths["txt"], "\n".join(head) + "\n\n" + text + "\n")
    write_json(paths["json"], {"benchmark": "train", "machine": info, "config": vars(a), "matmul_rate": rate,
                               "matmul_rate_before": before, "matmul_rate_after": after, "records": records})
    print(f"\nwrote {paths['txt']}, {paths['json']}")
    return 1 if any("error" in r for r in records) else 0
