"""Rotate a model before quantizing it (QuaRot-style, no training): a ModelSource -> a
ModelSource that computes the same function with weights that quantize better.

Three rotations, all orthogonal (pyklei.formats.rotation), all exact in real arithmetic:

1. The residual stream, by Q_r [n_embd]. RMSNorm commutes with an orthogonal matrix once its
   gain is taken out, so each norm's gain is folded into the linears that read it (q/k/v,
   gate/up, an untied lm_head) and the norm tensors become ones. Then every weight that reads
   the stream becomes W Q_r, every weight that writes it (o_proj, down_proj) Q_r^T W, and the
   embedding rows E Q_r. A tied embedding is stored once, rotated, and also serves as lm_head:
   the final norm's gain cannot be folded into a shared table, so the file keeps it and the
   runtime brings the normalised row back with Q_r^T, applies the gain and rotates again
   (tensors rot.output.*).
2. Each value head, by Q_h [head_dim]: v_proj's rows per head and o_proj's columns per head
   (GQA: the query heads of a group read the same rotated value head). Folded, free at run time.
3. The input of down_proj, by Q_f [n_ff]: down_proj becomes W Q_f and the runtime rotates the
   SwiGLU output online (tensors rot.ffn_down.*), so the widest activation, whose outliers
   per-row int8 handles worst, reaches the kernels spread out.

Rows of the residual rotation are mixed across o_proj's and down_proj's output rows, so those
tensors are read whole (their size: n_embd x n_embd and n_embd x n_ff floats).

Families (pyklei/formats/families.py): q/k biases and q/k head norms are untouched (the
rotations act on the stream the projections read, not on q or k); a v bias is rotated with its
head (Q_h^T b). A family with post norms (Gemma 3: the attention's and the MLP's outputs are
normalised, with a gain, before the residual add) keeps its residual stream unrotated: those
gains do not commute with Q_r, and folding the input norms' gains into the weights, which
rotation 1 needs, costs that family precision: Gemma 3 270M's input gains span 0.1 to 145, and
8-bit rows of W g Q_r left its residual stream 39% off after 18 layers at 8 bits (2% without).
Rotations 2 and 3 apply to it as to Llama.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from gguf import GGUFValueType as T

from pyklei.formats import gguf_keys as K
from pyklei.formats import llama_tensors as L
from pyklei.formats.rotation import Rotation, make_rotation

from .core import ModelSource, SourceTensor, source_hparams
from .errors import ConversionError

ROTATION_KINDS = "residual,value_heads,ffn_down"   # KEY_ROTATION's value: what was rotated
NO_RESIDUAL = "value_heads,ffn_down"               # ... for a family with post norms


def _columns(x: np.ndarray, rot: Rotation, transpose: bool) -> np.ndarray:
    """Q^T x (transpose=True) on the rows of x, i.e. (x^T Q)^T."""
    return rot.apply(x.T).T if transpose else rot.apply_t(x.T).T


def rotate_source(src: ModelSource, seed: int = 0) -> ModelSource:
    """The rotated twin of src (see the module doc). Sets `ffn_down_input` on the result: the
    online transform the forward pass applies before down_proj (x -> x @ Q_f)."""
    if getattr(src, "ffn_down_input", None) is not None:
        raise ConversionError("the source is rotated already")
    hp = source_hparams(src)
    n_embd, n_ff, head_dim = hp.n_embd, hp.n_ff, hp.head_dim
    by_name = {t.name: t for t in src.tensors}
    residual = L.POST_NORMS not in hp.features    # see the module doc
    tied = K.OUTPUT not in by_name
    rng = np.random.default_rng(seed)
    try:
        q_r, q_f, q_h = (make_rotation(n_embd, rng), make_rotation(n_ff, rng),
                         make_rotation(head_dim, rng))
    except ValueError as e:
        raise ConversionError(f"cannot rotate this model: {e}") from None

    def gain_of(t: SourceTensor) -> np.ndarray | None:
        """The gain of the norm in front of linear t, or None."""
        norm = L.norm_of(t.name)
        return by_name[norm].read(0, n_embd) if norm else None

    def transform(t: SourceTensor):
        found = L.parse_name(t.name)
        part = found[0].part if found else t.name
        if t.kind == "head_norm" or (t.kind == "bias" and part != "attn_v"):
            return t.read, t.whole                       # q and k are not rotated
        if t.kind == "bias":   # v's bias per head: Q_h^T b_h
            def read_bv(r0, r1):
                b = t.read(0, t.shape[0]).reshape(-1, head_dim, 1)
                return np.stack([_columns(h, q_h, True) for h in b]).reshape(t.shape)[r0:r1]
            return read_bv, True
        if not residual:
            return transform_heads_ffn(t, part)
        if t.kind == "norm":
            if t.name == K.OUTPUT_NORM and tied:
                return t.read, False                     # kept: the runtime applies it
            return (lambda r0, r1: np.ones(r1 - r0, np.float32)), False
        if t.kind == "embedding":
            return (lambda r0, r1: q_r.apply(t.read(r0, r1))), t.whole
        if part == "attn_v":   # rows per head: Q_h^T W_v,h
            g = gain_of(t)

            def read_v(r0, r1):
                w = q_r.apply(t.read(0, t.shape[0]) * g)
                heads = w.reshape(-1, head_dim, n_embd)
                return np.stack([_columns(h, q_h, True) for h in heads]).reshape(w.shape)[r0:r1]
            return read_v, True
        if L.norm_of(t.name):   # reads a norm's output (q, k, gate, up, lm_head): W g Q_r
            g = gain_of(t)
            return (lambda r0, r1: q_r.apply(t.read(r0, r1) * g)), t.whole
        if part == "attn_output":   # Q_r^T W_o, columns per head W_o,h Q_h
            def read_o(r0, r1):
                w = t.read(0, t.shape[0])
                w = q_h.apply(w.reshape(n_embd, -1, head_dim)).reshape(w.shape)
                return _columns(w, q_r, True)[r0:r1]
            return read_o, True
        if part == "ffn_down":      # Q_r^T W_d Q_f
            def read_down(r0, r1):
                return _columns(q_f.apply(t.read(0, t.shape[0])), q_r, True)[r0:r1]
            return read_down, True
        if t.kind == "rope_freqs":
            return t.read, t.whole
        raise ConversionError(f"cannot rotate tensor {t.name} (kind {t.kind})")

    def transform_heads_ffn(t: SourceTensor, part: str):
        """Rotations 2 and 3 only (no residual rotation): norms keep their gains."""
        if part == "attn_v":   # Q_h^T W_v,h
            def read_v(r0, r1):
                heads = t.read(0, t.shape[0]).reshape(-1, head_dim, n_embd)
                return np.stack([_columns(h, q_h, True) for h in heads]).reshape(t.shape)[r0:r1]
            return read_v, True
        if part == "attn_output":   # W_o,h Q_h
            def read_o(r0, r1):
                w = t.read(r0, r1)
                return q_h.apply(w.reshape(r1 - r0, -1, head_dim)).reshape(w.shape)
            return read_o, t.whole
        if part == "ffn_down":      # W_d Q_f
            return (lambda r0, r1: q_f.apply(t.read(r0, r1))), t.whole
        return t.read, t.whole

    tensors = []
    for t in src.tensors:
        read, whole = transform(t)
        tensors.append(dataclasses.replace(t, read=read, whole=whole))
    extra = [(K.ROT_FFN_DOWN, q_f)] + ([(K.ROT_OUTPUT, q_r)] if tied and residual else [])
    for prefix, rot in extra:
        for name, arr in ((K.rot_signs(prefix), rot.signs), (K.rot_mix(prefix), rot.mix)):
            tensors.append(SourceTensor(name, arr.shape, "rotation",
                                        lambda r0, r1, a=arr: a[r0:r1], name))
    kv = src.kv + [(K.KEY_ROTATION, ROTATION_KINDS if residual else NO_RESIDUAL, T.STRING, None),
                   (K.KEY_ROTATION_SEED, int(seed), T.UINT32, None)]
    return ModelSource(kv=kv, tensors=tensors, description=src.description, close=src.close,
                       after_tensor=src.after_tensor, ffn_down_input=q_f.apply,
                       notes=src.notes + [f"weights rotated ({'residual stream, ' if residual else ''}"
                                          "value heads, down_proj input) before quantization"])
