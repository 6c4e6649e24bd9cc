"""Small weights' repacked copies share huge-page arenas (ops/pk_arena.c): each weight reads its
own copy (the SIMD kernels, which read the copies, against the scalar one, which reads the
canonical arrays), and the memory comes back when the last weight of an arena is freed, in
whatever order the weights go."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyklei import _ext

SCALAR = "qai8dx_qsi4c32_1x1_scalar"


def _rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _weights(rng, count, n=1536, k=576, shared=False):
    """count weights [n, k] (each copy ~0.5 MB: below the 2 MB of an own allocation); shared:
    all borrow one pair of canonical arrays, so that only the copies take new memory."""
    out, arrays = [], None
    for _ in range(count):
        if arrays is None or not shared:
            qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
            sc = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(np.float32)
            arrays = qs, (sc.view(np.uint32) >> 16).astype(np.uint16)
        out.append(_ext.QWeight("qsi4c32", *arrays, 32))
    return out


def test_each_weight_reads_its_own_copy():   # the canonical arrays alone where nothing repacks
    rng = np.random.default_rng(0)
    ops = _ext.Ops(1)
    ws = _weights(rng, 12)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    for w in ws:
        assert np.array_equal(ops.matmul(w, x), ops.matmul(w, x, kernel=SCALAR))


# in a process of its own: an arena that a weight of another test's model still uses would
# keep the pages this test's weights used in it
FREE_ALL = r"""
import gc, sys
import numpy as np
from pyklei import _ext
sys.path.insert(0, sys.argv[1])
from test_weight_arena import SCALAR, _rss_mb, _weights
rng = np.random.default_rng(1)
ops = _ext.Ops(1)
x = rng.standard_normal((1, 576)).astype(np.float32)
gc.collect()
before = _rss_mb()
a, b = _weights(rng, 60, shared=True), _weights(rng, 60, shared=True)   # ~60 MB of copies, in arenas a and b share
for w in a + b:
    ops.matmul(w, x)                                                      # every copy's pages touched
grown = _rss_mb() - before
del a
gc.collect()
intact = all(np.array_equal(ops.matmul(w, x), ops.matmul(w, x, kernel=SCALAR)) for w in b)
del b, w
gc.collect()
print(grown, intact, _rss_mb() - before)
"""


@pytest.mark.skipif(os.environ.get("PYKLEI_WEIGHT_ARENA") == "0",
                    reason="PYKLEI_WEIGHT_ARENA=0: each copy is malloc's, which may keep freed memory")
def test_freed_weights_return_the_arenas_memory():
    if _weights(np.random.default_rng(2), 1)[0].owned_bytes < 1536 * 576 // 2:
        pytest.skip("this CPU's kernels read the canonical arrays: no repacked copies")
    out = subprocess.run([sys.executable, "-c", FREE_ALL, str(Path(__file__).parent)], capture_output=True,
                         text=True, check=True).stdout.split()
    grown, intact, left = float(out[0]), out[1] == "True", float(out[2])
    assert grown > 40 and intact   # the copies took memory; the weights left read their own
    assert left < 8                # every arena unmapped once its last weight went
