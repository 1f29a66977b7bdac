"""`linattn bench serve`: what the HTTP server costs, against `linattn generate`, for one checkpoint.

1. Single-stream decode speed: in each round, greedy `linattn.generate.generate_text` in this process, then the
   same prompt and length streamed from `linattn serve` (a child process, same --threads, `ignore_eos`) and timed
   by the client from the request to the last event; the ratio generate/server per round, and its median over
   --rounds (the target: at most 1.2). The two alternate, so a change in the machine's load hits both.
2. `/health` latency while --streams requests generate at once (the target: under 100 ms): the requests stream
   --load-tokens tokens each; /health is asked --health-samples times, 20 ms apart, once all of them generate.

3. `batch`: aggregate decode tokens/s of --batch-clients (8) concurrent requests (--prompt-tokens
   random prompt tokens, --tokens generated each) against one request alone through the same server (target >= 4).
4. `prefix`: time to first token of a --prefix-tokens (2000) prefix plus 32 new tokens, cold against a prefix-cache
   hit, --rounds fresh prefixes (target: the hit >= 10x faster).
5. `load`: --load-clients (32) clients for --duration (60) s, short random requests whose prompts share prefixes
   (of up to --prompt-tokens tokens); every
   output checked against its solo output (lost, crossed, errors: target 0), throughput, TTFT and latency p50/p99,
   the prefix cache's figures from /metrics.
6. `state`: the state bytes of one conversation after each of --state-tokens tokens, in this process: the linear
   layers' (constant) and the softmax layers' KV caches.

--checks picks them (default speed,health). `--create-hybrid` first writes a randomly initialised ~90 M-parameter
gated DeltaNet / softmax (3:1) hybrid checkpoint at --model when nothing is there. The client side uses only the
standard library (urllib). Table on stdout, JSON under results/bench/serve/.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from typing import Any, Dict, List

from ..cli_support import UsageError, finite_float, int_at_least
from ..io import write_json
from . import common

DESCRIPTION = __doc__
PROG = "linattn bench serve"


def add_arguments(p) -> None:
    """The options of `linattn bench serve`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--model", required=True, help="a checkpoint or run folder (as `linattn serve --model`)")
    p.add_argument("--prompt", default="def main(", help="the prompt (default 'def main(')")
    p.add_argument("--tokens", type=int_at_least(1), default=256, help="tokens per single-stream request (256)")
    p.add_argument("--rounds", type=int_at_least(1), default=5, help="interleaved rounds of the speed check (5)")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch threads, for both sides (1)")
    p.add_argument("--streams", type=int_at_least(1), default=8, help="requests generating during the /health check")
    p.add_argument("--load-tokens", type=int_at_least(1), default=100000,
                   help="tokens each loading request asks for (they are cancelled once measured)")
    p.add_argument("--health-samples", type=int_at_least(1), default=100, help="/health requests to time (100)")
    p.add_argument("--stream-interval", type=finite_float(0.0), default=0.0, help="the server's --stream-interval (0)")
    p.add_argument("--checks", default="speed,health",
                   help="comma-separated: speed, health, batch, prefix, load, state (default speed,health)")
    p.add_argument("--create-hybrid", action="store_true",
                   help="first write a random ~90 M gated-deltanet/softmax 3:1 hybrid checkpoint at --model if absent")
    p.add_argument("--batch-clients", type=int_at_least(1), default=8, help="concurrent requests of `batch` (8)")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=128, help="prompt tokens of `batch` (128)")
    p.add_argument("--prefix-tokens", type=int_at_least(1), default=2000, help="cached prefix of `prefix` (2000)")
    p.add_argument("--load-clients", type=int_at_least(1), default=32, help="clients of `load` (32)")
    p.add_argument("--duration", type=finite_float(0.0), default=60.0, help="seconds of `load` (60)")
    p.add_argument("--state-tokens", default="1024,2048,4096",
                   help="conversation lengths of `state`, comma-separated (default 1024,2048,4096; up to 32768)")
    p.add_argument("--out", default=None, help="output folder (default results/bench/serve/)")
    p.add_argument("--overwrite", action="store_true", help="replace earlier output files")


