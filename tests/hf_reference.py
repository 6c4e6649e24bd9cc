"""transformers references for the runtime tests.

`dequantized_hf_model(gguf, hf_dir)` builds a float32 LlamaForCausalLM from an HF config
with the weights of a pyklei file dequantized (q/k rows back in Hugging Face order): the same
numbers the pyklei kernels multiply, so the remaining difference is pyklei's int8 activation
quantization and float summation order.
"""
from __future__ import annotations

import numpy as np

from pyklei.converters import ConversionError
from pyklei_dev.gguf_to_hf import _hf_name as gguf_hf_name
from pyklei.converters.hf_llama import unpermute_qk
from pyklei.formats.model_file import read_model


def _hf_name(name: str) -> str | None:
    try:
        return gguf_hf_name(name)
    except ConversionError:          # rope_freqs.weight: no Hugging Face tensor
        return None


def dequantized_hf_model(gguf_path, hf_dir):
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    mf = read_model(gguf_path)
    cfg = AutoConfig.from_pretrained(hf_dir)
    cfg.torch_dtype = torch.float32
    hp = mf.hparams
    state = {}
    for name, t in mf.tensors.items():
        hf = _hf_name(name)
        if hf is None:
            continue
        w = t.dequantize().astype(np.float32)
        if name.endswith("attn_q.weight"):
            w = unpermute_qk(w, hp.n_head)
        elif name.endswith("attn_k.weight"):
            w = unpermute_qk(w, hp.n_head_kv)
        state[hf] = torch.from_numpy(np.ascontiguousarray(w))
    if hp.tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = LlamaForCausalLM(cfg).float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


def hf_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long))
    return out.logits[0].float().numpy()


def english_text() -> str:
    """Real English prose that every Python ships: the Language Reference topics (pydoc_data)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in ("assignment", "if", "while", "for", "try", "with",
                                           "function", "class", "import", "numbers"))


def add_rotation_hooks(model, gguf_path):
    """Makes a dequantized_hf_model of a rotated file compute what pyklei's forward pass does:
    rotate the SwiGLU output before down_proj and, for a tied rotated file, bring the final
    norm's output back (Q^T), apply its gain, rotate again (Q). Returns the model."""
    import torch

    rots = read_model(gguf_path).rotations
    if "ffn_down" in rots:
        q_f = torch.from_numpy(rots["ffn_down"].dense().astype(np.float32))
        for layer in model.model.layers:
            layer.mlp.down_proj.register_forward_pre_hook(lambda mod, inp: (inp[0] @ q_f,))
    if "output" in rots:
        q_r = torch.from_numpy(rots["output"].dense().astype(np.float32))
        norm = model.model.norm
        gain = norm.weight.detach().clone()
        with torch.no_grad():
            norm.weight.fill_(1.0)
        norm.register_forward_hook(lambda mod, inp, out: ((out @ q_r.T) * gain) @ q_r)
    return model
