"""config.json of published checkpoints of each family: the fields that shape the model, as their
model cards' config.json files give them (Phi-4-mini's LongRoPE factor lists are stand-ins of
the right length, not its values). Tests check pyklei's shapes against them
(tests/converters/test_hf_families.py) and benchmarks build random checkpoints of these shapes
(benchmarks/random_family.py), since no hub is reachable here.
"""
from __future__ import annotations


def _phi4_factors(n, top):
    return [round(1 + (top - 1) * i / (n - 1), 3) for i in range(n)]


def _gemma3_image_text(**text):
    return dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
                boi_token_index=255999, eoi_token_index=256000, eos_token_id=[1, 106],
                image_token_index=262144, initializer_range=0.02, mm_tokens_per_image=256,
                text_config=dict(model_type="gemma3_text", **text,
                                 rope_scaling={"factor": 8.0, "rope_type": "linear"},
                                 sliding_window=1024))


PUBLISHED = {
    "Qwen3-0.6B": dict(architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                       sliding_window=None, max_window_layers=28, attention_bias=False, hidden_act="silu"),
    "Qwen3-1.7B": dict(architectures=["Qwen3ForCausalLM"], hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                       sliding_window=None, max_window_layers=28, attention_bias=False, hidden_act="silu"),
    "Qwen2.5-0.5B": dict(architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                         sliding_window=32768, max_window_layers=24, hidden_act="silu"),
    "Qwen2.5-1.5B": dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                         sliding_window=32768, max_window_layers=21, hidden_act="silu"),
    "gemma-3-1b-it": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                          hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                          max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
                          sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                          rope_scaling=None, rms_norm_eps=1e-6, final_logit_softcapping=None,
                          attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh"),
    # Gemma 3 4B / 12B / 27B: image-text checkpoints whose text_config lists only what differs
    # from Gemma3TextConfig's defaults (vision_config left out: pyklei converts the text part).
    # Linear RoPE scaling (factor 8) on the global layers only; 27B scales scores by
    # query_pre_attn_scalar 168, not head_dim 128.
    "gemma-3-4b-it": _gemma3_image_text(hidden_size=2560, intermediate_size=10240,
                                        num_hidden_layers=34),
    "gemma-3-12b-it": _gemma3_image_text(hidden_size=3840, intermediate_size=15360,
                                         num_attention_heads=16, num_hidden_layers=48,
                                         num_key_value_heads=8),
    "gemma-3-27b-it": _gemma3_image_text(head_dim=128, hidden_size=5376, intermediate_size=21504,
                                         num_attention_heads=32, num_hidden_layers=62,
                                         num_key_value_heads=16, query_pre_attn_scalar=168),
    "Phi-4-mini-instruct": dict(
        architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=0.75, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=262144,
        tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False,
        rope_scaling=dict(type="longrope", short_factor=_phi4_factors(48, 3.0),
                          long_factor=_phi4_factors(48, 64.0))),
    # Mistral's own small checkpoints: Ministral-8B-Instruct-2410 (its window is its whole
    # context, so no layer needs one) and Mistral-7B-v0.1 (a 4096 window on every layer)
    "Ministral-8B-Instruct-2410": dict(
        architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=131072, max_position_embeddings=32768, rope_theta=100000000.0,
        sliding_window=32768, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu"),
    "Mistral-7B-v0.1": dict(
        architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu"),
    "SmolLM3-3B": dict(architectures=["SmolLM3ForCausalLM"], hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                       vocab_size=128256, max_position_embeddings=65536, rope_theta=5000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                       sliding_window=None, no_rope_layers=[1, 1, 1, 0] * 9, hidden_act="silu"),
}
