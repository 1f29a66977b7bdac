"""`linattn bench vision`: YOLO-LAT necks compared: parameters, FLOPs, CPU latency per image, and
the neck's cost as the grid grows.

Part 1 (the detector). One YOLOLAT per neck (same backbone and head, random weights, eval mode,
fp32): parameters; FLOPs of one forward pass of one image (torch.utils.flop_counter, which counts
matrix products and convolutions, 2 flops per multiply-add, plus 4 T^2 d per head for softmax
attention, whose fused CPU kernel the counter does not see; exponentials and normalisations are
not counted); latency of a forward pass
(torch.no_grad) at each image side and batch size, timed with every neck interleaved in rounds
(`bench.common.time_interleaved`) so that load from other processes hits all necks alike. Latency
per image = batch latency / batch.

Part 2 (the neck alone). The mixer of each neck on a [1, width, g, g] map for growing grids g
(T = g^2 cells): bidirectional linear attention costs O(T d^2), softmax attention O(T^2 d), the
conv stack O(T). The table gives the time and its growth per doubling of T.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

from ..cli_support import UsageError, int_at_least
from ..io import atomic_write_text, write_json
from ..plotting import save_figure
from . import common

DESCRIPTION = __doc__
PROG = "linattn bench vision"
DEFAULT_NECKS = "hadamard_exp,softmax,conv"


def add_arguments(p) -> None:
    """The options of `linattn bench vision`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--necks", default=DEFAULT_NECKS, help=f"comma list (default {DEFAULT_NECKS}; any linattn "
                                                          f"feature map is a linear-attention neck)")
    p.add_argument("--sizes", type=int, nargs="+", default=[320, 640], help="image sides (default 320 640)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    p.add_argument("--grids", type=int, nargs="+", default=[20, 40, 80, 160],
                   help="grid sides g for the neck-alone part (default 20 40 80 160; 0 = skip the part)")
    p.add_argument("--max-softmax-cells", type=int, default=25600,
                   help="largest g*g for softmax in the neck-alone part (default 25600)")
    p.add_argument("--width", type=int, default=64, help="neck width d (default 64)")
    p.add_argument("--num-classes", type=int, default=10, help="(default 10)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case (default 5, fewer for slow cases)")
    p.add_argument("--budget-s", type=float, default=20.0, help="timing budget per case in seconds (default 20)")
    p.add_argument("--min-time-s", type=float, default=0.2,
                   help="fast cases are repeated until this much time has passed (default 0.2)")
    p.add_argument("--threads", type=int_at_least(0), default=None,
                   help="torch.set_num_threads (default 1, for steadier timings on a shared machine; "
                        "0 = torch's default)")
    p.add_argument("--out", default=None, help="output folder (default results/bench/vision/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")


