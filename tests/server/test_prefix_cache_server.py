"""`pyklei serve`'s prefix cache (--cache-ram, --cache-dir): a chat's next turn, after another
conversation took the only slot, reports its restored prefix in
usage.prompt_tokens_details.cached_tokens; another API key never gets it; /metrics has the
gauges and counters a router reads; a restarted server finds the blocks on disk and gives the
same reply. A real subprocess over SmolLM2 (that a hit never
changes a reply, greedy or seeded, is tests/runtime/test_prefix_cache.py's)."""
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from live_server import LiveServer  # noqa: E402  (tests/fixtures/, on sys.path via conftest)

SYSTEM = ("You are a careful assistant for a library. Answer briefly and politely, cite the "
          "shelf of every book you name, never invent a title, and say when you do not know. "
          "The library opens at nine, closes at six, and lends at most five books a person. ") * 2
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}]
OTHER = [{"role": "user", "content": "Name three colours of the rainbow, please, in order."}]


def _metrics(srv) -> dict:
    out = {}
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _chat(c, messages):
    return c.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=12)


def test_next_turn_hits_the_cache_across_a_slot_reuse_and_a_restart(smollm2_q4, tmp_path):
    args = ("--parallel", "1", "--api-key", "k1,k2", "--cache-dir", tmp_path / "kv")
    with LiveServer(smollm2_q4, *args) as srv:
        a, b = srv.openai_client("k1"), srv.openai_client("k2")
        one = _chat(a, TURN1)
        _chat(a, OTHER)                              # the only slot now holds another prompt
        turn2 = TURN1 + [{"role": "assistant", "content": one.choices[0].message.content},
                         {"role": "user", "content": "And when do you close?"}]
        two = _chat(a, turn2)
        cached = two.usage.prompt_tokens_details.cached_tokens
        assert cached >= one.usage.prompt_tokens - 32 and cached % 32 == 0
        _chat(b, OTHER)       # another tenant: only its own slot's template head, no k1 block
        assert _chat(b, turn2).usage.prompt_tokens_details.cached_tokens < 32
        m = _metrics(srv)
        # the slot held the chat template's head (OTHER's); the cache added the rest
        assert cached - 32 < m["pyklei_prefix_cache_restored_tokens_total"] <= cached
        assert m["pyklei_prefix_cache_hits_total"] >= cached
        assert m["pyklei_prefix_cache_queries_total"] >= 5 * one.usage.prompt_tokens // 2
        assert 0 < m["pyklei_prefix_cache_bytes"] <= m["pyklei_prefix_cache_capacity_bytes"]
        assert m["pyklei_num_requests_waiting"] == 0 and m["pyklei_num_requests_running"] == 0
        assert m["pyklei_kv_cache_usage_perc"] == 0
    with LiveServer(smollm2_q4, *args) as srv:          # restarted: the blocks are on disk
        again = _chat(srv.openai_client("k1"), turn2)
        assert again.usage.prompt_tokens_details.cached_tokens == cached
        assert again.choices[0].message.content == two.choices[0].message.content
