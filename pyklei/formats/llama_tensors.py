"""The Llama block's tensors, in one table: what each is called (GGUF and Hugging Face), its
shape from the hyperparameters, what it is, which RMSNorm feeds it and which activation it
reads, and the field of the C model that holds it.

    for name, spec, layer in for_each_tensor(hp):      # hp: HParams, or anything with its dims
        spec.shape(hp), spec.kind, spec.hf_name(layer), spec.norm, spec.field

The reader's checks (model_file), the importers (pyklei/converters/hf_llama.py,
llamacpp_gguf.py), the exporter the tests use (pyklei_dev/gguf_to_hf.py), the rotation and the
converter core, the imatrix, `pyklei info` and the runtime's weight hand-over (pyklei/model.py
-> _ext.pyx) all walk this table, as gemma.cpp's loader and exporter walk its tensor registry:
adding a tensor is one row here (and, for a tensor the C forward pass reads, one field of
pk_llama.h). The names are llama.cpp's; docs/FORMAT.md ("GGUF container") is the specification.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

# Kinds of tensor (SourceTensor.kind): what the converter stores one as (core.choose_format)
# and how the rotation transforms it.
EMBEDDING = "embedding"            # token_embd: read by rows; the lm_head too when tied
NORM = "norm"                      # an RMSNorm gain, always f32
LINEAR = "linear"                  # a block's weight matrix, 4 bits by default
OUTPUT = "output"                  # the untied lm_head
ROPE_FREQS_KIND = "rope_freqs"     # llama3 RoPE frequency divisors, f32
HEAD_NORM = "head_norm"            # a per-head RMSNorm gain of q or k [head_dim], f32
BIAS = "bias"                      # a linear's bias, f32

# Features: tensors some families have beyond Llama's (families.py says which family has
# which; TensorSpec.feature names the one a row belongs to).
QKV_BIAS = "qkv_bias"              # q/k/v projections with biases (Qwen2)
QK_NORM = "qk_norm"                # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
POST_NORMS = "post_norms"          # RMSNorm of the attention and MLP outputs (Gemma 3)
FEATURES = (QKV_BIAS, QK_NORM, POST_NORMS)


class LlamaDims(Protocol):
    """What the tensor list and the shapes depend on: HParams (model_file) has it; an importer
    that has no HParams yet builds a Dims."""
    vocab_size: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    tied: bool                 # token_embd is also the lm_head: no output.weight
    has_rope_freqs: bool       # llama3 RoPE scaling factors in rope_freqs.weight
    features: frozenset        # of FEATURES: the family's tensors beyond Llama's


@dataclass(frozen=True)
class Dims:
    """LlamaDims for a source read before its HParams exist (the importers, gguf_to_hf)."""
    vocab_size: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    tied: bool = False
    has_rope_freqs: bool = False
    features: frozenset = frozenset()


@dataclass(frozen=True)
class TensorSpec:
    part: str                      # GGUF name: "token_embd" or, in block i, blk.{i}.<part>.weight
    hf: str | None                 # Hugging Face name (block i: model.layers.{i}.<hf>.weight); None: none
    kind: str                      # EMBEDDING | NORM | LINEAR | OUTPUT | ROPE_FREQS_KIND
    shape: Callable[[LlamaDims], tuple[int, ...]]   # logical numpy shape: (N, K) or (n,)
    per_layer: bool
    # The RMSNorm (a part of the same block, or "output_norm") whose output this weight reads:
    # its gain scales the weight's input channels (the rotation folds it into the weight,
    # --norm-weighting weighs by it). None: the input is not a norm's output.
    norm: str | None = None
    # The activation a linear reads, named as the C forward pass's statistics sections
    # (pk_llama.h, pk_llama_stat_names): the imatrix gives it that section's statistics, and
    # GPTQ quantizes the linears that read one activation over one Hessian.
    input: str | None = None
    # The field of pk_llama_layer (pyklei_ext/model/pk_llama.h) that holds it, for block tensors.
    field: str | None = None
    short: str | None = None       # the short name `pyklei info` shows for a block linear
    heads: str | None = None       # q/k: the dims attribute counting the heads whose rows HF
                                   # stores in rotate-half order (hf_llama.permute_qk)
    optional: str | None = None    # "untied": only without tied embeddings; "rope_freqs": llama3
    feature: str | None = None     # of FEATURES: only in a family that has it
    suffix: str = "weight"         # "bias" for a linear's bias (same part as its weight)

    @property
    def key(self) -> str:
        """The row's name in the table: the part, "<part>.bias" for a bias."""
        return self.part if self.suffix == "weight" else f"{self.part}.{self.suffix}"

    def name(self, layer: int | None = None) -> str:
        """The GGUF tensor name (block tensors need their layer)."""
        return blk(layer, self.part, self.suffix) if self.per_layer else f"{self.part}.{self.suffix}"

    def hf_name(self, layer: int | None = None, hf: str | None = None) -> str | None:
        """The Hugging Face name; hf: the family's own name for the part (families.py)."""
        hf = hf or self.hf
        if hf is None:
            return None
        return f"model.layers.{layer}.{hf}.{self.suffix}" if self.per_layer else f"{hf}.{self.suffix}"

    def head_count(self, dims: LlamaDims) -> int:
        """q/k (weights, biases, head norms): the heads whose rows are permuted between HF and
        llama.cpp order ("one": a head norm's single head); else 0."""
        if not self.heads:
            return 0
        return 1 if self.heads == "one" else getattr(dims, self.heads)


