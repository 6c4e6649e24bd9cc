"""What a pyklei model file holds and which kernel each of its weights runs on this CPU.

    info = model_info("smollm2.gguf")            # a dict (JSON-ready); reads the file only
    print(info_text(info))                       # what `pyklei info` prints

Nothing is loaded into the runtime: the tensors are read from the file's header and the kernel
table is asked which kernel a weight of each format gets for decode (m = activation planes)
and for a full prefill chunk (m = planes x batch size).

A GGUF that is not a pyklei file (llama.cpp's, say) gets gguf_info instead: its metadata,
hyperparameters, tensor types and vocabulary, and the `pyklei convert` command that makes a
pyklei file of it ("file_kind" tells the two dicts apart).
"""
from __future__ import annotations

import math
import shlex
from pathlib import Path

from ._report import mb, table, wrap


def _tensor_bytes(t) -> int:
    return sum(a.nbytes for a in (t.data, t.qs, t.scales) if a is not None)


def model_info(path, activations: str = "auto", batch_size: int = 256) -> dict:
    """The model's metadata, its tensors by format, the CPU's kernels and the kernel of each
    weight shape for decode and prefill, as a dict; for a GGUF file that is not a pyklei file,
    gguf_info(path). Raises ValueError (ModelFileError, GGUFError) for a path that is not a
    well-formed GGUF file, or a broken pyklei one."""
    from .runtime.activation_policy import choose_activations
    from .formats import gguf_keys as K
    from .formats.llama_tensors import BLOCK_LINEARS
    from .formats.model_file import check_model_path, is_model_file, read_model
    from .formats.registry import WEIGHT_FORMATS
    from .runtime.kernels import available_kernels, cpu_features, selected_kernel_for

    path = check_model_path(path)
    if not is_model_file(path):
        return gguf_info(path)
    mf = read_model(path)
    hp, md = mf.hparams, mf.metadata
    fmts: dict[str, dict] = {}
    for t in mf.tensors.values():
        f = fmts.setdefault(t.format, {"tensors": 0, "params": 0, "bytes": 0})
        f["tensors"] += 1
        f["params"] += math.prod(t.shape)
        f["bytes"] += _tensor_bytes(t)
    for f in fmts.values():
        f["bits_per_weight"] = 8 * f["bytes"] / f["params"] if f["params"] else 0.0
    n_params = sum(f["params"] for f in fmts.values())
    n_bytes = sum(f["bytes"] for f in fmts.values())

    activations = choose_activations(mf, activations)
    planes = 2 if activations == "qai8dx2" else 1
    m_dec, m_pre = planes, planes * batch_size
    shapes: dict[tuple, dict] = {}
    for i in range(hp.n_layer):
        for spec in BLOCK_LINEARS:
            t, short = mf.layer(i, spec.part), spec.short
            key = (short, t.shape, t.format)
            s = shapes.setdefault(key, {"weight": short, "n": t.shape[0], "k": t.shape[1],
                                        "format": t.format, "layers": 0})
            s["layers"] += 1
    out = mf.output
    rows = list(shapes.values())
    rows.append({"weight": "lm_head" + (" (tied)" if hp.tied else ""), "n": out.shape[0],
                 "k": out.shape[1], "format": out.format, "layers": 1})
    for r in rows:
        # an f16/f32 lm_head is quantized to qsi8cx at load (pyklei.runtime.model)
        f = r["format"] if WEIGHT_FORMATS[r["format"]].quantized else "qsi8cx"
        if f != r["format"]:
            r["runtime_format"] = f
        r["decode_kernel"] = selected_kernel_for(f, m_dec, activations)
        # only the last position's logits are computed after a prompt: lm_head runs at m = planes
        r["prefill_kernel"] = selected_kernel_for(f, m_dec if r["weight"].startswith("lm_head") else m_pre,
                                                  activations)

    tmpl = md.get("tokenizer.chat_template")
    return {
        "file_kind": "pyklei",
        "path": str(path),
        "file_bytes": Path(path).stat().st_size,
        "name": md.get(K.GENERAL_NAME),
        "architecture": md.get(K.GENERAL_ARCHITECTURE),
        "pyklei_format_version": md.get(K.KEY_FORMAT_VERSION),
        "converted_from": md.get(K.KEY_SOURCE),
        "weight_method": md.get(K.KEY_WEIGHT_METHOD) or "rounding",   # how 4-bit values were chosen
        "params": n_params,
        "tensor_bytes": n_bytes,
        "bits_per_weight": 8 * n_bytes / n_params if n_params else 0.0,
        "qsi4c32_block_size": hp.block_size,
        "hparams": {"context_length": hp.context_length, "n_layer": hp.n_layer,
                    "n_embd": hp.n_embd, "n_ff": hp.n_ff, "n_head": hp.n_head,
                    "n_head_kv": hp.n_head_kv, "head_dim": hp.head_dim,
                    "rope_theta": hp.rope_theta,
                    "rope_scaling": md.get(K.ROPE_SCALING_TYPE) or ("linear" if any(
                        f != 1.0 for f in hp.layer_rope_factor) else None),
                    "rms_eps": hp.rms_eps, "tied_embeddings": hp.tied},
        "family": _family_features(hp),
        "tokenizer": {"model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre"),
                      "vocab_size": hp.vocab_size, "bos_id": md.get("tokenizer.ggml.bos_token_id"),
                      "eos_ids": mf.eos_token_ids,
                      "add_bos": md.get("tokenizer.ggml.add_bos_token")},
        "chat_template": bool(tmpl),
        "formats": fmts,
        "cpu_features": cpu_features(),
        "kernels_available": [k["name"] for k in available_kernels() if k["priority"] >= 0],
        "activations": activations,
        "m_decode": m_dec,
        "m_prefill": m_pre,
        "layers": rows,
    }


