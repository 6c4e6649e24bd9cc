"""`pyklei serve --ray`'s autoscaling live, on its own local Ray cluster of 2 CPUs
(tests/distributed/conftest.py): one SmolLM2 replica at rest, a second under a burst of
requests (more ongoing than --parallel), back to one when idle. Slow: Ray Serve's scaling
delays and a replica's start are tens of seconds; test_prefix_routing.py checks the
autoscaling options Ray Serve is given on every run."""
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve", reason="needs the 'ray' extra (pip install -e '.[ray]')")

from ray_serve_apps import smollm2_application  # noqa: E402


@pytest.mark.slow
def test_autoscaling_adds_replicas_under_load_and_removes_them_idle(ray_cluster, smollm2_q4):
    """One replica at rest; a burst of requests (more than --parallel ongoing) brings a second
    one; idle again, it goes back to one."""
    from ray import serve

    app = smollm2_application(smollm2_q4, replicas=1, min_replicas=1, max_replicas=2)
    serve.run(app, name="autoscaled", route_prefix="/autoscaled")

    def replicas():
        dep = serve.status().applications["autoscaled"].deployments["PykleiReplica"]
        return dep.replica_states.get("RUNNING", 0)

    try:
        assert replicas() == 1
        stop = threading.Event()
        statuses = []

        def load():
            with httpx.Client(base_url=ray_cluster[1], timeout=300) as c:
                while not stop.is_set():
                    statuses.append(c.post("/autoscaled/v1/completions", json={
                        "model": "smollm2", "prompt": "Once upon a time",
                        "max_tokens": 48}).status_code)

        workers = [threading.Thread(target=load) for _ in range(6)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 240
        while replicas() < 2 and time.monotonic() < deadline:
            time.sleep(2)
        stop.set()
        for w in workers:
            w.join(300)
        assert statuses and set(statuses) == {200}     # under the application's route prefix
        assert replicas() == 2
        deadline = time.monotonic() + 240
        while replicas() > 1 and time.monotonic() < deadline:
            time.sleep(2)
        assert replicas() == 1
    finally:
        serve.delete("autoscaled")
