"""`pyklei serve --ray`'s bad input, as a user meets it: each is one line on stderr and exit
code 2, at once (never a hang on an unreachable cluster, never a traceback)."""
import socket
import subprocess
import sys
import time

import pytest

from paths import ROOT, SEED


def pyklei_serve(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "pyklei", "serve", str(SEED), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def one_line_error(r) -> str:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "\n" not in err, r.stderr
    assert err.startswith("pyklei serve: error: "), err
    return err


def test_an_unreachable_cluster_is_one_line_at_once():
    pytest.importorskip("ray.serve", reason="needs the 'ray' extra")
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.monotonic()
    err = one_line_error(pyklei_serve("--ray", "--ray-address", f"127.0.0.1:{port}"))
    assert time.monotonic() - t < 45
    assert f"--ray-address 127.0.0.1:{port}: no Ray cluster answers" in err
    assert "ray start --head" in err
    err = one_line_error(pyklei_serve("--ray", "--ray-address", "somewhere:notaport"))
    assert "not HOST:PORT" in err


def test_without_the_extra_it_names_the_extra(tmp_path):
    (tmp_path / "ray.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    err = one_line_error(pyklei_serve("--ray", env=env))
    assert "--ray needs the 'ray' extra" in err and "pip install" in err


@pytest.mark.parametrize("args, says", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray-address", "auto"], "--ray-address needs --ray"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is more than --max-replicas 2"),
    (["--ray", "--draft-model", str(SEED)], "--ray serves one model without --draft-model"),
    (["--ray", "--models-dir", str(ROOT)], "--ray serves one model without several models"),
])
def test_flags_that_do_not_go_together(args, says):
    assert says in one_line_error(pyklei_serve(*args))


def test_every_engine_flag_reaches_the_replicas(monkeypatch, tmp_path):
    """The engine's flags go to each replica's engine as to `pyklei serve`'s own: the prefix
    cache's (--cache-ram, --cache-dir, --cache-disk) among them."""
    pytest.importorskip("ray.serve", reason="needs the 'ray' extra")
    import pyklei.distributed.ray_serve_run as run
    from pyklei.cli import main
    seen = {}
    monkeypatch.setattr(run, "serve_on_ray", lambda **kw: seen.update(kw) or 0)
    assert main(["serve", str(SEED), "--ray", "--parallel", "3", "--cache-ram", "64",
                 "--cache-dir", str(tmp_path), "--cache-disk", "128", "--max-queue", "7"]) == 0
    engine = seen["engine_kwargs"]
    assert (engine["cache_ram"], engine["cache_dir"], engine["cache_disk"]) == (64, str(tmp_path), 128)
    assert (engine["n_parallel"], engine["max_queue"]) == (3, 7)