# llama.cpp's llama_ftype (llama.h), the value of general.file_type: the type of most weights
LLAMA_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
    30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
}
_PLAIN_TYPES = ("F32", "F16", "BF16")
# what gguf_info shows of an architecture's hyperparameters: (dict key, GGUF key after "ARCH.")
_GGUF_HPARAMS = (("context_length", "context_length"), ("n_layer", "block_count"),
                 ("n_embd", "embedding_length"), ("n_ff", "feed_forward_length"),
                 ("n_head", "attention.head_count"), ("n_head_kv", "attention.head_count_kv"),
                 ("head_dim", "attention.key_length"), ("rope_theta", "rope.freq_base"),
                 ("rms_eps", "attention.layer_norm_rms_epsilon"))


def gguf_info(path) -> dict:
    """What a GGUF file that is not a pyklei file holds (a llama.cpp model, typically): name,
    architecture, llama.cpp file type, hyperparameters, tensors counted by GGML type, vocabulary,
    and `convert_command`, the `pyklei convert` line for it (None where pyklei cannot convert
    it: `convert_note` says why). Reads only the header; raises GGUFError for a broken file."""
    from .runtime.activation_policy import choose_activations
    from .formats import gguf_keys as K
    from .formats.end_of_generation import end_of_generation_ids
    from .formats.gguf_reader import read_gguf
    from .converters.llamacpp_gguf import GGUF_ARCHS

    path = Path(path)
    g = read_gguf(path, tensors=True, arrays="list")
    md = g.metadata
    arch = md.get(K.GENERAL_ARCHITECTURE)
    types: dict[str, dict] = {}
    for t in g.tensors.values():
        f = types.setdefault(t.type_name, {"tensors": 0, "params": 0, "bytes": 0})
        f["tensors"] += 1
        f["params"] += math.prod(t.shape)
        f["bytes"] += t.nbytes
    for f in types.values():
        f["bits_per_weight"] = 8 * f["bytes"] / f["params"] if f["params"] else 0.0
    n_params = sum(f["params"] for f in types.values())
    n_bytes = sum(f["bytes"] for f in types.values())
    hparams = {k: md.get(f"{arch}.{key}") for k, key in _GGUF_HPARAMS}
    if hparams["head_dim"] is None and hparams["n_embd"] and hparams["n_head"]:
        hparams["head_dim"] = hparams["n_embd"] // hparams["n_head"]
    hparams["tied_embeddings"] = K.OUTPUT not in g.tensors if g.tensors else None
    tokens = md.get("tokenizer.ggml.tokens")
    eos = end_of_generation_ids(md)     # what pyklei would stop on (and a converted file lists)
    ftype = md.get("general.file_type")

    out = f"{path.stem}.pyklei.gguf"
    if arch not in GGUF_ARCHS:
        cmd, note = None, (f"pyklei imports llama.cpp files of {', '.join(GGUF_ARCHS)}; this "
                           f"file's architecture is {arch!r}")
    else:
        cmd = f"pyklei convert {shlex.quote(str(path))} -o {shlex.quote(out)}"
        quantized = sorted(set(types) - set(_PLAIN_TYPES))
        note = (f"its {'/'.join(quantized)} weights are dequantized and quantized again, which "
                f"adds pyklei's rounding error to theirs; the Hugging Face checkpoint, if there "
                f"is one, makes a better file" if quantized else None)
    return {
        "file_kind": "gguf",
        "path": str(path),
        "file_bytes": path.stat().st_size,
        "gguf_version": g.version,
        "name": md.get(K.GENERAL_NAME),
        "architecture": arch,
        "file_type": LLAMA_FILE_TYPES.get(ftype, None if ftype is None else f"type {ftype}"),
        "params": n_params,
        "tensor_bytes": n_bytes,
        "bits_per_weight": 8 * n_bytes / n_params if n_params else 0.0,
        "hparams": hparams,
        "tokenizer": {"model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre"),
                      "vocab_size": len(tokens) if isinstance(tokens, list) else md.get(f"{arch}.vocab_size"),
                      "bos_id": md.get("tokenizer.ggml.bos_token_id"), "eos_ids": eos},
        "chat_template": bool(md.get("tokenizer.chat_template")),
        "tensor_types": types,
        "convert_command": cmd,
        "convert_note": note,
    }


