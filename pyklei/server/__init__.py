"""`pyklei serve`: an OpenAI-compatible HTTP server over pyklei.runtime.engine (docs/SERVE.md).

    run.py             serve(): the engines, the socket, uvicorn, SIGTERM -> drain -> exit 0
    app.py             the Starlette app: routes, streaming, disconnects, errors
    middleware.py      the Host check, request counts, the release of a request's model
    model_registry.py  the models served: which are loaded, load on demand, LRU unload
    openai_api.py      OpenAI's request/response shapes, checked with pyklei's sampling schema
    whole_reply.py     a completion run to its end without HTTP (the batch job's too)
    metrics.py         Prometheus metrics (prometheus_client)
    static/            the chat page served at /

Needs the `serve` extra (in a checkout: pip install -e '.[serve]').
"""
