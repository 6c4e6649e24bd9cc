# pyklei._ext (_ext.pyx includes this): the Llama forward pass (pyklei_ext/model) and the
# declarations of the C ops it stands on (ops/pk_nn.h).

cdef extern from "ops/pk_nn.h":
    ctypedef struct pk_tensor:
        pk_format type
        int n, k, bl
        const void *data
        const void *scales
    ctypedef void (*pk_f16_to_f32_fn)(size_t n, const uint16_t *x, float *out) noexcept nogil
    pk_f16_to_f32_fn pk_f16_to_f32_pick(const char **isa)
    pk_f16_to_f32_fn pk_f16_to_f32_for_isa(const char *isa)
    ctypedef enum pk_kv_type:
        PK_KV_F32, PK_KV_F16, PK_KV_Q8, PK_KV_BF16
    ctypedef struct pk_kv_head:
        pk_kv_type type
        const void *k
        const void *v
        const uint16_t *k_scale
        const uint16_t *v_scale
        pk_f16_to_f32_fn f16
        int dot_bf16
    int pk_attend_bf16_pick(pk_kv_type type, int log_choice)
    int pk_attend_bf16_runs()
    void pk_kv_q8_row(int hd, const float *x, int8_t *out, uint16_t *scale) nogil
    uint16_t pk_kv_bf16_round(float x) nogil
    void pk_attend_group(int group, int hd, int n_pos, const float *q, const pk_kv_head *kv, float scale,
                         float *scores, size_t ld_scores, float *out) nogil
    void pk_attend_group_reference(int group, int hd, int n_pos, const float *q, const pk_kv_head *kv,
                                   float scale, float *scores, size_t ld_scores, float *out) nogil
    void pk_attend_rows(int rows, const int *n_pos, int group, int hd, const float *q, size_t ldq,
                        const pk_kv_head *kv, float scale, float *scores, size_t ld_scores, float *out,
                        size_t ldo) nogil
    void pk_attend_rows_window(int rows, const int *lo, const int *hi, int ring, int group, int hd, const float *q,
                               size_t ldq, const pk_kv_head *kv, float scale, float *scores, size_t ld_scores,
                               float *out, size_t ldo) nogil
    int PK_KV_BLOCK
    int PK_KV_Q8_GROUP
    int PK_ATTEND_ROWS
    int PK_ATTEND_CHUNK

cdef extern from "model/pk_llama.h":
    ctypedef struct pk_llama_hparams:
        int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff
        float rms_eps, rope_theta
        int n_ctx, n_batch, kv_type, n_seq
        int act, rope_dim
        float embd_scale, attn_scale, logit_softcap
    ctypedef struct pk_llama_layer:
        const float *attn_norm
        const float *ffn_norm
        const pk_rhs *wq
        const pk_rhs *wk
        const pk_rhs *wv
        const pk_rhs *wo
        const pk_rhs *w_gate
        const pk_rhs *w_up
        const pk_rhs *w_down
        const float *bq
        const float *bk
        const float *bv
        const float *q_norm
        const float *k_norm
        const float *post_attn_norm
        const float *post_ffn_norm
        int window
        float rope_theta
        float rope_factor
        int no_rope
    ctypedef struct pk_rotation:
        int n, m, p
        const char *fwht_isa
    int pk_rotation_init(pk_rotation *r, int n, const float *signs, const float *mix)
    int pk_rotation_use(pk_rotation *r, const char *isa)
    void pk_rotate_row(const pk_rotation *r, int transpose, float *x, float *scratch) nogil
    ctypedef struct pk_llama_weights:
        pk_tensor tok_embd
        const pk_rhs *lm_head
        const float *output_norm
        const float *rope_freqs
        const pk_llama_layer *layers
        pk_rotation rot_ffn_down
        pk_rotation rot_output
    ctypedef struct pk_llama:
        pass
    pk_llama *pk_llama_create(const pk_llama_hparams *hp, const pk_llama_weights *w, pk_ctx *ctx)
    void pk_llama_destroy(pk_llama *model)
    size_t pk_llama_state_bytes(const pk_llama *model)
    int pk_llama_forward(pk_llama *model, const int32_t *tokens, int n, int pos0, float *logits,
                         int all_logits, volatile int *interrupt) nogil
    int pk_llama_forward_batch(pk_llama *model, int n, const int32_t *tokens, const int32_t *seq,
                               const int32_t *pos, int n_out, const int32_t *out_rows, float *logits,
                               volatile int *interrupt) nogil
    int pk_llama_hidden_batch(pk_llama *model, int n, const int32_t *tokens, const int32_t *seq,
                              const int32_t *pos, int n_out, const int32_t *out_rows, float *hidden,
                              volatile int *interrupt) nogil
    int pk_llama_kv_copy(pk_llama *model, int src, int dst, int n) nogil
    size_t pk_llama_kv_rows_bytes(const pk_llama *model, int n)
    int pk_llama_kv_export(pk_llama *model, int seq, int a, int b, void *buf) nogil
    int pk_llama_kv_import(pk_llama *model, int seq, int a, int b, const void *buf) nogil
    int pk_llama_ring(const pk_llama *model, int layer)
    ctypedef enum pk_llama_stat:
        PK_LLAMA_STAT_LM_HEAD_IN
        PK_LLAMA_STATS
    const char *const pk_llama_stat_names[]
    size_t pk_llama_stat_section(const pk_llama_hparams *hp, int l, pk_llama_stat s, size_t *len)
    int pk_llama_stats_enable(pk_llama *model, int on)
    const double *pk_llama_stats(const pk_llama *model, size_t *len, long *rows, long *lm_rows)
    void pk_llama_profile_enable(pk_llama *model, int on)
    int pk_llama_profile(const pk_llama *model, const char *const **names, const double **seconds, long *calls)