def _gguf_text(info: dict) -> str:
    hp, tk = info["hparams"], info["tokenizer"]

    def v(x, fmt="{}"):
        return "-" if x is None else fmt.format(x)

    tok_kind = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}.get(tk["model"], tk["model"])
    tied = {True: "yes", False: "no", None: "-"}[hp["tied_embeddings"]]
    L = [
        f"file           {info['path']} ({mb(info['file_bytes'])})",
        f"kind           GGUF v{info['gguf_version']}, not a pyklei file"
        + (f" (llama.cpp file type {info['file_type']})" if info["file_type"] else ""),
        f"name           {info['name'] or '-'}",
        f"architecture   {info['architecture'] or '-'}",
        f"parameters     {info['params'] / 1e6:.1f} M, {info['bits_per_weight']:.2f} bits per "
        f"weight overall",
        f"context        {v(hp['context_length'])} tokens",
        f"shape          {v(hp['n_layer'])} layers, embedding {v(hp['n_embd'])}, feed-forward "
        f"{v(hp['n_ff'])}, heads {v(hp['n_head'])} (kv {v(hp['n_head_kv'])}), head dim "
        f"{v(hp['head_dim'])}",
        f"rope           theta {v(hp['rope_theta'], '{:g}')}; tied embeddings: {tied}",
        f"vocab          {v(tk['vocab_size'])} tokens, {tok_kind or '-'}"
        + (f" (pre-tokenizer {tk['pre']})" if tk["pre"] else "")
        + f"; BOS {v(tk['bos_id'])}, EOS {tk['eos_ids']}",
        f"chat template  {'yes' if info['chat_template'] else 'no'}",
        "",
        "tensors by type",
    ]
    rows = [["type", "tensors", "params", "bytes", "bits/weight"]]
    for f, t in sorted(info["tensor_types"].items(), key=lambda kv: -kv[1]["bytes"]):
        rows.append([f, str(t["tensors"]), f"{t['params']:,}", mb(t["bytes"]),
                     f"{t['bits_per_weight']:.2f}"])
    rows.append(["total", str(sum(t["tensors"] for t in info["tensor_types"].values())),
                 f"{info['params']:,}", mb(info["tensor_bytes"]), f"{info['bits_per_weight']:.2f}"])
    L += table(rows, indent=2)
    L.append("")
    if info["convert_command"]:
        L += ["to run it with pyklei, convert it:", f"  {info['convert_command']}"]
    if info["convert_note"]:
        L += wrap("  " if info["convert_command"] else "", f"({info['convert_note']})")
    return "\n".join(L)


