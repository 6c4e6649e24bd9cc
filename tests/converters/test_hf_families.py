"""Hugging Face checkpoints of every family (issue 42) -> pyklei files, against transformers fp32.

Tiny random checkpoints (tests/fixtures/models.py: make_tiny_family, every feature of the family on,
saved by transformers 5) are converted with q8 weights (`keep=["*=q8"]`, 8-bit embedding)
and with the default 4-bit weights, and run by the C runtime (qai8dx2 activations, attention
in f32: the exact bounds check the conversion, not bf16's rounding) over 60 positions, beyond every sliding window (16-24). Stated tolerances (`-s` prints the measured
values):

- exact: pyklei (q8 file) against transformers running the *same* dequantized weights,
  mapped back by this file's own name map (independent of the converter's): max |dlogit| <=
  5e-3, top-1 100% — the tolerance test_runtime.py states for Llama (logits of std ~0.5 here).
- each feature matters: the same reference with one feature switched off (a window, a RoPE
  base, NoPE layers, biases, q/k norms, LongRoPE's factors or attention factor, Gemma's scales
  and soft-capping) differs by max |dlogit| >= 0.1, twenty times the tolerance, so a converter
  that dropped it fails the exact check.
- against the original checkpoint (transformers' own from_pretrained, fp32): KLD <= 1e-3 and
  top-1 >= 90% at q8; KLD <= 0.05 at 4 bits (random tiny models have flat distributions, so
  4-bit top-1 is not a useful measure there).

Plus shape checks on the published configs (no weights) and refusals with one line.
"""
from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from converter_checks import llamacpp_writer  # noqa: E402
from models import make_tiny_family  # noqa: E402

from pyklei.converters import ConversionError, convert  # noqa: E402
from pyklei.converters.hf_config import hparams_from_config  # noqa: E402
from pyklei.converters.hf_llama import expected_tensors  # noqa: E402
from pyklei.formats.model_file import read_model  # noqa: E402
from pyklei_dev.published_configs import PUBLISHED  # noqa: E402

pytestmark = pytest.mark.usefixtures("f32_attention")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen2", "qwen3", "mistral", "smollm3", "phi3", "gemma3")
TOKENS = list(range(5, 65))            # 60 positions
EXACT_MAX_DIFF = 5e-3
FEATURE_MIN_DIFF = 20 * EXACT_MAX_DIFF
Q8_KLD, Q8_TOP1, Q4_KLD = 1e-3, 0.9, 0.05
# Phi-3's LongRoPE attention factor of the fixture (max 256 / original 64 = 4)
PHI3_ATTENTION_FACTOR = math.sqrt(1 + math.log(4) / math.log(64))