def count_flops(model: torch.nn.Module, x: torch.Tensor) -> int:
    """FLOPs of model(x): torch's counter for products and convolutions; softmax attention is 4 T^2
    head_dim per head (QK^T and PV), added by hand when the counter does not see the fused SDPA
    kernel (never through SDPA's math form, which would materialise the T x T matrix)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..vision.layers import SoftmaxAttention2d

    extra = [0]

    def hook(mod, inputs):
        B, _, H, W = inputs[0].shape
        extra[0] += 4 * B * mod.heads * (H * W) ** 2 * mod.head_dim

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, SoftmaxAttention2d)]
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(x)
    finally:
        for h in handles:
            h.remove()
    counted_sdpa = any("scaled_dot_product" in str(op) for op in fc.get_flop_counts().get("Global", {}))
    return int(fc.get_total_flops()) + (0 if counted_sdpa else extra[0])


def run(a) -> int:
    """Run the `linattn bench vision` benchmark (module docstring).

    Args:
        a: The options parsed with `add_arguments` (`linattn bench vision --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    from ..vision.model import NECKS, YOLOLAT, count_parameters, make_mixer

    necks = [s.strip() for s in a.necks.split(",") if s.strip()]
    bad = [n for n in necks if n not in NECKS]
    if bad or not necks:
        raise UsageError(f"--necks: unknown {bad}; choose from {', '.join(NECKS)}", prog=PROG)
    if any(s < 16 or s % 16 for s in a.sizes):
        raise UsageError("--sizes must be positive multiples of 16", prog=PROG)
    if any(b < 1 for b in a.batches) or a.repeats < 1 or any(g < 0 for g in a.grids):
        raise UsageError("--batches and --repeats must be >= 1, --grids >= 0", prog=PROG)
    if a.width < 4 or a.width % 4:
        raise UsageError("--width must be a positive multiple of 4 (4 heads)", prog=PROG)
    a.threads, log = common.start_run(a.threads, "cpu", a.quiet)
    paths = common.output_paths("vision", a.out, overwrite=a.overwrite)
    info = common.machine_info("cpu")
    head = [PROG, common.describe_machine(info),
            f"models   YOLOLAT width {a.width}, {a.num_classes} classes, random weights, eval mode, fp32, "
            f"torch.no_grad; necks {', '.join(necks)}",
            f"timing   median of up to {a.repeats} calls after 1 warm-up, necks interleaved in rounds; "
            f"{torch.get_num_threads()} thread(s)"]
    print("\n".join(head) + "\n")
    t0 = time.perf_counter()
    models = {}
    for n in necks:
        torch.manual_seed(0)
        models[n] = YOLOLAT(num_classes=a.num_classes, width=a.width, neck=n).eval()
    records: List[Dict[str, Any]] = []
    static = {}
    for n, m in models.items():
        static[n] = {"params": count_parameters(m),
                     "flops": {s: count_flops(m, torch.zeros(1, 3, s, s)) for s in a.sizes}}
    for s in a.sizes:
        for b in a.batches:
            x = torch.rand(b, 3, s, s, generator=torch.Generator().manual_seed(0))

            def maker(m):
                def make():
                    return lambda: m(x)
                return make

            log(f"[bench vision] {s}x{s} batch {b}: {', '.join(necks)}")
            with torch.no_grad():
                timings = common.time_interleaved([maker(models[n]) for n in necks], repeats=a.repeats,
                                                  budget_s=a.budget_s, min_time_s=a.min_time_s)
            for n, t in zip(necks, timings):
                rec = {"part": "detector", "neck": n, "size": s, "batch": b, "params": static[n]["params"],
                       "flops_per_image": static[n]["flops"][s]}
                if isinstance(t, Exception):
                    rec["error"] = f"{type(t).__name__}: {t}"
                else:
                    rec["latency"] = t.to_dict()
                    rec["ms_per_image"] = t.median_ms / b
                records.append(rec)

    grids = sorted({g for g in a.grids if g > 0})
    for g in grids:
        x = torch.randn(1, a.width, g, g, generator=torch.Generator().manual_seed(0))
        mixers, names = [], []
        for n in necks:
            if n == "softmax" and g * g > a.max_softmax_cells:
                records.append({"part": "neck", "neck": n, "grid": g, "cells": g * g,
                                "skipped": "above --max-softmax-cells"})
                continue
            torch.manual_seed(0)
            mixers.append(make_mixer(n, a.width, 4).eval())
            names.append(n)
        log(f"[bench vision] neck alone, grid {g}x{g} ({g * g} cells): {', '.join(names)}")

        def mk(m):
            def make():
                return lambda: m(x)
            return make

        with torch.no_grad():
            timings = common.time_interleaved([mk(m) for m in mixers], repeats=a.repeats, budget_s=a.budget_s,
                                              min_time_s=a.min_time_s)
        for n, m, t in zip(names, mixers, timings):
            rec = {"part": "neck", "neck": n, "grid": g, "cells": g * g, "flops": count_flops(m, x)}
            if isinstance(t, Exception):
                rec["error"] = f"{type(t).__name__}: {t}"
            else:
                rec["latency"] = t.to_dict()
                rec["ms"] = t.median_ms
            records.append(rec)
    elapsed = time.perf_counter() - t0

    def det(n, s, b):
        for r in records:
            if r["part"] == "detector" and r["neck"] == n and r["size"] == s and r["batch"] == b:
                return r.get("ms_per_image")
        return None

    def neck_ms(n, g):
        for r in records:
            if r["part"] == "neck" and r["neck"] == n and r["grid"] == g:
                return r.get("ms")
        return None

    rows = []
    for n in necks:
        row = [n, f"{static[n]['params']:,}"] + [f"{static[n]['flops'][s] / 1e9:.3f}" for s in a.sizes]
        row += [common.fmt_ms(det(n, s, b)) for s in a.sizes for b in a.batches]
        rows.append(row)
    headers = ["neck", "params"] + [f"GFLOPs@{s}" for s in a.sizes] + \
        [f"ms/img {s} b{b}" for s in a.sizes for b in a.batches]
    lines = ["Detector (per image; batch latency / batch):", common.format_table(headers, rows), ""]
    base = necks[0]
    for n in necks[1:]:
        for s in a.sizes:
            for b in a.batches:
                tb, tn = det(base, s, b), det(n, s, b)
                if tb and tn:
                    lines.append(f"{s}x{s} b{b}: speed-up of {base} over {n}: {tn / tb:.2f}x "
                                 f"({common.fmt_ms(tb)} vs {common.fmt_ms(tn)} ms/img)")
        pb, pn = static[base]["params"], static[n]["params"]
        lines.append(f"parameters: {n} has {pn / pb:.2f}x the parameters of {base} ({pn:,} vs {pb:,})")
    if grids:
        nrows = []
        for n in necks:
            prev, r = None, [n]
            for g in grids:
                ms = neck_ms(n, g)
                cell = common.fmt_ms(ms)
                if ms and prev:
                    cell += f" (x{ms / prev:.1f})"
                r.append(cell)
                prev = ms
            nrows.append(r)
        lines += ["", "Neck alone, [1, %d, g, g], ms (growth per 4x cells):" % a.width,
                  common.format_table(["neck"] + [f"g={g} T={g * g}" for g in grids], nrows)]
    lines.append(f"\nelapsed {elapsed:.0f} s")
    text = "\n".join(lines)
    print(text)

    panels = [{"title": f"detector latency per image, batch {b}", "xlabel": "image side", "ylabel": "ms / image",
               "series": [{"label": n, "x": a.sizes, "y": [det(n, s, b) for s in a.sizes]} for n in necks]}
              for b in a.batches]
    if grids:
        panels.append({"title": "neck alone vs grid cells T", "xlabel": "T = g^2", "ylabel": "ms",
                       "series": [{"label": n, "x": [g * g for g in grids], "y": [neck_ms(n, g) for g in grids]}
                                  for n in necks]})
    atomic_write_text(paths["txt"], "\n".join(head) + "\n\n" + text + "\n")
    write_json(paths["json"], {"benchmark": "vision", "machine": info, "config": vars(a), "static": static,
                               "records": records, "elapsed_s": elapsed})
    note = save_figure(paths["png"], lambda p: common.plot_panels(
        p, panels, title=f"{PROG}: {common.describe_machine(info).splitlines()[0]}"))
    print(f"\nwrote {paths['txt']}, {paths['json']}, {note}")
    return 0