def info_text(info: dict) -> str:
    """model_info's dict as the text `pyklei info` prints."""
    if info.get("file_kind") == "gguf":
        return _gguf_text(info)
    hp, tk = info["hparams"], info["tokenizer"]
    tok_kind = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}.get(tk["model"], tk["model"])
    src = f", converted from {info['converted_from']}" if info["converted_from"] else ""
    L = [
        f"file           {info['path']} ({mb(info['file_bytes'])})",
        f"name           {info['name'] or '-'}",
        f"architecture   {info['architecture']} (pyklei format {info['pyklei_format_version']}{src})",
        f"parameters     {info['params'] / 1e6:.1f} M, {info['bits_per_weight']:.2f} bits per "
        f"weight overall",
        f"weights        4-bit values chosen by {info['weight_method']}"
        + (" (per-block scale search)" if info["weight_method"] == "rounding" else ""),
        f"context        {hp['context_length']} tokens",
        f"shape          {hp['n_layer']} layers, embedding {hp['n_embd']}, feed-forward {hp['n_ff']}, "
        f"heads {hp['n_head']} (kv {hp['n_head_kv']}), head dim {hp['head_dim']}",
        f"rope           theta {hp['rope_theta']:g}" + (f", {hp['rope_scaling']} scaling"
                                                        if hp["rope_scaling"] else "")
        + f"; tied embeddings: {'yes' if hp['tied_embeddings'] else 'no'}",
        *([f"family         {'; '.join(info['family'])}"] if info["family"] else []),
        f"vocab          {tk['vocab_size']} tokens, {tok_kind}"
        + (f" (pre-tokenizer {tk['pre']})" if tk["pre"] else "")
        + f"; BOS {tk['bos_id']}, EOS {tk['eos_ids']}",
        f"chat template  {'yes' if info['chat_template'] else 'no'}",
        "",
        "tensors by format",
    ]
    rows = [["format", "tensors", "params", "bytes", "bits/weight"]]
    for f, v in sorted(info["formats"].items(), key=lambda kv: -kv[1]["bytes"]):
        label = f + (f" (group {info['qsi4c32_block_size']})" if f == "qsi4c32" else "")
        rows.append([label, str(v["tensors"]), f"{v['params']:,}", mb(v["bytes"]),
                     f"{v['bits_per_weight']:.2f}"])
    rows.append(["total", str(sum(v["tensors"] for v in info["formats"].values())),
                 f"{info['params']:,}", mb(info["tensor_bytes"]), f"{info['bits_per_weight']:.2f}"])
    L += table(rows, indent=2)
    L += ["", f"cpu features   {' '.join(info['cpu_features']) or '(baseline only)'}",
          *wrap("kernels        ", ", ".join(info["kernels_available"])), "",
          *wrap("", f"kernel per weight on this CPU ({info['activations']} activations: decode "
                    f"runs m={info['m_decode']} rows, prefill m={info['m_prefill']} for a full "
                    f"chunk of {info['m_prefill'] // info['m_decode']} tokens; lm_head runs on "
                    f"the last position only)")]
    rows = [["weight", "N x K", "format", "layers", f"decode (m={info['m_decode']})",
             f"prefill (m={info['m_prefill']})"]]
    for r in info["layers"]:
        fmt = r["format"] + (f" -> {r['runtime_format']}" if "runtime_format" in r else "")
        rows.append([r["weight"], f"{r['n']} x {r['k']}", fmt, str(r["layers"]),
                     r["decode_kernel"], r["prefill_kernel"]])
    L += table(rows, indent=2)
    return "\n".join(L)


def _family_features(hp) -> list[str]:
    """What the file computes beyond Llama's block (pyklei/formats/families.py), for people."""
    out = sorted(hp.features)
    windows = [hp.window(i) for i in range(hp.n_layer)]
    if any(windows):
        local = sum(1 for w in windows if w)
        out.append(f"sliding window {max(windows)} on {local} of {hp.n_layer} layers")
    bases = sorted({hp.rope_base(i) for i in range(hp.n_layer)})
    if hp.layer_rope_base and len(bases) > 1:
        out.append("RoPE bases " + ", ".join("none" if b == 0 else f"{b:g}" for b in bases))
    scaled = [hp.rope_factor(i) for i in range(hp.n_layer) if hp.rope_factor(i) != 1.0]
    if scaled:
        out.append("RoPE linear scaling " + "/".join(f"{f:g}" for f in sorted(set(scaled)))
                   + f" on {len(scaled)} of {hp.n_layer} layers")
    if hp.rope_long_factors:
        out.append(f"LongRoPE long factors past {hp.rope_long_from} tokens of context")
    if hp.rope_dim != hp.head_dim:
        out.append(f"RoPE on {hp.rope_dim} of {hp.head_dim} dims")
    if hp.activation != "silu":
        out.append(f"activation {hp.activation}")
    if hp.embedding_scale != 1.0:
        out.append(f"embedding scale {hp.embedding_scale:g}")
    if hp.attention_scale:
        out.append(f"attention scale {hp.attention_scale:g}")
    if hp.logit_softcap:
        out.append(f"logit soft-cap {hp.logit_softcap:g}")
    if hp.pooling:
        out.append(f"embedding pooling {hp.pooling}")
    return out
