"""The calibration pass of GPTQ: calibration tokens through a ModelSource's float weights,
one decoder layer at a time, in numpy (converters import no runtime).

    src = gptq_source(hf_source(hf_dir), tokens, group_size=32)
    write_model(src, "m.gguf")     # each linear's `quantized` runs GPTQ as the writer gets there

The residual stream of every calibration token, x [T = n_seq * seq_len, n_embd] float32, is
held; layer i then

1. normalises x (attn_norm), gathers H = xn^T xn, GPTQs q/k/v, computes q/k/v with the
   quantized weights, the family's head features (q/k/v biases, per-head q/k RMSNorm), RoPE
   at the layer's base (none where it is 0; the first rope_dim dims of each head), causal GQA
   attention per sequence (the layer's sliding window, the file's attention scale);
2. gathers the attention output's H, GPTQs o_proj, adds its output to x (through the
   post-attention norm where the family has one);
3. normalises x (ffn_norm), gathers H, GPTQs gate/up, computes SwiGLU or GeGLU (and the
   source's ffn_down_input transform, for rotated sources);
4. gathers that H (n_ff x n_ff), GPTQs down_proj, adds its output to x (through the post-MLP
   norm where the family has one).

The embedding rows are scaled by the file's embedding scale first. So each matrix's Hessian is
of its inputs in the partly quantized model it will run in ("sequential" GPTQ). Memory: one
layer's weights, the largest H, the stream and the gated activations [T, n_ff]. The operations
follow pyklei's C forward pass (pyklei_ext/model/pk_llama.c, ops/pk_rmsnorm_swiglu.c,
ops/pk_rope.c) feature by feature: RMSNorm with a float64 sum, RoPE on llama.cpp's interleaved
pairs (the source's q/k rows are in GGUF order), angles pos * inv_freq in float32.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGUFValueType as T

from pyklei.formats import gguf_keys as K
from pyklei.formats import llama_tensors as L
from pyklei.formats import qsi6c32
from pyklei.formats.model_file import HParams

from . import gptq
from .core import ModelSource, SourceTensor, source_hparams
from .errors import ConversionError

MIN_CALIBRATION_TOKENS = 256     # fewer: the Hessians are too poor to be worth it
#: How much calibration text every calibrated path reads by default, and in windows of how many
#: tokens: GPTQ here, the importance matrix and its conversion (pyklei.calibration), the CLI's
#: --calib-tokens and `pyklei imatrix`. The converters are the lowest floor that calibrates.
DEFAULT_CALIBRATION_TOKENS = 8192
DEFAULT_SEQ_LEN = 512
METHOD_GPTQ = "gptq"


# ---- the operations of the forward pass (x: [T, d] float32) ----------------------------------

def rmsnorm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """x [T, d] -> x / rms(x) * gain, the sum of squares in float64 as pk_rmsnorm."""
    ss = np.einsum("td,td->t", x.astype(np.float64), x.astype(np.float64)) / x.shape[1]
    inv = (1.0 / np.sqrt(ss + eps)).astype(np.float32)
    return (x * inv[:, None]) * gain.astype(np.float32)


def rope_tables(base: float, rope_dim: int, n_pos: int, rope_freqs: np.ndarray | None,
                factor: float = 1.0):
    """(cos, sin), each float32 [n_pos, rope_dim/2]: pair i at position p turns by
    p * base^(-2i/rope_dim) / rope_freqs[i] / factor (inv_freq in float32, as pk_llama_create;
    factor: the layer's linear scaling)."""
    i = np.arange(rope_dim // 2, dtype=np.float64)
    inv = (1.0 / base ** (2 * i / rope_dim)).astype(np.float32)
    if rope_freqs is not None:
        inv = (inv / rope_freqs.astype(np.float32)).astype(np.float32)
    if factor != 1.0:
        inv = (inv / np.float32(factor)).astype(np.float32)
    ang = np.arange(n_pos, dtype=np.float32)[:, None] * inv[None, :]
    return np.cos(ang), np.sin(ang)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [S, L, heads, hd] (GGUF row order: pairs (2i, 2i+1)) -> rotated, a new array. Partial
    RoPE (cos/sin of rope_dim/2 < hd/2 pairs): the first rope_dim dims of each head turn, the
    rest are copied."""
    rd = 2 * cos.shape[1]
    a, b = x[..., 0:rd:2], x[..., 1:rd:2]               # [S, L, heads, rd/2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = np.empty_like(x)
    out[..., 0:rd:2] = a * c - b * s
    out[..., 1:rd:2] = a * s + b * c
    if rd < x.shape[-1]:
        out[..., rd:] = x[..., rd:]
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float = 0.0,
              window: int = 0) -> np.ndarray:
    """Causal GQA attention per sequence. q [S, L, nh, hd], k/v [S, L, nkv, hd] ->
    [S, L, nh * hd]; query head h reads K/V head h // (nh / nkv). scale: of the scores (0:
    1/sqrt(hd)); window > 0: the row at position p attends [p - window + 1, p] only."""
    n_seq, seq_len, nh, hd = q.shape
    nkv = k.shape[2]
    group = nh // nkv
    mask = np.triu(np.full((seq_len, seq_len), -np.inf, np.float32), 1)
    if window:
        mask += np.tril(np.full((seq_len, seq_len), -np.inf, np.float32), -window)
    out = np.empty((n_seq, seq_len, nh, hd), np.float32)
    scale = np.float32(scale) if scale else np.float32(1.0 / np.sqrt(hd))
    for s in range(n_seq):
        for g in range(nkv):
            qg = q[s, :, g * group:(g + 1) * group].transpose(1, 0, 2)     # [group, L, hd]
            sc = (qg @ k[s, :, g].T) * scale + mask                          # [group, L, L]
            sc -= sc.max(-1, keepdims=True)
            np.exp(sc, out=sc)
            sc /= sc.sum(-1, keepdims=True)
            out[s, :, g * group:(g + 1) * group] = (sc @ v[s, :, g]).transpose(1, 0, 2)
    return out.reshape(n_seq, seq_len, nh * hd)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gate / (1.0 + np.exp(-gate)) * up


def geglu_tanh(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu(gate) * up, GELU's tanh approximation (Gemma's GeGLU, pk_geglu_tanh)."""
    c = np.float32(0.7978845608028654)                   # sqrt(2/pi)
    return np.float32(0.5) * gate * (1 + np.tanh(c * (gate + np.float32(0.044715) * gate ** 3))) * up


GATED = {"silu": swiglu, "gelu_tanh": geglu_tanh}       # HParams.activation -> the MLP's gate


def head_features(hp: HParams, vec: dict, q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """q, k [S, L, heads, hd] as the family has them before RoPE (pk_llama.c head_features):
    the q/k/v biases added (v in place), each q and k head RMS-normalised. vec: the layer's
    BLOCK_VECTORS by table key ("attn_q.bias", "attn_q_norm", ...)."""
    if "attn_q.bias" in vec:
        q, k = q + vec["attn_q.bias"].reshape(q.shape[2:]), k + vec["attn_k.bias"].reshape(k.shape[2:])
        v += vec["attn_v.bias"].reshape(v.shape[2:])
    if "attn_q_norm" in vec:
        hd = hp.head_dim
        q = rmsnorm(q.reshape(-1, hd), vec["attn_q_norm"], hp.rms_eps).reshape(q.shape)
        k = rmsnorm(k.reshape(-1, hd), vec["attn_k_norm"], hp.rms_eps).reshape(k.shape)
    return q, k


def output_norm(y: np.ndarray, gain: np.ndarray | None, eps: float) -> np.ndarray:
    """A block's output y [T, d] as the residual adds it: through Gemma's post-attention /
    post-MLP RMSNorm where the layer has one (gain), else as it is."""
    return y if gain is None else rmsnorm(y, gain, eps)


# ---- the layer-streaming calibrator ------------------------------------------------------------

@dataclass
class GPTQOptions:
    """What gptq_source does. tokens: the calibration token ids (cut into sequences of
    seq_len; a shorter remainder is dropped); propagate: "quantized" (the stream goes through
    the GPTQ weights, as the runtime will) or "float"."""
    tokens: np.ndarray | list
    seq_len: int = DEFAULT_SEQ_LEN
    damp: float = gptq.DEFAULT_DAMP
    act_order: bool = False
    weighted_scales: bool = True
    propagate: str = "quantized"
    log: Callable[[str], None] | None = None

    def describe(self, n_tokens: int) -> str:
        return (f"GPTQ on {n_tokens} calibration tokens (damp {self.damp:g}"
                f"{', act-order' if self.act_order else ''}, stream through "
                f"{self.propagate} weights)")


def calibration_batch(tokens, seq_len: int, vocab_size: int) -> np.ndarray:
    """tokens [n] -> int64 [n_seq, seq_len] (one shorter sequence if n < seq_len)."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size < MIN_CALIBRATION_TOKENS:
        raise ConversionError(f"GPTQ needs at least {MIN_CALIBRATION_TOKENS} calibration "
                              f"tokens, got {ids.size}: give a longer calibration text")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ConversionError(f"calibration token ids must lie in [0, {vocab_size}), got "
                              f"{ids.min()}..{ids.max()}: tokens of another tokenizer?")
    seq_len = min(seq_len, ids.size)
    n_seq = ids.size // seq_len
    return ids[:n_seq * seq_len].reshape(n_seq, seq_len)


class LayerCalibrator:
    """Runs GPTQ layer by layer on demand: quantized(name) returns a linear's stored arrays,
    running the layers up to its own first (tensors are asked for in file order, one layer
    after the other; a layer's results are held until taken)."""

    def __init__(self, src: ModelSource, opts: GPTQOptions, group_size: int):
        if opts.propagate not in ("quantized", "float"):
            raise ConversionError(f"GPTQ propagate must be 'quantized' or 'float', got {opts.propagate!r}")
        self.src, self.opts, self.bl = src, opts, group_size
        self.hp = source_hparams(src, group_size)
        self.by_name = {t.name: t for t in src.tensors}
        self.batch = calibration_batch(opts.tokens, opts.seq_len, self.hp.vocab_size)
        self.down_input = getattr(src, "ffn_down_input", None)
        self.x: np.ndarray | None = None      # [T, d] the residual stream before layer next_layer
        self.next_layer = 0
        self.done: dict[str, tuple[np.ndarray, np.ndarray]] = {}   # stored arrays not yet taken
        self.formats: dict[str, str] = {}     # the writer's plan (set_formats); else qsi4c32
        self.seconds = 0.0
        self.quantize = True                  # False: the float model (float_forward)
        self.status: Callable[[str], None] | None = None   # the writer's bar postfix (set_status)
        rf = self.by_name.get(K.ROPE_FREQS)
        self.rope_freqs = None if rf is None else self._read(rf).reshape(-1)
        self.rope: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}   # (base, factor) -> (cos, sin)

    @property
    def n_tokens(self) -> int:
        return self.batch.size

    def _read(self, t: SourceTensor) -> np.ndarray:
        a = np.asarray(t.read(0, t.shape[0]), dtype=np.float32)
        if not (a.flags.writeable and a.flags.c_contiguous):   # GPTQ works in place
            a = np.array(a, dtype=np.float32, order="C")
        if not np.isfinite(a).all():
            raise ConversionError(f"{t.name} ({t.src_name or 'source'}) has NaN or Inf values")
        if self.src.after_tensor:
            self.src.after_tensor()
        return a

    def _embed(self) -> np.ndarray:
        """The embedding rows of the batch's tokens, [T, d], reading the table in chunks."""
        t = self.by_name[K.TOKEN_EMBD]
        ids = self.batch.reshape(-1)
        x = np.empty((ids.size, self.hp.n_embd), np.float32)
        step = max(1, (1 << 22) // self.hp.n_embd)
        for r0 in range(0, t.shape[0], step):
            r1 = min(t.shape[0], r0 + step)
            sel = np.nonzero((ids >= r0) & (ids < r1))[0]
            if sel.size:
                x[sel] = np.asarray(t.read(r0, r1), np.float32)[ids[sel] - r0]
        if self.src.after_tensor:
            self.src.after_tensor()
        return x

    def set_formats(self, formats: dict[str, str]) -> None:
        self.formats = dict(formats)

    def grid(self, name: str, bl: int | None = None) -> gptq.Grid | None:
        """The GPTQ grid of a linear stored as the plan says (None: a format GPTQ does not
        choose, such as qsi8cx or f16, which the writer rounds as usual). bl: the group size
        the writer asks for, checked against the calibrator's."""
        fmt = self.formats.get(name, "qsi4c32")
        if fmt == "qsi4c32" and (bl or self.bl) != self.bl:
            return None
        return gptq.GRIDS.get(fmt)

    def quantized(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        layer = int(name.split(".")[1])
        while name not in self.done and self.next_layer <= layer:
            self._run_layer(self.next_layer)
        if name not in self.done:
            raise ConversionError(f"GPTQ: {name} was asked for twice or out of order")
        return self.done.pop(name)

    def _gptq(self, i: int, part: str, h: np.ndarray) -> np.ndarray:
        """GPTQ of blk.i.part on its format's grid (its float weight read now, h [K, K]
        consumed); keeps the stored arrays, returns the weight [N, K] the stream goes on
        through (the float weight for a format GPTQ does not choose: 8 bits and more)."""
        name = K.blk(i, part)
        w = self._read(self.by_name[name])                       # [N, K] float32
        grid = self.grid(name)
        if not self.quantize or grid is None:
            return w
        keep = w.copy() if self.opts.propagate == "float" else None
        bl = self.bl if grid.fmt == "qsi4c32" else qsi6c32.BLOCK
        q, bits = gptq.gptq_quantize(w, h, bl, self.opts.damp, act_order=self.opts.act_order,
                                     weighted_scales=self.opts.weighted_scales, grid=grid)
        self.done[name] = gptq.pack(q, bits, grid)
        return keep if keep is not None else gptq.dequantize(q, bits)

    def _gptq_readers(self, i: int, inp: str, x: np.ndarray) -> dict[str, np.ndarray]:
        """GPTQ of every linear of block i that reads the activation `inp` (the tensor table's
        input: q/k/v read attn_in, gate/up ffn_in), all over one Hessian of x [T, K], in the
        table's order: {part: the weight the stream goes on through}."""
        readers = [s for s in L.BLOCK_LINEARS if s.input == inp]
        h = gptq.accumulate_gram(None, x)
        return {s.part: self._gptq(i, s.part, h if s is readers[-1] else h.copy())
                for s in readers}

    def _rope(self, i: int, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """q and k of layer i after RoPE at its own base and linear factor (none where the
        base is 0)."""
        base, factor = self.hp.rope_base(i), self.hp.rope_factor(i)
        key = (base, factor)
        if not base:
            return q, k
        if key not in self.rope:
            self.rope[key] = rope_tables(base, self.hp.rope_dim, self.batch.shape[1],
                                         self.rope_freqs, factor)
        cos, sin = self.rope[key]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def set_status(self, status: Callable[[str], None] | None) -> None:
        """Where to say what runs (the writer's progress bar), from now until the last layer;
        None: per-layer lines to opts.log, as without a bar."""
        self.status = status
        if status:       # the first layer comes after token_embd is written: seconds of 0%
            status(f"GPTQ set-up: {self.n_tokens} calibration tokens, {self.hp.n_layer} layers")

    def _run_layer(self, i: int) -> None:
        t0 = time.perf_counter()
        hp, (n_seq, seq_len) = self.hp, self.batch.shape
        if self.status:
            per = f", {self.seconds / i:.1f} s per layer" if i else ""
            self.status(f"GPTQ layer {i + 1}/{hp.n_layer}{per}")
        if self.x is None:
            self.x = self._embed()
            if hp.embedding_scale != 1.0:                   # Gemma: sqrt(n_embd), as pk_llama
                self.x *= np.float32(hp.embedding_scale)
        x = self.x
        norm = {p: self._read(self.by_name[K.blk(i, p)]) for p in K.BLOCK_NORMS}   # gains [d]
        vec = {s.key: self._read(self.by_name[s.name(i)]) for s in L.BLOCK_VECTORS
               if s.feature in hp.features}   # the family's biases, head and output norms
        # attention
        xn = rmsnorm(x, norm["attn_norm"], hp.rms_eps)
        w = self._gptq_readers(i, "attn_in", xn)
        shape = (n_seq, seq_len, -1, hp.head_dim)
        q, k, v = ((xn @ w.pop(p).T).reshape(shape) for p in ("attn_q", "attn_k", "attn_v"))
        del xn, w
        q, k = self._rope(i, *head_features(hp, vec, q, k, v))
        a = attention(q, k, v, hp.attention_scale, hp.window(i)).reshape(n_seq * seq_len, -1)
        del q, k, v                                                  # a: [T, nh * hd]
        wo = self._gptq_readers(i, "attn_out", a).pop("attn_output")
        x += output_norm(a @ wo.T, vec.get("post_attention_norm"), hp.rms_eps)
        del a, wo
        # feed-forward
        xn = rmsnorm(x, norm["ffn_norm"], hp.rms_eps)
        w = self._gptq_readers(i, "ffn_in", xn)
        wg, wu = w.pop("ffn_gate"), w.pop("ffn_up")
        gated = GATED[hp.activation]
        act = np.empty((x.shape[0], hp.n_ff), np.float32)         # [T, n_ff]
        for r0 in range(0, x.shape[0], seq_len):
            r1 = r0 + seq_len
            y = gated(xn[r0:r1] @ wg.T, xn[r0:r1] @ wu.T)
            act[r0:r1] = y if self.down_input is None else self.down_input(y)
        del xn, wg, wu
        wd = self._gptq_readers(i, "down_in", act).pop("ffn_down")
        x += output_norm(act @ wd.T, vec.get("post_ffw_norm"), hp.rms_eps)
        del act, wd
        self.next_layer = i + 1
        self.seconds += time.perf_counter() - t0
        if self.status:
            if self.next_layer == hp.n_layer:
                self.status(f"GPTQ: {hp.n_layer} layers in {self.seconds:.1f} s")
        elif self.opts.log:
            self.opts.log(f"GPTQ layer {i + 1}/{hp.n_layer}: {time.perf_counter() - t0:.1f} s")
        if self.next_layer == hp.n_layer:
            self.x = None                                           # the stream is done


def float_forward(src: ModelSource, tokens, seq_len: int = DEFAULT_SEQ_LEN) -> np.ndarray:
    """The residual stream after the last layer, float32 [n_seq * seq_len, n_embd], of the
    float model (no quantization): the calibration forward pass alone, for tests."""
    cal = LayerCalibrator(src, GPTQOptions(tokens, seq_len), 32)
    cal.quantize = False
    for i in range(cal.hp.n_layer - 1):
        cal._run_layer(i)
    x = cal.x
    cal._run_layer(cal.hp.n_layer - 1)
    return x


def gptq_source(src: ModelSource, opts: GPTQOptions, group_size: int = 32) -> ModelSource:
    """src with GPTQ as the `quantized` rule of every block linear: on the grid of the format
    the writer plans for it (qsi4c32 at group_size, or qsi6c32: the ladder's and --keep's 6-bit
    tensors); a linear kept at 8 bits or more is rounded as usual and the calibration stream
    runs through its float weights. The file records the method (K.KEY_WEIGHT_METHOD)."""
    cal = LayerCalibrator(src, opts, group_size)
    blk_linears = {K.blk(i, p) for i in range(cal.hp.n_layer) for p in K.BLOCK_LINEARS}

    def rule(name: str):
        def quantized(fmt: str, bl: int):
            if cal.formats.get(name, "qsi4c32") != fmt:
                raise ConversionError(f"GPTQ: {name} is written as {fmt}, planned as "
                                      f"{cal.formats.get(name, 'qsi4c32')}")
            return cal.quantized(name) if cal.grid(name, bl) is not None else None
        return quantized

    tensors = [dataclasses.replace(t, quantized=rule(t.name)) if t.name in blk_linears else t
               for t in src.tensors]
    missing = blk_linears - {t.name for t in src.tensors}
    if missing:
        raise ConversionError(f"GPTQ: the source lacks {sorted(missing)[0]}")
    out = dataclasses.replace(
        src, tensors=tensors,
        kv=[e for e in src.kv if e[0] != K.KEY_WEIGHT_METHOD]
        + [(K.KEY_WEIGHT_METHOD, METHOD_GPTQ, T.STRING, None)],
        notes=list(src.notes) + [f"weights: {opts.describe(cal.n_tokens)}"],
        before_write=cal.set_formats, set_status=cal.set_status)
    out.calibrator = cal
    return out
