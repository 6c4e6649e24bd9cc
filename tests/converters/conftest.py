"""Fixtures of the converter tests: tiny random checkpoints (tests/fixtures/models.py), one per
module, and llama.cpp's SmolLM2 GGUF (pyklei_dev.assets)."""
import pytest

from models import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_bpe(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "bpe64", head_dim=64, tied=True,
                           tokenizer="bpe", seed=0)


@pytest.fixture(scope="module")
def tiny_spm(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "spm128", head_dim=128, tied=False,
                           tokenizer="spm", seed=1)


@pytest.fixture(scope="module")
def smollm2_gguf_path():
    from pyklei_dev.assets import smollm2_gguf
    return smollm2_gguf()
