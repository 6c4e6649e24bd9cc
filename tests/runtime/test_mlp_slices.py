"""A prefill chunk's MLP in slices of rows (model/pk_llama_create.c, mlp_slice_rows): a model whose n_ff
makes slices of 24 rows gives every row the bits, and the activation statistics the sums, of
the same rows run one at a time (no slices), at 1 and 2 threads."""
import numpy as np
import pytest

from pyklei.runtime.model import Model


@pytest.fixture(scope="module")
def sliced_gguf(tmp_path_factory):
    """n_ff 4096: 768 KiB of gate_up output holds 24 rows, fewer than the chunk's 64."""
    from models import make_tiny_llama
    from pyklei.converters import convert
    d = tmp_path_factory.mktemp("mlp_slices")
    hf = make_tiny_llama(d / "hf", head_dim=32, hidden_size=64, n_head=2, n_head_kv=1, n_layer=2,
                         intermediate_size=4096, seed=3)
    out = d / "sliced.gguf"
    convert(hf, out)
    return out


@pytest.mark.parametrize("n_threads", [1, 2])
def test_sliced_mlp_rows_equal_rows_run_one_at_a_time(sliced_gguf, n_threads):
    toks = np.random.default_rng(5).integers(0, 512, 150).tolist()   # chunks of 64, 64, 22
    m = Model(sliced_gguf, n_threads=n_threads, n_ctx=256, n_batch=64)
    m.runtime.collect_stats(True)
    whole = m.logits(toks)
    sums, rows, _ = m.runtime.stats()
    m.reset()
    m.runtime.collect_stats(True)
    solo = np.stack([m.eval(toks[:1])] + [m.step(t) for t in toks[1:]])
    solo_sums, solo_rows, _ = m.runtime.stats()
    assert np.array_equal(whole, solo)
    assert rows == solo_rows == len(toks)
    assert np.array_equal(sums, solo_sums)
