"""Watching a process from a test on clocks that a busy machine does not stretch.

A test that presses Ctrl-C "during a long prefill" must know that the prefill is running. A
sleep only guesses: on a loaded machine it can end before the prefill has begun (the Ctrl-C then
lands at the prompt) or after it has ended. Here the event is observed instead: a thread of the
process other than its main thread (pyklei/runtime/model.py runs a long C pass in one) has done
so much CPU work since a given moment. Likewise "the Ctrl-C took effect promptly" is counted in the
CPU seconds the process spent after the signal, which another process's load does not add to.
CPU times are read from /proc (Linux), in clock ticks.

A Ctrl-C test's child must also be able to receive SIGINT: a job started in the background by a
non-interactive shell ignores SIGINT, and every process it starts inherits that (so does a
blocked SIGINT); the Ctrl-C tests then saw their prefill run to the end ("completed 13.99").
`sigint_as_in_a_terminal` gives the child SIGINT as a shell in a terminal would.
"""
from __future__ import annotations

import os
import signal
import threading
import time

# The tests' wall-clock bounds are for the normal build. scripts/test_sanitizers.sh runs
# test_reliability.py under ASan+UBSan, where the C pass runs several times slower, and widens
# them by this factor; so can anyone on a slow machine.
TIME_SCALE = float(os.environ.get("PYKLEI_TEST_TIME_SCALE", "1"))

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(stat_path: str) -> float:
    with open(stat_path) as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()     # after "pid (comm) ", from field 3
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S   # utime + stime (proc(5) 14, 15)


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of process pid so far, ended threads included."""
    return _cpu_seconds(f"/proc/{pid}/stat")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """{thread id: CPU seconds} of the living threads of process pid other than its main one."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        tid = int(name)
        if tid != pid:
            try:
                out[tid] = _cpu_seconds(f"/proc/{pid}/task/{name}/stat")
            except (FileNotFoundError, ProcessLookupError):   # it ended meanwhile
                pass
    return out


def wait_for_thread_work(pid: int, seconds: float, since: dict[int, float],
                         timeout: float = 120.0) -> float:
    """Waits until one thread of process pid, other than its main thread and the caller, has run
    `seconds` of CPU more than in `since` (a thread_cpu_seconds(pid) snapshot; a thread born
    after it counts from 0). Returns that thread's share of a CPU over the wait (its CPU
    seconds per wall-clock second, at most 1): how much this machine's load slowed it.
    Raises AssertionError if the process ends or `timeout` (wall seconds, times TIME_SCALE)
    passes first."""
    me = threading.get_native_id()
    t0 = time.monotonic()
    deadline = t0 + timeout * TIME_SCALE
    while True:
        try:
            now = thread_cpu_seconds(pid)
        except FileNotFoundError:
            raise AssertionError(f"process {pid} ended before one of its threads ran "
                                 f"{seconds} s") from None
        work = max((cpu - since.get(tid, 0.0) for tid, cpu in now.items() if tid != me),
                   default=0.0)
        if work >= seconds:
            return min(1.0, work / max(time.monotonic() - t0, 1e-3))
        if time.monotonic() > deadline:
            raise AssertionError(f"no thread of process {pid} ran {seconds} s of CPU in "
                                 f"{timeout * TIME_SCALE:.0f} s (the most: {work:.2f} s)")
        time.sleep(0.01)


def sigint_as_in_a_terminal() -> None:
    """For Popen(preexec_fn=...): the child starts with SIGINT unblocked and at its default
    action (Python then raises KeyboardInterrupt on it), whatever this process inherited."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    signal.signal(signal.SIGINT, signal.SIG_DFL)
