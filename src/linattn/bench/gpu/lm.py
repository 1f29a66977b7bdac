"""Step `lm`: one training step (AdamW, bf16 autocast; tokens/s, peak memory) and greedy decoding (ms/token)
of a 12-layer d 1024 LM: Gated DeltaNet, the same model with softmax attention, and flash-linear-attention's
own `GatedDeltaNetForCausalLM` at the same configuration (its row is skipped, with the reason, where fla's
models or transformers do not import)."""
from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Dict, List

import torch

from .. import common
from .base import Ctx, NotCovered, free_cuda, sync, tail
from .fla_ops import fla_gated_deltanet_lm

# label -> linattn mixer, or None for fla's model; GDN and softmax first (the targets), then the others
LM_ROWS = (("gated-deltanet", "gated-deltanet"), ("softmax", "softmax"), ("fla GatedDeltaNet", None),
           ("linear", "linear-elu+1"), ("efla", "efla"))


def ffn_hidden(d_model: int) -> int:
    """fla's SwiGLU width for hidden_ratio 4 (2/3 of 4 d, rounded up to 256): both models use it."""
    return 256 * -(-int(d_model * 4 * 2 / 3) // 256)


def linattn_model(mixer: str, p: Dict[str, Any]):
    from ...models import LanguageModel, LMConfig

    cfg = LMConfig(vocab_size=p["vocab"], d_model=p["d_model"], n_layers=p["n_layers"], n_heads=p["n_heads"],
                   mixer=mixer, ffn_hidden=ffn_hidden(p["d_model"]), max_seq_len=max(p["T"], 2048))
    model = LanguageModel(cfg)
    return model, (lambda ids: model(ids[:, :-1], targets=ids[:, 1:]).loss)


def fla_model(p: Dict[str, Any]):
    """fla's GatedDeltaNetForCausalLM at linattn's configuration: heads of d/n_heads, values of the same size
    (expand_v 1), short conv 4, the same SwiGLU width, tied embeddings."""
    Config, Model = fla_gated_deltanet_lm()
    cfg = Config(hidden_size=p["d_model"], num_hidden_layers=p["n_layers"], num_heads=p["n_heads"],
                 head_dim=p["d_model"] // p["n_heads"], expand_v=1.0, intermediate_size=ffn_hidden(p["d_model"]),
                 vocab_size=p["vocab"], tie_word_embeddings=True, fuse_cross_entropy=False)
    model = Model(cfg)
    return model, (lambda ids: model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss)


def _decode(model, prompt, steps: int, device, fla: bool) -> Dict[str, Any]:
    r: Dict[str, Any] = {}
    sync(device)
    t0 = time.perf_counter()
    if fla:
        out = model(input_ids=prompt, use_cache=True)
        cache_kw = lambda o: {"past_key_values": o.past_key_values, "use_cache": True}  # noqa: E731
    else:
        out = model(prompt, use_cache=True, logits_to_keep=1)
        cache_kw = lambda o: {"cache": o.cache, "logits_to_keep": 1}  # noqa: E731
    sync(device)
    r["prefill_ms"] = (time.perf_counter() - t0) * 1e3
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=nxt, **cache_kw(out)) if fla else model(nxt, **cache_kw(out))
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    r["decode_ms_per_token"] = times[len(times) // 2] * 1e3
    return r


def run_lm_case(mixer, plan, device) -> Dict[str, Any]:
    p = plan["lm"]
    torch.manual_seed(0)
    model, loss_fn = fla_model(p) if mixer is None else linattn_model(mixer, p)
    if mixer is None and device != "cuda":  # built (the configuration is checked); its kernels are Triton's
        raise NotCovered("fla's model built; its kernels need a CUDA GPU")
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = device == "cuda"
    ids = torch.randint(0, p["vocab"], (p["B"], p["T"] + 1), device=device)
    autocast: Callable[[], Any] = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda
                                   else (lambda: torch.autocast("cpu", enabled=False)))

    def train_step():
        with autocast():
            loss = loss_fn(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

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
    with torch.no_grad(), autocast():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        r.update(_decode(model, ids[:1, :p["prompt"]], p["decode"], device, fla=mixer is None))
        if cuda:
            r["decode_peak_MiB"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return r


def step_lm(ctx: Ctx, rec: Dict[str, Any], deadline: float) -> None:
    plan, dev = ctx.plan, ctx.device
    p = plan["lm"]
    rows: List[List[Any]] = []
    rec["cases"] = []
    rec["table"] = {"headers": ["model", "params M", "train ms/step", "train tok/s", "train peak MiB",
                                "prefill ms", "decode ms/token", "decode peak MiB", "status"], "rows": rows}
    rec["notes"] = [f"d_model {p['d_model']}, {p['n_layers']} layers, {p['n_heads']} heads, SwiGLU "
                    f"{ffn_hidden(p['d_model'])}, vocab {p['vocab']}, tied head; train: B={p['B']} T={p['T']}, AdamW, "
                    f"bf16 autocast on CUDA, median of {p['steps']} steps after 1 warm-up; decode: B=1, prompt "
                    f"{p['prompt']} tokens, median of {p['decode']} greedy steps; linattn with backend='auto'"]
    for i, (label, mixer) in enumerate(LM_ROWS):
        if time.monotonic() > deadline:
            rec["notes"].append(f"skipped (step budget ran out): {', '.join(m for m, _ in LM_ROWS[i:])}")
            rec["partial"] = True
            break
        t0 = time.monotonic()
        try:
            r = run_lm_case(mixer, plan, dev)
            r["status"] = "ok"
        except (ImportError, NotCovered) as e:  # fla's models or transformers absent, or no GPU: skipped, not an error
            r = {"status": "skipped", "note": str(e)[:160]}
        except Exception as e:
            r = {"status": "error", "error": tail(traceback.format_exc(), 16), "note": f"{type(e).__name__}: {e}"}
        finally:
            free_cuda(dev)
        r["model"], r["seconds"] = label, round(time.monotonic() - t0, 2)
        rec["cases"].append(r)
        rows.append([label, r.get("params_M"), r.get("train_ms"), r.get("train_tok_s"), r.get("train_peak_MiB"),
                     r.get("prefill_ms"), r.get("decode_ms_per_token"), r.get("decode_peak_MiB"),
                     r["status"] if r["status"] == "ok" else r.get("note", r["status"])[:120]])
        ctx.log(f"  {label}: {r['status']} ({r['seconds']} s)")
        ctx.report.save()
    tok = {c["model"]: c.get("train_tok_s") for c in rec["cases"] if c["status"] == "ok"}
    gdn, soft, fla = tok.get("gated-deltanet"), tok.get("softmax"), tok.get("fla GatedDeltaNet")
    if gdn and soft:
        rec["notes"].append(f"GDN / softmax tokens/s: {gdn / soft:.2f}x (target >= 2x at T = 8k)")
    if gdn and fla:
        rec["notes"].append(f"GDN / fla's model tokens/s: {gdn / fla:.2f}x (target >= 0.9x)")
