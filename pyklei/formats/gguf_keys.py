"""Names shared by the converter and the loader: pyklei's GGUF keys (the tensor names come from
llama_tensors.py, the table of the Llama block, and are re-exported here).

docs/FORMAT.md ("GGUF container" and "Converter") is the specification; this module is the
single place the strings live, so the writer and the reader cannot drift apart.
"""
from __future__ import annotations

from . import llama_tensors as L
from .llama_tensors import OUTPUT, OUTPUT_NORM, ROPE_FREQS, TOKEN_EMBD, blk  # noqa: F401  (re-exported)

ARCH = "llama"
FORMAT_VERSION = 1
ALIGNMENT = 64

# pyklei's own keys
KEY_FORMAT_VERSION = "pyklei.format_version"
KEY_BLOCK_SIZE = "pyklei.qsi4c32.block_size"
KEY_FORMAT_PREFIX = "pyklei.format."          # + tensor name -> a name of registry.WEIGHT_FORMATS
KEY_EOS_IDS = "pyklei.eos_token_ids"          # every id that ends generation (array uint32)
KEY_SOURCE = "pyklei.converter.source"        # "hf" | "gguf"
KEY_CONVERTER_VERSION = "pyklei.converter.version"
KEY_WEIGHT_METHOD = "pyklei.converter.weight_method"   # "gptq"; absent: per-block rounding
# Rotations (pyklei.formats.rotation, docs/FORMAT.md "Rotations"): what the converter rotated
# (a comma list: "residual,value_heads,ffn_down"), and the online ones as f32 tensors
# <prefix>.signs [n] and <prefix>.mix [m, m]: rot.ffn_down (before down_proj, every layer) and
# rot.output (around the final norm's gain, tied embeddings only). Files without the key run
# unrotated, as every file before it.
KEY_ROTATION = "pyklei.rotation"
KEY_ROTATION_SEED = "pyklei.rotation.seed"
ROT_FFN_DOWN = "rot.ffn_down"
ROT_OUTPUT = "rot.output"

SCALES_SUFFIX = ".scales"

# llama.cpp metadata keys (a subset of gguf.Keys, spelled out so readers need no gguf import)
GENERAL_ARCHITECTURE = "general.architecture"
GENERAL_ALIGNMENT = "general.alignment"
GENERAL_NAME = "general.name"


def llama_key(suffix: str) -> str:
    return f"{ARCH}.{suffix}"


def arch_key(arch: str, key: str) -> str:
    """A Llama key (CONTEXT_LENGTH, ...) as a file of family `arch` spells it."""
    return arch + key[len(ARCH):] if key.startswith(ARCH + ".") else key


CONTEXT_LENGTH = llama_key("context_length")
EMBEDDING_LENGTH = llama_key("embedding_length")
BLOCK_COUNT = llama_key("block_count")
FEED_FORWARD_LENGTH = llama_key("feed_forward_length")
HEAD_COUNT = llama_key("attention.head_count")
HEAD_COUNT_KV = llama_key("attention.head_count_kv")
KEY_LENGTH = llama_key("attention.key_length")
VALUE_LENGTH = llama_key("attention.value_length")
RMS_EPS = llama_key("attention.layer_norm_rms_epsilon")
ROPE_FREQ_BASE = llama_key("rope.freq_base")
ROPE_DIM = llama_key("rope.dimension_count")
VOCAB_SIZE = llama_key("vocab_size")
# How an embedding model pools its hidden states into one vector (llama.cpp's key, its values:
# gguf-py's PoolingType). Written at conversion where the checkpoint declares it (a
# sentence-transformers 1_Pooling/config.json, or a llama.cpp file's own key); absent: "mean"
# (pyklei.runtime.embedding).
POOLING_TYPE = llama_key("pooling_type")
POOLING_TYPES = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}

# Tensor names (llama.cpp's): the Llama tensor table (llama_tensors.py) is their one place;
# the names and part tuples are here too, for the code that spells keys and names together.
BLOCK_LINEARS = tuple(s.part for s in L.BLOCK_LINEARS)
BLOCK_NORMS = tuple(s.part for s in L.BLOCK_NORMS)


def scales_name(name: str) -> str:
    return name + SCALES_SUFFIX


