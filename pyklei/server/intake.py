"""A request's way in: its body read within a deadline and a size, parsed as JSON with bounded
integers and nesting, and its Content-Type checked, before any use of it (app.py's handlers).

Each failure is the APIError that says what is wrong (413 too large, 408 too slow, 400 not JSON,
415 not sent as JSON); a client that hangs up mid-upload is ClientGone (nothing to answer).
"""
from __future__ import annotations

import asyncio
import json

from starlette.requests import ClientDisconnect, Request as HTTPRequest

from ..runtime.request import check_depth
from .openai_api import APIError

MAX_BODY = 8 << 20
MAX_DEPTH = 64                 # JSON nesting; deeper bodies are refused before any use of them
MAX_INT_DIGITS = 40            # JSON integers (a seed is at most 20 digits)


class ClientGone(Exception):
    """The client hung up before its request body arrived: nothing to answer (logged as 499)."""


async def read_body(request: HTTPRequest) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
        raise APIError(f"the body must be at most {MAX_BODY} bytes", status=413)
    chunks, n = [], 0
    async for c in request.stream():
        n += len(c)
        if n > MAX_BODY:
            raise APIError(f"the body must be at most {MAX_BODY} bytes", status=413)
        chunks.append(c)
    return b"".join(chunks)


async def read_json(request: HTTPRequest, timeout: float):
    """The body as JSON, or the APIError that says what is wrong with it: 413 (too large),
    408 (not sent within `timeout` s), 400 (not JSON: bad syntax, not UTF-8, an integer of more
    than 4300 digits, nested too deeply). ClientGone when the client hung up mid-upload."""
    try:
        raw = await asyncio.wait_for(read_body(request), timeout)
    except asyncio.TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout:g} s",
                           status=408, code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        body = json.loads(raw, parse_int=parse_int)
    except RecursionError:
        raise APIError(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:      # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise APIError(f"the body is not valid JSON: {e}") from None
    try:
        check_depth(body, MAX_DEPTH)
    except ValueError as e:
        raise APIError(f"the body: {e}") from None
    return body


def parse_int(digits: str) -> int:
    """json's integer hook: refuses a long one before Python's own int parsing (quadratic, and
    limited to 4300 digits with a message about sys.set_int_max_str_digits)."""
    if len(digits) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits)} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def check_json_content_type(request: HTTPRequest) -> None:
    """415 unless the body says it is JSON. A browser sends a cross-origin text/plain or form
    POST without asking first (no CORS preflight); requiring application/json makes every such
    request preflighted, so a web page cannot drive a local server."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise APIError(f"the body must be sent as 'Content-Type: application/json' (got "
                           f"{media or 'none'!r})", status=415, code="unsupported_media_type")
