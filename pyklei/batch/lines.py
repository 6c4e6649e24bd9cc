"""The OpenAI Batch API's files: input lines in, result lines out, and where a partial output
left off (resume).

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}   # input
    {"id": "batch_req_…", "custom_id": "q1", "response": {"status_code": 200,
     "request_id": "req_…", "body": {...}}, "error": null}                              # output

One output line per input line, in the input's order. A request the API refuses (a 400 of
the endpoint, a 500 of a failed generation) is a result line whose response holds the
endpoint's own error body, as OpenAI's batches write it; a line that is no request at all (not
JSON, no custom_id, a method or url the job cannot run, no body) has `response: null` and
`error: {"code", "message", "param", "line"}` (the Batch object's error fields) naming the line
and the field. Blank lines are no requests and get no output line.

Reproducible output: every id is derived from the input line (its number and bytes), the bodies'
`created` is the input file's modification time, and what depends on the run alone (speeds,
`timings`; how much of a prompt a KV cache slot already held, usage.prompt_tokens_details) is
left out. So a rerun, a resumed run and a Ray run write the same bytes for greedy requests.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

#: the endpoints a batch line may call -> the kind of request (openai_api's "chat"/"text", or
#: embeddings)
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "text",
             "/v1/embeddings": "embeddings"}
MAX_CUSTOM_ID = 512     # characters; OpenAI's limit
MALFORMED = "invalid_batch_line"    # error.code of a line that is no request


class BatchInputError(ValueError):
    """The input (or the output it resumes) cannot be run at all: duplicate custom_ids, an
    output that is not this input's. One line, said before any request runs."""


@dataclass(frozen=True)
class BatchLine:
    number: int                 # 1-based line number in the input file
    raw: str                    # the line's text, as read (ids are derived from it)
    custom_id: str | None       # None when the line has none (then it is malformed)
    kind: str | None = None     # ENDPOINTS' value; None: malformed
    body: dict | None = None
    problem: tuple[str, str] | None = None   # malformed: (message, the field at fault)

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.number}\n{self.raw}".encode()).hexdigest()


def parse_line(number: int, raw: str) -> BatchLine:
    """One input line; a malformed one comes back with `problem` set, never raises."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return BatchLine(number, raw, None, problem=(f"not JSON: {e}", "line"))
    if not isinstance(obj, dict):
        return BatchLine(number, raw, None, problem=("must be a JSON object with custom_id, "
                                                     "method, url and body", "line"))
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not 0 < len(cid) <= MAX_CUSTOM_ID:
        return BatchLine(number, raw, None, problem=(
            f"'custom_id' must be a non-empty string of at most {MAX_CUSTOM_ID} characters",
            "custom_id"))
    if obj.get("method") != "POST":
        return BatchLine(number, raw, cid, problem=(
            f"'method' must be \"POST\", got {obj.get('method')!r}", "method"))
    url = obj.get("url")
    if url not in ENDPOINTS:
        return BatchLine(number, raw, cid, problem=(
            f"'url' must be one of {', '.join(ENDPOINTS)}, got {url!r}", "url"))
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchLine(number, raw, cid, problem=("'body' must be a JSON object: the "
                                                    "endpoint's request body", "body"))
    return BatchLine(number, raw, cid, ENDPOINTS[url], body)


def read_input(path) -> list[BatchLine]:
    """The input file's request lines (blank lines skipped). BatchInputError when two lines
    share a custom_id: their results could not be told apart."""
    lines, seen = [], {}
    with open(path, "rb") as f:
        for number, data in enumerate(f, 1):
            data = data.rstrip(b"\r\n")
            if not data.strip():
                continue
            try:
                line = parse_line(number, data.decode("utf-8"))
            except UnicodeDecodeError as e:
                line = BatchLine(number, data.decode("utf-8", "replace"), None,
                                 problem=(f"not UTF-8 text: {e}", "line"))
            if line.custom_id is not None:
                if line.custom_id in seen:
                    raise BatchInputError(f"{path}: lines {seen[line.custom_id]} and {number} have "
                                          f"the same custom_id {line.custom_id!r}: each request "
                                          f"needs its own")
                seen[line.custom_id] = number
            lines.append(line)
    return lines


def created_of(path) -> int:
    """The `created` of every body of a job: its input file's modification time."""
    return int(os.stat(path).st_mtime)


# ---- output ---------------------------------------------------------------------------------

def response_id(line: BatchLine, kind: str) -> str:
    """The id of the body of a completion of `line` (openai_api.new_id's prefixes)."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + line.digest[:24]


def reproducible(body: dict, created: int) -> dict:
    """A completion body without what depends on the run alone (module doc)."""
    body = {k: v for k, v in body.items() if k != "timings"}
    if "created" in body:
        body["created"] = created
    usage = body.get("usage")
    if isinstance(usage, dict) and "prompt_tokens_details" in usage:
        body["usage"] = {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
    return body


def result(line: BatchLine, status: int, body: dict) -> dict:
    """The output line of a request the endpoint answered (status 200, or its error's)."""
    d = line.digest
    return {"id": f"batch_req_{d[:32]}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": f"req_{d[32:]}", "body": body},
            "error": None}


def malformed(line: BatchLine) -> dict:
    """The output line of a line that is no request."""
    message, param = line.problem
    return {"id": f"batch_req_{line.digest[:32]}", "custom_id": line.custom_id, "response": None,
            "error": {"code": MALFORMED, "message": f"line {line.number}: {message}",
                      "param": param, "line": line.number}}


def encode(out: dict) -> bytes:
    """One output line, as bytes: compact JSON, UTF-8 unescaped, and its newline."""
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


# ---- resume ---------------------------------------------------------------------------------

def resume_point(path, lines: list[BatchLine]) -> int:
    """How many of `lines` the output at `path` already holds (0 when there is none). A last
    line cut short (the job was killed while writing it) is cut off the file, to be redone.
    BatchInputError when a complete line is not the output of the input line at its place
    (another input's output, or an edited input): nothing is appended to it then."""
    p = Path(path)
    if not p.exists():
        return 0
    data = p.read_bytes()
    keep = data.rfind(b"\n") + 1            # what follows the last newline was torn
    if keep < len(data):
        with open(p, "r+b") as f:
            f.truncate(keep)
    done = data[:keep].split(b"\n")[:-1]
    if len(done) > len(lines):
        raise BatchInputError(f"{path} holds {len(done)} results, more than the {len(lines)} "
                              f"requests of the input: it is not this job's output")
    for i, raw in enumerate(done):
        try:
            got = json.loads(raw)
        except ValueError:
            got = None
        want = lines[i]
        if not (isinstance(got, dict) and got.get("id") == f"batch_req_{want.digest[:32]}"
                and got.get("custom_id") == want.custom_id):
            raise BatchInputError(f"{path}: result line {i + 1} is not the result of input line "
                                  f"{want.number} (custom_id {want.custom_id!r}): it is not this "
                                  f"input's output (write to a new file, or remove it)")
    return len(done)
