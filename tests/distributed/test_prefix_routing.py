"""pyklei.distributed.prefix_routing without Ray: the routing key of each API's body (a chat's
next turn extends its key; tenants never share one), the radix tree (longest prefix, splits,
forgetting a replica, LRU eviction within a budget) and the choice (prefix unless the holder's
queue is much longer; else least-loaded); and the replicas' Serve options (fixed or autoscaled)."""
import json

import pytest

from pyklei.distributed.prefix_routing import PrefixTree, choose_replicas, routing_key

CHAT = "/v1/chat/completions"


def body(**kw) -> bytes:
    return json.dumps(kw).encode()


def chat_key(messages, headers=None, **kw):
    return routing_key(CHAT, body(messages=messages, **kw), headers or {})


def test_a_chats_next_turn_extends_its_key():
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Hello!"},
                     {"role": "user", "content": [{"type": "text", "text": "And?"}]}]
    k1, k2 = chat_key(turn1), chat_key(turn2)
    assert k1 and k2.startswith(k1) and len(k2) > len(k1)
    # another conversation shares only the system prompt
    other = chat_key([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Yo"}])
    assert other[:len(k1) - 2] == k1[:len(k1) - 2] and other != k1


def test_each_api_has_a_key_and_bodies_without_a_prompt_have_none():
    assert routing_key("/v1/completions", body(prompt="Once upon"), {}).endswith("Once upon")
    assert routing_key("/v1/completions", body(prompt=[1, 2, 3]), {}).endswith("1 2 3")
    assert routing_key("/v1/completions", body(prompt=["a b", "c"]), {}).endswith("a b")
    assert routing_key("/v1/responses", body(input="Hi", instructions="Be brief."), {}).endswith(
        "Be brief.Hi")
    assert "Hi" in routing_key("/v1/messages", body(system="S", messages=[
        {"role": "user", "content": "Hi"}]), {})
    for path, raw in ((CHAT, b"{not json"), (CHAT, b"[1]"), (CHAT, body(messages="x")),
                      ("/v1/embeddings", body(input="Hi")), ("/health", b"")):
        assert routing_key(path, raw, {}) == "", (path, raw)


def test_tenants_never_share_a_key():
    m = [{"role": "user", "content": "the same words"}]
    keys = {chat_key(m), chat_key(m, {"authorization": "Bearer k1"}),
            chat_key(m, {"x-api-key": "k2"}), chat_key(m, {"authorization": "Bearer k1"},
                                                        cache_salt="s")}
    assert len(keys) == 4
    assert len({k.split("\x00")[0] for k in keys}) == 4      # they differ from the first char
    assert chat_key(m, {"authorization": "bearer k1"}) == chat_key(m, {"x-api-key": "k1"})


def test_tree_finds_the_longest_prefix_and_who_holds_it():
    t = PrefixTree()
    t.insert("system:abc|user:hello", "A")
    t.insert("system:abc|user:world", "B")
    assert t.match("system:abc|user:hello again", ["A", "B"]) == (len("system:abc|user:hello"), ["A"])
    n, holders = t.match("system:abc|user:w", ["A", "B"])
    assert n == len("system:abc|user:w") and holders == ["B"]
    n, holders = t.match("system:abc|other", ["A", "B"])
    assert n == len("system:abc|") and sorted(holders) == ["A", "B"]
    assert t.match("system:abc|user:hello", ["B"]) == (len("system:abc|user:"), ["B"])
    assert t.match("zzz", ["A", "B"]) == (0, [])
    # the earlier keys a key continues, and who was sent them
    t.insert("system:abc|", "B")
    assert t.matches("system:abc|user:hello, again", ["A", "B"])[1] == (
        len("system:abc|user:hello"), ["A"])
    assert t.matches("system:abc|user:w", ["A", "B"])[1] == (len("system:abc|"), ["B"])
    assert t.matches("system:abc|user:hello", ["B"])[1] == (len("system:abc|"), ["B"])
    t.remove("A")
    assert t.match("system:abc|user:hello", ["A", "B"]) == (len("system:abc|user:"), ["B"])
    t.remove("B")
    assert t.root.children == {} and t.chars == {}


def test_tree_counts_each_replicas_conversations():
    t = PrefixTree()
    sys = "SYSTEM|user:"
    t.insert(sys + "a", "A")
    t.insert(sys + "a|assistant:x|user:b", "A")           # the next turn: the same conversation
    t.insert(sys + "a|assistant:x|user:b", "A")           # the same request again
    assert t.leaves == {"A": 1}
    t.insert(sys + "c", "A")                               # a new conversation
    t.insert(sys + "d", "B")
    assert t.leaves == {"A": 2, "B": 1}
    t.insert(sys, "B")                                     # a prefix of what it holds
    assert t.leaves == {"A": 2, "B": 1}
    t.remove("A")
    assert t.leaves == {"B": 1}


def test_tree_evicts_a_replicas_least_recently_used_prefixes_beyond_its_budget():
    clock = iter(range(1000))
    t = PrefixTree(chars_per_replica=30, clock=lambda: next(clock))
    for tail in ("old", "new", "mid"):
        t.insert("x" * 10 + tail, "A")
    t.insert("y" * 10, "B")
    assert t.chars["A"] == 19
    t.insert("x" * 10 + "abcdefghijkl", "A")       # 31 chars: over budget, evicted to 90%
    assert t.chars["A"] == 25
    assert t.leaves["A"] == 2                                 # "mid" and "abcdefghijkl" are left
    assert t.match("x" * 10 + "old", ["A"])[0] == 10         # the two oldest branches went
    assert t.match("x" * 10 + "new", ["A"])[0] == 10
    assert t.match("x" * 10 + "mid", ["A"])[0] == 13
    assert t.match("x" * 10 + "abcdefghijkl", ["A"])[0] == 22
    assert t.match("y" * 10, ["B"])[0] == 10                 # another replica's entries stay


def test_choice_follows_the_previous_turn_unless_its_queue_is_much_longer():
    t = PrefixTree()
    t.insert("conversation-1 turn 1", "A")
    key = "conversation-1 turn 1 reply turn 2"
    assert choose_replicas(t, key, {"A": 3, "B": 0}, imbalance=4) == (["A"], "prefix")
    assert choose_replicas(t, key, {"A": 5, "B": 0}, imbalance=4) == (["B"], "least_loaded")
    assert choose_replicas(t, "unknown", {"A": 1, "B": 0, "C": 0}, 4) == (["B", "C"], "least_loaded")
    assert choose_replicas(t, "", {"A": 0, "B": 1}, 4) == (["A"], "least_loaded")
    # a key that only branches off a shared prefix (a new conversation under the same system
    # prompt) goes to the replica with the fewest conversations, not onto the holder ...
    t.insert("SYSTEM PROMPT user: first question", "A")
    assert choose_replicas(t, "SYSTEM PROMPT user: second question", {"A": 0, "B": 0}, 4) == (
        ["B"], "least_loaded")
    # ... unless it is much busier
    assert choose_replicas(t, "SYSTEM PROMPT user: 2nd", {"A": 0, "B": 5}, 4) == (
        ["A"], "least_loaded")
    # an earlier key too short for this one is not worth a choice
    t.insert("ab", "A")
    assert choose_replicas(t, "ab" + "z" * 100, {"A": 0, "B": 0}, 4) == (["B"], "least_loaded")
    # a replica no longer a candidate (dead, scaled down) holds nothing
    assert choose_replicas(t, key, {"B": 2, "C": 1}, 4) == (["C"], "least_loaded")
    assert choose_replicas(t, key, {}, 4) == ([], "least_loaded")


def test_replica_options_fixed_or_autoscaled():
    pytest.importorskip("ray.serve", reason="needs the 'ray' extra")
    from pyklei.distributed.ray_serve_app import deployment_options
    from pyklei.distributed.ray_serve_router import PrefixAwareRequestRouter

    fixed = deployment_options(replicas=3, threads=2, n_parallel=4, max_queue=16)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 2}
    assert fixed["max_ongoing_requests"] == 20
    assert fixed["request_router_config"].request_router_kwargs == {"imbalance": 4}
    assert fixed["request_router_config"].get_request_router_class() is PrefixAwareRequestRouter

    auto = deployment_options(replicas=1, threads=1, n_parallel=2, max_queue=8, min_replicas=1,
                              max_replicas=4)
    a = auto["autoscaling_config"]
    assert "num_replicas" not in auto
    assert (a["min_replicas"], a["max_replicas"], a["initial_replicas"]) == (1, 4, 1)
    assert a["target_ongoing_requests"] == 2
    # Ray Serve accepts it as it is
    from ray.serve.config import AutoscalingConfig
    AutoscalingConfig(**a)
    assert deployment_options(replicas=9, threads=1, n_parallel=2, max_queue=8,
                              max_replicas=4)["autoscaling_config"]["initial_replicas"] == 4
    with pytest.raises(ValueError, match="--min-replicas"):
        deployment_options(replicas=1, threads=1, n_parallel=2, max_queue=8, min_replicas=5,
                           max_replicas=2)