from libc.stdlib cimport calloc, free

cdef const float *_f32_ptr(object arr, list keep, Py_ssize_t n, str what) except NULL:
    cdef const float[::1] v = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    if v.shape[0] != n:
        raise ValueError(f"{what} has {v.shape[0]} values, expected {n}")
    keep.append(v)
    return &v[0]


# The fields of pk_llama_layer (model/pk_llama.h) a layer dict gives LlamaRuntime: the norms'
# gains (f32 [n_embd]), then the linears (QWeight). Model fills them by the `field` column of the
# tensor table (pyklei/formats/llama_tensors.py); tests/formats/test_llama_tensors.py checks the two agree.
LAYER_NORM_FIELDS = ("attn_norm", "ffn_norm")
LAYER_LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# Per-layer features a layer dict may give (None or absent: the layer has none): f32 vectors
# (field -> its length from the hparams) and settings.
LAYER_VECTOR_FIELDS = ("bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")
LAYER_SETTINGS = ("window", "rope_theta", "rope_factor", "no_rope")
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}      # pk_llama_act; gguf_keys.ACTIVATIONS' names
# The sections of the activation statistics, in the C layout's order (pk_llama.h, pk_llama_stat)
STAT_SECTIONS = tuple(pk_llama_stat_names[i].decode() for i in range(<int>PK_LLAMA_STATS))


