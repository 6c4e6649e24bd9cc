"""The size/quality ladder (pyklei/converters/recipes.py) and the activation default
(activation_policy.choose_activations)."""
import math

import pytest

from pyklei.runtime.activation_policy import choose_activations
from pyklei.converters import ConversionError, convert
from pyklei.converters.recipes import (BITS_6, PROMOTION_ORDER, bits_4, bits_keep, ends_first,
                                      expected_quality, recipe_keep)
from pyklei.formats.model_file import read_model

SHAPES = {f"blk.{i}.{p}.weight": s for i in range(4) for p, s in (
    ("attn_q", (64, 64)), ("attn_k", (32, 64)), ("attn_v", (32, 64)), ("attn_output", (64, 64)),
    ("ffn_gate", (128, 64)), ("ffn_up", (128, 64)), ("ffn_down", (64, 128)))}


def _avg_bits(rules, group_size=32):
    six = {n for n, f in rules if f == "qsi6c32"}
    total = sum(math.prod(s) for s in SHAPES.values())
    return sum(math.prod(s) * (BITS_6 if n in six else bits_4(group_size))
               for n, s in SHAPES.items()) / total


@pytest.mark.parametrize("target", [4.5, 4.8, 5.2, 5.9, 6.5])
def test_bits_target_is_met_and_filled_in_order(target):
    rules = bits_keep(target, SHAPES, 32)
    assert _avg_bits(rules) <= target + 1e-9
    names = [n for n, _ in rules]
    kinds = [n.split(".")[2] for n in names]
    # kinds come in PROMOTION_ORDER, and a kind is complete before the next one starts
    order = [PROMOTION_ORDER.index(k) for k in kinds]
    assert order == sorted(order)
    for k in set(kinds[:-1]) - set(kinds[-1:]):
        assert kinds.count(k) == 4
    # inside a kind, layers from both ends inwards: 0, 3, 1, 2
    for k in set(kinds):
        assert [int(n.split(".")[1]) for n in names if n.split(".")[2] == k] == \
            [0, 3, 1, 2][:kinds.count(k)]
    # one more tensor would break the budget
    rest = [f"blk.{i}.{k}.weight" for k in PROMOTION_ORDER for i in (0, 3, 1, 2)
            if f"blk.{i}.{k}.weight" not in names]
    if rest:
        assert _avg_bits(rules + [(rest[0], "qsi6c32")]) > target
    assert (target >= 6.5) == (len(rules) == len(SHAPES))


def test_ends_first_is_a_permutation_from_both_ends_inwards():
    assert ends_first([0, 1, 2, 3, 4, 5]) == [0, 5, 1, 4, 2, 3]
    assert ends_first([0, 1, 2, 3, 4]) == [0, 4, 1, 3, 2]
    assert ends_first([7]) == [7] and ends_first([]) == []
    assert sorted(ends_first(list(range(30)))) == list(range(30))


def test_bits_below_the_4bit_floor_and_unknown_recipe_are_errors():
    with pytest.raises(ConversionError, match="below qsi4c32's 4.5"):
        bits_keep(4.4, SHAPES, 32)
    with pytest.raises(ConversionError, match="unknown recipe 'q5'"):
        recipe_keep("q5")


def test_recipe_q4m_and_user_keep_first(tiny64, tmp_path):
    hf, _ = tiny64
    out = convert(hf, tmp_path / "m.gguf", recipe="q4m", keep=["blk.0.ffn_down.weight=q8"])
    mf = read_model(out.path)
    for i in range(mf.hparams.n_layer):
        assert mf.layer(i, "attn_v").format == "qsi6c32"
        assert mf.layer(i, "attn_q").format == "qsi4c32"
        assert mf.layer(i, "ffn_down").format == ("qsi8cx" if i == 0 else "qsi6c32")
    with pytest.raises(ConversionError, match="not both"):
        convert(hf, tmp_path / "x.gguf", recipe="q4m", bits=5.0)


def test_activation_default_is_per_row_on_rotated_files_per_block_on_others(tiny64, tmp_path):
    import pyklei
    hf, plain = tiny64
    rot = convert(hf, tmp_path / "r.gguf", rotate=True).path
    assert read_model(rot).rotated and not read_model(plain).rotated
    assert choose_activations(read_model(rot)) == "qai8dx"       # the decision: docs/QUALITY.md
    assert choose_activations(read_model(plain)) == "qsi8d32"    # unrotated: a scale per block
    assert choose_activations(read_model(plain), "qai8dx") == "qai8dx"
    assert choose_activations(read_model(rot), "qai8dx2") == "qai8dx2"
    with pyklei.load(rot, n_threads=1, n_ctx=32) as llm:
        assert llm.model.activations == "qai8dx"
    with pyklei.load(plain, n_threads=1, n_ctx=32) as llm:
        assert llm.model.activations == "qsi8d32"
    with pyklei.load(rot, n_threads=1, n_ctx=32, activations="qai8dx2") as llm:
        assert llm.model.activations == "qai8dx2"
    with pytest.raises(ValueError, match="activations must be one of auto, qai8dx2, qai8dx"):
        pyklei.load(plain, activations="int4")


def test_expected_quality_quotes_the_measured_rung_at_or_below():
    assert "default (4.5 bits) measured KL divergence 0.053-0.218" in expected_quality(4.5)
    assert "--bits 4.9 (4.9 bits)" in expected_quality(5.0)
    assert "--recipe q4m" in expected_quality(5.06)
    assert "--bits 6.0 (6 bits)" in expected_quality(6.5)
    assert "at 4.25 bits" in expected_quality(4.25) and "default" in expected_quality(4.25)


def test_a_rotated_gptq_conversion_says_its_expected_quality(tiny64, tmp_path):
    from pyklei.calibration import convert_gptq
    hf, _ = tiny64
    text = " ".join(f"word{i % 97} the of and" for i in range(800))
    res = convert_gptq(hf, tmp_path / "m.gguf", text, n_tokens=512, seq_len=256, progress=False,
                       rotate=True, recipe="q6")
    assert abs(res.block_linear_bits() - BITS_6) < 1e-9
    assert "expected quality: block linears at 6.50 bits per weight; --bits 6.0" in res.summary()
