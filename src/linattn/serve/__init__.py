"""`linattn serve`: an OpenAI-compatible HTTP server for a linattn checkpoint (needs the `serve` extra:
`pip install 'linattn[serve]'`).

    settings   the flags and their checks, the API key's sources (no web imports: `linattn --help` reads them)
    protocol   the OpenAI request fields, checked; the error body
    chat       the chat template: --chat-template FILE or the checkpoint's own
    jobs       a request as the engine runs it, its events, its output side (text, stop strings, logprobs)
    engine     one worker thread that owns the model: continuous batching, or turn by turn for other caches
    batching   the continuous-batching scheduler (chunked prefill, one batched decode step, rows join and leave)
    prefix_cache   an exact token-keyed tree of prompt states under a memory budget (LRU)
    metrics    counters, gauges and histograms in the Prometheus text format
    app        the Starlette routes
    server     loading, uvicorn, the drain on SIGTERM

Importing this package imports nothing of the web stack; docs/serving.md describes the server.
"""
