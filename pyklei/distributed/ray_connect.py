"""Ray for pyklei's commands (`pyklei batch --ray`, `pyklei serve --ray`): the `ray` extra
imported with the part a command needs (Ray Data or Ray Serve), and the connection to a
cluster; each failure is one line (RayUnavailable, a ValueError: the CLI's "error: ..." and
exit code 2), never a hang or a traceback.

    ray = import_ray("pyklei batch --ray", part="data")
    connect(num_cpus=2, part="data")                      # a new local cluster of 2 CPUs
    connect("10.0.0.5:6379", part="serve")                # a cluster's head; also "auto",
                                                          # "ray://host:10001", "host"

ray.init(address=...) retries a silent head for a minute or more (the Ray Client, ray://, for
longer), so an address is held to a deadline: a TCP probe of its host and port comes first, and
the connection itself runs on a helper thread under what is left of the same deadline
(connecting starts no process, so the thread may be abandoned).
"""
from __future__ import annotations

import importlib
import os
import socket
import threading
import time
from pathlib import Path

RAY_EXTRA_HINT = "pip install -e '.[ray]' in a pyklei checkout, or pip install 'pyklei[ray]'"
CONNECT_TIMEOUT_S = 15.0     # the deadline on reaching and joining a cluster at an address
DEFAULT_GCS_PORT = 6379      # Ray's head (GCS) port when an address names no port
DEFAULT_CLIENT_PORT = 10001  # the Ray Client server's, for ray://host
RAY_PARTS = {"data": "Ray Data", "serve": "Ray Serve"}   # part -> its name in messages
# Serve's proxy must answer its readiness and health checks within 5 s by default, which a
# busy small machine misses for minutes (the proxy is restarted again and again)
SLOW_MACHINE_SERVE_TIMEOUTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                               "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
_QUIET = dict(logging_level="ERROR", log_to_driver=False)   # the command's own output only


class RayUnavailable(ValueError):
    """Ray (or the part of it a command needs) is not installed, the cluster cannot be reached,
    or the replicas did not start: the message is the one line a user needs."""


def import_ray(what: str, part: str):
    """The ray module with ray.<part> ("data" or "serve") imported, or RayUnavailable naming the
    extra and what is missing; `what` is the command that needs it ("pyklei serve --ray")."""
    if part not in RAY_PARTS:
        raise ValueError(f"part must be one of {sorted(RAY_PARTS)}, not {part!r}")
    try:
        ray = importlib.import_module("ray")
    except ImportError as e:
        raise RayUnavailable(f"{what} needs the 'ray' extra (Ray is not installed; "
                             f"{RAY_EXTRA_HINT}): {e}") from None
    try:
        importlib.import_module(f"ray.{part}")
    except ImportError as e:
        raise RayUnavailable(f"{what} needs the 'ray' extra (Ray is installed without "
                             f"{RAY_PARTS[part]}; {RAY_EXTRA_HINT}): {e}") from None
    return ray


def ray_host_port(address: str) -> tuple[str, int] | None:
    """The host and port a Ray address names: "host:port", "ray://host:port", or a bare host
    (Ray's default ports); None for "auto" and "local", ray.init's own words, checked by it."""
    if address in ("auto", "local"):
        return None
    client = address.startswith("ray://")
    rest = address[len("ray://"):] if client else address
    host, sep, port = rest.rpartition(":")
    if not sep or rest.endswith("]"):       # no port: "host", "[::1]"
        return rest.strip("[]"), DEFAULT_CLIENT_PORT if client else DEFAULT_GCS_PORT
    if not port.isdigit() or not host:
        raise RayUnavailable(f"--ray-address {address}: not HOST:PORT or ray://HOST:PORT")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """RayUnavailable unless a TCP connection to the address's host and port opens within
    `timeout` seconds."""
    hp = ray_host_port(address)
    if hp is None:
        return
    host, port = hp
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise RayUnavailable(f"--ray-address {address}: no Ray cluster answers at {host}:{port} "
                             f"({e.strerror or e}); start one with `ray start --head` or leave "
                             f"--ray-address out for a local one") from None


def connect(address: str | None = None, *, part: str, num_cpus: int | None = None,
            timeout: float = CONNECT_TIMEOUT_S, what: str = "pyklei"):
    """ray.init: to the cluster at `address`, or (None) a new local one of `num_cpus` CPUs
    (None: all of this machine's), for a command that uses ray.<part> ("data" or "serve").
    Returns the ray module; RayUnavailable when the extra is missing or the cluster does not
    answer within `timeout` seconds. An already initialised Ray is used as it is."""
    ray = import_ray(what, part)
    if ray.is_initialized():
        return ray
    if not address:
        _start_local(ray, part, num_cpus)
        return ray
    deadline = time.monotonic() + timeout
    check_reachable(address, timeout)
    failure: list[BaseException] = []

    def init():
        try:
            ray.init(address=address, **_QUIET)
        except BaseException as e:      # handed to the caller's thread
            failure.append(e)

    t = threading.Thread(target=init, daemon=True, name="pyklei-ray-connect")
    t.start()
    t.join(max(deadline - time.monotonic(), 1.0))
    if t.is_alive():
        raise RayUnavailable(f"the Ray cluster at {address} did not answer within {timeout:g} s")
    if failure:
        raise RayUnavailable(f"cannot connect to the Ray cluster at {address}: "
                             f"{_first_line(failure[0])}") from None
    return ray


def _start_local(ray, part: str, num_cpus: int | None) -> None:
    """A cluster for this command alone, started on the caller's thread: Ray's processes die
    with the thread that started them (PR_SET_PDEATHSIG), so never from a helper thread."""
    if part == "serve":
        # read by the Serve controller this cluster starts; a user's own values win
        for name, seconds in SLOW_MACHINE_SERVE_TIMEOUTS.items():
            os.environ.setdefault(name, seconds)
    # the workers import the pyklei this process runs (a checkout's, not another installed
    # one); on a cluster of its own every node must have it installed
    here = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    try:
        # no dashboard: its start-up time and ports are no use to one command. address="local":
        # a new cluster even where one runs on this machine (`ray start`, another command's),
        # which ray.init() would join instead, hanging on it when it does not answer and
        # refusing num_cpus; --ray-address auto joins that one
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}}, **_QUIET)
    except Exception as e:
        raise RayUnavailable(f"cannot start a local Ray cluster: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    """The first line of Ray's message (often a traceback follows it)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__
