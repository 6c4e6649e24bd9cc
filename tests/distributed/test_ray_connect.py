"""pyklei.distributed.ray_connect without a cluster: addresses and their default ports, the
extra's message naming the missing part, and connect() against a stand-in ray module (what a
local cluster is started with, per part; a silent head held to the deadline). The live paths
are tests/batch/test_batch_ray.py and tests/distributed/test_serve_ray.py."""
import socket
import sys
import threading
import time
import types

import pytest

from pyklei.distributed import ray_connect as rc


@pytest.mark.parametrize("address, expected", [
    ("10.0.0.5:6379", ("10.0.0.5", 6379)),
    ("headnode", ("headnode", rc.DEFAULT_GCS_PORT)),
    ("ray://headnode", ("headnode", rc.DEFAULT_CLIENT_PORT)),
    ("ray://headnode:10002", ("headnode", 10002)),
    ("[::1]:6380", ("::1", 6380)),
    ("ray://[::1]", ("::1", rc.DEFAULT_CLIENT_PORT)),
    ("auto", None),
    ("local", None),
])
def test_the_host_and_port_an_address_names(address, expected):
    assert rc.ray_host_port(address) == expected


@pytest.mark.parametrize("address", ["somewhere:notaport", ":6379", "ray://h:x"])
def test_a_malformed_address_is_one_line(address):
    with pytest.raises(rc.RayUnavailable, match=r"not HOST:PORT or ray://HOST:PORT"):
        rc.ray_host_port(address)


def test_an_unreachable_port_is_one_line_at_once():
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(rc.RayUnavailable, match=f"127.0.0.1:{port}.*ray start --head"):
        rc.check_reachable(f"127.0.0.1:{port}", timeout=2)


class FakeRay(types.ModuleType):
    """`ray` as connect() uses it: is_initialized, and init recording its arguments (or
    blocking, as a head that accepts TCP and never answers Ray)."""

    def __init__(self, block=False):
        super().__init__("ray")
        self.calls, self.block, self.env_at_init = [], block, {}

    def is_initialized(self):
        return False

    def init(self, **kwargs):
        self.calls.append(kwargs)
        self.env_at_init = {k: rc.os.environ.get(k) for k in rc.SLOW_MACHINE_SERVE_TIMEOUTS}
        if self.block:
            threading.Event().wait()


@pytest.fixture
def fake_ray(monkeypatch):
    def install(part, block=False, missing_part=False):
        ray = FakeRay(block)
        monkeypatch.setitem(sys.modules, "ray", ray)
        monkeypatch.setitem(sys.modules, f"ray.{part}",
                            None if missing_part else types.ModuleType(f"ray.{part}"))
        for name in rc.SLOW_MACHINE_SERVE_TIMEOUTS:
            monkeypatch.delenv(name, raising=False)
        return ray
    return install


@pytest.mark.parametrize("part, name", [("data", "Ray Data"), ("serve", "Ray Serve")])
def test_the_extra_message_names_the_missing_part(fake_ray, part, name):
    fake_ray(part, missing_part=True)
    with pytest.raises(rc.RayUnavailable) as e:
        rc.connect(part=part, what="pyklei x --ray")
    msg = str(e.value)
    assert msg.startswith("pyklei x --ray needs the 'ray' extra") and "\n" not in msg
    assert f"without {name}" in msg and "pip install -e '.[ray]'" in msg


def test_without_ray_the_message_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(rc.RayUnavailable, match=r"Ray is not installed; pip install -e '\.\[ray\]'"):
        rc.import_ray("pyklei batch --ray", part="data")


@pytest.mark.parametrize("part, serve_timeouts", [("serve", True), ("data", False)])
def test_a_new_local_cluster_is_started_here_without_a_dashboard(fake_ray, part, serve_timeouts):
    ray = fake_ray(part)
    assert rc.connect(part=part, num_cpus=3) is ray
    (kwargs,) = ray.calls
    assert kwargs["num_cpus"] == 3 and kwargs["include_dashboard"] is False
    # a new cluster, never one already running here (ray.init's default would join it)
    assert kwargs["address"] == "local"
    assert kwargs["runtime_env"]["env_vars"]["PYTHONPATH"].split(rc.os.pathsep)[0] == \
        str(rc.Path(rc.__file__).resolve().parents[2])
    # Serve's proxy checks get the loaded machine's longer timeouts; Ray Data needs none
    assert all((v is not None) == serve_timeouts for v in ray.env_at_init.values())


def test_a_silent_head_fails_within_the_deadline(fake_ray):
    ray = fake_ray("serve", block=True)
    with socket.socket() as head:           # accepts TCP, never answers as Ray
        head.bind(("127.0.0.1", 0))
        head.listen()
        address = f"127.0.0.1:{head.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(rc.RayUnavailable, match=f"{address} did not answer within 1 s"):
            rc.connect(address, part="serve", timeout=1.0)
    assert time.monotonic() - t0 < 5
    assert ray.calls == [dict(address=address, logging_level="ERROR", log_to_driver=False)]
