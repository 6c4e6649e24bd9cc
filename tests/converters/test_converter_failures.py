"""Conversions that must fail, and files the loader must refuse: a bad shard of a sharded
checkpoint, configs that lie about heads, vocabulary or width, missing or broken files and
fields (each a ConversionError or ModelFileError that says what is wrong, no partial file left
behind), the CLI's messages for them, and read_model on files that are not pyklei's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from converter_checks import cli_main, edit_config, fails_to_convert, leftovers, reshard
from models import make_tiny_llama
from pyklei.converters import ConversionError, convert
from pyklei.formats import gguf_keys as K
from pyklei.formats.model_file import ModelFileError, read_model


# ---------------------------------------------------------------------------------------------
# A bad shard of a sharded checkpoint, configs that lie about heads / vocabulary / width
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    pytest.importorskip("torch")
    return make_tiny_llama(tmp_path_factory.mktemp("rel") / "hf", head_dim=32, tied=True,
                           tokenizer="bpe", seed=3, hidden_size=64, n_head=2, n_head_kv=1,
                           n_layer=2, intermediate_size=128, vocab_size=384)


def _conv_fails(src: Path, out: Path, match: str):
    with pytest.raises(ConversionError, match=match) as ei:
        convert(src, out)
    print(f"\n{src.name}: {ei.value}")
    left = [p.name for p in out.parent.iterdir() if p.suffix in (".gguf", ".part") or ".part" in p.name]
    assert left == [], left


def test_converter_bad_shards_and_lying_configs(tiny_hf, tmp_path):
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    sh = reshard(tiny_hf, tmp_path / "sharded")
    convert(sh, out)                                    # the sharded copy itself converts
    out.unlink()
    shard2 = sh / "model-00002-of-00002.safetensors"
    good = shard2.read_bytes()
    shard2.write_bytes(good[: len(good) // 2])
    _conv_fails(sh, out, "truncated safetensors")
    shard2.write_bytes(good[:8] + b"{not json" + good[17:])
    _conv_fails(sh, out, "corrupt")
    shard2.write_bytes(b"")
    _conv_fails(sh, out, "safetensors")
    shard2.write_bytes(good)
    for change, match in [
        ({"num_attention_heads": 4}, "does not match|shape"),
        ({"num_key_value_heads": 2}, "does not match|shape"),
        ({"vocab_size": 400}, "does not match|shape|vocab"),
        ({"hidden_size": 128}, "does not match|shape"),
    ]:
        d = tmp_path / ("lie_" + "_".join(change))
        shutil.copytree(tiny_hf, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(change)
        (d / "config.json").write_text(json.dumps(cfg))
        _conv_fails(d, out, match)


# ---- bad inputs, checked by the converter and the loader (were converters/test_convert.py's) ----

def test_errors(tiny_bpe, tmp_path):
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    fails_to_convert(tmp_path / "nope", out, "missing input")
    empty = tmp_path / "empty"
    empty.mkdir()
    fails_to_convert(empty, out, "missing config.json")

    def copy(name):
        return Path(shutil.copytree(tiny_bpe, tmp_path / name))

    d = copy("arch")
    edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    fails_to_convert(d, out, "unsupported architecture GPT2LMHeadModel")
    d = copy("bias")
    edit_config(d, attention_bias=True)
    fails_to_convert(d, out, "unsupported feature: attention_bias")
    d = copy("yarn")
    edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    fails_to_convert(d, out, "rope scaling of type 'yarn'")
    d = copy("lies_hidden")
    edit_config(d, intermediate_size=1024)
    fails_to_convert(d, out, r"does not match the weights: model.layers.0.mlp.gate_proj.weight has shape \[512, 256\]")
    d = copy("lies_layers")
    edit_config(d, num_hidden_layers=3)
    fails_to_convert(d, out, "lacks tensor.*model.layers.2")
    d = copy("lies_layers1")
    edit_config(d, num_hidden_layers=1)
    fails_to_convert(d, out, "does not account for: model.layers.1")
    d = copy("lies_untied")
    edit_config(d, tie_word_embeddings=False)
    fails_to_convert(d, out, "lacks tensor.*lm_head.weight")
    d = copy("no_weights")
    (d / "model.safetensors").unlink()
    fails_to_convert(d, out, "missing model weights")
    d = copy("no_tok")
    (d / "tokenizer.json").unlink()
    fails_to_convert(d, out, "missing tokenizer")
    d = copy("truncated")
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size - 1000])
    fails_to_convert(d, out, "truncated safetensors file")
    d = copy("corrupt")
    raw = bytearray((tiny_bpe / "model.safetensors").read_bytes())
    raw[8:20] = b"\x00garbage!!!!"
    (d / "model.safetensors").write_bytes(bytes(raw))
    fails_to_convert(d, out, "corrupt safetensors header")
    d = copy("corrupt_len")
    raw = bytearray((tiny_bpe / "model.safetensors").read_bytes())
    raw[0:8] = (1 << 40).to_bytes(8, "little")
    (d / "model.safetensors").write_bytes(bytes(raw))
    fails_to_convert(d, out, "corrupt or truncated safetensors")
    sh = reshard(tiny_bpe, tmp_path / "missing_shard")
    (sh / "model-00002-of-00002.safetensors").unlink()
    fails_to_convert(sh, out, "missing shard model-00002-of-00002.safetensors")
    # dimension not divisible by the group size
    d = make_tiny_llama(tmp_path / "ffn480", head_dim=64, tokenizer="bpe", n_layer=1,
                        intermediate_size=480)
    fails_to_convert(d, out, r"ffn_down.weight: input dimension K=480 is not divisible by the group size 64; "
                   r"use --group-size 32", group_size=64)
    fails_to_convert(tiny_bpe, out, "group-size must be one of", group_size=48)
    fails_to_convert(tiny_bpe, out, "embedding-bits must be", embedding_bits=2)
    # NaN weights fail while streaming: the partly written temporary file is removed
    d = copy("nan")
    from safetensors.torch import load_file, save_file
    ts = load_file(str(d / "model.safetensors"))
    ts["model.layers.1.mlp.down_proj.weight"][3, 7] = float("nan")
    save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
    fails_to_convert(d, out, "NaN")
    # an existing output needs force
    out.write_bytes(b"old")
    with pytest.raises(ConversionError, match="exists; pass force=True"):
        convert(tiny_bpe, out)
    assert out.read_bytes() == b"old"
    convert(tiny_bpe, out, force=True)
    read_model(out)
    assert leftovers(out.parent) == ["m.gguf"]


def test_interrupt_leaves_nothing(tiny_bpe, tmp_path, monkeypatch):
    from pyklei.converters import core

    calls = {"n": 0}
    real = core._write_tensor

    def boom(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(core, "_write_tensor", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_bpe, tmp_path / "m.gguf")
    assert leftovers(tmp_path) == []


def test_cli(tiny_bpe, tmp_path, capsys):
    out = tmp_path / "c.gguf"
    assert cli_main([str(tiny_bpe), "-o", str(out), "--group-size", "64", "--embedding-bits", "4",
                     "--keep", "blk.0.*=q8", "--name", "tiny", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "bits per weight" in text and "peak RSS" in text
    mf = read_model(out)
    assert mf.metadata["general.name"] == "tiny" and mf.layer(0, "attn_q").format == "qsi8cx"
    assert cli_main([str(tiny_bpe), "-o", str(out), "--no-progress"]) == 2
    assert "exists" in capsys.readouterr().err
    nw = tmp_path / "nw.gguf"   # --norm-weighting: the same bytes as the Python API's
    assert cli_main([str(tiny_bpe), "-o", str(nw), "--norm-weighting", "--no-progress"]) == 0
    convert(tiny_bpe, tmp_path / "nw2.gguf", norm_weighting=True)
    assert nw.read_bytes() == (tmp_path / "nw2.gguf").read_bytes()
    convert(tiny_bpe, tmp_path / "plain.gguf")
    assert nw.read_bytes() != (tmp_path / "plain.gguf").read_bytes()   # the flag took effect


def test_read_model_rejects(tmp_path, tiny_bpe, smollm2_gguf_path, monkeypatch):
    with pytest.raises(ModelFileError, match="not a pyklei model file"):
        read_model(smollm2_gguf_path)
    monkeypatch.setattr(K, "FORMAT_VERSION", 2)
    convert(tiny_bpe, tmp_path / "v2.gguf")
    monkeypatch.setattr(K, "FORMAT_VERSION", 1)
    with pytest.raises(ModelFileError, match="format version 2"):
        read_model(tmp_path / "v2.gguf")
    with pytest.raises(ModelFileError, match="no such model file"):
        read_model(tmp_path / "none.gguf")
    good = tmp_path / "good.gguf"
    convert(tiny_bpe, good)
    raw = good.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(raw[: len(raw) - 100])
    with pytest.raises(ModelFileError, match="truncated"):
        read_model(tmp_path / "trunc.gguf")
    (tmp_path / "head.gguf").write_bytes(raw[:5000])
    with pytest.raises(ModelFileError, match="truncated"):
        read_model(tmp_path / "head.gguf")
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + raw[4:])
    with pytest.raises(ModelFileError, match="bad magic"):
        read_model(tmp_path / "magic.gguf")
