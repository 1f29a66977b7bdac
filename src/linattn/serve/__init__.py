"""`linattn serve`: an OpenAI-compatible HTTP server for a linattn checkpoint (needs the `serve` extra:
`pip install 'linattn[serve]'`).

    settings   the flags and their checks, the API key's sources (no web imports: `linattn --help` reads them)
    protocol   the OpenAI request fields, checked; the error body
    chat       the chat template: --chat-template FILE or the checkpoint's own
    engine     one worker thread that generates for every request in turn (the code `linattn generate` runs)
    metrics    counters, gauges and histograms in the Prometheus text format
    app        the Starlette routes
    server     loading, uvicorn, the drain on SIGTERM

Importing this package imports nothing of the web stack; docs/serving.md describes the server.
"""
