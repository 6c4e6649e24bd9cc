"""Embeddings (pyklei.runtime.embedding, LLM.embed, Model.hidden_states) against transformers:
SmolLM2's final hidden state (after its last RMSNorm), mean- and last-token pooled, from the
real checkpoint for an 8-bit file and from the 4-bit file's own dequantized weights; a rotated
file (its rotation undone on the way out); batched rows equal solo rows, bit for bit, however
the passes cut the inputs; the pooling a checkpoint declares; bad arguments."""
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import pyklei  # noqa: E402
from hf_reference import dequantized_hf_model  # noqa: E402
from pyklei.converters import ConversionError, convert  # noqa: E402
from pyklei.runtime import embedding as E  # noqa: E402

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France, a country in Europe.",
         "hello", "def add(a, b):\n    return a + b  # a small function"]


def _reference(model, ids_list, pooling):
    """Unit vectors of a transformers model's last_hidden_state (after the final norm)."""
    out = []
    for ids in ids_list:
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
        v = h.mean(0) if pooling == "mean" else h[-1]
        out.append(v / np.linalg.norm(v))
    return np.array(out)


def _cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_hf_path):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(smollm2_hf_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def q8_file(smollm2_hf_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("emb") / "smollm2-q8.gguf"
    convert(smollm2_hf_path, out, keep=["*=q8"], embedding_bits=8)
    return out


@pytest.fixture(scope="module")
def q8(q8_file):
    return pyklei.load(q8_file, n_threads=2, n_ctx=512, n_seq=4)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_an_8bit_file_embeds_as_transformers_does(q8, hf_smollm2, pooling):
    """8-bit weights and two-plane int8 activations: within 0.2% of the float checkpoint
    (measured 0.9983-0.9995); the tokens are transformers' own."""
    ids = [q8.encode(t) for t in TEXTS]
    vectors = np.array(q8.embed(TEXTS, pooling=pooling))
    assert vectors.shape == (len(TEXTS), 576)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert (_cosines(vectors, _reference(hf_smollm2, ids, pooling)) >= 0.99).all()
    # a text pools differently by the mean than by its last token
    assert (_cosines(vectors, np.array(q8.embed(TEXTS, pooling="cls" if pooling == "last" else "last")))
            < 0.99).any()


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_4bit_file_embeds_as_its_own_weights_do(smollm2_q4, smollm2_hf_path, hf_smollm2, pooling):
    """A 4-bit file is a slightly different function than the checkpoint (its vectors are
    0.89-0.97 of the float model's: measured, kept as a floor of 0.85), so the tight check is
    against transformers running the file's own dequantized weights: >= 0.99."""
    llm = pyklei.load(smollm2_q4, n_threads=2, n_ctx=512, n_seq=2)
    ids = [llm.encode(t) for t in TEXTS]
    vectors = np.array(llm.embed(ids, pooling=pooling))
    own = _reference(dequantized_hf_model(smollm2_q4, smollm2_hf_path), ids, pooling)
    assert (_cosines(vectors, own) >= 0.99).all()
    assert (_cosines(vectors, _reference(hf_smollm2, ids, pooling)) >= 0.85).all()


def test_batched_inputs_equal_solo_inputs_bit_for_bit(q8):
    """Inputs packed several to a pass, cut at odd places, on any slots: the same bits as
    each alone in one pass (the runtime's batch contract, and mean pooling's sequential sum)."""
    ids = [q8.encode(t) for t in TEXTS] + [q8.encode(" ".join(TEXTS) * 3)]
    for pooling in E.POOLINGS:
        alone = np.concatenate([E.embed(q8.model, [x], pooling, [1], 4096) for x in ids])
        packed = E.embed(q8.model, ids, pooling, [3, 1, 2], 7)
        one_slot = E.embed(q8.model, ids, pooling, [0], 5)
        assert np.array_equal(alone, packed) and np.array_equal(alone, one_slot), pooling
    assert np.array_equal(np.array(q8.embed(TEXTS)), np.array([q8.embed(t)[0] for t in TEXTS]))


def test_hidden_states_are_the_rows_before_the_lm_head(q8):
    """Model.hidden_states' rows times the lm_head are the logits batch() gives (tied: the
    embedding table), so the hidden rows are the ones the model decodes from."""
    m = q8.model
    ids = np.array(q8.encode(TEXTS[1]), np.int32)
    rows = np.arange(len(ids), dtype=np.int32)
    hidden = m.hidden_states(ids, np.zeros_like(ids), rows, rows)
    logits = m.batch(ids, np.zeros_like(ids), rows, rows)
    table = m.file.tensor("token_embd.weight").dequantize()
    ref = hidden.astype(np.float64) @ table.T.astype(np.float64)
    assert np.corrcoef(ref[-1], logits[-1])[0, 1] > 0.999
    assert (ref.argmax(1) == logits.argmax(1)).mean() > 0.9


def test_a_rotated_file_gives_the_unrotated_hidden_states(tiny64, tmp_path):
    """A rotated tied file keeps its final norm's gain and rotation apart (rot.output); the
    hidden rows undo the rotation, so they match the checkpoint's, as an unrotated file's do."""
    from transformers import LlamaForCausalLM
    hf, _ = tiny64
    ref_model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = [[1, 5, 9, 200, 33, 7], [4, 8, 15, 16, 23, 42, 99, 100]]
    for rotate in (False, True):
        out = tmp_path / f"tiny-{rotate}.gguf"
        convert(hf, out, keep=["*=q8"], embedding_bits=8, rotate=rotate)
        llm = pyklei.load(out, n_threads=1, n_ctx=64)
        for pooling in ("mean", "last"):
            got = np.array(llm.embed(ids, pooling=pooling))
            assert (_cosines(got, _reference(ref_model, ids, pooling)) >= 0.99).all(), (rotate, pooling)


def test_dimensions_cut_then_normalise(q8):
    full = np.array(q8.embed(TEXTS, normalize=False))
    cut = np.array(q8.embed(TEXTS, dimensions=64))
    assert cut.shape == (len(TEXTS), 64)
    expect = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expect, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.linalg.norm(full, axis=1), 1.0)     # normalize=False: raw pooled


def test_bad_arguments_are_refused_naming_them(q8):
    with pytest.raises(ValueError, match="empty string"):
        q8.embed(["a", ""])
    with pytest.raises(ValueError, match="empty list"):
        q8.embed([])
    with pytest.raises(ValueError, match="more than the context of 512"):
        q8.embed([[1] * 513])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        q8.embed([[1, 2, 49152]])
    with pytest.raises(TypeError, match="texts"):
        q8.embed(3)
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        q8.embed(["a", 5])
    with pytest.raises(ValueError, match="pooling must be one of"):
        q8.embed("a", pooling="max")
    with pytest.raises(ValueError, match=r"dimensions must be in \[1, 576\]"):
        q8.embed("a", dimensions=577)
    with pytest.raises(TypeError, match="dimensions"):
        q8.embed("a", dimensions=1.5)
    assert len(q8.embed("a")) == 1 and len(q8.embed([5, 6, 7])) == 1


def test_embedding_keeps_the_conversation_in_slot_0(q8):
    """embed runs on the slots after slot 0: a chat's cached turn is still reused after it."""
    q8.generate("Once upon a time", max_tokens=4, temperature=0)
    cached = q8.model.seq_tokens(0)
    q8.embed(TEXTS)
    assert q8.model.seq_tokens(0) == cached


def _with_pooling(src, dst, config):
    shutil.copytree(src, dst)
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return dst


def test_the_pooling_a_checkpoint_declares_is_the_default(tiny64, tmp_path):
    hf, _ = tiny64
    d = _with_pooling(hf, tmp_path / "st", {"word_embedding_dimension": 64,
                                            "pooling_mode_lasttoken": True})
    out = tmp_path / "st.gguf"
    convert(d, out)
    llm = pyklei.load(out, n_threads=1, n_ctx=64)
    assert llm.model.hparams.pooling == "last"
    assert llm.model.file.metadata["llama.pooling_type"] == 3     # llama.cpp's PoolingType.LAST
    ids = [[1, 5, 9, 200, 33, 7]]
    assert llm.embed(ids) == llm.embed(ids, pooling="last") != llm.embed(ids, pooling="mean")
    # a file that declares nothing pools by the mean
    plain = pyklei.load(tiny64[1], n_threads=1, n_ctx=64)
    assert plain.model.hparams.pooling is None
    assert plain.embed(ids) == plain.embed(ids, pooling="mean")


def test_a_pooling_pyklei_cannot_do_is_refused_at_conversion(tiny64, tmp_path):
    d = _with_pooling(tiny64[0], tmp_path / "max", {"pooling_mode_max_tokens": True})
    with pytest.raises(ConversionError, match="pooling_mode_max_tokens"):
        convert(d, tmp_path / "max.gguf")


def test_the_engine_embeds_on_its_own_slots(q8):
    """Engine.embed runs on the slots beyond n_parallel, between generation steps: the same
    vectors as LLM.embed, a generation beside it unchanged; without a spare slot it says how
    to load the model."""
    from pyklei.runtime.engine import Engine
    from pyklei.runtime.sampler import SamplingParams
    ids = [q8.encode(t) for t in TEXTS]
    solo = q8.generate("Once upon a time", max_tokens=24, temperature=0).text
    with Engine(q8.model, q8.tokenizer, n_parallel=2, prefill_chunk=16) as engine:
        stream = engine.submit(q8.encode("Once upon a time"), max_tokens=24,
                               params=SamplingParams(temperature=0))
        futures = [engine.embed(ids, "mean") for _ in range(3)]
        text = "".join(r.text for r in stream)
        pooled = [f.result(timeout=120) for f in futures]
        for p in pooled:
            assert np.array_equal(E.finish(p), E.embed(q8.model, ids, "mean", [1], 4096))
        assert text == solo
        cancelled = engine.embed(ids * 20, "last")
        cancelled.cancel()
        assert engine.embed(ids[:1], "last").result(timeout=120).shape == (1, 576)
    with Engine(q8.model, q8.tokenizer, n_parallel=4) as engine:
        with pytest.raises(ValueError, match="n_seq=6"):
            engine.embed(ids, "mean")
