"""A prefix cache that outlives a KV cache slot: K/V blocks of BLOCK_TOKENS positions in host
memory (and optionally on disk), keyed by a chained hash of their tokens, as vLLM's automatic
prefix caching keys its blocks.

    cache = PrefixCache(model, ram_bytes=1 << 30, disk_dir="/var/cache/pyklei", disk_bytes=8 << 30)
    cache.save(slot, partition)                  # a request ended: its slot's whole blocks go in
    n = cache.restore(slot, prompt, partition, have)   # admission: the slot now holds n >= have
    cache.close()                                # waits for the disk writes

A block's key is sha256(parent key + its token ids), the first block's parent a hash of the
request's cache partition (pyklei.runtime.engine: an API key's tenant and a cache_salt): a block
stands for the whole prefix up to its end, and two partitions never share a key, so no entry,
hit count or restore time of one partition is seen by another. Its value is Model.export_kv's
bytes for its positions: importing them gives a row after them the logits, bit for bit, that
computing them would.

Memory: blocks are evicted least recently used first within ram_bytes; a chain's deeper blocks
go before its head (they are touched child first), since a block is reachable only through its
parents. The disk tier (disk_dir) keeps every block written through, in a folder per model
identity (model_identity: the file, the KV cache type, the activations scheme and the CPU's
kernels, all of which change the bits), one file per block named by its key, written to a
temporary name and renamed (a crash leaves no half file under a key's name), with a header the
reader checks; oldest (last used) files go first beyond disk_bytes. A restarted server finds them.

Sliding-window files (Gemma 3; Model._rings) are not cached: a finished request's slot no longer
holds its early positions in those layers' rings, and those are what a restore needs.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

#: Tokens per cached block. A multiple of the K cache's 16-position blocks (Model.kv_row_block),
#: so a block moves as one contiguous copy per layer and head; small enough that a chat turn
#: recomputes at most 31 tokens of the last turn's tail, large enough that a block's hash, entry
#: and disk file (SmolLM2, f16: 720 KB) cost little beside its K/V.
BLOCK_TOKENS = 32
_MAGIC = b"PKKVBLK1"         # a disk block's first bytes; the format's version is in it
_HEAD = struct.Struct("<8sI")  # magic, header JSON length; then the JSON, then the K/V bytes
_IDENTITY_SAMPLE = 1 << 20    # bytes of the model file's head and tail in its identity


def model_identity(model) -> str:
    """A digest of what a block's bits depend on: the model file (size, first and last MiB: the
    GGUF header with every hyperparameter, and the last tensors' data), the KV cache type, the
    activations scheme and the kernels this CPU selects."""
    from .kernels import cpu_features
    path = Path(model.file.path)
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        h.update(f.read(_IDENTITY_SAMPLE))
        f.seek(max(0, size - _IDENTITY_SAMPLE))
        h.update(f.read(_IDENTITY_SAMPLE))
    h.update(json.dumps([size, model.kv_cache, model.activations, cpu_features()]).encode())
    return h.hexdigest()[:32]


def cacheable(model) -> str | None:
    """None when a model's slots can be cached; else why not (module doc)."""
    if model._rings:
        return ("the model has sliding-window layers, whose ring caches no longer hold a "
                "finished request's early positions")
    return None


def engine_cache(model, ram_mb: int, disk_dir=None, disk_mb: int = 0) -> "PrefixCache | None":
    """An engine's prefix cache (pyklei.runtime.engine): None when ram_mb is 0 or the model is
    not cacheable (the engine then reuses slots only, as without one). A disk_dir needs RAM."""
    if disk_dir is not None and not ram_mb:
        raise ValueError("cache_dir needs cache_ram > 0 (blocks go to disk through memory)")
    if not ram_mb or cacheable(model) is not None:
        return None
    return PrefixCache(model, ram_mb << 20, disk_dir, disk_mb << 20)


class _Block:
    __slots__ = ("tokens", "data")

    def __init__(self, tokens: bytes, data: bytes):
        self.tokens, self.data = tokens, data   # int32 token ids; Model.export_kv's bytes


