"""Hugging Face Hub ids (pyklei.hub): `pyklei convert org/name`, `--revision`, `--file`, and
`org/name:file.gguf` wherever a model file is taken, all offline.

No test here reaches the network: the subprocesses run with HF_HUB_OFFLINE=1 over a hub cache
the test lays out itself (models--org--name/refs/REV -> snapshots/COMMIT/...), as
huggingface_hub's own cache looks after a download; the in-process ones replace
snapshot_download / list_repo_files.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from models import make_tiny_llama  # noqa: E402

from pyklei import hub  # noqa: E402
from pyklei.converters import ConversionError, convert  # noqa: E402
from pyklei.formats.model_file import read_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def mirror(cache: Path, repo_id: str, files: dict[str, Path], revision: str = "main") -> Path:
    """Puts `files` ({name in the repo: local file}) into `cache` as the hub cache holds
    revision `revision` of repo_id; returns the snapshot folder."""
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / commit
    for name, src in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, snap / name)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return snap


def offline_env(tmp_path: Path) -> dict:
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_CACHE": str(tmp_path / "hub-cache")}


def pyklei(tmp_path, *args, env=None, timeout=300):
    """`python -m pyklei ARGS` offline, in tmp_path (so that org/name is no local path)."""
    return subprocess.run([sys.executable, "-m", "pyklei", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path, env=env or offline_env(tmp_path))


def one_line_error(r, command: str) -> str:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "\n" not in err and "Traceback" not in err, r.stderr
    assert err.startswith(f"pyklei {command}: error: "), err
    return err


@pytest.fixture(scope="module")
def tiny_repos(tmp_path_factory):
    """Two tiny checkpoints: revision main (head_dim 64) and v2 (head_dim 128) of testorg/tiny."""
    d = tmp_path_factory.mktemp("hubsrc")
    return (make_tiny_llama(d / "main", head_dim=64, seed=0),
            make_tiny_llama(d / "v2", head_dim=128, seed=1))


def _checkpoint_files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in d.iterdir() if p.is_file()}


# ---- what is a hub id -----------------------------------------------------------------------

@pytest.mark.parametrize("arg, repo", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("org/name.v1", True), ("a/b_c", True),
    ("name", False), ("./org/name", False), ("/abs/org/name", False), ("org/name/sub", False),
    ("org/../x", False), ("org--x/name", False), ("org/name:file.gguf", False), ("", False),
])
def test_is_repo_id(arg, repo):
    assert hub.is_repo_id(arg) is repo


def test_a_local_path_wins_over_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not hub.is_repo_id("org/name")
    (tmp_path / "org" / "name:m.gguf").write_bytes(b"")
    assert hub.split_file_ref("org/name:m.gguf") is None
    assert hub.model_file("org/name:m.gguf") == Path("org/name:m.gguf")
    assert hub.split_file_ref("other/repo:dir/m.gguf") == ("other/repo", "dir/m.gguf")
    assert hub.split_file_ref("other/repo:m.bin") is None


# ---- pyklei convert org/name ------------------------------------------------------------------

def test_convert_a_hub_id_from_the_cache_and_a_revision(tiny_repos, tmp_path):
    main, v2 = tiny_repos
    cache = tmp_path / "hub-cache"
    mirror(cache, "testorg/tiny", _checkpoint_files(main))
    mirror(cache, "testorg/tiny", _checkpoint_files(v2), revision="v2")
    r = pyklei(tmp_path, "convert", "testorg/tiny", "-o", "a.gguf", "--no-calibrate", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert read_model(tmp_path / "a.gguf").hparams.head_dim == 64
    r = pyklei(tmp_path, "convert", "testorg/tiny", "--revision", "v2", "-o", "b.gguf",
               "--no-calibrate", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert read_model(tmp_path / "b.gguf").hparams.head_dim == 128
    # the default method (GPTQ) tokenizes its calibration text with the same download
    r = pyklei(tmp_path, "convert", "testorg/tiny", "-o", "c.gguf", "--calib-tokens", "512",
               "--no-progress")
    assert r.returncode == 0, r.stderr
    assert read_model(tmp_path / "c.gguf").metadata.get("pyklei.converter.weight_method") == "gptq"


def test_convert_offline_without_the_cache_is_one_line(tmp_path):
    r = pyklei(tmp_path, "convert", "testorg/absent", "-o", "x.gguf", "--no-progress")
    err = one_line_error(r, "convert")
    for s in ("could not reach the Hugging Face Hub", "testorg/absent", "HF_HUB_OFFLINE is set",
              str(tmp_path / "hub-cache"), "local checkpoint directory"):
        assert s in err, (s, err)
    assert not (tmp_path / "x.gguf").exists()
    r = pyklei(tmp_path, "convert", "testorg/absent", "--revision", "v9", "-o", "x.gguf",
               "--no-calibrate")
    assert "the checkpoint at revision v9 of testorg/absent" in one_line_error(r, "convert")


def test_convert_file_of_a_gguf_repo(tiny_repos, tmp_path):
    """--file fetches one GGUF of the repo and converts it (here a pyklei file, which the
    converter refuses by name: the file reached it)."""
    main, _ = tiny_repos
    convert(main, tmp_path / "tiny.gguf")
    mirror(tmp_path / "hub-cache", "testorg/tiny-GGUF", {"tiny.gguf": tmp_path / "tiny.gguf"})
    r = pyklei(tmp_path, "convert", "testorg/tiny-GGUF", "--file", "tiny.gguf", "-o", "o.gguf",
               "--no-calibrate")
    assert "already a pyklei model file" in one_line_error(r, "convert")
    r = pyklei(tmp_path, "convert", "testorg/tiny-GGUF", "--file", "other.gguf", "-o", "o.gguf",
               "--no-calibrate")
    assert "could not reach the Hugging Face Hub for other.gguf" in one_line_error(r, "convert")
    r = pyklei(tmp_path, "convert", "tiny.gguf", "--file", "x.gguf", "-o", "o.gguf", "--no-calibrate")
    assert "tiny.gguf is a local path" in one_line_error(r, "convert")


def test_convert_api_passes_revision_and_patterns(tiny_repos, tmp_path, monkeypatch):
    import huggingface_hub

    main, _ = tiny_repos
    calls = []

    def fake_snapshot(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, tuple(allow_patterns)))
        return str(main)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.chdir(tmp_path)
    res = convert("testorg/tiny", tmp_path / "t.gguf", revision="abc123")
    assert calls == [("testorg/tiny", "abc123", hub.CHECKPOINT_PATTERNS)]
    assert res.path.exists()
    with pytest.raises(ConversionError, match="missing input: no/such/dir does not exist"):
        convert("no/such/dir", tmp_path / "u.gguf")
    with pytest.raises(ConversionError, match="t.gguf exists"):        # before any download
        convert("testorg/tiny", tmp_path / "t.gguf")
    assert len(calls) == 1


def test_a_repo_without_safetensors_names_its_gguf_files(tmp_path, monkeypatch):
    import huggingface_hub

    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(tmp_path / "snap"))
    monkeypatch.setattr(huggingface_hub, "list_repo_files",
                        lambda *a, **k: ["README.md", "m-Q8_0.gguf", "m-Q4_0.gguf"])
    with pytest.raises(hub.HubError, match=r"org/m-GGUF has no \.safetensors weights; it holds "
                                           r"GGUF files: name one with --file \(e\.g\. --file m-Q4_0\.gguf\)"):
        hub.checkpoint_dir("org/m-GGUF")


def test_without_huggingface_hub_the_hint_is_one_line(tmp_path):
    code = ("import sys; sys.modules['huggingface_hub'] = None\n"
            "from pyklei.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    for args, command in ((["convert", "testorg/tiny", "-o", "x.gguf"], "convert"),
                          (["generate", "testorg/tiny:m.gguf", "-p", "hi"], "generate")):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path, env=offline_env(tmp_path))
        assert "needs huggingface_hub: pip install huggingface_hub" in one_line_error(r, command)


# ---- org/name:file.gguf where a model file is taken ------------------------------------------

def test_load_generate_and_info_take_a_hub_file(tiny_repos, tmp_path):
    main, _ = tiny_repos
    convert(main, tmp_path / "tiny.gguf")
    mirror(tmp_path / "hub-cache", "testorg/tiny-pyklei", {"q4/tiny.gguf": tmp_path / "tiny.gguf"})
    ref = "testorg/tiny-pyklei:q4/tiny.gguf"
    r = pyklei(tmp_path, "generate", ref, "-p", "hello", "-n", "3", "--temperature", "0", "-t", "1")
    assert r.returncode == 0, r.stderr
    r = pyklei(tmp_path, "info", ref, "--json")
    assert r.returncode == 0 and '"file_kind": "pyklei"' in r.stdout, r.stderr
    code = (f"import pyklei\nllm = pyklei.load({ref!r}, n_threads=1, n_ctx=64)\n"
            f"print(llm.generate('hello', max_tokens=3, temperature=0.0).generation_tokens)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=offline_env(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == "3", r.stderr
    r = pyklei(tmp_path, "generate", "testorg/tiny-pyklei:absent.gguf", "-p", "hi")
    err = one_line_error(r, "generate")
    assert "could not reach the Hugging Face Hub for absent.gguf of testorg/tiny-pyklei" in err
    assert "a local copy of absent.gguf" in err


def test_a_llamacpp_gguf_of_the_hub_gets_the_convert_line_of_the_repo(tmp_path):
    """What most GGUF repos hold is llama.cpp's: load, generate and bench say how to convert
    it from the repo; info describes it."""
    import gguf
    import numpy as np

    src = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mirror(tmp_path / "hub-cache", "testorg/m-GGUF", {"m-Q4_0.gguf": src})
    ref = "testorg/m-GGUF:m-Q4_0.gguf"
    hint = "pyklei convert testorg/m-GGUF --file m-Q4_0.gguf -o OUT.gguf"
    for args, command in ((["generate", ref, "-p", "hi"], "generate"),
                          (["bench", ref, "-p", "8", "-n", "1"], "bench")):
        err = one_line_error(pyklei(tmp_path, *args), command)
        assert "pyklei convert" in err and "not a pyklei model file" in err, err
        if command == "generate":
            assert hint in err, err
    r = pyklei(tmp_path, "info", ref)
    assert r.returncode == 0 and "not a pyklei file" in r.stdout, r.stderr
