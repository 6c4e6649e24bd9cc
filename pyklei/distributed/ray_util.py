"""Ray for pyklei's commands: the extra's import and the connection to a cluster, each failure
one line (RayUnavailable, a ValueError: the CLI's "error: ..." and exit code 2).

    ray = require_ray("pyklei batch --ray")
    connect(address=None, num_cpus=2)      # a local cluster of 2 CPUs
    connect(address="10.0.0.5:6379")       # a cluster's head (or "auto", "ray://host:10001")

An address that answers nothing fails within `timeout` seconds: a TCP probe of host:port comes
first, and the connection itself runs under the same deadline (on a helper thread: connecting
starts no process), since Ray retries a silent head for a minute or more.
"""
from __future__ import annotations

import socket
import threading

RAY_EXTRA_HINT = "pip install -e '.[ray]' in a pyklei checkout, or pip install 'pyklei[ray]'"
CONNECT_TIMEOUT = 15.0     # seconds


class RayUnavailable(ValueError):
    """Ray is not installed, or its cluster cannot be reached."""


def require_ray(what: str):
    """The ray module with Ray Data, or RayUnavailable naming the extra."""
    try:
        import ray
        import ray.data  # noqa: F401  (Ray Data comes with ray[data]; the extra installs it)
    except ImportError as e:
        raise RayUnavailable(f"{what} needs the 'ray' extra ({RAY_EXTRA_HINT}): {e}") from None
    return ray


def _host_port(address: str) -> tuple[str, int] | None:
    """host and port of "host:port" or "ray://host:port"; None for "auto" and other forms."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def connect(address: str | None = None, num_cpus: int | None = None,
            timeout: float = CONNECT_TIMEOUT, what: str = "pyklei"):
    """ray.init: to the cluster at `address`, or a new local one of `num_cpus` CPUs (None: all
    of this machine's). Returns the ray module; RayUnavailable when the extra is missing or
    the cluster does not answer within `timeout` seconds. An already initialised Ray is used
    as it is."""
    ray = require_ray(what)
    if ray.is_initialized():
        return ray
    if address:
        hp = _host_port(address)
        if hp is not None:
            try:
                socket.create_connection(hp, timeout=timeout).close()
            except OSError as e:
                raise RayUnavailable(f"cannot reach the Ray cluster at {address}: {e} (is a Ray "
                                     f"head running there? `ray start --head` starts one)") from None
    if not address:
        # on this thread: Ray's processes die with the thread that started them
        # (PR_SET_PDEATHSIG), so a local cluster is never started from a helper thread
        try:
            # a cluster for this command alone: no dashboard (its start-up and ports)
            ray.init(num_cpus=num_cpus, include_dashboard=False, **_QUIET)
        except Exception as e:
            raise RayUnavailable(f"cannot start a local Ray cluster: {_one_line(e)}") from None
        return ray
    failure: list[BaseException] = []

    def init():
        try:
            ray.init(address=address, **_QUIET)
        except BaseException as e:      # handed to the caller's thread
            failure.append(e)

    t = threading.Thread(target=init, daemon=True, name="pyklei-ray-connect")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise RayUnavailable(f"the Ray cluster at {address} did not answer within {timeout:g} s")
    if failure:
        raise RayUnavailable(f"cannot connect to the Ray cluster at {address}: "
                             f"{_one_line(failure[0])}") from None
    return ray


_QUIET = dict(logging_level="ERROR", log_to_driver=False)   # the command's own output only


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
