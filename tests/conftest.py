"""Shared, session-scoped fixtures: real and tiny models, made once per test run.

tests/ mirrors pyklei/: tests/formats, converters, runtime, text, server and cli test those
packages, tests/kernels the C kernel layer (tests/kernels/c: the standalone C tests), tests/docs
the README and docs/, and the files directly in tests/ the top-level modules (the API, the hub)
and the house itself (layering, packaging). Helpers and committed data live in tests/fixtures/.

Real model files are cached under ~/.cache/pyklei (see pyklei_dev.assets); converted files live
in pytest's temporary directory so every run tests the current converter.
"""
import json
import sys
from pathlib import Path

import pytest

# tests/fixtures/ (models.py, hf_reference.py, live_server.py, child_watch.py, kernel_log.py,
# paths.py, data/, fuzz_corpus/): imported by name, `from models import make_tiny_llama`
sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
sys.path.append(str(Path(__file__).parents[1]))  # pyklei_dev/ (not installed: its __init__.py)


@pytest.fixture(scope="session")
def smollm2_hf_path():
    from models import smollm2_hf_dir
    return smollm2_hf_dir()


@pytest.fixture(scope="session")
def smollm2_conversion(smollm2_hf_path, tmp_path_factory):
    """SmolLM2-135M-Instruct converted by pyklei (qsi4c32, group 32, defaults): (path, the
    ConversionResult). Read only: every test that converts SmolLM2 so shares this one."""
    from pyklei.converters import convert
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-q4.gguf"
    return out, convert(smollm2_hf_path, out)


@pytest.fixture(scope="session")
def smollm2_q4(smollm2_conversion):
    return smollm2_conversion[0]


def _tiny(tmp_path_factory, head_dim):
    """Tiny random Llama 3.2-style model (tied, GQA 4/2, llama3 RoPE scaling) whose
    original_max_position_embeddings is 64, so tests reach positions beyond it."""
    from models import make_tiny_llama
    from pyklei.converters import convert
    d = tmp_path_factory.mktemp(f"tiny{head_dim}")
    hf = make_tiny_llama(d / "hf", head_dim=head_dim, tied=True, tokenizer="bpe", seed=head_dim)
    cfg = json.loads((hf / "config.json").read_text())
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    rope["original_max_position_embeddings"] = 64
    (hf / "config.json").write_text(json.dumps(cfg))
    out = d / "tiny.gguf"
    convert(hf, out)
    return hf, out


@pytest.fixture(scope="session")
def tiny64(tmp_path_factory):
    return _tiny(tmp_path_factory, 64)


@pytest.fixture(scope="session")
def tiny128(tmp_path_factory):
    return _tiny(tmp_path_factory, 128)


@pytest.fixture
def f32_attention(monkeypatch):
    """Attention's dot products in f32 for the models the test makes (PYKLEI_ATTENTION, read
    when a model is made): for a reference, a tolerance or an expected text that assumes f32
    arithmetic. The default reads an f16 cache in bf16 where AVX-512 BF16 runs (docs/KERNELS.md,
    "Attention in bf16"); tests/runtime/test_attention_bf16_model.py and the bf16 test of
    test_vs_transformers.py check that path."""
    monkeypatch.setenv("PYKLEI_ATTENTION", "f32")
