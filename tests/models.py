"""Model fixtures for tests: tiny random Llama checkpoints and the real SmolLM2 HF checkpoint.

    from models import make_tiny_llama, smollm2_hf_dir     # tests/ is on sys.path in tests
    d = make_tiny_llama(tmp_path / "tiny", head_dim=64, tied=True, tokenizer="bpe", seed=0)
    AutoModelForCausalLM.from_pretrained(d)    # a real LlamaForCausalLM checkpoint

make_tiny_llama writes, with transformers (config + random weights) and tokenizers /
sentencepiece (a small tokenizer trained on generated text), a Llama 3.2-style checkpoint:
llama3 RoPE scaling (factor 32, low 1, high 4, original context 8192, theta 500000), GQA,
tied or untied embeddings, bf16 safetensors, tokenizer.json (Llama 3 pre-tokenizer, byte-level
BPE, <|begin_of_text|>/<|eot_id|> specials, chat template) or tokenizer.model (SentencePiece
BPE with byte fallback, Llama 2 style), tokenizer_config.json, generation_config.json.
Everything is deterministic in `seed`.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from it an be this which or are "
         "have had not but were his her they one all their there been has more when will would "
         "who what so out up into than them can only other new some could time these two may "
         "first then do any like my now over such our man me even most made after also did "
         "many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men "
         "work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three "
         "llama model token paris france capital river mountain number seven eleven").split()

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
SPM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def sample_text(n_lines: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        s = " ".join(words)
        s = s[0].upper() + s[1:] + rng.choice([".", "!", "?", ",", ";"])
        if rng.random() < 0.1:
            s += " Ünïcödé – “quotes” 日本語 🙂"
        lines.append(s)
    return lines


def _bpe_tokenizer(out: Path, vocab_size: int, seed: int) -> dict:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from pyklei.converters.hf_tokenizer import LLAMA3_REGEX

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(sample_text(seed=seed), trainer=trainer)
    n = tok.get_vocab_size()
    # Specials after the regular vocabulary, like Llama 3 (ids 128000+).
    tok.add_special_tokens(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    tok.save(str(out / "tokenizer.json"))
    eot, eos = tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")
    assert n + len(specials) <= vocab_size
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True, "model_max_length": 131072,
        "chat_template": LLAMA3_CHAT_TEMPLATE,
        "added_tokens_decoder": {str(tok.token_to_id(s)): {
            "content": s, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True} for s in specials},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return {"bos_token_id": bos, "eos_token_id": [eos, eot], "pad_token_id": None}


def _spm_tokenizer(out: Path, vocab_size: int, seed: int) -> dict:
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample_text(seed=seed)), model_writer=buf,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, split_digits=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, num_threads=1, minloglevel=2, add_dummy_prefix=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity")
    (out / "tokenizer.model").write_bytes(buf.getvalue())
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072,
        "chat_template": SPM_CHAT_TEMPLATE,
        "sp_model_kwargs": {},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}


def make_tiny_llama(dir, head_dim: int = 64, tied: bool = True, tokenizer: str = "bpe",
                    seed: int = 0, *, hidden_size: int = 256, n_head: int = 4, n_head_kv: int = 2,
                    n_layer: int = 2, intermediate_size: int = 512, vocab_size: int = 512,
                    dtype: str = "bfloat16", rope_scaling: bool = True,
                    init_std: float = 0.05) -> Path:
    """Write a tiny random Llama 3.2-style HF checkpoint into `dir` (created) and return it.

    tokenizer: "bpe" (Llama 3-style byte-level BPE tokenizer.json) or "spm" (SentencePiece
    tokenizer.model). With the defaults q has n_head*head_dim = 256 (head_dim 64) or 512
    (head_dim 128) rows, so head_dim 128 also covers n_head*head_dim != hidden_size.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bpe":
        ids = _bpe_tokenizer(out, vocab_size, seed)
    elif tokenizer == "spm":
        ids = _spm_tokenizer(out, vocab_size, seed)
    else:
        raise ValueError(f"tokenizer must be 'bpe' or 'spm', got {tokenizer!r}")
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192} if rope_scaling else None
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head_kv,
        head_dim=head_dim, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=tied,
        initializer_range=init_std, **ids)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 so a mix-up of norm weights shows
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def smollm2_hf_dir() -> Path:
    """The real SmolLM2-135M-Instruct HF checkpoint (~/.cache/pyklei/SmolLM2-135M-Instruct-hf),
    built from llama.cpp's Q4_1 GGUF on first use (see pyklei_dev.gguf_to_hf)."""
    from pyklei_dev.gguf_to_hf import smollm2_hf

    return smollm2_hf()


