"""llama.cpp GGUFs of Phi-3, SmolLM3 and Mistral imported (pyklei/converters/llamacpp_gguf.py):
the pyklei file equals, up to quantization, what `pyklei convert` makes from the same Hugging
Face checkpoint (tests/fixtures/models.py: make_tiny_family).

- CI (no llama.cpp needed): the test writes the llama.cpp layout itself with gguf.GGUFWriter,
  as llama.cpp's convert_hf_to_gguf.py lays these families out (read there, not imported): Phi-3
  with fused attn_qkv and ffn_up = [gate; up], q/k rows in Hugging Face's order, LongRoPE as
  rope_factors_long/short tensors and rope.scaling.attn_factor / original_context_length keys,
  a sliding_window key; SmolLM3 and Mistral ("llama") with q/k rows permuted into interleaved
  pairs. From f32 sources both files hold the same q8 bytes: tensors and hyperparameters are
  compared exactly, logits within the family tests' EXACT_MAX_DIFF (test_hf_families.py).
- Refusals, one line each, naming the key or tensor.
- slow, where llama.cpp's sources are (LLAMACPP_SRC, else the cache's llama-cpp-python sdist):
  its own convert_hf_to_gguf.py at f32 and f16, imported at q8, logits against the direct
  conversion's.

SmolLM3's checkpoints here have RoPE off on every 4th layer: llama.cpp's smollm3 knows only
that pattern (it is not in its files), so it is the only one a llama.cpp file can mean.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from converter_checks import llamacpp_writer
from models import make_tiny_family
from pyklei.converters import ConversionError, convert
from pyklei.converters.hf_llama import permute_qk
from pyklei.formats.model_file import read_model

pytest.importorskip("torch")
pytest.importorskip("transformers")

TOKENS = list(range(5, 65))
EXACT_MAX_DIFF = 5e-3          # test_hf_families.py's: pyklei against transformers, same weights
OVERRIDES = {"phi3": {}, "smollm3": dict(no_rope_layers=[1, 1, 1, 0]),
             # llama.cpp writes no sliding window for a Mistral file (and runs none)
             "mistral": dict(sliding_window=None)}
# The test's own GGUF part -> HF name map (apart from the converter's table)
PARTS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "attn_qkv": "self_attn.qkv_proj", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj"}
GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _checkpoint(family: str, base: Path) -> Path:
    return make_tiny_family(base / family, family, seed=3, **OVERRIDES[family])


def write_llamacpp_layout(hf_dir: Path, out: Path, family: str, qtype=Q.F32, edit=None) -> None:
    """The tiny checkpoint as llama.cpp's converter writes its family (keys and tensors; the
    tokenizer from the pyklei conversion's metadata). edit(keys, tensors): a change before
    writing (the refusal tests)."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    arch = "llama" if family == "mistral" else family
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rp = cfg.get("rope_parameters") or {}
    keys = {f"{arch}.context_length": cfg["max_position_embeddings"],
            f"{arch}.embedding_length": cfg["hidden_size"],
            f"{arch}.feed_forward_length": cfg["intermediate_size"],
            f"{arch}.block_count": cfg["num_hidden_layers"],
            f"{arch}.attention.head_count": n_head, f"{arch}.attention.head_count_kv": n_kv,
            f"{arch}.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
            f"{arch}.rope.freq_base": rp.get("rope_theta", cfg.get("rope_theta", 10000.0))}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    tensors = {}
    if family == "phi3":
        keys["phi3.rope.dimension_count"] = int(rp["partial_rotary_factor"] * cfg["hidden_size"]) // n_head
        keys["phi3.rope.scaling.original_context_length"] = rp["original_max_position_embeddings"]
        keys["phi3.attention.sliding_window"] = cfg["sliding_window"] or 0
        scale = cfg["max_position_embeddings"] / rp["original_max_position_embeddings"]
        keys["phi3.rope.scaling.attn_factor"] = float(np.sqrt(1 + np.log(scale) / np.log(
            rp["original_max_position_embeddings"])))
        tensors["rope_factors_long.weight"] = np.asarray(rp["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rp["short_factor"], np.float32)
    else:
        keys[f"{arch}.rope.dimension_count"] = head_dim
        keys[f"{arch}.vocab_size"] = cfg["vocab_size"]
        if "head_dim" in cfg:
            keys[f"{arch}.attention.key_length"] = keys[f"{arch}.attention.value_length"] = head_dim
    gguf_part = {**{v: k for k, v in PARTS.items()},
                 "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up"}   # the latter [gate; up]
    for name, x in hf.items():
        bits = name.removesuffix(".weight").split(".")
        if bits[:2] == ["model", "layers"]:
            part = gguf_part[".".join(bits[3:])]
            gname = f"blk.{bits[2]}.{part}.weight"
            if family != "phi3" and part in ("attn_q", "attn_k"):    # llama.cpp's LlamaModel.permute
                x = permute_qk(x, n_head if part == "attn_q" else n_kv)
        else:
            gname = {v: k for k, v in GLOBALS.items()}[".".join(bits)] + ".weight"
        tensors[gname] = x
    if edit:
        edit(keys, tensors)
    # the tokenizer keys, as any converter writes them
    w = llamacpp_writer(out, arch, read_model(_pyklei_file(hf_dir)), keep=lambda k: k.startswith("tokenizer."))
    for k, v in keys.items():
        vt = (gguf.GGUFValueType.STRING if isinstance(v, str) else gguf.GGUFValueType.FLOAT32
              if isinstance(v, float) else gguf.GGUFValueType.UINT32)
        w.add_key_value(k, v, vt)
    for name, x in tensors.items():
        if x.ndim == 2 and qtype != Q.F32:
            from gguf.quants import quantize
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _pyklei_file(hf_dir: Path) -> Path:
    """The direct conversion at q8 (8-bit embedding), made once per checkpoint."""
    out = hf_dir.parent / f"{hf_dir.name}.hf-q8.gguf"
    if not out.is_file():
        convert(hf_dir, out, keep=["*=q8"], embedding_bits=8)
    return out


def _import(src: Path) -> Path:
    out = src.with_suffix(".q8.gguf")
    convert(src, out, keep=["*=q8"], embedding_bits=8, force=True)
    return out


def logits(path: Path) -> np.ndarray:
    from pyklei.runtime.model import Model
    return Model(path, n_threads=2, n_ctx=64, activations="qai8dx2").logits(TOKENS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("families")
    return {f: _checkpoint(f, base) for f in OVERRIDES}


@pytest.mark.parametrize("family", list(OVERRIDES))
def test_import_of_the_llamacpp_layout_equals_the_hf_conversion(checkpoints, tmp_path, family):
    hf = checkpoints[family]
    src = tmp_path / f"{family}-f32.gguf"
    write_llamacpp_layout(hf, src, family)
    path = _import(src)
    direct, imported = read_model(_pyklei_file(hf)), read_model(path)
    want = direct.hparams
    if family == "mistral":             # a "llama" file: the Llama it says it is
        assert imported.hparams.arch == "llama"
        want = dataclasses.replace(want, arch="llama")
    assert imported.hparams == want
    assert set(imported.tensors) == set(direct.tensors)
    for name in direct.tensors:
        assert np.array_equal(imported.tensor(name).dequantize(), direct.tensor(name).dequantize()), name
    family_keys = {k for k in direct.metadata if k.startswith("pyklei.") and "converter" not in k}
    assert {k: imported.metadata.get(k) for k in family_keys} == {k: direct.metadata[k] for k in family_keys}
    diff = np.abs(logits(_pyklei_file(hf)) - logits(path)).max()
    print(f"\n{family}: llama.cpp layout imported vs direct, max |dlogit| {diff:.2e}")
    assert diff <= EXACT_MAX_DIFF


def test_phi3_quantized_fused_tensors_split_by_rows(checkpoints, tmp_path):
    """Q8_0 blocks of attn_qkv / ffn_up: each part is its rows of the dequantized fused tensor."""
    from gguf.quants import dequantize

    src = tmp_path / "phi3-q8_0.gguf"
    write_llamacpp_layout(checkpoints["phi3"], src, "phi3", Q.Q8_0)
    mf = read_model(_import(src))
    r = {t.name: t for t in gguf.GGUFReader(src).tensors}
    hp = mf.hparams
    qkv = np.asarray(dequantize(r["blk.1.attn_qkv.weight"].data, Q.Q8_0), np.float32)
    v = qkv[(hp.n_head + hp.n_head_kv) * hp.head_dim:]
    gate_up = np.asarray(dequantize(r["blk.1.ffn_up.weight"].data, Q.Q8_0), np.float32)
    for name, rows in (("blk.1.attn_v.weight", v), ("blk.1.ffn_gate.weight", gate_up[:hp.n_ff]),
                       ("blk.1.ffn_up.weight", gate_up[hp.n_ff:])):
        got = mf.tensor(name).dequantize()
        assert got.shape == rows.shape
        assert np.abs(got - rows).max() <= 0.02 * np.abs(rows).max(), name


def _drop(name):
    def edit(keys, tensors):
        del tensors[name]
    return edit


def _key(key, value):
    def edit(keys, tensors):
        keys[key] = value
    return edit


REFUSED = [
    ("phi3", _key("phi3.rope.scaling.type", "yarn"), "phi3.rope.scaling.type = 'yarn'"),
    ("phi3", _key("phi3.rope.scaling.factor", 4.0), "phi3.rope.scaling.factor"),
    ("phi3", _drop("blk.1.attn_qkv.weight"), "lacks tensor blk.1.attn_q.weight (nor its fused "
                                             "blk.1.attn_qkv.weight"),
    ("phi3", _drop("rope_factors_short.weight"), "LongRoPE without tensor rope_factors_short.weight"),
    ("smollm3", _key("smollm3.attention.sliding_window", 16), "smollm3.attention.sliding_window"),
    ("smollm3", _key("smollm3.rope.scaling.attn_factor", 1.2), "smollm3.rope.scaling.attn_factor"),
]


@pytest.mark.parametrize("family,edit,message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_what_pyklei_cannot_honour_is_refused_in_one_line(checkpoints, tmp_path, family, edit, message):
    src = tmp_path / "bad.gguf"
    write_llamacpp_layout(checkpoints[family], src, family, edit=edit)
    with pytest.raises(ConversionError) as e:
        convert(src, tmp_path / "out.gguf")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out.gguf").exists()


# ----------------------------------------------------------------------------- llama.cpp's own

def _llamacpp_src() -> Path | None:
    from pyklei_dev.assets import cache_dir
    src = Path(os.environ.get("LLAMACPP_SRC") or
               cache_dir() / "llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
    return src if (src / "convert_hf_to_gguf.py").is_file() else None


# llama.cpp's converter, its tokenizer checks relaxed: it recognises a BPE pre-tokenizer by a
# hash of known tokenizers (the tiny one is none of them) and reads Phi-3's vocabulary from a
# SentencePiece model; the tokenizer is not what these tests compare.
DRIVER = """
import sys
from pathlib import Path
src = Path(sys.argv[1])
sys.path[:0] = [str(src), str(src / "gguf-py")]
import convert_hf_to_gguf
from conversion.base import TextModel
from conversion.phi import Phi3MiniModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "llama-bpe"
Phi3MiniModel.set_vocab = TextModel._set_vocab_gpt2
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("family,outtype", [("phi3", "f32"), ("phi3", "f16"), ("smollm3", "f32"),
                                            ("smollm3", "f16"), ("mistral", "f32")])
def test_llamacpp_converted_files_import_like_the_hf_conversion(checkpoints, tmp_path, family, outtype):
    src_dir = _llamacpp_src()
    if src_dir is None:
        pytest.skip("llama.cpp's sources (convert_hf_to_gguf.py) not found: set LLAMACPP_SRC")
    hf = checkpoints[family]
    src = tmp_path / f"{family}-{outtype}.gguf"
    run = subprocess.run([sys.executable, "-c", DRIVER, str(src_dir), str(hf), "--outtype", outtype,
                          "--outfile", str(src)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    arch = gguf.GGUFReader(src).fields["general.architecture"].contents()
    assert arch == ("llama" if family == "mistral" else family)
    imported = _import(src)
    direct = _pyklei_file(hf)
    ref, out = logits(direct), logits(imported)
    diff = np.abs(out - ref).max()
    print(f"\n{family} llama.cpp {outtype} -> q8 vs direct q8: max |dlogit| {diff:.2e}")
    assert diff <= EXACT_MAX_DIFF and (out.argmax(-1) == ref.argmax(-1)).all()
    want = read_model(direct).hparams
    got = read_model(imported).hparams
    assert (got.layer_window, got.layer_rope_base, got.rope_dim, got.context_length) == \
        (want.layer_window, want.layer_rope_base, want.rope_dim, want.context_length)
