"""Fixtures the server tests share: a real `pyklei serve` of SmolLM2 with two API keys (two
tenants), one per test module that asks for it."""
import pytest


@pytest.fixture(scope="module")
def two_key_server(smollm2_q4):
    """LiveServer with `--parallel 2 --api-key key-a,key-b` (the Responses and Messages API tests)."""
    from live_server import LiveServer      # tests/fixtures/, on sys.path via tests/conftest.py
    with LiveServer(smollm2_q4, "--parallel", "2", "--api-key", "key-a,key-b", ctx=2048,
                    threads=2) as srv:
        yield srv
