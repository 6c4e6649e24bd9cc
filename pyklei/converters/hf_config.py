"""A Hugging Face config.json -> the hyperparameters of a pyklei file, one family at a time.

    hp = hparams_from_config(json.load(open("config.json")))
    hp["family"].arch, hp["n_layer"], hp["layer_window"], hp["layer_rope_base"],
    hp["layer_rope_factor"], ...
    kv = hparams_kv(hp, "name")          # the file's metadata (gguf_keys), family keys included

What each family's config means is transformers' (5.x, reading 4.x files too): its
configuration_<family>.py defaults and the way its modeling_<family>.py reads the fields. What
the runtime cannot honour is refused here with one line naming the field (ConversionError),
never converted into a model that computes something else.
"""
from __future__ import annotations

import math

import numpy as np
from gguf import GGUFValueType as T

from pyklei.formats import gguf_keys as K
from pyklei.formats.families import family_of_hf, supported

from .errors import ConversionError

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
# transformers' hidden_act names -> the file's KEY_ACTIVATION
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# RoPE scalings the runtime honours: "linear" per layer type (its frequencies divided by the
# factor: Gemma 3 4B+ scale their global layers only), "llama3" and "longrope" on every layer
# alike (rope_freqs holds one set of divisors)
ROPE_SCALINGS = ("linear", "llama3", "longrope")

# transformers' config defaults for the fields a saved config may omit (a nested text_config
# is saved as its difference from the class defaults: Gemma 3's image-text checkpoints keep
# only a handful of fields there). Keys absent here fall back to the Llama defaults below.
DEFAULTS = {
    "gemma3": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0,
                   rope_local_base_freq=10_000.0),
    "smollm3": dict(no_rope_layer_interval=4, rope_theta=2_000_000.0, tie_word_embeddings=True),
    "qwen2": dict(max_window_layers=28, sliding_window=4096),
    "qwen3": dict(max_window_layers=28, sliding_window=4096, head_dim=128),
    "mistral": dict(sliding_window=4096),
}
# Which layers a config's sliding_window applies to, per family (modeling_<family>.py):
# "every": every layer (Mistral, Phi-3); "switched": the sliding_attention layers, and only
# with use_sliding_window (Qwen2, Qwen3, SmolLM3); "typed": the sliding_attention layers
# (Gemma 3); absent: none (Llama has no sliding window).
WINDOW_RULE = {"mistral": "every", "phi3": "every", "qwen2": "switched", "qwen3": "switched",
               "smollm3": "switched", "gemma3": "typed"}


def _text_config(cfg: dict, fam, cls: str) -> dict:
    """The language model's config: the top level, or a nested text_config (with the
    family's defaults under it)."""
    nested = fam.hf_nested.get(cls)
    text = cfg if nested is None else cfg.get(nested[0])
    if not isinstance(text, dict):
        raise ConversionError(f"config.json of {cls} lacks its {nested[0]!r}")
    out = {**DEFAULTS.get(fam.arch, {}), **text}
    if nested is not None and "tie_word_embeddings" in cfg:
        out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return out


