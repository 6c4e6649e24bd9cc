"""Importing llama.cpp GGUF files (pyklei/converters/llamacpp_gguf.py): a tiny checkpoint
written the llama.cpp way in each type pyklei imports, read back within each format's bound;
the files it refuses and why; `pyklei info` of a llama.cpp GGUF and the convert line it gives.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from converter_checks import check_tensor, fails_to_convert, hf_name, hf_tensors, llamacpp_writer
from pyklei.converters import convert
from pyklei.converters.hf_llama import permute_qk
from pyklei.formats import gguf_keys as K
from pyklei.formats.model_file import read_model

def _write_llamacpp_gguf(hf_dir: Path, out: Path, qtype) -> None:
    """A llama.cpp-style GGUF of a tiny HF checkpoint (q/k permuted), tensors in `qtype`."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    tmp = out.with_suffix(".pyklei.gguf")
    convert(hf_dir, tmp, embedding_bits=16)  # reuse its metadata
    mf = read_model(tmp)
    hf = hf_tensors(hf_dir)
    w = llamacpp_writer(out, "llama", mf)
    for name in mf.tensors:
        if name == K.ROPE_FREQS:
            w.add_tensor(name, mf.tensor(name).data.copy())
            continue
        x = hf[hf_name(name)]
        if name.endswith("attn_q.weight"):
            x = permute_qk(x, mf.hparams.n_head)
        elif name.endswith("attn_k.weight"):
            x = permute_qk(x, mf.hparams.n_head_kv)
        t = qtype if x.ndim == 2 else Q.F32
        if t == Q.F32:
            w.add_tensor(name, x.astype(np.float32))
        elif t in (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
            w.add_tensor(name, quantize(x.astype(np.float32), t), raw_dtype=t)
        else:
            w.add_tensor(name, _random_blocks(x.shape, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.unlink()


def _random_blocks(shape, qtype) -> np.ndarray:
    """Random blocks of a type gguf cannot quantize (K-quants, IQ types): every byte below
    0x30, so that any f16 scale the layout holds is small and finite (exponent field <= 11)."""
    from gguf.constants import GGML_QUANT_SIZES
    block, nbytes = GGML_QUANT_SIZES[qtype]
    n, k = shape
    rng = np.random.default_rng(int(qtype))
    return rng.integers(0, 0x30, (n, k // block * nbytes), dtype=np.uint8)


@pytest.mark.parametrize("qname", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_import_llamacpp_types(tiny_bpe, tmp_path, qname):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    qtype = Q[qname]
    src = tmp_path / f"tiny-{qname}.gguf"
    _write_llamacpp_gguf(tiny_bpe, src, qtype)
    out = tmp_path / "out.gguf"
    res = convert(src, out)
    mf = read_model(out)
    r = gguf.GGUFReader(src)
    for t in r.tensors:
        x = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(mf.tensor(t.name).shape)
        check_tensor(x, mf.tensor(t.name), t.name)
    assert mf.metadata["tokenizer.ggml.tokens"] == r.fields["tokenizer.ggml.tokens"].contents()
    assert mf.metadata[K.KEY_SOURCE] == "gguf" and mf.hparams.has_rope_freqs
    requantized = "re-quantizing adds pyklei's rounding error" in res.summary()
    assert requantized == (qname not in ("F32", "F16", "BF16"))


def test_import_llamacpp_errors(tmp_path, tiny_bpe):
    out = tmp_path / "o.gguf"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 10)
    fails_to_convert(bad, out, "not a readable GGUF")
    w = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fails_to_convert(tmp_path / "phi.gguf", out, "unsupported architecture 'phi2'")
    conv = tmp_path / "conv.gguf"
    convert(tiny_bpe, conv)
    fails_to_convert(conv, out, "already a pyklei model file")


def test_info_of_a_llamacpp_gguf_and_its_convert_line(tiny_bpe, tmp_path):
    """pyklei.info on a llama.cpp GGUF the test writes: what the file holds, counted as the gguf
    package reads it, and a `pyklei convert` line that, run as printed, makes a pyklei file."""
    import shlex
    from collections import Counter

    from gguf import GGMLQuantizationType as Q

    from pyklei.info import gguf_info, info_text, model_info

    src = tmp_path / "tiny q8.gguf"        # a space: the command must quote the path
    _write_llamacpp_gguf(tiny_bpe, src, Q.Q8_0)
    info = model_info(src)
    assert info == gguf_info(src) and info["file_kind"] == "gguf"
    r = gguf.GGUFReader(src)
    assert {k: v["tensors"] for k, v in info["tensor_types"].items()} == \
        dict(Counter(t.tensor_type.name for t in r.tensors))
    assert {k: v["bytes"] for k, v in info["tensor_types"].items()} == \
        {name: sum(int(t.n_bytes) for t in r.tensors if t.tensor_type.name == name)
         for name in info["tensor_types"]}
    assert info["params"] == sum(int(t.n_elements) for t in r.tensors)
    cfg = json.loads((tiny_bpe / "config.json").read_text())
    hp = info["hparams"]
    assert (hp["n_layer"], hp["n_embd"], hp["n_ff"], hp["n_head"], hp["n_head_kv"]) == \
        (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"],
         cfg["num_attention_heads"], cfg["num_key_value_heads"])
    assert hp["tied_embeddings"] is True and info["architecture"] == "llama"
    assert info["tokenizer"]["vocab_size"] == cfg["vocab_size"]
    assert "Q8_0 weights are dequantized and quantized again" in info["convert_note"]
    text = info_text(info)
    assert "not a pyklei file" in text and info["convert_command"] in text

    argv = shlex.split(info["convert_command"])
    assert argv[:3] == ["pyklei", "convert", str(src)] and argv[3] == "-o"
    run = subprocess.run([sys.executable, "-m", "pyklei", *argv[1:], "--no-progress"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert model_info(tmp_path / argv[4])["file_kind"] == "pyklei"


def test_info_of_a_gguf_pyklei_cannot_convert(tmp_path):
    """Another architecture: described, no convert line but the reason; a broken GGUF is a
    GGUFError (ValueError) naming the problem."""
    from pyklei.info import info_text, model_info

    w = gguf.GGUFWriter(tmp_path / "qwen.gguf", "qwen2moe")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_file_type(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float16))
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = model_info(tmp_path / "qwen.gguf")
    assert (info["architecture"], info["file_type"], info["convert_command"]) == ("qwen2moe", "F16", None)
    assert info["hparams"]["n_layer"] == 1 and info["hparams"]["n_embd"] is None
    assert info["tensor_types"]["F16"] == {"tensors": 1, "params": 256, "bytes": 512,
                                           "bits_per_weight": 16.0}
    text = info_text(info)
    assert info["convert_note"] == ("pyklei imports llama.cpp files of llama, qwen2, qwen3, gemma3, "
                                    "smollm3, phi3; this file's architecture is 'qwen2moe'")
    assert "architecture is 'qwen2moe'" in text
    assert "pyklei convert " not in text and "convert it:" not in text and "embedding -," in text
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "qwen.gguf").read_bytes()[:100])
    with pytest.raises(ValueError, match="cut.gguf"):
        model_info(tmp_path / "cut.gguf")


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


@pytest.mark.parametrize("keys,expect", [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, [4.0] * 3),
    ({"llama.rope.scale_linear": 2.0}, [2.0] * 3),                 # llama.cpp's older key
    ({"llama.rope.scaling.type": "none"}, None),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, None),  # 0: none
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "'yarn'"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -2.0}, "factor -2"),
    ({"llama.rope.scaling.attn_factor": 1.1}, "rope.scaling.attn_factor"),
])
def test_import_reads_llamacpp_rope_scaling_keys(keys, expect):
    from pyklei.converters import ConversionError
    from pyklei.converters.llamacpp_gguf import _family_kv

    fields = {k: _Field(v) for k, v in keys.items()}
    if isinstance(expect, str):
        with pytest.raises(ConversionError, match=expect) as e:
            _family_kv("llama", fields, 3, 64, 16, "x.gguf")
        assert "\n" not in str(e.value)
        return
    kv = {k: v for k, v, _, _ in _family_kv("llama", fields, 3, 64, 16, "x.gguf")}
    assert kv.get(K.KEY_LAYER_ROPE_FACTOR) == expect


def test_llama_file_type_names_match_gguf():
    from pyklei.info import LLAMA_FILE_TYPES

    names = {m.value: m.name.removeprefix("MOSTLY_") for m in gguf.LlamaFileType}
    assert {k: names[k].replace("ALL_", "") for k in LLAMA_FILE_TYPES} == LLAMA_FILE_TYPES
