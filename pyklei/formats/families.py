"""The model families pyklei runs, one description each: what a file of the family holds beyond
the Llama block (llama_tensors.py, the one tensor table every family shares), what Hugging Face
calls its parts, and how llama.cpp stores its q/k rows.

    fam = family("gemma3")                 # or family_of_hf("Gemma3ForCausalLM")
    fam.features, fam.hf_part("ffn_norm"), fam.gguf_neox

A family's per-layer behaviour (sliding windows, RoPE bases, layers without RoPE) and its
scalars (embedding and attention scales, the activation, logit soft-capping) are not here: a
converter reads them from the checkpoint and writes them into the file as the keys of
gguf_keys ("Family hyperparameters"), so the reader and the C forward pass follow the file,
never a rule of the family. Adding a family is one entry here, its checkpoint reading in the
converters, and the C features it needs (pyklei_ext/model/pk_llama.h).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .llama_tensors import POST_NORMS, QK_NORM, QKV_BIAS


@dataclass(frozen=True)
class Family:
    arch: str                          # general.architecture of a pyklei file (llama.cpp's name)
    hf_classes: tuple[str, ...]        # Hugging Face `architectures` it converts from
    features: frozenset = frozenset()  # of llama_tensors.FEATURES
    # Hugging Face names of block parts where the family's differ from Llama's
    hf_names: dict = field(default_factory=dict)
    # llama.cpp keeps q/k rows in Hugging Face's rotate-half ("NeoX") order for this family; it
    # permutes only its Llama-derived families' (LlamaModel in its converter: Llama, SmolLM3)
    # into interleaved pairs, which pyklei's RoPE rotates
    gguf_neox: bool = True
    # tensors llama.cpp's files of the family hold fused: {its block part: the parts it holds,
    # as consecutive row blocks}; an importer splits one when its rows are the parts' sum
    gguf_fused: dict = field(default_factory=dict)
    # Hugging Face checkpoints of a class that nests the language model (Gemma 3's image-text
    # model): {class: (the config.json key of its text config, ((prefix of the "model." names,
    # prefix of "lm_head"), ...) tried in order)}. transformers 4 and 5 save
    # language_model.model.*; transformers 5's module tree says model.language_model.*. The
    # checkpoint's other tensors (the vision tower) are not the text model's and are skipped.
    hf_nested: dict = field(default_factory=dict)
    # added to a Hugging Face checkpoint's RMSNorm gains (block, q/k and final norms): Gemma
    # computes x * (1 + w), and a pyklei file stores the gain as used
    hf_norm_offset: float = 0.0

    def hf_part(self, part: str, default: str | None) -> str | None:
        """The Hugging Face name of a block part (without model.layers.{i}. and .weight).
        Parts that share one name are row blocks of that fused tensor, in the table's order
        (Phi-3's qkv_proj = [q; k; v], gate_up_proj = [gate; up])."""
        return self.hf_names.get(part, default)


FAMILIES = {f.arch: f for f in (
    Family("llama", ("LlamaForCausalLM",), gguf_neox=False),
    Family("mistral", ("MistralForCausalLM",), gguf_neox=False),
    Family("qwen2", ("Qwen2ForCausalLM",), frozenset({QKV_BIAS})),
    Family("qwen3", ("Qwen3ForCausalLM",), frozenset({QK_NORM})),
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
           frozenset({QK_NORM, POST_NORMS}),
           # Gemma's post_attention_layernorm normalises the attention's output, not the MLP's
           # input as Llama's does
           hf_names={"ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"},
           hf_nested={"Gemma3ForConditionalGeneration": (
               "text_config", (("language_model.model.", "language_model."),
                               ("model.language_model.", "")))},
           hf_norm_offset=1.0),
    Family("smollm3", ("SmolLM3ForCausalLM",), gguf_neox=False),
    Family("phi3", ("Phi3ForCausalLM",),
           # fused projections, split at conversion (gate before up: transformers' Phi3MLP
           # chunks gate_up_proj's output into gate, up)
           hf_names={"attn_q": "self_attn.qkv_proj", "attn_k": "self_attn.qkv_proj",
                     "attn_v": "self_attn.qkv_proj", "ffn_gate": "mlp.gate_up_proj",
                     "ffn_up": "mlp.gate_up_proj"},
           # llama.cpp's phi3: attn_qkv = [q; k; v]; ffn_up = [gate; up] (its fused SwiGLU
           # activates the first half, src/models/phi3.cpp)
           gguf_fused={"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")}),
)}


def supported() -> str:
    """The supported Hugging Face classes, for an error message."""
    return ", ".join(c for f in FAMILIES.values() for c in f.hf_classes)


def family(arch: str) -> Family | None:
    return FAMILIES.get(arch)


def family_of_hf(classes) -> Family | None:
    """The family of a config.json's `architectures` list, or None."""
    for f in FAMILIES.values():
        if any(c in f.hf_classes for c in classes or ()):
            return f
    return None