def _q(d): return (d.n_head * d.head_dim, d.n_embd)
def _kv(d): return (d.n_head_kv * d.head_dim, d.n_embd)
def _vocab(d): return (d.vocab_size, d.n_embd)
def _embd(d): return (d.n_embd,)
def _head(d): return (d.head_dim,)


# Order: the order a converted file holds them (rope_freqs first, then the forward pass's).
GLOBAL_HEAD = (
    TensorSpec("rope_freqs", None, ROPE_FREQS_KIND,
               lambda d: ((getattr(d, "rope_dim", 0) or d.head_dim) // 2,), False,
               optional="rope_freqs"),
    TensorSpec("token_embd", "model.embed_tokens", EMBEDDING, _vocab, False),
)
BLOCK = (
    TensorSpec("attn_norm", "input_layernorm", NORM, _embd, True, field="attn_norm"),
    TensorSpec("attn_q", "self_attn.q_proj", LINEAR, _q, True, norm="attn_norm",
               input="attn_in", field="wq", short="q", heads="n_head"),
    TensorSpec("attn_k", "self_attn.k_proj", LINEAR, _kv, True, norm="attn_norm",
               input="attn_in", field="wk", short="k", heads="n_head_kv"),
    TensorSpec("attn_v", "self_attn.v_proj", LINEAR, _kv, True, norm="attn_norm",
               input="attn_in", field="wv", short="v"),
    TensorSpec("attn_q", "self_attn.q_proj", BIAS, lambda d: (d.n_head * d.head_dim,), True,
               field="bq", heads="n_head", feature=QKV_BIAS, suffix="bias"),
    TensorSpec("attn_k", "self_attn.k_proj", BIAS, lambda d: (d.n_head_kv * d.head_dim,), True,
               field="bk", heads="n_head_kv", feature=QKV_BIAS, suffix="bias"),
    TensorSpec("attn_v", "self_attn.v_proj", BIAS, lambda d: (d.n_head_kv * d.head_dim,), True,
               field="bv", feature=QKV_BIAS, suffix="bias"),
    TensorSpec("attn_q_norm", "self_attn.q_norm", HEAD_NORM, _head, True, field="q_norm",
               heads="one", feature=QK_NORM),
    TensorSpec("attn_k_norm", "self_attn.k_norm", HEAD_NORM, _head, True, field="k_norm",
               heads="one", feature=QK_NORM),
    TensorSpec("attn_output", "self_attn.o_proj", LINEAR,
               lambda d: (d.n_embd, d.n_head * d.head_dim), True,
               input="attn_out", field="wo", short="o"),
    TensorSpec("post_attention_norm", None, NORM, _embd, True, field="post_attn_norm",
               feature=POST_NORMS),
    TensorSpec("ffn_norm", "post_attention_layernorm", NORM, _embd, True, field="ffn_norm"),
    TensorSpec("ffn_gate", "mlp.gate_proj", LINEAR, lambda d: (d.n_ff, d.n_embd), True,
               norm="ffn_norm", input="ffn_in", field="w_gate", short="gate"),
    TensorSpec("ffn_up", "mlp.up_proj", LINEAR, lambda d: (d.n_ff, d.n_embd), True,
               norm="ffn_norm", input="ffn_in", field="w_up", short="up"),
    TensorSpec("ffn_down", "mlp.down_proj", LINEAR, lambda d: (d.n_embd, d.n_ff), True,
               input="down_in", field="w_down", short="down"),
    TensorSpec("post_ffw_norm", None, NORM, _embd, True, field="post_ffn_norm",
               feature=POST_NORMS),
)
GLOBAL_TAIL = (
    TensorSpec("output_norm", "model.norm", NORM, _embd, False),
    # the lm_head; a tied model has none and reads token_embd in its place (input and norm
    # alike: ModelFile.output)
    TensorSpec("output", "lm_head", OUTPUT, _vocab, False, norm="output_norm",
               input="lm_head_in", optional="untied"),
)
TENSORS = GLOBAL_HEAD + BLOCK + GLOBAL_TAIL
BY_PART = {s.key: s for s in TENSORS}

BLOCK_LINEARS = tuple(s for s in BLOCK if s.kind == LINEAR)
# the input norms every family has (attn_norm, ffn_norm): the gains the linears read
BLOCK_NORMS = tuple(s for s in BLOCK if s.kind == NORM and s.feature is None)
# every other f32 vector of a block a family may have, with the C field that holds it
BLOCK_VECTORS = tuple(s for s in BLOCK if s.kind in (NORM, HEAD_NORM, BIAS) and s.feature is not None)

# Global tensor names
TOKEN_EMBD = BY_PART["token_embd"].name()
OUTPUT = BY_PART["output"].name()
OUTPUT_NORM = BY_PART["output_norm"].name()
ROPE_FREQS = BY_PART["rope_freqs"].name()


def blk(i: int, part: str, suffix: str = "weight") -> str:
    """Tensor name of `part` (e.g. "attn_q") in block i: "blk.{i}.attn_q.weight"."""
    return f"blk.{i}.{part}.{suffix}"


def for_each_tensor(dims: LlamaDims) -> Iterator[tuple[str, TensorSpec, int | None]]:
    """Every tensor of a Llama model with these dims, in file order: (GGUF name, spec, layer or
    None)."""
    present = {"untied": not dims.tied, "rope_freqs": dims.has_rope_freqs, None: True}
    features = dims.features
    for s in GLOBAL_HEAD:
        if present[s.optional]:
            yield s.name(), s, None
    for i in range(dims.n_layer):
        for s in BLOCK:
            if s.feature is None or s.feature in features:
                yield s.name(i), s, i
    for s in GLOBAL_TAIL:
        if present[s.optional]:
            yield s.name(), s, None


def parse_name(name: str) -> tuple[TensorSpec, int | None] | None:
    """The spec and layer of a GGUF tensor name of the table, or None (rot.*, scales, other)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] in ("weight", "bias") and parts[1].isdigit():
        s = BY_PART.get(parts[2] if parts[3] == "weight" else f"{parts[2]}.bias")
        return (s, int(parts[1])) if s is not None and s.per_layer else None
    if len(parts) == 2 and parts[1] == "weight":
        s = BY_PART.get(parts[0])
        return (s, None) if s is not None and not s.per_layer else None
    return None


def layer_of(name: str) -> int | None:
    """The block of a block tensor of the table ("blk.3.attn_q.weight" -> 3), else None."""
    found = parse_name(name)
    return found[1] if found else None


def hf_name_of(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None if it has none."""
    found = parse_name(name)
    return found[0].hf_name(found[1]) if found else None


def norm_of(name: str) -> str | None:
    """GGUF name of the RMSNorm whose output the weight `name` reads, or None."""
    found = parse_name(name)
    if found is None or found[0].norm is None:
        return None
    spec, layer = found
    return BY_PART[spec.norm].name(layer)