cdef class LlamaRuntime:
    """The C forward pass over borrowed weights; owns the KV cache and scratch buffers.

    Not safe to call from two threads at once (the caller serialises)."""
    cdef pk_llama *model
    cdef pk_llama_layer *layers
    cdef list _keep
    cdef readonly Ops ops
    cdef readonly int n_vocab, n_ctx, n_batch, n_seq
    cdef volatile int interrupt
    cdef pk_llama_hparams hp

    def __cinit__(self, Ops ops, dict hp, tuple tok_embd, QWeight lm_head, output_norm,
                  rope_freqs, list layers, dict rotations=None):
        cdef pk_llama_hparams h
        cdef pk_llama_weights w
        cdef int i
        cdef QWeight qw
        cdef const uint8_t[::1] emb_bytes
        cdef const float *ptr
        self._keep = [ops, lm_head]
        self.ops = ops
        h.n_vocab, h.n_embd, h.n_layer = hp["n_vocab"], hp["n_embd"], hp["n_layer"]
        h.n_head, h.n_head_kv, h.head_dim, h.n_ff = hp["n_head"], hp["n_head_kv"], hp["head_dim"], hp["n_ff"]
        h.rms_eps, h.rope_theta = hp["rms_eps"], hp["rope_theta"]
        h.n_ctx, h.n_batch = hp["n_ctx"], hp["n_batch"]
        kv_types = {"f32": PK_KV_F32, "f16": PK_KV_F16, "q8": PK_KV_Q8, "bf16": PK_KV_BF16}   # pyklei.options' names
        if hp.get("kv_cache", "f32") not in kv_types:
            raise ValueError(f"kv_cache must be one of {', '.join(kv_types)}, not {hp['kv_cache']!r}")
        h.kv_type = kv_types[hp.get("kv_cache", "f32")]
        h.n_seq = hp.get("n_seq", 1)
        if hp.get("activation", "silu") not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {hp['activation']!r}")
        h.act = ACTIVATIONS[hp.get("activation", "silu")]
        h.rope_dim = hp.get("rope_dim", 0)
        h.embd_scale = hp.get("embedding_scale", 0.0)
        h.attn_scale = hp.get("attention_scale", 0.0)
        h.logit_softcap = hp.get("logit_softcap", 0.0)
        if len(layers) != h.n_layer:
            raise ValueError(f"{len(layers)} layers given, hparams say {h.n_layer}")
        # token embedding table: (dtype name, data array, scales array or None, block size)
        dtype, data, scales, bl = tok_embd
        if dtype not in FORMATS:
            raise ValueError(f"unsupported embedding type {dtype!r}")
        emb_bytes = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._keep.append(emb_bytes)
        w.tok_embd.type = FORMATS[dtype]
        w.tok_embd.n, w.tok_embd.k, w.tok_embd.bl = h.n_vocab, h.n_embd, bl
        w.tok_embd.data = &emb_bytes[0]
        w.tok_embd.scales = NULL
        if scales is not None:
            sc = np.ascontiguousarray(scales).reshape(-1).view(np.uint8)
            self._keep.append(sc)
            emb_bytes = sc
            w.tok_embd.scales = &emb_bytes[0]
        w.lm_head = &lm_head.rhs
        w.output_norm = _f32_ptr(output_norm, self._keep, h.n_embd, "output_norm")
        w.rope_freqs = NULL if rope_freqs is None else _f32_ptr(
            rope_freqs, self._keep, (h.rope_dim or h.head_dim) // 2, "rope_freqs")
        lengths = {"bq": h.n_head * h.head_dim, "bk": h.n_head_kv * h.head_dim, "bv": h.n_head_kv * h.head_dim,
                   "q_norm": h.head_dim, "k_norm": h.head_dim, "post_attn_norm": h.n_embd,
                   "post_ffn_norm": h.n_embd}
        known = set(LAYER_NORM_FIELDS + LAYER_LINEAR_FIELDS + LAYER_VECTOR_FIELDS + LAYER_SETTINGS)
        self.layers = <pk_llama_layer *>calloc(h.n_layer, sizeof(pk_llama_layer))
        if self.layers == NULL:
            raise MemoryError()
        for i, L in enumerate(layers):
            if not set(LAYER_NORM_FIELDS + LAYER_LINEAR_FIELDS) <= set(L) <= known:
                raise ValueError(f"layer {i} gives fields {sorted(L)}, pk_llama_layer has "
                                 f"{sorted(known)}")
            self.layers[i].attn_norm = _f32_ptr(L["attn_norm"], self._keep, h.n_embd, f"blk.{i}.attn_norm")
            self.layers[i].ffn_norm = _f32_ptr(L["ffn_norm"], self._keep, h.n_embd, f"blk.{i}.ffn_norm")
            for name in LAYER_LINEAR_FIELDS:
                qw = L[name]
                self._keep.append(qw)
            self.layers[i].wq = &(<QWeight>L["wq"]).rhs
            self.layers[i].wk = &(<QWeight>L["wk"]).rhs
            self.layers[i].wv = &(<QWeight>L["wv"]).rhs
            self.layers[i].wo = &(<QWeight>L["wo"]).rhs
            self.layers[i].w_gate = &(<QWeight>L["w_gate"]).rhs
            self.layers[i].w_up = &(<QWeight>L["w_up"]).rhs
            self.layers[i].w_down = &(<QWeight>L["w_down"]).rhs
            for name in LAYER_VECTOR_FIELDS:
                v = L.get(name)
                if v is not None:
                    ptr = _f32_ptr(v, self._keep, lengths[name], f"blk.{i}.{name}")
                    if name == "bq": self.layers[i].bq = ptr
                    elif name == "bk": self.layers[i].bk = ptr
                    elif name == "bv": self.layers[i].bv = ptr
                    elif name == "q_norm": self.layers[i].q_norm = ptr
                    elif name == "k_norm": self.layers[i].k_norm = ptr
                    elif name == "post_attn_norm": self.layers[i].post_attn_norm = ptr
                    else: self.layers[i].post_ffn_norm = ptr
            self.layers[i].window = L.get("window", 0)
            self.layers[i].rope_theta = L.get("rope_theta", 0.0)
            self.layers[i].rope_factor = L.get("rope_factor", 0.0)
            self.layers[i].no_rope = L.get("no_rope", 0)
        w.layers = self.layers
        # rotations: {"ffn_down" | "output": (signs [n], mix [m, m])}, checked by the loader
        w.rot_ffn_down.n = 0
        w.rot_output.n = 0
        for key, rot in (rotations or {}).items():
            if key not in ("ffn_down", "output"):
                raise ValueError(f"unknown rotation {key!r}")
            signs = np.ascontiguousarray(rot[0], np.float32).reshape(-1)
            n = signs.shape[0]
            mix = np.ascontiguousarray(rot[1], np.float32)
            if mix.ndim != 2 or mix.shape[0] != mix.shape[1] or mix.shape[0] * (n // max(mix.shape[0], 1)) != n:
                raise ValueError(f"rotation {key}: mix of shape {list(mix.shape)} does not fit size {n}")
            if pk_rotation_init(&w.rot_ffn_down if key == "ffn_down" else &w.rot_output, n,
                                _f32_ptr(signs, self._keep, n, f"rotation {key} signs"),
                                _f32_ptr(mix, self._keep, mix.size, f"rotation {key} mix")):
                raise ValueError(_last_error())
        self.model = pk_llama_create(&h, &w, ops.ctx)
        if self.model == NULL:
            raise ValueError(_last_error())
        self.n_vocab, self.n_ctx, self.n_batch, self.n_seq = h.n_vocab, h.n_ctx, h.n_batch, h.n_seq
        self.hp = h

    def __dealloc__(self):
        if self.model != NULL:
            pk_llama_destroy(self.model)
        free(self.layers)

    @property
    def rings(self):
        """Per layer, the ring length of its KV cache (a sliding-window layer keeps position p
        at p % ring), or 0 for a layer that keeps every position (pk_llama_ring)."""
        return [pk_llama_ring(self.model, l) for l in range(self.hp.n_layer)]

    @property
    def state_bytes(self):
        """Bytes of the KV cache and scratch buffers."""
        return pk_llama_state_bytes(self.model)

    def collect_stats(self, bint on=True):
        """Start (zeroing) or stop accumulating per-channel sums of squares of every linear
        layer's input (for importance-weighted quantization)."""
        if pk_llama_stats_enable(self.model, on) != 0:
            raise MemoryError(_last_error())

    def stats(self):
        """(float64 sums of squares, rows per layer, rows at the lm_head), or None if off.
        Layout per layer: [attn_in n_embd][attn_out n_head*head_dim][ffn_in n_embd][down_in n_ff],
        then [lm_head_in n_embd]."""
        cdef size_t n
        cdef long rows, lm_rows
        cdef const double *p = pk_llama_stats(self.model, &n, &rows, &lm_rows)
        if p == NULL:
            return None
        return np.asarray(<const double[:n]>p).copy(), rows, lm_rows

    def stats_sections(self):
        """({input name: float64 sums of squares [n_layer, width]}, rows per layer, rows at the
        lm_head), or None if off: stats() cut by the C layout (pk_llama_stat_section). Names are
        pk_llama.h's, as the tensor table (pyklei/formats/llama_tensors.py) calls each linear's
        input; "lm_head_in" has one row."""
        got = self.stats()
        if got is None:
            return None
        flat, rows, lm_rows = got
        cdef size_t off, width
        cdef int s, l
        out = {}
        for s in range(PK_LLAMA_STATS):
            layers = 1 if s == PK_LLAMA_STAT_LM_HEAD_IN else self.hp.n_layer
            parts = []
            for l in range(layers):
                off = pk_llama_stat_section(&self.hp, l, <pk_llama_stat>s, &width)
                parts.append(flat[off:off + width])
            out[pk_llama_stat_names[s].decode()] = np.stack(parts)
        return out, rows, lm_rows

    def profile_ops(self, bint on=True):
        """Start (zeroing) or stop timing each operation of the forward pass."""
        pk_llama_profile_enable(self.model, on)

    def op_profile(self):
        """({operation: seconds summed}, forward calls) since profile_ops(True)."""
        cdef const char *const *names
        cdef const double *sec
        cdef long calls
        cdef int n = pk_llama_profile(self.model, &names, &sec, &calls)
        return {names[i].decode(): sec[i] for i in range(n)}, calls

    def request_interrupt(self):
        """Makes a running forward() stop at the next layer boundary (thread-safe)."""
        self.interrupt = 1

    def forward(self, tokens, int pos0, bint all_logits=False):
        """Runs tokens at positions pos0.. and returns float32 logits: [n, n_vocab] when
        all_logits, else [n_vocab] for the last token. Returns None if interrupted."""
        cdef const int32_t[::1] tv = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        cdef int n = tv.shape[0]
        if n == 0:
            raise ValueError("no tokens to evaluate")
        shape = [n, self.n_vocab] if all_logits else [self.n_vocab]
        out = np.empty(shape, np.float32)
        cdef float[::1] ov = out.reshape(-1)
        cdef int rc
        self.interrupt = 0
        with nogil:
            rc = pk_llama_forward(self.model, &tv[0], n, pos0, &ov[0], all_logits, &self.interrupt)
        if rc == 1:
            return None
        if rc != 0:
            raise ValueError(_last_error())
        return out

    def forward_batch(self, tokens, seq, pos, out_rows, bint hidden=False):
        """Runs row i = (tokens[i], slot seq[i], position pos[i]) for all rows in one pass (the
        rules: pk_llama.h) and returns float32 logits [len(out_rows), n_vocab] for the rows
        out_rows (ascending); with hidden, their final hidden states [len(out_rows), n_embd]
        instead (pk_llama_hidden_batch: the final norm's output, no lm_head). Returns None if
        interrupted."""
        cdef const int32_t[::1] tv = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        cdef const int32_t[::1] sv = np.ascontiguousarray(seq, dtype=np.int32).reshape(-1)
        cdef const int32_t[::1] pv = np.ascontiguousarray(pos, dtype=np.int32).reshape(-1)
        cdef const int32_t[::1] rv = np.ascontiguousarray(out_rows, dtype=np.int32).reshape(-1)
        cdef int n = tv.shape[0], n_out = rv.shape[0]
        if n == 0:
            raise ValueError("no rows to evaluate")
        if sv.shape[0] != n or pv.shape[0] != n:
            raise ValueError(f"{n} tokens but {sv.shape[0]} sequence ids and {pv.shape[0]} positions")
        out = np.empty((n_out, self.hp.n_embd if hidden else self.n_vocab), np.float32)
        cdef float[:, ::1] ov = out
        cdef float *optr = &ov[0, 0] if n_out else NULL
        cdef const int32_t *rptr = &rv[0] if n_out else NULL
        cdef int rc
        self.interrupt = 0
        with nogil:
            if hidden:
                rc = pk_llama_hidden_batch(self.model, n, &tv[0], &sv[0], &pv[0], n_out, rptr, optr,
                                           &self.interrupt)
            else:
                rc = pk_llama_forward_batch(self.model, n, &tv[0], &sv[0], &pv[0], n_out, rptr, optr,
                                            &self.interrupt)
        if rc == 1:
            return None
        if rc != 0:
            raise ValueError(_last_error())
        return out

    def kv_copy(self, int src, int dst, int n):
        """Copies the K/V of positions [0, n) of slot src into slot dst."""
        if pk_llama_kv_copy(self.model, src, dst, n) != 0:
            raise ValueError(_last_error())

    @property
    def kv_row_block(self):
        """Positions kv_export / kv_import move in units of (PK_KV_BLOCK)."""
        return PK_KV_BLOCK

    def kv_rows_bytes(self, int n):
        """Bytes kv_export writes for n positions (pk_llama_kv_rows_bytes)."""
        return pk_llama_kv_rows_bytes(self.model, n)

    def kv_export(self, int seq, int a, int b):
        """The K/V of positions [a, b) of slot seq, every layer, as bytes (pk_llama_kv_export)."""
        if b < a or a < 0:
            raise ValueError(f"kv export: bad positions [{a}, {b})")
        out = bytearray(pk_llama_kv_rows_bytes(self.model, b - a))
        cdef unsigned char[::1] ov = out
        cdef int rc
        with nogil:
            rc = pk_llama_kv_export(self.model, seq, a, b, &ov[0] if ov.shape[0] else NULL)
        if rc != 0:
            raise ValueError(_last_error())
        return bytes(out)

    def kv_import(self, int seq, int a, int b, const unsigned char[::1] data):
        """Writes kv_export's bytes of positions [a, b) into slot seq (pk_llama_kv_import)."""
        if b < a or a < 0 or <size_t>data.shape[0] != pk_llama_kv_rows_bytes(self.model, b - a):
            raise ValueError(f"kv import: {data.shape[0]} bytes are not the K/V of positions "
                             f"[{a}, {b}) of this model")
        cdef int rc
        with nogil:
            rc = pk_llama_kv_import(self.model, seq, a, b, &data[0] if data.shape[0] else NULL)
        if rc != 0:
            raise ValueError(_last_error())
