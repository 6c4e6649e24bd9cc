"""llama.cpp's own quantized files in the quality harness (issue 15, item 1).

    python benchmarks/quality.py                        # pyklei's variants and these files
    python benchmarks/quality.py --llamacpp Q4_K_M,Q4_K_M+imatrix --variants default

For each test bed, from the same weights pyklei converts:

1. llama.cpp's convert_hf_to_gguf.py writes an f32 GGUF of the HF checkpoint;
2. llama-imatrix measures an importance matrix on pyklei's calibration text
   (pyklei.imatrix.default_calibration_text()), with the token budget and window of
   `pyklei convert --calibrate` (pyklei.pipeline.convert_calibrated: its first 8192 tokens in
   windows of 512);
3. llama-quantize writes each file of KINDS, with that matrix for the "+imatrix" kinds.

Each file is scored on its dequantized weights (the `gguf` package's dequantize, through
pyklei/converters/llamacpp_gguf.py; q/k rows back in Hugging Face order) loaded into a float32
transformers LlamaForCausalLM: the numbers llama.cpp multiplies, without its activation
rounding. An output.weight of its own becomes lm_head. quality.py scores the logits against
transformers fp32 on the original weights, on the same token ids.

llama.cpp is a measuring tool here, never a dependency: its sources (LLAMACPP_SRC, by default
llama-cpp-python 0.3.36's sdist) and built tools (LLAMACPP_BIN) are found through the
environment. Every file is cached under ~/.cache/pyklei/llamacpp/<bed>/, named by what made it,
so a re-run quantizes nothing.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[1]))  # pyklei_dev/ (not installed: its __init__.py)

import numpy as np

LLAMACPP_SRC = Path(os.environ.get(
    "LLAMACPP_SRC", "/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp"))
LLAMACPP_BIN = Path(os.environ.get("LLAMACPP_BIN", "/tmp/lcpp-build/bin"))

# name -> (llama-quantize type, with the importance matrix)
KINDS = {
    "Q4_0": ("Q4_0", False),
    "IQ4_NL": ("IQ4_NL", False),
    "Q4_K_M": ("Q4_K_M", False),
    "Q5_0": ("Q5_0", False),
    "Q6_K": ("Q6_K", False),
    "Q8_0": ("Q8_0", False),
    "Q4_0+imatrix": ("Q4_0", True),
    "IQ4_NL+imatrix": ("IQ4_NL", True),
    "Q4_K_M+imatrix": ("Q4_K_M", True),
}


def variant_name(kind: str) -> str:
    """The quality table's variant column: "llama.cpp Q4_K_M", "llama.cpp Q4_K_M +imatrix"."""
    return "llama.cpp " + kind.replace("+imatrix", " +imatrix")


def tools_missing() -> list[str]:
    need = [LLAMACPP_SRC / "convert_hf_to_gguf.py", LLAMACPP_BIN / "llama-quantize",
            LLAMACPP_BIN / "llama-imatrix"]
    return [str(p) for p in need if not p.is_file()]


