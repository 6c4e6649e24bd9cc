"""Prefix-aware routing, without Ray: which replica should take a request so that the prompt
prefix it already computed is reused (ray_serve_router.py puts this behind Ray Serve's
request-router API).

    routing_key(path, body, headers)   the text a request's prompt starts with, in its tenant's
                                       partition ("" when it has none: least-loaded)
    PrefixTree                         a radix tree of the keys each replica was sent, each
                                       replica's entries LRU-evicted beyond a character budget
    choose_replicas(tree, key, queues, imbalance)
                                       the replicas that were sent the longest earlier request
                                       that `key` continues, unless their queue is `imbalance`
                                       requests longer than the shortest; else the ones with
                                       the fewest conversations among those not `imbalance`
                                       busier than the least-loaded

Why text and not tokens: the router runs before any tokenizer (in the ingress, once per request)
and a chat's turns are prefixes of each other as text already: turn n+1's messages are turn n's
messages, the reply and a new user message. The replica that served turn n holds its prompt's KV
(today in a `--parallel` slot; with a prefix cache, beyond it), so sending turn n+1 there prefills
only the new tokens. The key is built in the order the chat template writes messages, so a text
prefix is a token prefix up to the template's separators.

Continuing, not just sharing: a new conversation shares its system prompt with every other,
and sending it where that prefix is would pile every new conversation onto the first replica
that served one. So the prefix that counts is a whole earlier key (the previous turn): a key
that only branches off a shared prefix (a new conversation) goes to the replica holding the
fewest conversations (the ends of its branches in the tree) among those not much busier than
the least-loaded one. Each replica then computes the shared prefix once and holds it too, and
conversations spread evenly over the replicas' slots: a replica with more conversations than
`--parallel` slots lets them take each other's slots (as ray.llm's PrefixCacheAffinityRouter
falls back to its "smallest tenant").

Tenants: a key starts with a digest of the request's API key and `cache_salt` (the engine's
cache partition, pyklei.server.app), so a request is never routed by another tenant's prompts
and its routing tells it nothing about them.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

MIN_MATCH_FRACTION = 0.1     # a shorter shared prefix is not worth a longer queue: least-loaded
DEFAULT_CHARS_PER_REPLICA = 1_000_000    # ~250k tokens: beyond what a replica's KV holds


def routing_key(path: str, body: bytes, headers: dict[str, str]) -> str:
    """The routing text of a request to `path` with this JSON body: "" when the body is not
    JSON or the path has no prompt (then the router picks the least-loaded replica; the
    replica's own checks answer a bad body). headers: lower-case names."""
    try:
        req = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(req, dict):
        return ""
    text = _PROMPT_TEXT.get(path.rstrip("/"), lambda r: "")(req)
    if not text:
        return ""
    return _partition(headers, req.get("cache_salt")) + "\x00" + text


def _partition(headers: dict[str, str], salt) -> str:
    """A digest of the tenant: the API key the request carries (Bearer or x-api-key) and its
    cache_salt, the same pair the engine partitions its cache by."""
    auth = headers.get("authorization", "")
    key = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return hashlib.sha256(json.dumps([key, salt if isinstance(salt, str) else None])
                          .encode()).hexdigest()[:16]


def _text(content) -> str:
    """A message's content as text: a string, or the text of its parts (OpenAI's and
    Anthropic's content parts), or JSON for anything else (tool calls, images' urls)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str)
                       else _text(p) if isinstance(p, (list, str)) else json.dumps(p, sort_keys=True)
                       for p in content)
    return json.dumps(content, sort_keys=True)


def _messages_text(messages) -> str:
    """Each message as role, content and tool calls, in order (\x1e opens a message, \x1f
    ends its role), so that a conversation's next turn extends this turn's text."""
    if not isinstance(messages, list):
        return ""
    out = []
    for m in messages:
        if isinstance(m, dict):
            out.append(f"\x1e{m.get('role', '')}\x1f{_text(m.get('content'))}")
            if m.get("tool_calls"):
                out.append(_text(m["tool_calls"]))
    return "".join(out)


def _completion_prompt(req) -> str:
    p = req.get("prompt")
    if isinstance(p, list) and p:        # token ids, or a batch of prompts: route by the first
        p = p if all(isinstance(t, int) for t in p) else p[0]
        p = " ".join(map(str, p)) if isinstance(p, list) else p
    return p if isinstance(p, str) else ""


_PROMPT_TEXT = {
    "/v1/chat/completions": lambda r: _text(r.get("tools")) * bool(r.get("tools"))
    + _messages_text(r.get("messages")),
    "/v1/completions": _completion_prompt,
    "/v1/responses": lambda r: _text(r.get("instructions")) + (
        r["input"] if isinstance(r.get("input"), str) else _messages_text(r.get("input"))),
    "/v1/messages": lambda r: _text(r.get("system")) + _messages_text(r.get("messages")),
}


@dataclass
class _Node:
    edge: str = ""                                     # the characters leading to this node
    children: dict[str, "_Node"] = field(default_factory=dict)   # by their edge's first char
    used: dict[object, float] = field(default_factory=dict)      # replica -> when last sent
    ends: set = field(default_factory=set)       # replicas sent a key that ends at this node


class PrefixTree:
    """The routing keys sent to each replica, as one radix tree whose nodes record which
    replicas were sent a key through them and when. chars_per_replica bounds each replica's
    entries: beyond it, its least recently used leaves go (so memory follows traffic, as the
    replicas' own caches do)."""

    def __init__(self, chars_per_replica: int = DEFAULT_CHARS_PER_REPLICA, clock=time.monotonic):
        self.root = _Node()
        self.chars_per_replica = chars_per_replica
        self.clock = clock
        self.chars: dict[object, int] = {}     # replica -> characters of its entries
        self.leaves: dict[object, int] = {}    # replica -> its branches' ends: conversations

    def insert(self, key: str, replica) -> None:
        """Records that `replica` was sent `key` (every prefix of it is now its too)."""
        now, node, i = self.clock(), self.root, 0
        node.used[replica] = now
        branched, was_leaf = False, False
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                child = node.children[key[i]] = _Node(key[i:])
            else:
                n = _common(child.edge, key, i)
                if n < len(child.edge):                     # split the edge at the divergence
                    head = _Node(child.edge[:n], {child.edge[n]: child}, dict(child.used), set())
                    child.edge = child.edge[n:]
                    node.children[key[i]] = child = head
            if replica not in child.used:
                if not branched:       # the key leaves the replica's branches here
                    branched = True
                    was_leaf = node is not self.root and not any(
                        replica in c.used for c in node.children.values())
                self.chars[replica] = self.chars.get(replica, 0) + len(child.edge)
            child.used[replica] = now
            node, i = child, i + len(child.edge)
        node.ends.add(replica)
        if branched:                   # a new leaf; the one it extends (a previous turn) is not
            self.leaves[replica] = self.leaves.get(replica, 0) + 1 - was_leaf
        if self.chars.get(replica, 0) > self.chars_per_replica:
            self._evict(replica, int(self.chars_per_replica * 0.9))

    def match(self, key: str, replicas) -> tuple[int, list]:
        """The longest prefix of `key` that any of `replicas` was sent: (its length in
        characters, the replicas holding it); (0, []) when none shares a character."""
        return self.matches(key, replicas)[0]

    def matches(self, key: str, replicas) -> tuple[tuple[int, list], tuple[int, list]]:
        """(match(key, replicas), the longest earlier key that `key` starts with: (its length,
        the replicas of `replicas` it was sent to), (0, []) when there is none)."""
        among, node, i, best, ended = set(replicas), self.root, 0, (0, []), (0, [])
        while i < len(key):
            child = node.children.get(key[i])
            holders = [r for r in child.used if r in among] if child else []
            if not holders:
                break
            n = _common(child.edge, key, i)
            best = (i + n, holders)
            if n < len(child.edge):
                break
            node, i = child, i + n
            if node.ends & among:
                ended = (i, [r for r in node.used if r in node.ends and r in among])
        return best, ended

    def remove(self, replica) -> None:
        """Forgets `replica` (it died or was scaled down)."""
        self._prune(self.root, lambda node: (node.used.pop(replica, None),
                                             node.ends.discard(replica)))
        self.chars.pop(replica, None)
        self.leaves.pop(replica, None)

    def _evict(self, replica, target: int) -> None:
        """Drops `replica`'s least recently used leaves until its entries fit `target` chars."""
        while self.chars.get(replica, 0) > target:
            leaves = [(up, n) for up, n in _walk(self.root) if replica in n.used
                      and not any(replica in c.used for c in n.children.values())]
            if not leaves:
                return
            up, old = min(leaves, key=lambda un: un[1].used[replica])
            del old.used[replica]
            old.ends.discard(replica)
            self.chars[replica] -= len(old.edge)
            # one leaf fewer, unless its parent is the replica's leaf now
            self.leaves[replica] -= up is self.root or any(
                replica in c.used for c in up.children.values())
        self._prune(self.root, lambda node: None)

    def _prune(self, node: _Node, visit) -> None:
        """visit(n) on every node below `node`, then removes the nodes nobody holds."""
        for k, c in list(node.children.items()):
            visit(c)
            self._prune(c, visit)
            if not c.used:
                del node.children[k]


def _walk(node: _Node):
    """(parent, node) for every node below `node`."""
    for c in node.children.values():
        yield node, c
        yield from _walk(c)


def _common(edge: str, key: str, at: int) -> int:
    """How many leading characters of `edge` equal key[at:]."""
    n = 0
    while n < len(edge) and at + n < len(key) and edge[n] == key[at + n]:
        n += 1
    return n


def choose_replicas(tree: PrefixTree, key: str, queues: dict, imbalance: int,
                    min_match_fraction: float = MIN_MATCH_FRACTION) -> tuple[list, str]:
    """The replicas to send a request with this routing key to, and why ("prefix" or
    "least_loaded"). queues: replica -> ongoing requests (every candidate). The replicas that
    were sent the longest earlier key that this one continues win, unless that key is under
    min_match_fraction of this one or each of them has `imbalance` more requests than the
    shortest queue; else, of the replicas within `imbalance` of the shortest queue, those
    holding the fewest conversations (branches of the tree), the least loaded of them (module
    doc; the caller breaks the remaining ties)."""
    if not queues:
        return [], "least_loaded"
    low = min(queues.values())
    if key:
        _, (n, senders) = tree.matches(key, queues)
        near = [r for r in senders if queues[r] - low <= imbalance]
        if near and n >= min_match_fraction * len(key):
            best = min(queues[r] for r in near)
            return [r for r in near if queues[r] == best], "prefix"
    if not key:                  # nothing to hold (embeddings, a body without a prompt)
        return [r for r, q in queues.items() if q == low], "least_loaded"
    near = [r for r, q in queues.items() if q - low <= imbalance]
    fewest = min(tree.leaves.get(r, 0) for r in near)
    near = [r for r in near if tree.leaves.get(r, 0) == fewest]
    best = min(queues[r] for r in near)
    return [r for r in near if queues[r] == best], "least_loaded"
