"""`pyklei batch --ray` (pyklei.batch.ray_data) on a local Ray cluster of 2 CPUs, one for the
whole module (Ray starts slowly here): two engines in Ray Data's actor pool write the local
run's bytes, resume a partial output the same way, and a cluster that is not there is one line,
at once."""
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray.data")

from paths import ROOT, SEED  # noqa: E402
from pyklei.batch import lines as L  # noqa: E402
from pyklei.batch.engine_run import EngineRunner, load_engine  # noqa: E402
from pyklei.batch.job import run_job  # noqa: E402
from pyklei.batch.ray_data import run_on_ray  # noqa: E402
from pyklei.distributed.ray_connect import connect  # noqa: E402

from test_batch_job import _mixed_input  # noqa: E402  (the same mixed file as the local tests)

N_PARALLEL = 2


@pytest.fixture(scope="module")
def ray():
    ray = connect(part="data", num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The mixed input and its local run's output."""
    d = tmp_path_factory.mktemp("batch_ray")
    inp = _mixed_input(d / "in.jsonl")
    llm, engine = load_engine(str(SEED), N_PARALLEL, n_threads=1)
    try:
        run_job(inp, d / "local.jsonl",
                EngineRunner(engine, llm.tokenizer, "seed", L.created_of(inp)).run)
    finally:
        engine.shutdown(cancel=True)
    return d, inp


def _on_ray(ray, inp):
    return lambda todo: run_on_ray(ray, todo, model=str(SEED), replicas=2, threads=1,
                                   n_parallel=N_PARALLEL, load_kwargs={}, model_id="seed",
                                   created=L.created_of(inp), batch_size=3)


def test_ray_data_writes_the_local_runs_bytes_and_resumes(ray, files):
    d, inp = files
    local = (d / "local.jsonl").read_bytes()
    summary = run_job(inp, d / "ray.jsonl", _on_ray(ray, inp))
    assert summary.written == local.count(b"\n") == 11
    assert (d / "ray.jsonl").read_bytes() == local
    # a partial output (4 lines and a torn fifth) resumed on Ray: the same file
    part = local.split(b"\n")
    (d / "resumed.jsonl").write_bytes(b"\n".join(part[:4]) + b"\n" + part[4][:30])
    summary = run_job(inp, d / "resumed.jsonl", _on_ray(ray, inp))
    assert (summary.resumed, summary.written) == (4, 7)
    assert (d / "resumed.jsonl").read_bytes() == local


def test_an_unreachable_cluster_is_one_line_at_once(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                   '"body": {"prompt": "x"}}\n')
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pyklei", "batch", str(SEED), str(inp), "-o",
                        str(tmp_path / "o.jsonl"), "--ray", "--ray-address", "127.0.0.1:1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--ray-address 127.0.0.1:1: no Ray cluster answers" in err[0], \
        r.stderr
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "o.jsonl").exists()
