"""Converter tests: HF checkpoints -> pyklei GGUF (issue 3); llama.cpp GGUFs are
test_llamacpp_import.py's, conversions that must fail test_converter_failures.py's, the checks
they share tests/fixtures/converter_checks.py's.

Fixtures: tiny random Llama 3.2-style checkpoints (tests/fixtures/models.py: make_tiny_llama), the
real SmolLM2-135M-Instruct as a HF checkpoint built from llama.cpp's GGUF (smollm2_hf_path), its
conversion (smollm2_conversion: both in tests/conftest.py, shared with the other tests) and that
GGUF itself (tests/converters/conftest.py). The 1.24 B random Llama 3.2 1B checkpoint test is
marked slow.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import gguf  # noqa: E402
from models import make_tiny_llama  # noqa: E402
from paths import ROOT  # noqa: E402

from converter_checks import (check_against_hf, check_tensor, hf_name, hf_tensors,  # noqa: E402
                              leftovers, reshard)
from pyklei.converters import ConversionError, convert  # noqa: E402
from pyklei.converters.hf_llama import llama3_rope_factors, permute_qk, unpermute_qk  # noqa: E402
from pyklei.converters.hf_tokenizer import LLAMA3_REGEX, detect_pre  # noqa: E402
from pyklei.formats import gguf_keys as K  # noqa: E402
from pyklei.formats.model_file import read_model  # noqa: E402

REPO = ROOT


# ----------------------------------------------------------------------------- unit pieces

def test_permute_qk_matches_rope_layouts():
    """Attention scores of HF's rotate-half RoPE on HF weights equal those of llama.cpp's
    pairwise RoPE on the permuted weights: the permutation is what makes one runtime fit."""
    rng = np.random.default_rng(0)
    n_head, hd, dim, pos = 3, 8, 16, 5
    wq = rng.standard_normal((n_head * hd, dim))
    x = rng.standard_normal((2, dim))
    theta = 10000.0 ** (-np.arange(0, hd, 2) / hd) * np.array([1, 1, 2, 4])[: hd // 2]

    def rope_half(v, p):  # HF: pairs (i, i + hd/2)
        v = v.reshape(-1, n_head, hd)
        a, b = v[..., : hd // 2], v[..., hd // 2:]
        c, s = np.cos(p * theta), np.sin(p * theta)
        return np.concatenate([a * c - b * s, a * s + b * c], -1)

    def rope_pairs(v, p):  # llama.cpp: pairs (2i, 2i + 1)
        v = v.reshape(-1, n_head, hd // 2, 2)
        a, b = v[..., 0], v[..., 1]
        c, s = np.cos(p * theta), np.sin(p * theta)
        return np.stack([a * c - b * s, a * s + b * c], -1).reshape(-1, n_head, hd)

    hf_q = rope_half(x @ wq.T, pos)
    hf_k = rope_half(x @ wq.T, pos - 3)
    wp = permute_qk(wq, n_head)
    cpp_q = rope_pairs(x @ wp.T, pos)
    cpp_k = rope_pairs(x @ wp.T, pos - 3)
    np.testing.assert_allclose(np.einsum("mhd,nhd->hmn", hf_q, hf_k),
                               np.einsum("mhd,nhd->hmn", cpp_q, cpp_k), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(unpermute_qk(wp, n_head), wq)
    # Row order of one head (hd = 8): HF rows 0..7 -> llama.cpp rows [0, 4, 1, 5, 2, 6, 3, 7]
    r = np.arange(8.0)[:, None]
    assert permute_qk(r, 1).ravel().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_llama3_rope_factors_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    f = llama3_rope_factors(64, 500000.0, 32.0, 1.0, 4.0, 8192)
    base = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(base / f, inv.numpy(), rtol=1e-5)
    assert f[0] == 1.0 and f[-1] == 32.0 and f.dtype == np.float32 and f.shape == (32,)


def test_detect_pre():
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    llama3 = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
        dict(bl, use_regex=False)]}
    smol = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, bl]}
    assert detect_pre(llama3) == "llama-bpe"
    assert detect_pre(smol) == "smollm"
    assert detect_pre(bl) == "gpt2"
    with pytest.raises(ConversionError, match="Metaspace"):
        detect_pre({"type": "Metaspace", "replacement": "▁"})
    with pytest.raises(ConversionError, match="Digits"):
        detect_pre({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": False}, bl]})


# ----------------------------------------------------------------------------- tiny models

def test_tiny_bpe_tied(tiny_bpe, tmp_path):
    out = tmp_path / "m.gguf"
    res = convert(tiny_bpe, out)
    assert leftovers(tmp_path) == ["m.gguf"]
    # gguf's own reader lists every key and tensor
    r = gguf.GGUFReader(out)
    names = [t.name for t in r.tensors]
    assert len(names) == len(set(names))
    assert K.OUTPUT not in names and K.TOKEN_EMBD in names and K.ROPE_FREQS in names
    for t in r.tensors:
        assert t.data_offset % 64 == 0
    assert r.fields["general.alignment"].contents() == 64
    mf = read_model(out)
    cfg = json.loads((tiny_bpe / "config.json").read_text())
    hp = mf.hparams
    assert (hp.vocab_size, hp.n_embd, hp.n_layer, hp.n_ff, hp.n_head, hp.n_head_kv, hp.head_dim) == (
        cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"],
        cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    assert hp.context_length == cfg["max_position_embeddings"]
    assert hp.rope_theta == 500000.0 and hp.tied and hp.has_rope_freqs
    assert math.isclose(hp.rms_eps, cfg["rms_norm_eps"], rel_tol=1e-6)
    md = mf.metadata
    assert md["general.architecture"] == "llama" and md[K.KEY_FORMAT_VERSION] == 1
    assert md[K.KEY_BLOCK_SIZE] == 32
    assert md[K.ROPE_SCALING_TYPE] == "llama3" and md[K.ROPE_SCALING_FACTOR] == 32.0
    np.testing.assert_array_equal(mf.tensor(K.ROPE_FREQS).data,
                                  llama3_rope_factors(64, 500000.0, 32, 1, 4, 8192))
    # formats: linears qsi4c32, tied embedding qsi6c32 (default 6 bits), norms f32
    assert mf.tensor(K.TOKEN_EMBD).format == "qsi6c32"
    assert mf.output is mf.tensor(K.TOKEN_EMBD)
    assert {mf.layer(i, p).format for i in range(2) for p in K.BLOCK_LINEARS} == {"qsi4c32"}
    assert {mf.layer(i, p).format for i in range(2) for p in K.BLOCK_NORMS} == {"f32"}
    errs = check_against_hf(mf, hf_tensors(tiny_bpe))
    assert max(errs[K.blk(0, "attn_q")], errs[K.blk(1, "ffn_down")]) < 0.12
    # summary figures
    assert res.by_format() == {"qsi4c32": 14, "qsi6c32": 1, "f32": 6}
    assert res.bits_per_weight(("qsi4c32",)) == pytest.approx(4.5)
    assert res.file_size == out.stat().st_size
    assert "bits per weight" in res.summary() and "relative RMSE" in res.summary()


def test_tiny_bpe_tokenizer_metadata(tiny_bpe, tmp_path):
    from tokenizers import Tokenizer

    out = tmp_path / "m.gguf"
    convert(tiny_bpe, out)
    md = read_model(out).metadata
    tok = Tokenizer.from_file(str(tiny_bpe / "tokenizer.json"))
    tj = json.loads((tiny_bpe / "tokenizer.json").read_text())
    tokens = md["tokenizer.ggml.tokens"]
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "llama-bpe"
    assert tokens == [tok.id_to_token(i) for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert md["tokenizer.ggml.merges"] == merges
    types = md["tokenizer.ggml.token_type"]
    bos, eot, eos = (tok.token_to_id(t) for t in ("<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"))
    assert types[bos] == types[eot] == 3 and types[0] == 1
    assert md["tokenizer.ggml.bos_token_id"] == bos
    assert md["tokenizer.ggml.eos_token_id"] == eot  # tokenizer_config's eos_token
    assert md["tokenizer.ggml.eot_token_id"] == eot
    assert sorted(md[K.KEY_EOS_IDS]) == sorted([eos, eot])
    assert sorted(read_model(out).eos_token_ids) == sorted([eos, eot])
    assert md["tokenizer.ggml.add_bos_token"] is True  # from the TemplateProcessing post-processor
    assert "<|start_header_id|>" in md["tokenizer.chat_template"]


def test_tiny_spm_untied_hd128(tiny_spm, tmp_path):
    import sentencepiece as spm

    out = tmp_path / "m.gguf"
    res = convert(tiny_spm, out, embedding_bits=16)
    mf = read_model(out)
    assert not mf.hparams.tied and mf.hparams.head_dim == 128
    assert mf.tensor(K.OUTPUT).format == "f16" and mf.tensor(K.TOKEN_EMBD).format == "f16"
    assert mf.layer(0, "attn_q").shape == (512, 256) and mf.layer(0, "attn_output").shape == (256, 512)
    check_against_hf(mf, hf_tensors(tiny_spm))
    assert res.by_format()["f16"] == 2
    md = mf.metadata
    sp = spm.SentencePieceProcessor(model_file=str(tiny_spm / "tokenizer.model"))
    n = sp.GetPieceSize()
    assert md["tokenizer.ggml.model"] == "llama" and md["tokenizer.ggml.pre"] == "default"
    assert md["tokenizer.ggml.tokens"][:n] == [sp.IdToPiece(i) for i in range(n)]
    np.testing.assert_allclose(md["tokenizer.ggml.scores"][:n], [sp.GetScore(i) for i in range(n)])
    types = md["tokenizer.ggml.token_type"]
    assert types[0] == 2 and types[1] == types[2] == 3 and types[3] == 6  # unk, <s>, </s>, <0x00>
    assert md["tokenizer.ggml.bos_token_id"] == 1 and md["tokenizer.ggml.eos_token_id"] == 2
    assert md["tokenizer.ggml.unknown_token_id"] == 0
    assert md["tokenizer.ggml.add_bos_token"] is True and md["tokenizer.ggml.add_space_prefix"] is True
    assert md[K.KEY_SPM_MODEL] == (tiny_spm / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("gs", [64, 128, 256])
def test_group_sizes_and_4bit_embedding(tiny_bpe, tmp_path, gs):
    out = tmp_path / "m.gguf"
    res = convert(tiny_bpe, out, group_size=gs, embedding_bits=4)
    mf = read_model(out)
    assert mf.hparams.block_size == gs
    assert mf.tensor(K.TOKEN_EMBD).format == "qsi4c32"
    assert {t.block_size for t in mf.tensors.values() if t.format == "qsi4c32"} == {gs}
    check_against_hf(mf, hf_tensors(tiny_bpe))
    assert res.bits_per_weight(("qsi4c32",)) == pytest.approx(4 + 16 / gs)


@pytest.mark.parametrize("fixture", ["tiny_bpe", "tiny_spm"])
def test_6bit_embedding(fixture, tmp_path, request):
    """--embedding-bits 6: token_embd (and the untied output.weight) as qsi6c32, 6.5 bits."""
    src = request.getfixturevalue(fixture)
    res = convert(src, tmp_path / "m.gguf", embedding_bits=6)
    mf = read_model(res.path)
    outs = [K.TOKEN_EMBD] + ([] if mf.hparams.tied else [K.OUTPUT])
    assert all(mf.tensor(n).format == "qsi6c32" for n in outs)
    assert mf.tensor(K.TOKEN_EMBD).qs.shape == (mf.hparams.vocab_size, mf.hparams.n_embd // 32 * 24)
    check_against_hf(mf, hf_tensors(src))
    assert res.bits_per_weight(("qsi6c32",)) == pytest.approx(6.5)


def test_keep_patterns(tiny_bpe, tmp_path):
    out = tmp_path / "m.gguf"
    res = convert(tiny_bpe, out, keep=["blk.*.ffn_down.weight=q8", "*.self_attn.v_proj.weight=f16",
                                       "token_embd.weight=bf16"])
    mf = read_model(out)
    assert mf.layer(1, "ffn_down").format == "qsi8cx"
    assert mf.layer(0, "attn_v").format == "f16"          # matched by its HF name
    assert mf.tensor(K.TOKEN_EMBD).format == "bf16"
    assert mf.layer(0, "ffn_up").format == "qsi4c32"
    check_against_hf(mf, hf_tensors(tiny_bpe))
    assert res.by_format() == {"qsi4c32": 10, "qsi8cx": 2, "f16": 2, "bf16": 1, "f32": 6}
    with pytest.raises(ConversionError, match="matches no weight matrix"):
        convert(tiny_bpe, tmp_path / "x.gguf", keep=["*norm*=q8"])
    with pytest.raises(ConversionError, match="PATTERN=FORMAT"):
        convert(tiny_bpe, tmp_path / "x.gguf", keep=["blk.*"])
    with pytest.raises(ConversionError, match="unknown format"):
        convert(tiny_bpe, tmp_path / "x.gguf", keep=["blk.*=q3"])
    assert leftovers(tmp_path) == ["m.gguf"]


def test_norm_gain_weighting(tmp_path):
    """norm_weighting=True: 4-bit scales weigh input channel c of q/k/v, gate/up and the tied
    lm_head by the squared gain of the RMSNorm before it: that weighted error is lower than
    plain rounding's (the default), the weights after no norm (o, down) are byte-identical."""
    import torch
    from safetensors.torch import load_file, save_file
    d = make_tiny_llama(tmp_path / "hf", seed=3)
    sd = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for k in sd:
        if k.endswith("norm.weight"):   # gains spread over ~2 decades, as in real models
            sd[k] = torch.exp(1.2 * torch.randn(sd[k].shape, generator=g)).to(sd[k].dtype)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf = hf_tensors(d)
    on, off = read_model(convert(d, tmp_path / "on.gguf", embedding_bits=4, norm_weighting=True).path), \
        read_model(convert(d, tmp_path / "off.gguf", embedding_bits=4).path)
    norm_of = {"attn_q": "input_layernorm", "attn_k": "input_layernorm", "attn_v": "input_layernorm",
               "ffn_gate": "post_attention_layernorm", "ffn_up": "post_attention_layernorm"}
    n_weighted = 0
    for name, t in on.tensors.items():
        if t.format != "qsi4c32":
            continue
        parts = name.split(".")
        if name == K.TOKEN_EMBD:
            gain = hf["model.norm.weight"]
        elif parts[2] in norm_of:
            gain = hf[f"model.layers.{parts[1]}.{norm_of[parts[2]]}.weight"]
        else:
            assert np.array_equal(on.tensor(name).dequantize(), off.tensor(name).dequantize()), name
            continue
        ref = hf[hf_name(name)]
        if parts[-2] in ("attn_q", "attn_k"):   # rows stored in llama.cpp's order
            ref = permute_qk(ref, on.hparams.n_head if parts[-2] == "attn_q" else on.hparams.n_head_kv)
        w_on, w_off = on.tensor(name).dequantize(), off.tensor(name).dequantize()
        err = lambda w: float((np.square(w - ref) * np.square(gain)[None, :]).sum())
        assert err(w_on) < 0.97 * err(w_off), (name, err(w_on), err(w_off))
        n_weighted += 1
    assert n_weighted == 2 * 5 + 1
    check_against_hf(on, hf)


