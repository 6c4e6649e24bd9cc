"""Fixtures of the runtime tests: the tiny committed model (tests/fixtures/fuzz_corpus) as an
LLM per module, with one or two KV cache slots; the SmolLM2 file examples/convert_and_generate.py
writes, when it is there; draft lengths that do not follow the measured costs."""
import pytest

from paths import SEED, SMOLLM2_CACHED
from pyklei.llm import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM(SEED, n_threads=1, n_ctx=64)


@pytest.fixture(scope="module")
def tiny():
    return LLM(SEED, n_threads=1, n_ctx=512, n_seq=2)


@pytest.fixture(scope="module")
def smollm2():
    if not SMOLLM2_CACHED.exists():
        pytest.skip(f"{SMOLLM2_CACHED} is not cached")
    return LLM(SMOLLM2_CACHED, n_threads=1, n_ctx=2048, n_seq=3)


@pytest.fixture(scope="module")
def gguf(tiny64):
    """The tiny random Llama file (tests/conftest.py's tiny64) the engine tests run on."""
    return tiny64[1]


@pytest.fixture(scope="module")
def tok(gguf):
    from pyklei.text.tokenizer import Tokenizer
    return Tokenizer.from_gguf(gguf)


@pytest.fixture
def steady_costs(monkeypatch):
    """Draft lengths from the acceptance rate and the cost priors only: on a loaded machine
    the measured costs vary, and with them how much is drafted (never what is generated)."""
    from pyklei.runtime.speculative import DraftLength, PassCost
    for name in ("timed_step", "timed_pass", "timed_draft"):
        monkeypatch.setattr(DraftLength, name, lambda self, *a: None)
    monkeypatch.setattr(PassCost, "add", lambda self, *a: None)

