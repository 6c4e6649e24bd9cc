"""Converter failures converters/test_convert.py lacks: a bad shard of a sharded checkpoint, and
configs that lie about heads, vocabulary or width. Each fails with a ConversionError that says
what is wrong, and leaves no partial file behind."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


# ---------------------------------------------------------------------------------------------
# Converter failures test_convert.py lacks: a bad shard of a sharded checkpoint, configs that
# lie about heads / vocabulary / width
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    pytest.importorskip("torch")
    from models import make_tiny_llama
    return make_tiny_llama(tmp_path_factory.mktemp("rel") / "hf", head_dim=32, tied=True,
                           tokenizer="bpe", seed=3, hidden_size=64, n_head=2, n_head_kv=1,
                           n_layer=2, intermediate_size=128, vocab_size=384)


def _sharded(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file as load_pt     # bf16: through torch
    from safetensors.torch import save_file as save_pt
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    ts = load_pt(str(src / "model.safetensors"))
    names = sorted(ts)
    half = len(names) // 2
    wm = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_pt({k: ts[k] for k in part}, str(dst / fn), metadata={"format": "pt"})
        wm.update({k: fn for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return dst


def _conv_fails(src: Path, out: Path, match: str):
    from pyklei.converters import ConversionError, convert
    with pytest.raises(ConversionError, match=match) as ei:
        convert(src, out)
    print(f"\n{src.name}: {ei.value}")
    left = [p.name for p in out.parent.iterdir() if p.suffix in (".gguf", ".part") or ".part" in p.name]
    assert left == [], left


def test_converter_bad_shards_and_lying_configs(tiny_hf, tmp_path):
    from pyklei.converters import convert
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    sh = _sharded(tiny_hf, tmp_path / "sharded")
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