def test_sharded_equals_single(tiny_bpe, tmp_path):
    sharded = reshard(tiny_bpe, tmp_path / "sharded")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert(tiny_bpe, a, name="x")
    convert(sharded, b, name="x")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_f32_f16_checkpoints(tmp_path, dtype):
    d = make_tiny_llama(tmp_path / dtype, head_dim=64, tied=False, tokenizer="bpe", seed=3,
                        n_layer=1, dtype=dtype)
    out = tmp_path / "m.gguf"
    convert(d, out)
    mf = read_model(out)
    assert mf.tensor(K.OUTPUT).format == "qsi6c32"
    check_against_hf(mf, hf_tensors(d))


def test_tiny_checkpoints_load_in_transformers(tiny_bpe, tiny_spm):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for d in (tiny_bpe, tiny_spm):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        assert m.config.rope_parameters["rope_type"] == "llama3"
        logits = m(torch.tensor([[1, 2, 3, 4]])).logits
        assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()
    tok = AutoTokenizer.from_pretrained(tiny_bpe)
    ids = tok("The capital of France is Paris.").input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")


# ----------------------------------------------------------------------------- the real SmolLM2

def test_smollm2_hf_checkpoint_generates_paris(smollm2_hf_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((smollm2_hf_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    tj = json.loads((smollm2_hf_path / "tokenizer.json").read_text())
    assert detect_pre(tj["pre_tokenizer"]) == "smollm" and tj["decoder"]["type"] == "ByteLevel"
    tok = AutoTokenizer.from_pretrained(smollm2_hf_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_path, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0][ids.shape[1]:])
    assert "Paris" in text, text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_smollm2_end_to_end(smollm2_hf_path, smollm2_conversion, smollm2_gguf_path):
    out, res = smollm2_conversion
    r = gguf.GGUFReader(out)
    assert len(r.tensors) == 30 * 7 * 2 + 30 * 2 + 2 + 1  # qs+scales per linear, norms, embd(+scales), output_norm
    mf = read_model(out)
    hp = mf.hparams
    assert (hp.vocab_size, hp.n_embd, hp.n_layer, hp.n_ff, hp.n_head, hp.n_head_kv, hp.head_dim) == (
        49152, 576, 30, 1536, 9, 3, 64)
    assert hp.tied and not hp.has_rope_freqs and hp.rope_theta == 100000.0
    md = mf.metadata
    src = gguf.GGUFReader(smollm2_gguf_path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.chat_template", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                "llama.context_length", "llama.rope.dimension_count"):
        assert md[key] == src.fields[key].contents(), key
    assert mf.eos_token_ids == [2, 0]      # <|im_end|>, then <|endoftext|> (end_of_generation)
    errs = check_against_hf(mf, hf_tensors(smollm2_hf_path))
    q4 = [e for n, e in errs.items() if mf.tensors[n].format == "qsi4c32"]
    assert np.mean(q4) < 0.1 and max(q4) < 0.12
    assert res.bits_per_weight(("qsi4c32",)) == pytest.approx(4.5)
    assert res.peak_rss_mb < 2000


def test_smollm2_llamacpp_import_matches_hf_route(smollm2_gguf_path, smollm2_conversion, tmp_path):
    """Real Q4_1 GGUF import; its tensors agree with the HF route's (the q/k permutation is
    undone by gguf_to_hf and redone by the converter), and with the source within the bound."""
    from gguf.quants import dequantize

    out = tmp_path / "imported.gguf"
    convert(smollm2_gguf_path, out)
    a, b = read_model(out), read_model(smollm2_conversion[0])
    assert a.metadata["tokenizer.ggml.tokens"] == b.metadata["tokenizer.ggml.tokens"]
    assert a.eos_token_ids == b.eos_token_ids == [2, 0]
    src = {t.name: t for t in gguf.GGUFReader(smollm2_gguf_path).tensors}
    for name in (K.TOKEN_EMBD, K.blk(0, "attn_q"), K.blk(7, "attn_k"), K.blk(29, "ffn_down"),
                 K.blk(3, "attn_norm")):
        t = src[name]
        x = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(a.tensor(name).shape)
        check_tensor(x, a.tensor(name), name)
        ya, yb = a.tensor(name).dequantize(), b.tensor(name).dequantize()
        rel = np.sqrt(((ya - yb) ** 2).sum() / (ya ** 2).sum())
        assert rel < 0.05, (name, rel)


# ----------------------------------------------------------------------------- Llama 3.2 1B size

@pytest.mark.slow
def test_llama32_1b_random_peak_rss(tmp_path):
    """The random 1.24 B checkpoint with Llama 3.2 1B's exact config converts within 1.5 GB."""
    from pyklei_dev.assets import cache_dir

    subprocess.run([sys.executable, str(REPO / "scripts" / "make_llama32_1b_random.py")], check=True)
    src = cache_dir() / "llama32-1b-random"
    out = tmp_path / "1b.gguf"
    code = (
        "import sys\n"
        "from pyklei.converters import convert\n"
        f"r = convert({str(src)!r}, {str(out)!r})\n"
        "print(r.summary())\n"
        # VmHWM, not ru_maxrss: the latter starts from the parent's peak (a big pytest process)
        "print('PEAK_KB', [l.split()[1] for l in open('/proc/self/status') "
        "if l.startswith('VmHWM:')][0])\n")
    p = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                       env=dict(os.environ))
    print(p.stdout)
    peak_kb = int(p.stdout.split("PEAK_KB")[1])
    assert peak_kb < 1.5 * 1024 * 1024
    mf = read_model(out)
    assert mf.hparams.n_layer == 16 and mf.hparams.vocab_size == 128256 and mf.hparams.has_rope_freqs
    assert mf.tensor(K.TOKEN_EMBD).format == "qsi6c32" and mf.hparams.tied


# ---- every key the converter writes has a reader ----------------------------------------------

class _Recording(dict):
    """A metadata dict that records which keys its reader asked for."""

    def __init__(self, d, seen):
        super().__init__(d)
        self.seen = seen

    def __getitem__(self, k):
        self.seen.add(k)
        return super().__getitem__(k)

    def get(self, k, default=None):
        self.seen.add(k)
        return super().get(k, default)

    def __contains__(self, k):
        self.seen.add(k)
        return super().__contains__(k)


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_every_written_key_is_read_by_the_loader(which, tiny_bpe, tiny_spm, tmp_path, monkeypatch):
    """Issue 14: the converter stored the SentencePiece model under one key and the tokenizer
    looked for another, so the bytes were never read while each side's own test passed. Load a
    converted file with recording metadata and require every written key to be read, or to be
    listed in gguf_keys.INFORMATIONAL (kept for people and tools, not for pyklei)."""
    import pyklei.formats.model_file as mf_mod
    import pyklei.text.tokenizer as tok_mod
    from pyklei.formats.gguf_reader import read_gguf
    from pyklei.llm import LLM

    out = tmp_path / f"{which}.gguf"
    convert(tiny_bpe if which == "bpe" else tiny_spm, out)
    written = set(read_gguf(out, tensors=False).metadata)
    seen: set = set()
    real_read_gguf, real_read_meta = mf_mod.read_gguf, tok_mod._read_gguf_metadata

    def recording_read_gguf(*a, **kw):
        g = real_read_gguf(*a, **kw)
        g.metadata = _Recording(g.metadata, seen)
        return g

    def recording_read_meta(*a, **kw):
        return _Recording(real_read_meta(*a, **kw), seen)

    monkeypatch.setattr(mf_mod, "read_gguf", recording_read_gguf)
    monkeypatch.setattr(tok_mod, "_read_gguf_metadata", recording_read_meta)
    llm = LLM(out, n_threads=1, n_ctx=64)
    llm.generate("hello", max_tokens=2, temperature=0)
    if llm.tokenizer.chat_template:
        llm.chat([{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
    unread = written - seen - K.INFORMATIONAL - (K.SPM_FALLBACK if K.KEY_SPM_MODEL in seen else set())
    assert not unread, f"written by the converter, never read by the loader: {sorted(unread)}"
    if which == "spm":
        assert K.KEY_SPM_MODEL in seen
