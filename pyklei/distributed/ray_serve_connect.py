"""`pyklei serve --ray`'s way onto a Ray cluster: the `ray` extra imported, the cluster at
--ray-address reached (or a local one started), each failure one line (RayUnavailable), never a
hang or a traceback.

ray.init(address=...) retries an unreachable head for about a minute before it fails, and the
Ray Client (ray://) for longer; so the head's port is tried first, with a short deadline.
"""
from __future__ import annotations

import importlib
import os
import socket
from pathlib import Path

RAY_EXTRA_HINT = "pip install 'pyklei[ray]' (in a pyklei checkout: pip install -e '.[ray]')"
CONNECT_TIMEOUT_S = 5.0
DEFAULT_GCS_PORT = 6379      # Ray's head (GCS) port when an address names no port
DEFAULT_CLIENT_PORT = 10001  # the Ray Client server's, for ray://host
SLOW_MACHINE_PROXY_TIMEOUTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                               "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


class RayUnavailable(RuntimeError):
    """Ray is not installed, the cluster cannot be reached or the replicas did not start: the
    message is the one line a user needs."""


def import_ray_serve():
    """(ray, ray.serve), or RayUnavailable naming the extra."""
    try:
        return importlib.import_module("ray"), importlib.import_module("ray.serve")
    except ImportError as e:
        raise RayUnavailable(f"--ray needs the 'ray' extra ({RAY_EXTRA_HINT}): {e}") from None


def _host_port(address: str) -> tuple[str, int]:
    client = address.startswith("ray://")
    rest = address[len("ray://"):] if client else address
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if not port:
        return rest, DEFAULT_CLIENT_PORT if client else DEFAULT_GCS_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise RayUnavailable(f"--ray-address {address}: not HOST:PORT or ray://HOST:PORT") from None


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """RayUnavailable unless a TCP connection to the address's host and port opens within
    `timeout` seconds ("auto" and "local" are ray.init's own words, checked by it)."""
    if address in ("auto", "local"):
        return
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise RayUnavailable(f"--ray-address {address}: no Ray cluster answers at {host}:{port} "
                             f"({e.strerror or e}); start one with `ray start --head` or leave "
                             f"--ray-address out for a local one") from None


def connect_for_serve(address: str | None, num_cpus: int | None = None):
    """ray.init on the cluster at `address` (None: a new local cluster of num_cpus CPUs, all
    of this machine's by default); returns the ray module. RayUnavailable when the extra is
    missing or the cluster does not answer."""
    ray, _ = import_ray_serve()
    if ray.is_initialized():
        return ray
    if address is not None:
        check_reachable(address)
    if address is None:
        # Serve's proxy must answer its readiness check within 5 s by default, which a busy
        # small machine misses for minutes (the proxy is restarted again and again)
        for name, seconds in SLOW_MACHINE_PROXY_TIMEOUTS.items():
            os.environ.setdefault(name, seconds)
    try:
        if address is None:
            # the replicas import the pyklei this process runs (a checkout's, not another
            # installed one); on a cluster of its own every node must have it installed
            here = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": path}})
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        where = f"at {address}" if address else "locally"
        raise RayUnavailable(f"could not start or join a Ray cluster {where}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return ray