# The test's own GGUF part -> HF part map, on purpose apart from the converter's table.
HF_PARTS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA_PARTS = {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
GLOBALS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kld(ref, out):
    """Mean KL(ref || out) over positions, in nats."""
    lr, lo = log_softmax(ref.astype(np.float64)), log_softmax(out.astype(np.float64))
    return float((np.exp(lr) * (lr - lo)).sum(-1).mean())


def hf_logits(model, ids=TOKENS):
    with torch.no_grad():
        return model(torch.tensor([list(ids)]), use_cache=False).logits[0].float().numpy()


def pyklei_logits(path, ids=TOKENS):
    from pyklei.runtime.model import Model
    return Model(path, n_threads=2, n_ctx=64, activations="qai8dx2").logits(list(ids))


def _unpermute_rows(w, n_head, rope_dim):
    """Interleaved pairs -> HF's rotate-half order, on the first rope_dim rows of each head."""
    heads = w.reshape(n_head, -1, *w.shape[1:]).copy()
    r = heads[:, :rope_dim]
    heads[:, :rope_dim] = r.reshape(n_head, rope_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(r.shape)
    return heads.reshape(w.shape)


def file_state_dict(gguf, family) -> dict:
    """The HF state dict of a pyklei file's dequantized weights (its q/k rows, norm offsets,
    fused projections and LongRoPE gain undone)."""
    mf = read_model(gguf)
    hp = mf.hparams
    parts = {**HF_PARTS, **(GEMMA_PARTS if family == "gemma3" else {})}
    state, fused = {}, {}
    for name, t in mf.tensors.items():
        if name == "rope_freqs.weight":
            continue
        w = t.dequantize().astype(np.float32)
        bits = name.split(".")
        part = bits[2] if bits[0] == "blk" else None
        heads = {"attn_q": hp.n_head, "attn_k": hp.n_head_kv,
                 "attn_q_norm": 1, "attn_k_norm": 1}.get(part)
        if heads:
            w = _unpermute_rows(w, heads, hp.rope_dim)
            if family == "phi3" and w.ndim == 2:
                w = w.reshape(heads, -1, w.shape[1]).copy()
                w[:, :hp.rope_dim] /= np.float32(PHI3_ATTENTION_FACTOR)
                w = w.reshape(-1, w.shape[-1])
        if family == "gemma3" and name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        if bits[0] != "blk":
            state[GLOBALS[name]] = w
            continue
        prefix = f"model.layers.{bits[1]}."
        if family == "phi3" and part in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            key = prefix + ("self_attn.qkv_proj.weight" if part.startswith("attn") else "mlp.gate_up_proj.weight")
            fused.setdefault(key, {})[part] = w
            continue
        state[prefix + parts[part] + "." + bits[3]] = w
    for key, blocks in fused.items():
        order = ("attn_q", "attn_k", "attn_v") if "qkv" in key else ("ffn_gate", "ffn_up")
        state[key] = np.concatenate([blocks[p] for p in order])
    if hp.tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}


def hf_model(hf_dir, state=None, config_edit=None, state_edit=None):
    """transformers fp32 of the checkpoint (or of `state`), a config or state edit applied."""
    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    if config_edit:
        config_edit(cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, config=cfg, dtype=torch.float32)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    if state_edit:
        with torch.no_grad():
            for name, p in model.named_parameters():
                state_edit(name, p)
    return model.eval()


def _set(**kw):
    def edit(cfg):
        for k, v in kw.items():
            setattr(cfg, k, v)
    return edit


def _rope_edit(**kw):
    def edit(cfg):
        cfg.rope_parameters = {**cfg.rope_parameters, **kw}
    return edit


def _gemma_local_base(cfg):
    rp = copy.deepcopy(cfg.rope_parameters)
    rp["sliding_attention"]["rope_theta"] = rp["full_attention"]["rope_theta"]
    cfg.rope_parameters = rp


def _fill(suffix, value):
    def edit(name, p):
        if name.endswith(suffix):
            p.fill_(value)
    return edit


# Twins: the reference with one feature of the family off (a config or a weight edit).
TWINS = {
    "qwen2": {"no sliding window": dict(config_edit=_set(layer_types=["full_attention"] * 3)),
              "no q/k/v biases": dict(state_edit=_fill("proj.bias", 0.0))},
    "qwen3": {"no q/k norm gains": dict(state_edit=_fill("_norm.weight", 1.0))},
    "mistral": {"no sliding window": dict(config_edit=_set(sliding_window=None))},
    "smollm3": {"RoPE on every layer": dict(config_edit=_set(no_rope_layers=[1, 1, 1, 1]))},
    "phi3": {"no sliding window": dict(config_edit=_set(sliding_window=None)),
             "LongRoPE factors 1": dict(config_edit=_rope_edit(short_factor=[1.0] * 8)),
             "no attention factor": dict(config_edit=_rope_edit(attention_factor=1.0))},
    "gemma3": {"no sliding window": dict(config_edit=_set(layer_types=["full_attention"] * 4)),
               "one RoPE base": dict(config_edit=_gemma_local_base),
               "no logit soft-cap": dict(config_edit=_set(final_logit_softcapping=None)),
               "1/sqrt(head_dim) scores": dict(config_edit=_set(query_pre_attn_scalar=64)),
               "no post-norm gains": dict(state_edit=_fill("post_feedforward_layernorm.weight", 0.0))},
}


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    """(family, checkpoint, {"q8" | "q4": file}, original fp32 logits)."""
    family = request.param
    d = tmp_path_factory.mktemp(family)
    hf = make_tiny_family(d / "hf", family, seed=FAMILIES.index(family))
    files = {"q8": d / "q8.gguf", "q4": d / "q4.gguf"}
    convert(hf, files["q8"], keep=["*=q8"], embedding_bits=8)
    convert(hf, files["q4"])
    return family, hf, files, hf_logits(hf_model(hf))


def test_q8_file_is_exact_against_transformers_on_its_weights(converted):
    family, hf, files, _ = converted
    state = file_state_dict(files["q8"], family)
    ref = hf_logits(hf_model(hf, state))
    out = pyklei_logits(files["q8"])
    diff = np.abs(out - ref).max()
    print(f"\n{family} q8, same weights: max |dlogit| {diff:.2e} (logit std {ref.std():.2f})")
    assert diff <= EXACT_MAX_DIFF
    assert (out.argmax(-1) == ref.argmax(-1)).all()
    for what, edit in TWINS[family].items():
        twin = hf_logits(hf_model(hf, state, **edit))
        far = np.abs(twin - ref).max()
        print(f"  twin '{what}': max |dlogit| {far:.3f} from the reference")
        assert far >= FEATURE_MIN_DIFF, what


def test_files_agree_with_the_checkpoint(converted):
    family, _, files, ref = converted
    q8, q4 = (pyklei_logits(files[k]) for k in ("q8", "q4"))
    for label, out in (("q8", q8), ("q4", q4)):
        print(f"\n{family} {label} vs transformers fp32: max |dlogit| {np.abs(out - ref).max():.3f}, "
              f"KLD {kld(ref, out):.2e}, top-1 {(out.argmax(-1) == ref.argmax(-1)).mean():.3f}")
    assert kld(ref, q8) <= Q8_KLD and (q8.argmax(-1) == ref.argmax(-1)).mean() >= Q8_TOP1
    assert kld(ref, q4) <= Q4_KLD


def test_phi3_past_its_original_context_takes_the_long_factors(converted):
    """LongRoPE: a model loaded with a context past original_max_position_embeddings (64 here)
    rotates by the long factors, as transformers does over a sequence that long; within it,
    by the short ones (every other test here)."""
    family, hf, files, _ = converted
    if family != "phi3":
        pytest.skip("LongRoPE is Phi-3's")
    from pyklei.runtime.model import Model
    ids = list(range(5, 95))                                  # 90 positions > 64
    state = file_state_dict(files["q8"], family)
    ref = hf_logits(hf_model(hf, state), ids)
    out = Model(files["q8"], n_threads=2, n_ctx=128, activations="qai8dx2").logits(ids)
    diff = np.abs(out - ref).max()
    short = hf_logits(hf_model(hf, state, config_edit=_rope_edit(
        long_factor=[1.0, 1.3, 1.7, 2.2, 2.9, 3.5, 4.0, 4.6])), ids)   # the fixture's short factors
    print(f"\nphi3 q8 over 90 positions: max |dlogit| {diff:.2e}; "
          f"with the short factors there {np.abs(short - ref).max():.3f}")
    assert diff <= EXACT_MAX_DIFF
    assert np.abs(short - ref).max() >= FEATURE_MIN_DIFF
    # the reader checks the long factors and the context they start past
    from pyklei.formats import gguf_keys as K
    from pyklei.formats.model_file import ModelFileError, read_hparams
    mf = read_model(files["q8"])
    assert mf.hparams.rope_long_from == 64 and len(mf.hparams.rope_long_factors) == 8
    from pyklei.info import _family_features     # what `pyklei info` lists as "family"
    assert "LongRoPE long factors past 64 tokens of context" in _family_features(mf.hparams)
    long = mf.metadata[K.KEY_ROPE_LONG_FACTORS]
    for edit, msg in ((dict(long=long[:3]), "must be an array of 8 values"),
                      (dict(long=[-1.0] * 8), "out of range"),
                      (dict(drop=K.ROPE_SCALING_ORIG_CTX), "lacks metadata key")):
        md = {**mf.metadata, K.KEY_ROPE_LONG_FACTORS: edit.get("long", long)}
        md.pop(edit.get("drop"), None)
        with pytest.raises(ModelFileError, match=msg):
            read_hparams(md, lambda k: mf.metadata_types[k][0], set(mf.tensors), "x")


def test_the_file_says_what_the_family_needs(converted):
    family, _, files, _ = converted
    hp = read_model(files["q4"]).hparams
    assert hp.arch == family
    expect = {
        "qwen2": dict(layer_window=(0, 16, 16)),
        "qwen3": dict(head_dim=64, layer_window=()),
        "mistral": dict(layer_window=(20, 20)),
        "smollm3": dict(layer_rope_base=(10000.0, 0.0, 10000.0, 0.0)),
        "phi3": dict(rope_dim=16, layer_window=(24, 24), context_length=256, has_rope_freqs=True,
                     rope_long_from=64),
        "gemma3": dict(layer_window=(16, 16, 0, 16), layer_rope_base=(100.0, 100.0, 1e6, 100.0),
                       activation="gelu_tanh", logit_softcap=4.0,
                       embedding_scale=pytest.approx(96 ** 0.5), attention_scale=pytest.approx(48 ** -0.5)),
    }[family]
    assert {k: getattr(hp, k) for k in expect} == expect


# Gemma 3 4B / 12B / 27B: RoPE scaled linearly (factor 8) on the global layers only
GEMMA3_LINEAR = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


def _rope_parameters(full, sliding):
    def edit(cfg):
        cfg.rope_parameters = {"full_attention": full, "sliding_attention": sliding}
    return edit


def test_gemma3_linear_rope_scaling_of_the_global_layers_is_exact(tmp_path):
    hf = make_tiny_family(tmp_path / "hf", "gemma3", seed=11, rope_parameters=GEMMA3_LINEAR)
    q8 = tmp_path / "q8.gguf"
    convert(hf, q8, keep=["*=q8"], embedding_bits=8)
    mf = read_model(q8)
    assert mf.hparams.layer_rope_factor == (1.0, 1.0, 8.0, 1.0)
    # llama.cpp's keys, which it applies to Gemma 3's global layers only; the reader refuses a
    # file where they disagree with the per-layer factors
    assert (mf.metadata["gemma3.rope.scaling.type"], mf.metadata["gemma3.rope.scaling.factor"]) == ("linear", 8.0)
    from pyklei.formats.model_file import ModelFileError, read_hparams
    md = {**mf.metadata, "gemma3.rope.scaling.factor": 4.0}
    with pytest.raises(ModelFileError, match="gemma3.rope.scaling.factor = 4.0 disagrees"):
        read_hparams(md, lambda k: mf.metadata_types[k][0], set(mf.tensors), "x")
    from pyklei.info import _family_features     # what `pyklei info` lists as "family"
    assert "RoPE linear scaling 8 on 1 of 4 layers" in _family_features(mf.hparams)
    state = file_state_dict(q8, "gemma3")
    ref = hf_logits(hf_model(hf, state))
    out = pyklei_logits(q8)
    diff = np.abs(out - ref).max()
    print(f"\ngemma3 linear RoPE x8 q8, same weights: max |dlogit| {diff:.2e}")
    assert diff <= EXACT_MAX_DIFF and (out.argmax(-1) == ref.argmax(-1)).all()
    full, sliding = GEMMA3_LINEAR["full_attention"], GEMMA3_LINEAR["sliding_attention"]
    for what, edit in (("unscaled", _rope_parameters({**full, "rope_type": "default"}, sliding)),
                       ("every layer scaled", _rope_parameters(full, {**full, "rope_theta": 100.0}))):
        far = np.abs(hf_logits(hf_model(hf, state, config_edit=edit)) - ref).max()
        print(f"  twin '{what}': max |dlogit| {far:.3f} from the reference")
        assert far >= FEATURE_MIN_DIFF, what
    # the default conversion (rotation + GPTQ, whose calibration runs each layer's own RoPE)
    q4 = tmp_path / "q4.gguf"
    convert(hf, q4)
    orig = hf_logits(hf_model(hf))
    print(f"  default 4-bit vs transformers fp32: KLD {kld(orig, pyklei_logits(q4)):.2e}")
    assert kld(orig, pyklei_logits(q4)) <= Q4_KLD


def _write_llamacpp_gemma3(hf_dir: Path, out: Path) -> None:
    """A Gemma 3 checkpoint as llama.cpp's converter writes it: q/k rows in Hugging Face's
    order, RMSNorm gains stored as 1 + w, f16 matrices, the sliding window, and (from the
    pyklei conversion's metadata, in llama.cpp's spelling) rope.scaling.type / factor;
    llama.cpp's rules give the rest (every 6th layer global, the local RoPE base 10000)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    from safetensors.torch import load_file

    tmp = out.with_suffix(".pyklei.gguf")
    convert(hf_dir, tmp, keep=["*=q8"], embedding_bits=8)    # for its metadata
    mf = read_model(tmp)
    hf = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    w = llamacpp_writer(out, "gemma3", mf)
    w.add_sliding_window(json.loads((hf_dir / "config.json").read_text())["sliding_window"])
    parts = {**HF_PARTS, **GEMMA_PARTS}
    for name in mf.tensors:
        bits = name.split(".")
        x = hf[GLOBALS[name] if bits[0] != "blk" else f"model.layers.{bits[1]}.{parts[bits[2]]}.weight"]
        if name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        if x.ndim == 2:
            w.add_tensor(name, quantize(x, Q.F16), raw_dtype=Q.F16)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.unlink()


def test_llamacpp_gemma3_file_scales_rope_linearly_on_its_global_layers(tmp_path):
    """Gemma 3 4B+ as llama.cpp files them (rope.scaling.type linear, factor 8, which llama.cpp
    applies to the global layers only), imported (pyklei/converters/llamacpp_gguf.py): exact
    against transformers on the imported weights."""
    import gguf

    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    local = {"rope_type": "default", "rope_theta": 10000.0}
    # what llama.cpp's gemma3 rules can hold: 1/sqrt(head_dim) scores, no logit soft-cap
    hf = make_tiny_family(tmp_path / "hf", "gemma3", seed=5, num_hidden_layers=6,
                          layer_types=["sliding_attention"] * 5 + ["full_attention"],
                          rope_parameters={"full_attention": full, "sliding_attention": local},
                          query_pre_attn_scalar=64, final_logit_softcapping=None)
    src, q8 = tmp_path / "gemma3-f16.gguf", tmp_path / "q8.gguf"
    _write_llamacpp_gemma3(hf, src)
    assert gguf.GGUFReader(src).fields["gemma3.rope.scaling.factor"].contents() == 8.0
    convert(src, q8, keep=["*=q8"], embedding_bits=8)
    assert read_model(q8).hparams.layer_rope_factor == (1.0,) * 5 + (8.0,)
    state = file_state_dict(q8, "gemma3")
    ref = hf_logits(hf_model(hf, state))
    out = pyklei_logits(q8)
    diff = np.abs(out - ref).max()
    twin = hf_logits(hf_model(hf, state, config_edit=_rope_parameters({**full, "rope_type": "default"}, local)))
    print(f"\ngemma3 llama.cpp file, linear RoPE x8 q8, same weights: max |dlogit| {diff:.2e}; "
          f"unscaled twin {np.abs(twin - ref).max():.3f}")
    assert diff <= EXACT_MAX_DIFF and (out.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(twin - ref).max() >= FEATURE_MIN_DIFF


def test_gemma3_image_text_checkpoint_converts_its_language_model(tmp_path):
    """The text part of a Gemma3ForConditionalGeneration (its vision tower skipped), with the
    RoPE of 4B and larger: linear scaling on the global layers."""
    hf = make_tiny_family(tmp_path / "hf", "gemma3", seed=7, multimodal=True,
                          rope_parameters=GEMMA3_LINEAR)
    out = tmp_path / "q8.gguf"
    convert(hf, out, keep=["*=q8"], embedding_bits=8)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    assert model.config.text_config.rope_parameters["full_attention"]["factor"] == 8.0
    ref = hf_logits(model)
    got = pyklei_logits(out)
    print(f"\ngemma3 image-text q8: KLD {kld(ref, got):.2e}")
    assert kld(ref, got) <= Q8_KLD
    hp = read_model(out).hparams
    assert hp.layer_window == (16, 16, 0, 16) and hp.layer_rope_factor == (1.0, 1.0, 8.0, 1.0)


# ----------------------------------------------------------------------------- published shapes
# (pyklei_dev/published_configs.py)

def _shape_summary(cfg):
    hp = hparams_from_config(cfg)
    return hp, sum(math.prod(t.shape) for t in expected_tensors(hp))


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_give_their_shapes(name):
    hp, n = _shape_summary(PUBLISHED[name])
    arch = hp["family"].arch
    g = {  # billions of parameters as published (tied embeddings counted once; Gemma 3 4B+:
           # the language model's, without the vision tower's ~0.4)
        "Qwen3-0.6B": 0.596, "Qwen3-1.7B": 1.72, "Qwen2.5-0.5B": 0.494, "Qwen2.5-1.5B": 1.54,
        "gemma-3-1b-it": 1.0, "gemma-3-4b-it": 3.88, "gemma-3-12b-it": 11.77,
        "gemma-3-27b-it": 27.0, "Phi-4-mini-instruct": 3.84, "Ministral-8B-Instruct-2410": 8.02,
        "Mistral-7B-v0.1": 7.24,
        "SmolLM3-3B": 3.08}[name]
    assert n / 1e9 == pytest.approx(g, rel=0.05), n
    if arch == "gemma3":
        globals_ = [i for i, w in enumerate(hp["layer_window"]) if w == 0]
        assert globals_ == list(range(5, hp["n_layer"], 6))
        one_b = name == "gemma-3-1b-it"
        assert {w for w in hp["layer_window"] if w} == {512 if one_b else 1024}
        assert [hp["layer_rope_base"][i] for i in (0, 5)] == [10000.0, 1e6]
        # 4B+: linear RoPE scaling x8 on exactly the global layers
        assert [i for i, f in enumerate(hp["layer_rope_factor"]) if f != 1.0] == ([] if one_b else globals_)
        assert set(hp["layer_rope_factor"]) == ({1.0} if one_b else {1.0, 8.0})
        assert hp["embedding_scale"] == pytest.approx(hp["n_embd"] ** 0.5)
        # 27B scales scores by query_pre_attn_scalar 168, not head_dim 128
        assert hp["attention_scale"] == (pytest.approx(168 ** -0.5) if name == "gemma-3-27b-it" else 0.0)
        assert hp["activation"] == "gelu_tanh" and hp["tied"]
        assert (hp["n_layer"], hp["n_head"], hp["n_head_kv"], hp["head_dim"]) == {
            "gemma-3-1b-it": (26, 4, 1, 256), "gemma-3-4b-it": (34, 8, 4, 256),
            "gemma-3-12b-it": (48, 16, 8, 256), "gemma-3-27b-it": (62, 32, 16, 128)}[name]
    elif arch == "phi3":
        assert (hp["head_dim"], hp["rope_dim"], hp["context_length"]) == (128, 96, 131072)
        assert hp["rope_factors"].shape == hp["rope_long_factors"].shape == (48,)
        assert hp["rope_long_from"] == 4096 and not any(hp["layer_window"])   # 262144 >= 131072
        assert hp["qk_rope_gain"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    elif arch == "smollm3":
        assert [i for i, b in enumerate(hp["layer_rope_base"]) if b == 0] == list(range(3, 36, 4))
    elif arch == "mistral":
        assert set(hp["layer_window"]) == ({4096} if name == "Mistral-7B-v0.1" else {0})
    else:
        assert not any(hp["layer_window"]) and hp["head_dim"] == (128 if arch == "qwen3" else
                                                                  hp["n_embd"] // hp["n_head"])


# ----------------------------------------------------------------------------- refusals

BAD_CONFIGS = [
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("qwen3", dict(layer_types=["full_attention", "chunked_attention"]), "layer_types[1]"),
    ("qwen3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0)), "'yarn'"),
    ("mistral", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("gemma3", dict(rope_scaling=dict(rope_type="yarn", factor=8.0)), "'yarn'"),
    ("gemma3", dict(rope_scaling=dict(rope_type="linear", factor=0.0)), "factor"),
    ("gemma3", dict(rope_scaling=dict(rope_type="linear")), "factor"),
    ("smollm3", dict(no_rope_layers=[1, 2]), "no_rope_layers"),
    ("qwen2", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    ("phi3", dict(partial_rotary_factor=0.34), "partial_rotary_factor"),
]
BASE = {"qwen3": "Qwen3-0.6B", "mistral": "Mistral-7B-v0.1", "gemma3": "gemma-3-1b-it",
        "smollm3": "SmolLM3-3B", "qwen2": "Qwen2.5-0.5B", "phi3": "Phi-4-mini-instruct"}


@pytest.mark.parametrize("family,edit,field", BAD_CONFIGS, ids=[b[2] for b in BAD_CONFIGS])
def test_config_fields_the_runtime_cannot_honour_are_refused(family, edit, field):
    cfg = {**copy.deepcopy(PUBLISHED[BASE[family]]), **edit}
    if "layer_types" in edit or "no_rope_layers" in edit:
        cfg["num_hidden_layers"] = 2
    with pytest.raises(ConversionError) as e:
        hparams_from_config(cfg)
    assert field in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_unsupported_architecture_names_it_and_the_supported():
    with pytest.raises(ConversionError, match="unsupported architecture Gemma2ForCausalLM; "
                                              "supported: .*Qwen3ForCausalLM.*Phi3ForCausalLM"):
        hparams_from_config({**PUBLISHED["gemma-3-1b-it"], "architectures": ["Gemma2ForCausalLM"]})


def test_missing_and_misshapen_tensors_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    bad = make_tiny_family(tmp_path / "bad", "qwen2")
    w = load_file(bad / "model.safetensors")
    gone = "model.layers.1.self_attn.k_proj.bias"
    save_file({k: v for k, v in w.items() if k != gone}, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=f"lacks tensor.*{gone}") as e:
        convert(bad, tmp_path / "x.gguf")
    assert "\n" not in str(e.value)
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 192}))
    with pytest.raises(ConversionError, match="does not match the weights: .*mlp") as e:
        convert(bad, tmp_path / "x.gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "x.gguf").exists()
