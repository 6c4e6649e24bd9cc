"""The local Ray cluster of the live `pyklei serve --ray` tests: 2 CPUs (this machine's), Ray
Serve's HTTP proxy on a free loopback port; one per test module, shut down after it."""
import pytest
from live_server import free_port


@pytest.fixture(scope="module")
def ray_cluster():
    """(the ray module, the proxy's base URL)."""
    pytest.importorskip("ray.serve", reason="needs the 'ray' extra (pip install -e '.[ray]')")
    from ray import serve

    from pyklei.distributed.ray_connect import connect

    ray = connect(None, part="serve", num_cpus=2)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield ray, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
