"""The tiny committed model as an LLM, one per test module (tests/fixtures/fuzz_corpus)."""
import pytest

from paths import SEED
from pyklei.llm import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM(SEED, n_threads=1, n_ctx=64)