def make_offgrid_twin(src: Path, out: Path, sigma: float, seed: int = 0) -> Path:
    """A function-identical copy of a Llama checkpoint whose weights no longer sit on a 4-bit
    grid (issue 15's test bed; SmolLM2's weights come from a Q4_1 file, which flatters
    asymmetric 4-bit formats). Each linear's input channels are scaled by log-normal factors
    exp(N(0, sigma^2)) and the scaling is undone exactly where the network allows:

    - the RMSNorm gain before q/k/v (and before gate/up) takes s, those weights' columns 1/s;
    - up_proj's rows take s, down_proj's columns 1/s (SwiGLU is linear in the up branch);
    - v_proj's rows take s per KV head, o_proj's columns 1/s for every query head of the group.

    In exact arithmetic the logits are SmolLM2's; in float32 they agree to rounding
    (tests/test_offgrid.py). Written as float32 safetensors; tokenizer and config copied."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    from pyklei.converters.safetensors_mmap import SafetensorsModel

    cfg = json.loads((src / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    st = SafetensorsModel(src)
    w = {k: np.asarray(st.read(k), np.float32) for k in st.keys()}
    rng = np.random.default_rng(seed)

    def factors(n):
        return np.exp(rng.normal(0.0, sigma, n)).astype(np.float32)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm, linears in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj",
                                                   "self_attn.v_proj")),
                              ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            s = factors(cfg["hidden_size"])
            w[p + norm + ".weight"] *= s
            for lin in linears:
                w[p + lin + ".weight"] /= s[None, :]
        s = factors(cfg["intermediate_size"])
        w[p + "mlp.up_proj.weight"] *= s[:, None]
        w[p + "mlp.down_proj.weight"] /= s[None, :]
        s = factors(n_kv * hd)
        w[p + "self_attn.v_proj.weight"] *= s[:, None]
        per_q_head = s.reshape(n_kv, 1, hd).repeat(n_head // n_kv, axis=1).reshape(-1)
        w[p + "self_attn.o_proj.weight"] /= per_q_head[None, :]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in w.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def smollm2_offgrid_dir(sigma: float = 0.5) -> Path:
    """SmolLM2's off-grid twin (make_offgrid_twin), cached beside the other test models."""
    import os
    import tempfile

    from pyklei_dev.assets import cache_dir

    out = cache_dir() / f"SmolLM2-135M-Instruct-offgrid-s{sigma:g}"
    if not (out / "model.safetensors").is_file():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".offgrid-"))
        make_offgrid_twin(smollm2_hf_dir(), tmp, sigma)
        try:
            os.rename(tmp, out)
        except OSError:          # built meanwhile by another process
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# Tiny random checkpoints of the other families (issue 42): odd sizes, GQA, and every feature
# on, so that a converter that drops one is caught (tests/test_hf_families.py). Each entry: the
# transformers config class, the model class, and the config (vocab and specials come from the
# tokenizer).
FAMILY_CONFIGS = {
    # q/k/v biases; the sliding window only on layers >= max_window_layers
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=96, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=3,
        intermediate_size=160, use_sliding_window=True, sliding_window=16, max_window_layers=1,
        rope_theta=10000.0, tie_word_embeddings=True)),
    # q/k head norms; head_dim explicit (n_head * head_dim = 256 != hidden_size 160)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_hidden_layers=3, intermediate_size=224, rope_theta=1000000.0,
        tie_word_embeddings=False)),
    # a sliding window on every layer
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=160, num_attention_heads=5, num_key_value_heads=1, head_dim=32,
        num_hidden_layers=2, intermediate_size=288, sliding_window=20, rope_theta=10000.0,
        tie_word_embeddings=False)),
    # layers without RoPE (no_rope_layers: 0 = no RoPE)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        hidden_size=96, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=4,
        intermediate_size=160, no_rope_layers=[1, 0, 1, 0], rope_theta=10000.0,
        tie_word_embeddings=True)),
    # fused qkv / gate_up, partial rotary (rope_dim 16 of head_dim 32), LongRoPE with its
    # attention factor (max/original = 4: sqrt(1 + ln 4 / ln 64)), a window on every layer
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=192, sliding_window=24, max_position_embeddings=256,
        original_max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                             short_factor=[1.0, 1.3, 1.7, 2.2, 2.9, 3.5, 4.0, 4.6],
                             long_factor=[1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
                             original_max_position_embeddings=64))),
    # four norms per block, q/k norms, GeGLU, sqrt(d) embeddings, sliding layers with their
    # own RoPE base, query_pre_attn_scalar != head_dim, final logit soft-capping
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
        num_hidden_layers=4, intermediate_size=160, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        query_pre_attn_scalar=48, final_logit_softcapping=4.0, max_position_embeddings=512,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        tie_word_embeddings=True)),
}


def make_tiny_family(dir, family: str, seed: int = 0, *, vocab_size: int = 512,
                     dtype: str = "bfloat16", multimodal: bool = False, **overrides) -> Path:
    """Write a tiny random checkpoint of `family` (FAMILY_CONFIGS, with overrides) into `dir`
    and return it: transformers' own save_pretrained, a byte-level BPE tokenizer.json. Norm
    gains are random around their mean (1, or 0 for Gemma's 1 + w), biases nonzero.
    multimodal (gemma3): a Gemma3ForConditionalGeneration with a one-layer vision tower."""
    import torch
    import transformers

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = _bpe_tokenizer(out, vocab_size, seed)
    cfg_name, model_name, kw = FAMILY_CONFIGS[family]
    kw = {**kw, **overrides}
    cfg = getattr(transformers, cfg_name)(vocab_size=vocab_size, rms_norm_eps=1e-5,
                                          initializer_range=0.05, **{**ids, **kw})
    if multimodal:
        vision = transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14)
        cfg = transformers.Gemma3Config(text_config=cfg.to_dict(), vision_config=vision.to_dict(),
                                        mm_tokens_per_image=4, **ids)
        model_name = "Gemma3ForConditionalGeneration"
    cfg.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg)
    mean = 0.0 if family == "gemma3" else 1.0
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(mean + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out