def _rope_dicts(c: dict, fam) -> dict[str, dict]:
    """{layer type: {"rope_theta", "rope_type", ...}}, from transformers 5's rope_parameters
    (flat, or one dict per layer type as Gemma 3's) or transformers 4's rope_theta /
    rope_scaling / rope_local_base_freq / partial_rotary_factor."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and any(t in rp for t in LAYER_TYPES):
        out = {t: dict(rp.get(t) or {}) for t in LAYER_TYPES}
    elif isinstance(rp, dict) and rp:
        out = {t: dict(rp) for t in LAYER_TYPES}
    else:
        sc = c.get("rope_scaling")
        base = dict(sc) if isinstance(sc, dict) else {}
        base.setdefault("rope_theta", c.get("rope_theta", 10000.0))
        out = {FULL: base, SLIDING: dict(base)}
        if fam.arch == "gemma3":     # its local layers: own base, never scaled
            out[SLIDING] = {"rope_theta": c.get("rope_local_base_freq", 10000.0)}
    for t, d in out.items():
        local = fam.arch == "gemma3" and t == SLIDING
        d.setdefault("rope_theta", c.get("rope_local_base_freq" if local else "rope_theta", 10000.0))
        if "type" in d and "rope_type" not in d:
            d["rope_type"] = d.pop("type")
        d.setdefault("rope_type", "default")
        if d["rope_type"] in ("su", "yarn") and fam.arch == "phi3":   # Phi-3's old names
            d["rope_type"] = "longrope"
        d.setdefault("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        d.setdefault("original_max_position_embeddings", c.get("original_max_position_embeddings"))
    return out


def _linear_factor(layer_type: str, d: dict) -> float:
    f = d.get("factor")
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
        raise ConversionError(f"rope scaling 'linear' of the {layer_type} layers: factor must be "
                              f"a positive number, got {f!r} (config rope_parameters / rope_scaling)")
    return float(f)


def _scaling(rope: dict, used_types: set) -> tuple[dict | None, dict[str, float]]:
    """The model's RoPE scalings, checked: (the one llama3 / longrope scaling of every layer,
    or None; {layer type: linear factor}, 1.0 where a type is not scaled linearly)."""
    kinds = {t: rope[t]["rope_type"] for t in used_types}
    linear = {t: _linear_factor(t, rope[t]) if k == "linear" else 1.0 for t, k in kinds.items()}
    scaled = {t: k for t, k in kinds.items() if k not in ("default", "linear")}
    if not scaled:
        return None, linear
    kind = next(iter(scaled.values()))
    if kind not in ROPE_SCALINGS:
        raise ConversionError(f"unsupported feature: rope scaling of type {kind!r} (config "
                              f"rope_scaling / rope_parameters; supported: "
                              f"{', '.join(ROPE_SCALINGS)})")
    if len(scaled) != len(kinds) or any(rope[t] != rope[next(iter(scaled))] for t in scaled):
        raise ConversionError(f"unsupported feature: rope scaling {kind!r} on the "
                              f"{', '.join(sorted(scaled))} layers only (config rope_parameters; "
                              f"pyklei applies {kind!r} to every layer or none)")
    sc = rope[next(iter(scaled))]
    need = {"llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}[kind]
    for k in need:
        if sc.get(k) is None:
            raise ConversionError(f"rope scaling {kind!r} lacks {k!r} in config.json")
    return dict(sc), linear


def _layer_types(c: dict, fam, n_layer: int) -> list[str]:
    lt = c.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != n_layer:
            raise ConversionError(f"config layer_types must list {n_layer} layer types")
        for i, t in enumerate(lt):
            if t not in LAYER_TYPES:
                raise ConversionError(f"unsupported feature: layer_types[{i}] = {t!r} (pyklei "
                                      f"runs {', '.join(LAYER_TYPES)})")
        return list(lt)
    on = bool(c.get("use_sliding_window")) and c.get("sliding_window") is not None
    if fam.arch in ("qwen2", "qwen3"):
        return [SLIDING if on and i >= int(c["max_window_layers"]) else FULL for i in range(n_layer)]
    if fam.arch == "smollm3":
        return [SLIDING if on and not _uses_rope(c, n_layer)[i] else FULL for i in range(n_layer)]
    if fam.arch == "gemma3":
        every = int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6)))
        return [SLIDING if (i + 1) % every else FULL for i in range(n_layer)]
    return [FULL] * n_layer


def _uses_rope(c: dict, n_layer: int) -> list[bool]:
    """SmolLM3's no_rope_layers: 1 = the layer applies RoPE, 0 = it has none (its modeling
    reads `self.use_rope = config.no_rope_layers[layer_idx]`)."""
    nr = c.get("no_rope_layers")
    if nr is None:
        every = int(c.get("no_rope_layer_interval", 4))
        return [(i + 1) % every != 0 for i in range(n_layer)]
    if not isinstance(nr, list) or len(nr) != n_layer or any(v not in (0, 1) for v in nr):
        raise ConversionError(f"config no_rope_layers must list {n_layer} values 0 or 1")
    return [bool(v) for v in nr]


def _refuse(cond: bool, what: str) -> None:
    if cond:
        raise ConversionError(f"unsupported feature: {what}")


def hparams_from_config(cfg: dict) -> dict:
    """The checked hyperparameters of a config.json (a dict; see hparams_kv for the file's)."""
    archs = cfg.get("architectures") or []
    fam = family_of_hf(archs)
    if fam is None:
        what = ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"
        raise ConversionError(f"unsupported architecture {what}; supported: {supported()}")
    cls = next(a for a in archs if a in fam.hf_classes)
    if cfg.get("quantization_config"):
        raise ConversionError("unsupported feature: a pre-quantized checkpoint "
                              f"(quantization_config {cfg['quantization_config'].get('quant_method')!r}); "
                              "convert the original bf16/f16/f32 weights")
    c = _text_config(cfg, fam, cls)
    # Bias terms: Qwen2's q/k/v biases are its family's (always there, no config field); any
    # other bias the runtime has no place for.
    _refuse(bool(c.get("attention_bias")), "attention_bias=true (bias terms)")
    _refuse(bool(c.get("mlp_bias")), "mlp_bias=true (bias terms)")
    _refuse(c.get("attn_logit_softcapping") is not None,
            f"attn_logit_softcapping={c.get('attn_logit_softcapping')} (soft-capped attention scores)")
    _refuse(bool(c.get("use_bidirectional_attention")), "use_bidirectional_attention=true")
    act_key = "hidden_activation" if "hidden_activation" in c else "hidden_act"
    act = c.get(act_key, "silu")
    _refuse(act not in ACTIVATIONS, f"{act_key}={act!r} (supported: {', '.join(ACTIVATIONS)})")
    try:
        h = int(c["hidden_size"])
        nh = int(c["num_attention_heads"])
        hp = dict(
            family=fam, hf_class=cls,
            vocab_size=int(c["vocab_size"]),
            n_embd=h,
            n_layer=int(c["num_hidden_layers"]),
            n_ff=int(c["intermediate_size"]),
            n_head=nh,
            n_head_kv=int(c.get("num_key_value_heads") or nh),
            head_dim=int(c.get("head_dim") or h // nh),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            context_length=int(c.get("max_position_embeddings", 2048)),
            tied=bool(c.get("tie_word_embeddings", False)),
            activation=ACTIVATIONS[act],
        )
    except KeyError as e:
        raise ConversionError(f"config.json lacks {e.args[0]!r}") from None
    if hp["n_head"] % hp["n_head_kv"]:
        raise ConversionError(f"num_attention_heads={nh} is not a multiple of "
                              f"num_key_value_heads={hp['n_head_kv']}")
    if hp["head_dim"] % 2:
        raise ConversionError(f"head_dim={hp['head_dim']} must be even for RoPE")
    n_layer = hp["n_layer"]
    types = _layer_types(c, fam, n_layer)
    rope = _rope_dicts(c, fam)
    prf = {float(rope[t]["partial_rotary_factor"]) for t in set(types)}
    _refuse(len(prf) > 1, "partial_rotary_factor differs between layer types")
    rope_dim = int(hp["head_dim"] * prf.pop())
    if rope_dim % 2 or not 0 < rope_dim <= hp["head_dim"]:
        raise ConversionError(f"partial_rotary_factor gives {rope_dim} rotated dimensions of "
                              f"head_dim {hp['head_dim']}; pyklei rotates an even number, at least 2")
    hp["rope_dim"] = rope_dim
    uses_rope = _uses_rope(c, n_layer) if fam.arch == "smollm3" else [True] * n_layer
    hp["rope_scaling"], linear = _scaling(rope, {t for t, r in zip(types, uses_rope) if r})
    hp["rope_theta"] = float(rope[FULL]["rope_theta"])
    hp["layer_rope_base"] = [float(rope[t]["rope_theta"]) if r else 0.0
                             for t, r in zip(types, uses_rope)]
    hp["layer_rope_factor"] = [linear[t] if r else 1.0 for t, r in zip(types, uses_rope)]

    rule, window = WINDOW_RULE.get(fam.arch), c.get("sliding_window")
    if rule == "switched" and not c.get("use_sliding_window"):
        window = None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ConversionError(f"config sliding_window={window!r} is not a positive integer")
    hp["layer_window"] = [window if window and (rule == "every" or (rule and t == SLIDING)) else 0
                          for t in types]
    _refuse(rule is None and SLIDING in types,
            f"sliding_attention layers in a {fam.arch} config (layer_types)")

    hp["embedding_scale"] = 1.0
    hp["attention_scale"] = 0.0
    hp["logit_softcap"] = float(c.get("final_logit_softcapping") or 0.0)
    if fam.arch == "gemma3":
        # Gemma3TextScaledWordEmbedding multiplies by sqrt(hidden_size) as float32
        hp["embedding_scale"] = float(np.float32(h ** 0.5))
        scale = float(c["query_pre_attn_scalar"]) ** -0.5
        if np.float32(scale) != np.float32(hp["head_dim"] ** -0.5):
            hp["attention_scale"] = scale
    _refuse(fam.arch != "gemma3" and hp["logit_softcap"] != 0.0,
            f"final_logit_softcapping in a {fam.arch} config")

    sc = hp["rope_scaling"]
    hp["notes"] = []
    if sc and sc["rope_type"] == "longrope":
        _longrope(hp, sc)
    # The runtime holds no position at or past the file's context length, so a window that
    # long never excludes one (Phi-4-mini's 262144): the layer attends globally, without the
    # windowed attention's cost
    hp["layer_window"] = [w if w < hp["context_length"] else 0 for w in hp["layer_window"]]
    return hp


def _longrope(hp: dict, sc: dict) -> None:
    """Phi-3's LongRoPE of a config: its short factors and attention factor (given, or
    transformers' default for factor = max / original positions), as fold_longrope keeps them."""
    orig = int(sc["original_max_position_embeddings"])
    factor = sc.get("factor") or hp["context_length"] / orig
    af = sc.get("attention_factor")
    if af is None:
        af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    fold_longrope(hp, sc["short_factor"], float(af), orig, "rope scaling 'longrope': {}_factor",
                  long=sc.get("long_factor"))


def fold_longrope(hp: dict, short, attention_factor: float, orig: int, what: str,
                  long=None) -> None:
    """LongRoPE (Phi-3) from a Hugging Face config or a llama.cpp file alike. hp holds
    rope_dim, context_length and notes; this sets rope_factors (the rope_freqs tensor: the
    short factors), rope_long_factors (gguf_keys.KEY_ROPE_LONG_FACTORS), qk_rope_gain and the
    context.

    transformers rotates by the short factors while the sequence is within
    original_max_position_embeddings and by the long ones past it (switching every position's
    rotation at once); llama.cpp picks one set by the context it is given, and so does pyklei's
    runtime (a model loaded with a context past the original length takes the long factors).
    Without long factors the file's context is that original length. The attention factor,
    which multiplies cos and sin (q.k of the rotated dimensions by its square), is folded into
    q's and k's rotated rows (hf_llama.scale_rotated_rows). what: the factors' source, for the
    error, with {} for "short" or "long"."""
    n = hp["rope_dim"] // 2
    factors = {}
    for name, f in (("short", short), ("long", long)):
        if f is None:
            continue
        f = np.asarray(f, np.float64)
        if f.shape != (n,) or not np.all(f > 0) or not np.all(np.isfinite(f)):
            raise ConversionError(f"{what.format(name)} must hold {n} positive values")
        factors[name] = f.astype(np.float32)
    if not (math.isfinite(attention_factor) and attention_factor > 0):
        raise ConversionError(f"LongRoPE attention factor {attention_factor!r} is not a positive number")
    hp["rope_factors"] = factors["short"]
    hp["qk_rope_gain"] = float(attention_factor)
    if hp["context_length"] <= orig:
        return
    if "long" in factors:
        hp["rope_long_factors"] = factors["long"]
        hp["rope_long_from"] = int(orig)
        hp["notes"].append(f"LongRoPE: the short factors up to {orig} tokens of context, the long "
                           f"ones when the model is loaded with a longer one (n_ctx), up to "
                           f"{hp['context_length']}")
    else:
        hp["notes"].append(f"LongRoPE: no long factors, so the file's context is "
                           f"original_max_position_embeddings = {orig}")
        hp["context_length"] = orig


def rope_scaling_kv(rope_type: str, orig: int, long_factors=None) -> list:
    """The file's keys of a scaling held in rope_freqs (LongRoPE): informational, and the long
    factors where the file has them (the runtime reads them and the original context)."""
    kv = [(K.ROPE_SCALING_TYPE, rope_type, T.STRING, None),
          (K.ROPE_SCALING_ORIG_CTX, int(orig), T.UINT32, None)]
    if long_factors is not None:
        kv.append((K.KEY_ROPE_LONG_FACTORS, [float(x) for x in long_factors], T.ARRAY, T.FLOAT32))
    return kv


def hparams_kv(hp: dict, name: str) -> list:
    """The file's metadata of hp: Llama's keys as the family spells them, then the family
    hyperparameters (gguf_keys) where the model differs from Llama."""
    arch = hp["family"].arch

    def a(key):
        return K.arch_key(arch, key)
    kv = [
        (K.GENERAL_ARCHITECTURE, arch, T.STRING, None),
        ("general.type", "model", T.STRING, None),
        (K.GENERAL_NAME, name, T.STRING, None),
        (a(K.CONTEXT_LENGTH), hp["context_length"], T.UINT32, None),
        (a(K.EMBEDDING_LENGTH), hp["n_embd"], T.UINT32, None),
        (a(K.BLOCK_COUNT), hp["n_layer"], T.UINT32, None),
        (a(K.FEED_FORWARD_LENGTH), hp["n_ff"], T.UINT32, None),
        (a(K.HEAD_COUNT), hp["n_head"], T.UINT32, None),
        (a(K.HEAD_COUNT_KV), hp["n_head_kv"], T.UINT32, None),
        (a(K.KEY_LENGTH), hp["head_dim"], T.UINT32, None),
        (a(K.VALUE_LENGTH), hp["head_dim"], T.UINT32, None),
        (a(K.RMS_EPS), hp["rms_eps"], T.FLOAT32, None),
        (a(K.ROPE_FREQ_BASE), hp["rope_theta"], T.FLOAT32, None),
        (a(K.ROPE_DIM), hp["rope_dim"], T.UINT32, None),
        (a(K.VOCAB_SIZE), hp["vocab_size"], T.UINT32, None),
    ]
    sc = hp.get("rope_scaling")
    if sc and sc["rope_type"] == "llama3":
        kv += [
            (K.ROPE_SCALING_TYPE, "llama3", T.STRING, None),
            (K.ROPE_SCALING_FACTOR, float(sc["factor"]), T.FLOAT32, None),
            (K.ROPE_SCALING_LOW, float(sc["low_freq_factor"]), T.FLOAT32, None),
            (K.ROPE_SCALING_HIGH, float(sc["high_freq_factor"]), T.FLOAT32, None),
            (K.ROPE_SCALING_ORIG_CTX, int(sc["original_max_position_embeddings"]), T.UINT32, None),
        ]
    elif sc:
        kv += rope_scaling_kv(sc["rope_type"], sc["original_max_position_embeddings"],
                              hp.get("rope_long_factors"))
    if any(hp["layer_window"]):
        kv.append((K.KEY_LAYER_WINDOW, hp["layer_window"], T.ARRAY, T.UINT32))
    if any(b != hp["rope_theta"] for b in hp["layer_rope_base"]):
        kv.append((K.KEY_LAYER_ROPE_BASE, hp["layer_rope_base"], T.ARRAY, T.FLOAT32))
    factors = hp["layer_rope_factor"]
    if any(f != 1.0 for f in factors):
        kv.append((K.KEY_LAYER_ROPE_FACTOR, factors, T.ARRAY, T.FLOAT32))
        linear = {f for f in factors if f != 1.0}
        if len(linear) == 1:    # llama.cpp's keys hold one factor
            kv += [(a(K.LLAMACPP_ROPE_SCALING_TYPE), "linear", T.STRING, None),
                   (a(K.LLAMACPP_ROPE_SCALING_FACTOR), linear.pop(), T.FLOAT32, None)]
    if hp["activation"] != "silu":
        kv.append((K.KEY_ACTIVATION, hp["activation"], T.STRING, None))
    for key, field in ((K.KEY_EMBEDDING_SCALE, "embedding_scale"),
                       (K.KEY_ATTENTION_SCALE, "attention_scale"),
                       (K.KEY_LOGIT_SOFTCAP, "logit_softcap")):
        if hp[field] and not (field == "embedding_scale" and hp[field] == 1.0):
            kv.append((key, hp[field], T.FLOAT32, None))
    return kv
