"""`pyklei serve`: an OpenAI-compatible HTTP server over pyklei.runtime.engine (docs/SERVE.md).

    run.py         serve(): the engine, the socket, uvicorn, SIGTERM -> drain -> exit 0
    app.py         the Starlette app: routes, streaming, disconnects, errors
    openai_api.py  OpenAI's request/response shapes, checked with pyklei's sampling schema
    metrics.py     Prometheus metrics (prometheus_client)
    static/        the chat page served at /

Needs the `serve` extra (in a checkout: pip install -e '.[serve]').
"""
