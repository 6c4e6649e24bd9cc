"""What a front of several replicas (`pyklei serve --ray`'s ingress, `pyklei route`) answers
when the replica a request went to fails, in the API's own error shape, and the header that
names the replica that served a request.

A replica that fails before its reply started: 503 `replica_unavailable` with Retry-After (the
client retries; the front sends it elsewhere). One that fails mid-stream: an error event ends
the stream (its headers were sent), so the client sees a reply cut short, never a complete one.
"""
from __future__ import annotations

import json

REPLICA_HEADER = "x-pyklei-replica"    # which replica served a request (routing is observable)


def failure_message(e: BaseException) -> str:
    return (f"the replica serving this request failed ({type(e).__name__}); retry it: another "
            f"replica will take it")


def error_body(path: str, message: str, type: str, code: str | None) -> dict:
    """The API's own error shape: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        kind = "api_error" if type == "server_error" else type
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def error_response(path: str, status: int, message: str, type: str, code: str | None,
                   headers=None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(path, message, type, code), status_code=status,
                        headers=headers)


def replica_unavailable(path: str, e: BaseException | None = None, message: str | None = None):
    """503 for a request no replica took: `message`, or failure_message(e)."""
    return error_response(path, 503, message or failure_message(e), "server_error",
                          "replica_unavailable", {"Retry-After": "1"})


def stream_error_event(path: str, e: BaseException) -> bytes:
    """The SSE event that ends a stream whose replica failed mid-reply."""
    body = json.dumps(error_body(path, failure_message(e), "server_error", "replica_unavailable"))
    if path.startswith("/v1/messages"):
        return b"event: error\ndata: " + body.encode() + b"\n\n"
    return b"data: " + body.encode() + b"\n\n"