def format_key(name: str) -> str:
    return KEY_FORMAT_PREFIX + name


def rot_signs(prefix: str) -> str:
    return prefix + ".signs"


def rot_mix(prefix: str) -> str:
    return prefix + ".mix"

# Llama 3 RoPE scaling, informational: the runtime applies it through the rope_freqs tensor
# (pair i of a head rotates by pos * theta**(-2i/d) / rope_freqs[i]), as llama.cpp does.
ROPE_SCALING_TYPE = "pyklei.rope.scaling.type"                  # "llama3"
ROPE_SCALING_FACTOR = "pyklei.rope.scaling.factor"
ROPE_SCALING_LOW = "pyklei.rope.scaling.low_freq_factor"
ROPE_SCALING_HIGH = "pyklei.rope.scaling.high_freq_factor"
ROPE_SCALING_ORIG_CTX = "pyklei.rope.scaling.original_context_length"

# Family hyperparameters (families.py): written only where a model differs from Llama, so a
# Llama file has none of them. Per layer, arrays of block_count values: the sliding window
# (0: the layer attends every position), the RoPE base (0: the layer has no RoPE) and the
# linear RoPE scaling factor (the layer's frequencies divided by it; 1: unscaled).
KEY_LAYER_WINDOW = "pyklei.attention.layer_sliding_window"     # array uint32
KEY_LAYER_ROPE_BASE = "pyklei.rope.layer_freq_base"             # array float32
KEY_LAYER_ROPE_FACTOR = "pyklei.rope.layer_scaling_factor"      # array float32
# llama.cpp's spelling of linear RoPE scaling (its rope.scaling.type "linear" and factor; it
# scales every layer, Gemma 3's global layers only). A file with linear scaling carries them
# too, so llama.cpp's tools read the scaling the layers get; the loader checks they agree with
# KEY_LAYER_ROPE_FACTOR, the one the runtime follows.
LLAMACPP_ROPE_SCALING_TYPE = llama_key("rope.scaling.type")
LLAMACPP_ROPE_SCALING_FACTOR = llama_key("rope.scaling.factor")
KEY_ACTIVATION = "pyklei.ffn.activation"     # the MLP's gate: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
KEY_EMBEDDING_SCALE = "pyklei.embedding_scale"       # token embeddings times this (Gemma: sqrt(n_embd))
KEY_ATTENTION_SCALE = "pyklei.attention.scale"       # scores times this; absent: 1/sqrt(head_dim)
KEY_LOGIT_SOFTCAP = "pyklei.final_logit_softcapping"  # logits = c tanh(logits / c); absent: none
# LongRoPE (Phi-3): rope_freqs holds the short factors; these (array float32, rope_dim / 2) are
# the divisors of a context longer than ROPE_SCALING_ORIG_CTX, which the runtime takes in
# place of rope_freqs when a model is loaded with such a context (as llama.cpp picks its
# rope_factors_long by the context it is given)
KEY_ROPE_LONG_FACTORS = "pyklei.rope.long_factors"
ACTIVATIONS = ("silu", "gelu_tanh")

# SentencePiece tokenizers: the original tokenizer.model bytes (array uint8), next to
# llama.cpp's tokens/scores/token_type arrays.
KEY_SPM_MODEL = "pyklei.tokenizer.sentencepiece_model"

# Keys a pyklei file carries for people and tools (`pyklei info`, llama.cpp's gguf-dump) that
# the loader does not need: tests/converters/test_convert.py checks every other key written is read.
INFORMATIONAL = frozenset({
    GENERAL_NAME, "general.type", KEY_SOURCE, KEY_CONVERTER_VERSION, GENERAL_ALIGNMENT,
    ROPE_SCALING_TYPE, ROPE_SCALING_FACTOR, ROPE_SCALING_LOW, ROPE_SCALING_HIGH,
    ROPE_SCALING_ORIG_CTX, KEY_ROTATION_SEED,
    KEY_WEIGHT_METHOD,
})

# What the tokenizer rebuilds a SentencePiece model from when a file has no KEY_SPM_MODEL
# (llama.cpp's files); with the original bytes present they are not read.
SPM_FALLBACK = frozenset({"tokenizer.ggml.scores", "tokenizer.ggml.add_space_prefix"})

# llama.cpp / GGUF token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
