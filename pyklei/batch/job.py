"""A batch job from its input file to its output file: what is left to do after a partial
output, each result appended (and flushed) as it comes, in the input's order, a count of what
was done.

    summary = run_job("in.jsonl", "out.jsonl", lambda todo: runner.run(todo), progress=bar)

`results(todo)` is any runner of BatchLines into encoded output lines in their order
(engine_run.EngineRunner.run on this machine, ray_data.run_on_ray on a Ray cluster): the file
handling, and so the resume, is the same for both. A job killed at any point leaves complete
lines plus at most one torn one, which the next run cuts off and redoes (lines.resume_point):
no result is lost or written twice.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from . import lines as L


@dataclass
class JobSummary:
    total: int                  # request lines in the input
    resumed: int                # of them, already in the output when the job started
    written: int = 0            # results this run wrote
    statuses: dict = field(default_factory=dict)    # status code (or "malformed") -> lines
    completion_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return sum(n for k, n in self.statuses.items() if k != 200)

    def line(self) -> str:
        """The job's one-line account (the CLI prints it on stderr)."""
        rate = self.written / self.seconds if self.seconds else 0.0
        tps = self.completion_tokens / self.seconds if self.seconds else 0.0
        resumed = f", {self.resumed} already done" if self.resumed else ""
        return (f"{self.written} requests in {self.seconds:.1f} s ({rate:.2f} req/s, "
                f"{tps:.1f} generated tok/s){resumed}; {self.failed} failed")


def run_job(input_path, output_path, results, progress=None) -> JobSummary:
    """Runs the requests of `input_path` that `output_path` does not hold yet through
    `results` (module doc), appending their result lines. progress(done, total), if given, is
    called as lines are written. BatchInputError (before anything runs) for an input with
    duplicate custom_ids or an output that is not this input's."""
    lines = L.read_input(input_path)
    start = L.resume_point(output_path, lines)
    summary = JobSummary(total=len(lines), resumed=start)
    todo = lines[start:]
    if progress:
        progress(start, len(lines))
    t0 = time.perf_counter()
    fd = os.open(output_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for i, data in enumerate(results(todo)):
            _write_all(fd, data)
            summary.written += 1
            _count(summary, data)
            if progress:
                progress(start + i + 1, len(lines))
    finally:
        os.close(fd)
        summary.seconds = time.perf_counter() - t0
    if summary.written != len(todo):
        raise RuntimeError(f"the runner gave {summary.written} results for {len(todo)} requests")
    return summary


def _write_all(fd: int, data: bytes) -> None:
    """One result line, whole, straight to the file (no buffer a kill could lose part of)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _count(summary: JobSummary, data: bytes) -> None:
    out = json.loads(data)
    response = out.get("response")
    key = "malformed" if response is None else response["status_code"]
    summary.statuses[key] = summary.statuses.get(key, 0) + 1
    usage = (response or {}).get("body", {}).get("usage") or {}
    summary.completion_tokens += usage.get("completion_tokens", 0)
    summary.prompt_tokens += usage.get("prompt_tokens", 0)