def _run(cmd: list, log: Path, env: dict | None = None) -> None:
    """Runs a llama.cpp tool at low priority, its output into `log`; raises naming the log."""
    with open(log, "w") as f:
        rc = subprocess.run(["nice", "-n", "10", *map(str, cmd)], stdout=f,
                            stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{Path(cmd[0]).name} failed (rc {rc}), log {log}:\n" + "\n".join(tail))


def calibration_budget() -> tuple[int, int]:
    """(tokens, window) of `pyklei convert --calibrate`: read from convert_calibrated's defaults
    and its draft's context, so the two calibrations stay alike if those change."""
    from pyklei.calibration import convert_calibrated
    n_tokens = inspect.signature(convert_calibrated).parameters["n_tokens"].default
    return n_tokens, 512


def f32_gguf(hf_dir: Path, work: Path) -> Path:
    """llama.cpp's f32 GGUF of the checkpoint (its convert_hf_to_gguf.py)."""
    out = work / "f32.gguf"
    if not out.is_file():
        tmp = work / "f32.gguf.part"
        env = dict(os.environ, PYTHONPATH=str(LLAMACPP_SRC / "gguf-py"))
        _run([sys.executable, LLAMACPP_SRC / "convert_hf_to_gguf.py", hf_dir, "--outtype", "f32",
              "--outfile", tmp], work / "convert.log", env)
        tmp.rename(out)
    return out


def imatrix(f32: Path, work: Path, threads: int) -> Path:
    """llama-imatrix over pyklei's calibration text, pyklei's token budget and window."""
    from pyklei.calibration import default_calibration_text
    n_tokens, window = calibration_budget()
    out = work / f"imatrix-{n_tokens}x{window}.gguf"
    if not out.is_file():
        text = work / "calibration.txt"
        text.write_text(default_calibration_text())
        tmp = work / (out.name + ".part.gguf")
        _run([LLAMACPP_BIN / "llama-imatrix", "-m", f32, "-f", text, "-o", tmp, "-c", window,
              "--chunks", n_tokens // window, "-t", threads, "--no-ppl"], work / "imatrix.log")
        tmp.rename(out)
    return out


def make_files(hf_dir: Path, work: Path, kinds, threads: int = 2, log=print) -> dict[str, Path]:
    """{kind: llama.cpp file} for `kinds` (names of KINDS), made once and cached in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    f32 = f32_gguf(hf_dir, work)
    files = {}
    for kind in kinds:
        qtype, with_imatrix = KINDS[kind]
        out = work / f"{kind}.gguf"
        if not out.is_file():
            im = ["--imatrix", imatrix(f32, work, threads)] if with_imatrix else []
            tmp = work / f"{kind}.part.gguf"
            _run([LLAMACPP_BIN / "llama-quantize", *im, f32, tmp, qtype, threads],
                 work / f"quantize-{kind}.log")
            tmp.rename(out)
        files[kind] = out
        log(f"llama.cpp {kind}: {out.stat().st_size / 1e6:.1f} MB")
    return files


def dequantized_model(gguf_path: Path, hf_dir: Path):
    """A float32 transformers LlamaForCausalLM (config of hf_dir) with the dequantized weights
    of a llama.cpp file; its own output.weight, when stored, as lm_head."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from pyklei_dev.gguf_to_hf import _hf_name
    from pyklei.converters.hf_llama import unpermute_qk
    from pyklei.converters.llamacpp_gguf import gguf_source

    cfg = AutoConfig.from_pretrained(hf_dir)
    src = gguf_source(gguf_path)
    state = {}
    for t in src.tensors:
        if t.kind == "rope_freqs":
            continue
        w = np.asarray(t.read(0, t.shape[0]), np.float32).reshape(t.shape)
        if t.name.endswith(".attn_q.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif t.name.endswith(".attn_k.weight"):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        state[_hf_name(t.name)] = torch.from_numpy(np.array(w, np.float32, order="C"))  # writable
    if src.close:
        src.close()
    untied = "lm_head.weight" in state
    cfg.tie_word_embeddings = not untied
    model = LlamaForCausalLM(cfg).float()
    if not untied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise RuntimeError(f"{gguf_path}: missing {missing}, unexpected {unexpected}")
    return model.eval()


def _score_key(path: Path, hf_dir: Path, tname: str, ids: list[int]) -> str:
    """What a score depends on: the file, the reference weights, the token ids."""
    stamp = lambda p: f"{p.stat().st_size}:{p.stat().st_mtime_ns}"  # noqa: E731
    ref = ":".join(stamp(p) for p in sorted(hf_dir.glob("*.safetensors")))
    digest = hashlib.sha1(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16]
    return f"{path.name}|{stamp(path)}|{ref}|{tname}|{digest}"


def llamacpp_rows(bed: str, hf_dir: Path, ids_by_text: dict[str, list[int]], kinds,
                  work: Path, threads: int = 2) -> list[dict]:
    """quality.py's rows for llama.cpp's files of one test bed: each file dequantized once and
    run on every text. Scores are kept in work/scores.json (keyed by _score_key), so a re-run
    of quality.py adds these rows in seconds; delete that file to score again."""
    import torch

    from quality import reference, score

    log = lambda m: print(f"{bed} {m}", file=sys.stderr)  # noqa: E731
    files = make_files(hf_dir, work, kinds, threads, log)
    cache_path = work / "scores.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    refs = {}
    rows = []
    for kind, path in files.items():
        keys = {t: _score_key(path, hf_dir, t, ids) for t, ids in ids_by_text.items()}
        todo = [t for t in ids_by_text if keys[t] not in cache]
        model = dequantized_model(path, hf_dir) if todo else None
        for tname, ids in ids_by_text.items():
            if tname in todo:
                if tname not in refs:
                    refs[tname] = reference(hf_dir, ids)
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0].numpy()
                cache[keys[tname]] = score(refs[tname], logits, ids)
                cache_path.write_text(json.dumps(cache, indent=1))
            rows.append({"bed": bed, "text": tname, "variant": variant_name(kind),
                         "bytes": path.stat().st_size, **cache[keys[tname]]})
            log(str(rows[-1]))
        del model
    return rows


# ---- a test bed that is a llama.cpp file (Gemma 3 270M's Q4_K_M): llama.cpp's requantization

# ggml's own quantization of float32 rows and back (libggml-base.a of the llama.cpp build),
# for when llama-quantize itself is not built: `roundtrip TYPE ROWS COLS < f32 > f32`.
ROUNDTRIP_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    enum ggml_type t = GGML_TYPE_COUNT;
    for (int i = 0; i < GGML_TYPE_COUNT; i++)
        if (ggml_get_type_traits(i)->type_name && !strcmp(ggml_get_type_traits(i)->type_name, argv[1])) t = i;
    const long rows = atol(argv[2]), cols = atol(argv[3]);
    if (t == GGML_TYPE_COUNT || cols % ggml_blck_size(t)) return 3;
    float *x = malloc(sizeof(float) * rows * cols);
    const size_t rs = ggml_row_size(t, cols);
    char *q = malloc(rs * rows);
    if (fread(x, sizeof(float), rows * cols, stdin) != (size_t)(rows * cols)) return 4;
    ggml_quantize_init(t);
    ggml_quantize_chunk(t, x, q, 0, rows, cols, NULL);
    for (long r = 0; r < rows; r++) ggml_get_type_traits(t)->to_float(q + r * rs, x + r * cols, cols);
    fwrite(x, sizeof(float), rows * cols, stdout);
    return 0;
}
"""
GGML_BUILD = Path(os.environ.get("LLAMACPP_GGML_BUILD", Path.home() / ".cache/pyklei/llama.cpp/build"))


def roundtrip_tool(work: Path) -> Path | None:
    """The ggml round-trip program, built once against the llama.cpp build; None without one."""
    lib = GGML_BUILD / "ggml/src/libggml-base.a"
    if not lib.is_file():
        return None
    exe = work / "ggml-roundtrip"
    if not exe.is_file():
        work.mkdir(parents=True, exist_ok=True)
        (work / "roundtrip.c").write_text(ROUNDTRIP_C)
        cache = (GGML_BUILD / "CMakeCache.txt").read_text()
        src = next(line.split("=", 1)[1] for line in cache.splitlines()
                   if line.startswith("CMAKE_HOME_DIRECTORY:"))   # the sources it was built from
        subprocess.run(["g++", "-x", "c", "-O2", work / "roundtrip.c", "-x", "none",
                        f"-I{src}/ggml/include", lib, "-lm", "-lpthread", "-fopenmp", "-o", exe],
                       check=True)
    return exe


def requant_types(kind: str, n_embd: int) -> tuple[str, str]:
    """(the block weights' type, the tied embedding's) of `llama-quantize --allow-requantize
    SRC OUT kind` without an imatrix (src/llama-quant.cpp): the tied embedding is the output,
    Q6_K, which falls back to Q8_0 when n_embd is no multiple of Q6_K's 256."""
    qtype = KINDS[kind][0].lower()
    return qtype, "q6_K" if n_embd % 256 == 0 else "q8_0"


def requant_rows(bed: str, gguf: Path, ids_by_text: dict[str, list[int]], refs: dict, kinds,
                 work: Path) -> list[dict]:
    """quality.py's rows for llama.cpp's requantizations of a llama.cpp file, scored on their
    dequantized weights in transformers float32 (as llamacpp_rows): llama-quantize's file when
    it is built (LLAMACPP_BIN), else the source's float weights (what llama-quantize reads)
    through ggml's own quantizers (roundtrip_tool) at the types llama-quantize picks. File size:
    the source's, with each tensor's data at its new type."""
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
    from quality import reference_model, score

    rows = []
    for kind in kinds:
        out = work / f"{kind}.gguf"
        if KINDS[kind][1] and not (LLAMACPP_BIN / "llama-imatrix").is_file():
            print(f"{bed}: {kind} skipped (no llama-imatrix under {LLAMACPP_BIN})", file=sys.stderr)
            continue
        if (LLAMACPP_BIN / "llama-quantize").is_file() and not out.is_file():
            work.mkdir(parents=True, exist_ok=True)
            # the importance matrix as a llama.cpp user makes one: llama-imatrix running the
            # source file itself over pyklei's calibration text (imatrix())
            im = ["--imatrix", imatrix(gguf, work, 2)] if KINDS[kind][1] else []
            tmp = work / f"{kind}.part.gguf"
            _run([LLAMACPP_BIN / "llama-quantize", "--allow-requantize", *im, gguf, tmp, KINDS[kind][0]],
                 work / f"quantize-{kind}.log")
            tmp.rename(out)
        model = reference_model(out if out.is_file() else gguf)
        how = "llama-quantize" if out.is_file() else "ggml's quantizers"
        if not out.is_file():
            if KINDS[kind][1]:
                continue         # ggml's quantizers below take no importance matrix
            exe = roundtrip_tool(work)
            if exe is None:
                print(f"{bed}: {kind} skipped (neither llama-quantize nor libggml-base.a under "
                      f"{LLAMACPP_BIN}, {GGML_BUILD})", file=sys.stderr)
                continue
            block, embd = requant_types(kind, model.config.hidden_size)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() == 2:
                        qt = embd if "embed_tokens" in name else block
                        x = p.detach().numpy().astype(np.float32).tobytes()
                        y = subprocess.run([exe, qt, *map(str, p.shape)], input=x,
                                           capture_output=True, check=True).stdout
                        p.copy_(torch.from_numpy(np.frombuffer(y, np.float32).reshape(p.shape).copy()))
        size = gguf.stat().st_size
        if not out.is_file():
            block, embd = requant_types(kind, model.config.hidden_size)
            for t in GGUFReader(gguf).tensors:
                if len(t.shape) == 2 and not t.name.endswith("_norm.weight"):
                    qt = GGMLQuantizationType[(embd if t.name == "token_embd.weight" else block).upper()]
                    bs, ts = GGML_QUANT_SIZES[qt]
                    size += int(t.n_elements) * ts // bs - int(t.n_bytes)
        else:
            size = out.stat().st_size
        for tname, ids in ids_by_text.items():
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].numpy()
            rows.append({"bed": bed, "text": tname, "variant": f"{variant_name(kind)} ({how})",
                         "bytes": size, **score(refs[tname], logits, ids)})
            print(rows[-1], file=sys.stderr)
        del model
    return rows