class PrefixCache:
    def __init__(self, model, ram_bytes: int, disk_dir=None, disk_bytes: int = 0):
        why = cacheable(model)
        if why is not None:
            raise ValueError(f"no prefix cache for this model: {why}")
        if ram_bytes <= 0:
            raise ValueError(f"ram_bytes must be > 0, got {ram_bytes}")
        self.model = model
        self.ram_bytes, self.disk_bytes = ram_bytes, disk_bytes
        self.block_bytes = model.kv_rows_bytes(BLOCK_TOKENS)
        self._ram: OrderedDict[bytes, _Block] = OrderedDict()   # LRU first
        self._lock = threading.Lock()            # the RAM and disk indexes (the writer thread)
        self.counts = dict(saved_blocks=0, restored_tokens=0, disk_reads=0, disk_writes=0,
                           evicted_blocks=0)
        self.disk_dir = None
        self._disk: OrderedDict[bytes, int] = OrderedDict()       # key -> file size, LRU first
        self.disk_used = 0
        self._writer = None
        if disk_dir is not None:
            self.identity = model_identity(model)
            self.disk_dir = Path(disk_dir) / self.identity
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._scan_disk()
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="pyklei-cache-write")

    # ---- keys ----------------------------------------------------------------------------
    @staticmethod
    def block_keys(tokens, partition) -> list[tuple[bytes, bytes]]:
        """(key, int32 token bytes) of each whole block of `tokens`, chained from the partition."""
        toks = np.asarray(tokens, np.int32)
        key = hashlib.sha256(b"pyklei prefix cache\0" + repr(partition).encode()).digest()
        out = []
        for i in range(len(toks) // BLOCK_TOKENS):
            t = toks[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS].tobytes()
            key = hashlib.sha256(key + t).digest()
            out.append((key, t))
        return out

    @property
    def ram_used(self) -> int:
        return len(self._ram) * self.block_bytes

    # ---- the engine's calls --------------------------------------------------------------
    def save(self, slot: int, partition) -> int:
        """Copies the whole blocks the slot holds that the cache lacks (a request of
        `partition` ended there) -> blocks added."""
        tokens = self.model.seq_tokens(slot)
        keys = self.block_keys(tokens, partition)
        added = 0
        for i, (key, t) in enumerate(keys):
            if key in self._ram:
                continue
            data = self.model.export_kv(slot, i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
            self._put(key, _Block(t, data))
            added += 1
            if self._writer is not None and key not in self._disk:
                self._writer.submit(self._write, key, t, data)
        self._touch([k for k, _ in keys])
        self._evict()
        self.counts["saved_blocks"] += added
        return added

    def restore(self, slot: int, prompt, partition, have: int) -> int:
        """Makes the slot, which holds the first `have` tokens of `prompt` already, hold the
        longest run of cached blocks of `prompt` when that reaches further -> the prefix it
        holds now (have, or the run's end)."""
        keys = self.block_keys(prompt, partition)
        run: list[_Block] = []
        for key, t in keys:
            b = self._ram.get(key) or self._read(key, t)
            if b is None or b.tokens != t:
                break
            run.append(b)
        self._touch([k for k, _ in keys[:len(run)]])
        self._evict()
        end = len(run) * BLOCK_TOKENS
        if end <= have:
            return have
        first = min(have, len(self.model.seq_tokens(slot))) // BLOCK_TOKENS
        for i in range(first, len(run)):
            self.model.import_kv(slot, i * BLOCK_TOKENS, prompt[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS],
                                 run[i].data)
        self.counts["restored_tokens"] += end - have
        return end

    def close(self) -> None:
        """Waits for the disk writes (a restarted server finds every block saved). Idempotent."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    # ---- memory --------------------------------------------------------------------------
    def _put(self, key: bytes, block: _Block) -> None:
        """Adds a block; _evict after the chain's _touch keeps the budget."""
        self._ram[key] = block

    def _evict(self) -> None:
        while self.ram_used > self.ram_bytes and self._ram:
            self._ram.popitem(last=False)
            self.counts["evicted_blocks"] += 1

    def _touch(self, chain: list[bytes]) -> None:
        """Marks a chain's blocks used, its head last: deeper blocks are evicted first."""
        for key in reversed(chain):
            if key in self._ram:
                self._ram.move_to_end(key)
        with self._lock:
            for key in reversed(chain):
                if key in self._disk:
                    self._disk.move_to_end(key)

    # ---- disk ----------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.disk_dir / (key.hex() + ".kv")

    def _scan_disk(self) -> None:
        found = []
        for p in self.disk_dir.glob("*.kv"):
            try:
                st = p.stat()
                found.append((st.st_mtime, bytes.fromhex(p.stem), st.st_size))
            except (OSError, ValueError):     # gone meanwhile, or not one of ours
                continue
        for _, key, size in sorted(found):
            self._disk[key] = size
            self.disk_used += size
        self._trim_disk()

    def _header(self, tokens: bytes) -> bytes:
        return json.dumps(dict(model=self.identity, kv_cache=self.model.kv_cache,
                               block_tokens=BLOCK_TOKENS, bytes=self.block_bytes,
                               tokens=np.frombuffer(tokens, np.int32).tolist())).encode()

    def _write(self, key: bytes, tokens: bytes, data: bytes) -> None:
        """(writer thread) One block's file, atomically: a temporary name, then renamed."""
        head = self._header(tokens)
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(_MAGIC, len(head)) + head)
                f.write(data)
            os.replace(tmp, path)
        except OSError:                 # a full or read-only disk: the RAM tier goes on
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self._disk[key] = size = _HEAD.size + len(head) + len(data)
            self.disk_used += size
            self.counts["disk_writes"] += 1
            self._trim_disk()

    def _trim_disk(self) -> None:
        """(lock held, or at start) Removes the least recently used files beyond disk_bytes."""
        while self._disk and self.disk_used > self.disk_bytes:
            key, size = self._disk.popitem(last=False)
            self.disk_used -= size
            self._path(key).unlink(missing_ok=True)

    def _read(self, key: bytes, tokens: bytes) -> _Block | None:
        """The block from its file, if it is there and its header is this model's and these
        tokens' (anything else counts as a miss); it goes into RAM."""
        with self._lock:
            if key not in self._disk:
                return None
        try:
            with open(self._path(key), "rb") as f:
                magic, n = _HEAD.unpack(f.read(_HEAD.size))
                head = json.loads(f.read(n)) if magic == _MAGIC else None
                data = f.read()
            os.utime(self._path(key))      # its last use, for the next start's order
        except (OSError, ValueError, struct.error):
            return None
        if head != json.loads(self._header(tokens)) or len(data) != self.block_bytes:
            return None
        block = _Block(tokens, data)
        self._put(key, block)
        self.counts["disk_reads"] += 1
        return block


__all__ = ["BLOCK_TOKENS", "PrefixCache", "cacheable", "engine_cache", "model_identity"]