def _post(url: str, body: Dict[str, Any], timeout: float = 600.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)   # the streamed response: read its lines


def _stream_tokens(url: str, body: Dict[str, Any]) -> int:
    """Stream one completion to its end; the completion tokens the server reports."""
    used = 0
    with _post(url + "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                used = usage["completion_tokens"] if usage else used
    return used


def _running(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("linattn_serve_requests_running "):
                return float(line.split()[1])
    return 0.0


def _percentile(values: List[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def stream_completion(url: str, body: Dict[str, Any], timeout: float = 600.0) -> Dict[str, Any]:
    """One streamed completion: {text, completion_tokens, finish_reason, ttft_s, latency_s, error}; a failure is
    recorded in `error`, never raised."""
    t0 = time.perf_counter()
    rec: Dict[str, Any] = {"text": "", "completion_tokens": None, "finish_reason": None, "ttft_s": None,
                           "latency_s": None, "error": None}
    try:
        with _post(url + "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}},
                   timeout) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    if choice.get("text") and rec["ttft_s"] is None:
                        rec["ttft_s"] = time.perf_counter() - t0
                    rec["text"] += choice.get("text") or ""
                    rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
                if event.get("usage"):
                    rec["completion_tokens"] = event["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001  (counted as an error of this request)
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["latency_s"] = time.perf_counter() - t0
    return rec


def run_clients(url: str, make_body, clients: int, duration: float) -> Dict[str, Any]:
    """`clients` threads, each sending streamed completions one after another for `duration` seconds (the ones in
    flight then finish): `make_body(client, i)` is the i-th body of a client. Returns {records (each with its
    client, i and body), wall_s}."""
    records: List[Dict[str, Any]] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def client(c: int) -> None:
        i = 0
        while time.perf_counter() - t0 < duration:
            body = make_body(c, i)
            rec = {"client": c, "i": i, "body": body, **stream_completion(url, body)}
            with lock:
                records.append(rec)
            i += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"records": records, "wall_s": time.perf_counter() - t0}


def solo_text(model, tokenizer, body: Dict[str, Any]) -> str:
    """The text a completion body gets from the model alone (`linattn.generate.stream_tokens`, decoded piece by
    piece as the server streams it): the reference every served output is checked against."""
    import torch

    from ..generate import TextDecoder, stream_tokens

    ids = body["prompt"] if isinstance(body["prompt"], list) else tokenizer.encode(body["prompt"])
    tokens = list(stream_tokens(model, torch.tensor([ids]), body["max_tokens"],
                                temperature=body.get("temperature", 1.0), seed=body.get("seed"),
                                eos_id=None if body.get("ignore_eos") else tokenizer.eos_id))
    decoder = TextDecoder(tokenizer, skip_special_tokens=True)
    return "".join(decoder.push(t) for t in tokens) + decoder.flush()


def check_outputs(records: List[Dict[str, Any]], solo) -> Dict[str, Any]:
    """Counts over served records: errors (failed requests), lost (no end: no finish reason), crossed (an output
    that is not its own request's solo output), and throughput / latency figures. `solo(body)` gives the
    reference text."""
    errors = [r for r in records if r["error"]]
    lost = [r for r in records if not r["error"] and r["finish_reason"] is None]
    crossed = [r for r in records if not r["error"] and r["finish_reason"] is not None and r["text"] != solo(r["body"])]
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    lat = [r["latency_s"] for r in records if not r["error"]]
    return {"requests": len(records), "errors": len(errors), "lost": len(lost), "crossed": len(crossed),
            "completion_tokens": sum(r["completion_tokens"] or 0 for r in records),
            "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99),
            "latency_p50_s": _percentile(lat, 0.5), "latency_p99_s": _percentile(lat, 0.99),
            "first_errors": [r["error"] for r in errors[:3]]}


def _speed(ck, url: str, args, log) -> Dict[str, Any]:
    from ..generate import generate_text

    body = {"prompt": args.prompt, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
    generate_text(ck.model, ck.tokenizer, args.prompt, 8, temperature=0)   # warm both sides
    _stream_tokens(url, {**body, "max_tokens": 8})
    rows = []
    for i in range(args.rounds):
        _, stats = generate_text(ck.model, ck.tokenizer, args.prompt, args.tokens, temperature=0)
        t = time.perf_counter()
        n = _stream_tokens(url, body)
        server_tps = n / (time.perf_counter() - t)
        rows.append({"generate_tokens_per_s": stats["tokens_per_s"], "serve_tokens_per_s": server_tps,
                     "ratio": stats["tokens_per_s"] / server_tps})
        log(f"[bench serve] round {i + 1}: generate {stats['tokens_per_s']:.1f} tok/s, serve {server_tps:.1f} tok/s")
    return {"rounds": rows, "median_ratio": statistics.median(r["ratio"] for r in rows),
            "median_generate_tokens_per_s": statistics.median(r["generate_tokens_per_s"] for r in rows),
            "median_serve_tokens_per_s": statistics.median(r["serve_tokens_per_s"] for r in rows)}


def _health_under_load(url: str, args, log) -> Dict[str, Any]:
    body = {"prompt": args.prompt, "max_tokens": args.load_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    responses: List[Any] = []

    def load():
        r = _post(url + "/v1/completions", body)
        responses.append(r)
        try:
            for _ in r:
                pass
        except Exception:  # noqa: BLE001  (closed by the bench)
            pass

    threads = [threading.Thread(target=load, daemon=True) for _ in range(args.streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while _running(url) < args.streams:
        if time.monotonic() > deadline:
            raise UsageError(f"the {args.streams} loading requests did not all start within 120 s", prog=PROG)
        time.sleep(0.05)
    samples = []
    for _ in range(args.health_samples):
        t = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            r.read()
        samples.append((time.perf_counter() - t) * 1000)
        time.sleep(0.02)
    running = _running(url)
    for r in responses:
        r.close()
    samples.sort()
    log(f"[bench serve] /health under {args.streams} streams: median {statistics.median(samples):.1f} ms, "
        f"max {samples[-1]:.1f} ms")
    return {"streams": args.streams, "running_at_end": running, "median_ms": statistics.median(samples),
            "p99_ms": samples[min(len(samples) - 1, int(0.99 * len(samples)))], "max_ms": samples[-1],
            "samples": len(samples)}


def _random_ids(rng, n: int, vocab: int) -> List[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _batch(url: str, vocab: int, args, log) -> Dict[str, Any]:
    import random

    rng = random.Random(0)

    def body(_c, _i):
        return {"prompt": _random_ids(rng, args.prompt_tokens, vocab), "max_tokens": args.tokens, "temperature": 0,
                "ignore_eos": True}

    def tokens_per_s(clients: int) -> float:
        done: List[Dict[str, Any]] = []
        t0 = time.perf_counter()
        threads = [threading.Thread(target=lambda: done.append(stream_completion(url, body(0, 0))))
                   for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(r["error"] for r in done):
            raise UsageError(f"a request failed: {[r['error'] for r in done if r['error']][0]}", prog=PROG)
        wall = time.perf_counter() - t0
        # the decode phase: each request's tokens after its first over the time after its first, summed
        decode = sum((r["completion_tokens"] - 1) / (r["latency_s"] - r["ttft_s"]) for r in done
                     if r["completion_tokens"] > 1 and r["latency_s"] > r["ttft_s"])
        return sum(r["completion_tokens"] for r in done) / wall, decode

    stream_completion(url, {**body(0, 0), "max_tokens": 4})   # warm
    rows = []
    for i in range(args.rounds):
        (one, one_decode), (many, many_decode) = tokens_per_s(1), tokens_per_s(args.batch_clients)
        rows.append({"one_tokens_per_s": one, "batch_tokens_per_s": many, "ratio": many / one,
                     "one_decode_tokens_per_s": one_decode, "batch_decode_tokens_per_s": many_decode,
                     "decode_ratio": many_decode / one_decode if one_decode else float("nan")})
        log(f"[bench serve] batch round {i + 1}: 1 request {one:.1f} tok/s, {args.batch_clients} requests "
            f"{many:.1f} tok/s ({many / one:.2f}x; decode phase {rows[-1]['decode_ratio']:.2f}x)")
    return {"clients": args.batch_clients, "rounds": rows, "median_ratio": statistics.median(r["ratio"] for r in rows),
            "median_decode_ratio": statistics.median(r["decode_ratio"] for r in rows)}


def _prefix(url: str, vocab: int, args, log) -> Dict[str, Any]:
    import random

    rng = random.Random(1)
    rows = []
    for i in range(args.rounds):   # cold: a fresh prefix; hit: a prefix an earlier request's prompt ended with
        one = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}
        cold = stream_completion(url, {**one, "prompt": _random_ids(rng, args.prefix_tokens + 32, vocab)})["ttft_s"]
        prefix = _random_ids(rng, args.prefix_tokens, vocab)
        stream_completion(url, {**one, "prompt": prefix})
        hit = stream_completion(url, {**one, "prompt": prefix + _random_ids(rng, 32, vocab)})["ttft_s"]
        rows.append({"cold_ttft_s": cold, "hit_ttft_s": hit, "ratio": cold / hit})
        log(f"[bench serve] prefix round {i + 1}: TTFT cold {cold * 1000:.0f} ms, hit {hit * 1000:.0f} ms "
            f"({cold / hit:.1f}x)")
    return {"prefix_tokens": args.prefix_tokens, "rounds": rows,
            "median_ratio": statistics.median(r["ratio"] for r in rows)}


def _metric_values(url: str) -> Dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        lines = r.read().decode().splitlines()
    return {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln and not ln.startswith("#") and "{" not in ln}


def _load(ck, url: str, vocab: int, args, log) -> Dict[str, Any]:
    import random

    import torch

    p = args.prompt_tokens
    shared = _random_ids(random.Random(2), p, vocab)   # prompts start with p/8, p/4, p/2 or p of these tokens

    def body(c, i):
        rng = random.Random(c * 100003 + i)
        b = {"prompt": shared[:max(1, p // rng.choice((8, 4, 2, 1)))] + _random_ids(rng, rng.randrange(1, 32), vocab),
             "max_tokens": rng.randrange(1, 32), "ignore_eos": True}
        return {**b, "temperature": 0} if rng.random() < 0.5 else {**b, "temperature": 0.8, "seed": rng.randrange(99)}

    before = _metric_values(url)
    result = run_clients(url, body, args.load_clients, args.duration)
    after = _metric_values(url)
    log(f"[bench serve] load: {len(result['records'])} requests in {result['wall_s']:.1f} s; checking each against "
        f"its solo output")
    with torch.no_grad():
        summary = check_outputs(result["records"], lambda b: solo_text(ck.model, ck.tokenizer, b))
    summary["tokens_per_s"] = summary["completion_tokens"] / result["wall_s"]
    summary["clients"], summary["duration_s"] = args.load_clients, args.duration
    summary["prefix_cache"] = {k: after.get(f"linattn_serve_prefix_cache_{k}", 0) - (
        before.get(f"linattn_serve_prefix_cache_{k}", 0) if k in ("hits", "misses", "evicted") else 0)
        for k in ("hits", "misses", "evicted", "entries", "bytes")}
    summary["prefill_tokens"] = after.get("linattn_serve_prefill_tokens_total", 0) - before.get(
        "linattn_serve_prefill_tokens_total", 0)
    summary["prefix_hit_tokens"] = after.get("linattn_serve_prefix_cache_hit_tokens_total", 0) - before.get(
        "linattn_serve_prefix_cache_hit_tokens_total", 0)
    return summary


def _state(ck, args, log) -> Dict[str, Any]:
    """Bytes of one conversation's state after n tokens: the KV caches' (stored keys/values) and the others'."""
    import random

    import torch

    from ..layers.cache import KVCache

    lengths = sorted({int(x) for x in args.state_tokens.split(",") if x.strip()})
    rng, vocab = random.Random(3), ck.model.config.vocab_size
    cache, seen, rows = ck.model.new_cache(), 0, []
    with torch.no_grad():
        for n in lengths:
            while seen < n:
                step = min(512, n - seen)
                ck.model(torch.tensor([_random_ids(rng, step, vocab)]), cache=cache, logits_to_keep=1)
                seen += step
            kv = sum(v.k[:, :v.length].nbytes + v.v[:, :v.length].nbytes for d in cache.layers
                     for lc in d.values() for v in lc.values() if isinstance(v, KVCache) and v.k is not None)
            rows.append({"tokens": n, "linear_state_bytes": cache.nbytes() - sum(
                v.nbytes() for d in cache.layers for lc in d.values() for v in lc.values() if isinstance(v, KVCache)),
                "kv_bytes": kv})
            log(f"[bench serve] state after {n} tokens: linear layers {rows[-1]['linear_state_bytes']} B, "
                f"softmax KV {kv} B")
    return {"rows": rows}


def create_hybrid(path: str) -> None:
    """A randomly initialised gated-deltanet/softmax 3:1 hybrid (d 768, 12 layers, ~90 M parameters, byte
    tokenizer) saved as a run folder at `path`: the model of the serving targets, when no trained one is at hand."""
    from pathlib import Path

    import torch

    from ..checkpoint import save_checkpoint
    from ..data.tokenizer import MIN_VOCAB_SIZE, train_tokenizer
    from ..models import LanguageModel, LMConfig

    tok = train_tokenizer(["linattn"], vocab_size=MIN_VOCAB_SIZE)
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=tok.vocab_size, d_model=768, n_layers=12, n_heads=6, max_seq_len=32768,
                   mixer=(["gated-deltanet"] * 3 + ["softmax"]) * 3)
    save_checkpoint(Path(path), 1, LanguageModel(cfg), model_config=cfg.to_dict(), tokenizer=tok)


CHECKS = ("speed", "health", "batch", "prefix", "load", "state")


def _rows(result: Dict[str, Any], args) -> List[List[str]]:
    rows = []
    if "speed" in result:
        sp = result["speed"]
        rows += [["decode tok/s, generate", f"{sp['median_generate_tokens_per_s']:.1f}", ""],
                 ["decode tok/s, serve", f"{sp['median_serve_tokens_per_s']:.1f}", ""],
                 ["generate / serve (median)", f"{sp['median_ratio']:.3f}", "<= 1.2"]]
    if "health" in result:
        h = result["health"]
        rows += [[f"/health median ms, {args.streams} streams", f"{h['median_ms']:.1f}", "< 100"],
                 [f"/health max ms, {args.streams} streams", f"{h['max_ms']:.1f}", ""]]
    if "batch" in result:
        rows += [[f"{args.batch_clients} requests / 1 request, aggregate tok/s, prefill included (median)",
                  f"{result['batch']['median_ratio']:.2f}", ""],
                 [f"{args.batch_clients} requests / 1 request, aggregate decode-phase tok/s (median)",
                  f"{result['batch']['median_decode_ratio']:.2f}", ">= 4"]]
    if "prefix" in result:
        rows.append([f"TTFT cold / prefix hit, {args.prefix_tokens} + 32 tokens (median)",
                     f"{result['prefix']['median_ratio']:.1f}", ">= 10"])
    if "load" in result:
        ld = result["load"]
        rows += [[f"load: {ld['clients']} clients, {ld['duration_s']:.0f} s: requests", str(ld["requests"]), ""],
                 ["load: errors / lost / crossed", f"{ld['errors']} / {ld['lost']} / {ld['crossed']}", "0 / 0 / 0"],
                 ["load: generated tok/s", f"{ld['tokens_per_s']:.1f}", ""],
                 ["load: TTFT p50 / p99 s", f"{ld['ttft_p50_s']:.3f} / {ld['ttft_p99_s']:.3f}", ""],
                 ["load: latency p50 / p99 s", f"{ld['latency_p50_s']:.3f} / {ld['latency_p99_s']:.3f}", ""],
                 ["load: prefix cache hits / misses / evicted",
                  " / ".join(str(int(ld["prefix_cache"][k])) for k in ("hits", "misses", "evicted")), ""],
                 ["load: prompt tokens from the cache / prefilled",
                  f"{int(ld['prefix_hit_tokens'])} / {int(ld['prefill_tokens'])}", ""]]
    for r in result.get("state", {}).get("rows", []):
        rows.append([f"state after {r['tokens']} tokens: linear / KV bytes",
                     f"{r['linear_state_bytes']} / {r['kv_bytes']}", "linear constant"])
    return rows


def run(args) -> int:
    """Run the chosen checks; print the table, write the JSON."""
    from pathlib import Path

    from ..generate import load_generator
    from ..serve.process import ServerProcess

    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in checks if c not in CHECKS]
    if unknown or not checks:
        raise UsageError(f"--checks: unknown {unknown or 'empty list'}; choose from {', '.join(CHECKS)}", prog=PROG)
    threads, log = common.start_run(args.threads, "cpu", quiet=False)
    paths = common.output_paths("serve", args.out, exts=("txt", "json"), overwrite=args.overwrite)
    if args.create_hybrid and not Path(args.model).exists():
        log(f"[bench serve] creating a random ~90 M gated-deltanet/softmax hybrid at {args.model}")
        create_hybrid(args.model)
    ck = load_generator(args.model, "cpu")
    vocab = ck.model.config.vocab_size
    flags = ["--model", args.model, "--threads", str(threads),
             "--max-concurrent", str(max(args.streams, args.batch_clients, args.load_clients)),
             "--max-tokens-limit", str(max(args.tokens, args.load_tokens)), "--log-level", "warning",
             "--max-prompt-tokens", str(max(8192, args.prefix_tokens + 64)),
             "--stream-interval", str(args.stream_interval)]
    load_before = common.loadavg()
    result: Dict[str, Any] = {"model": args.model, "prompt": args.prompt, "tokens": args.tokens, "threads": threads,
                              "stream_interval": args.stream_interval, "checks": checks}
    with ServerProcess(flags) as server:
        for name, fn in (("speed", lambda: _speed(ck, server.url, args, log)),
                         ("health", lambda: _health_under_load(server.url, args, log)),
                         ("batch", lambda: _batch(server.url, vocab, args, log)),
                         ("prefix", lambda: _prefix(server.url, vocab, args, log)),
                         ("load", lambda: _load(ck, server.url, vocab, args, log))):
            if name in checks:
                result[name] = fn()
    if "state" in checks:
        result["state"] = _state(ck, args, log)
    result.update(loadavg_before=load_before, loadavg_after=common.loadavg(), machine=common.machine_info("cpu"))
    table = common.format_table(["check", "value", "target"], _rows(result, args))
    text = f"{table}\nload average before {load_before}, after {result['loadavg_after']}\n"
    print(text, end="")
    paths["txt"].write_text(text, encoding="utf-8")
    write_json(paths["json"], result)
    return 0
