"""`linattn bench serve`: what the HTTP server costs, against `linattn generate`, for one checkpoint.

1. Single-stream decode speed: in each round, greedy `linattn.generate.generate_text` in this process, then the
   same prompt and length streamed from `linattn serve` (a child process, same --threads, `ignore_eos`) and timed
   by the client from the request to the last event; the ratio generate/server per round, and its median over
   --rounds (the target: at most 1.2). The two alternate, so a change in the machine's load hits both.
2. `/health` latency while --streams requests generate at once (the target: under 100 ms): the requests stream
   --load-tokens tokens each; /health is asked --health-samples times, 20 ms apart, once all of them generate.

The client side uses only the standard library (urllib). Table on stdout, JSON under results/bench/serve/.
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


def run(args) -> int:
    """Run the two checks; print the table, write the JSON."""
    from ..generate import load_generator
    from ..serve.process import ServerProcess

    threads, log = common.start_run(args.threads, "cpu", quiet=False)
    paths = common.output_paths("serve", args.out, exts=("txt", "json"), overwrite=args.overwrite)
    ck = load_generator(args.model, "cpu")
    flags = ["--model", args.model, "--threads", str(threads), "--max-concurrent", str(args.streams),
             "--max-tokens-limit", str(max(args.tokens, args.load_tokens)), "--log-level", "warning",
             "--stream-interval", str(args.stream_interval)]
    load_before = common.loadavg()
    with ServerProcess(flags) as server:
        speed = _speed(ck, server.url, args, log)
        health = _health_under_load(server.url, args, log)
    result = {"model": args.model, "prompt": args.prompt, "tokens": args.tokens, "threads": threads,
              "stream_interval": args.stream_interval,
              "speed": speed, "health": health, "loadavg_before": load_before, "loadavg_after": common.loadavg(),
              "machine": common.machine_info("cpu")}
    table = common.format_table(
        ["check", "value", "target"],
        [["decode tok/s, generate", f"{speed['median_generate_tokens_per_s']:.1f}", ""],
         ["decode tok/s, serve", f"{speed['median_serve_tokens_per_s']:.1f}", ""],
         ["generate / serve (median)", f"{speed['median_ratio']:.3f}", "<= 1.2"],
         [f"/health median ms, {args.streams} streams", f"{health['median_ms']:.1f}", "< 100"],
         [f"/health max ms, {args.streams} streams", f"{health['max_ms']:.1f}", ""]])
    text = f"{table}\nload average before {load_before}, after {result['loadavg_after']}\n"
    print(text, end="")
    paths["txt"].write_text(text, encoding="utf-8")
    write_json(paths["json"], result)
    return 0
