"""Which tokens end a generation: the one rule, read from a file's tokenizer metadata.

The tokenizer (``Tokenizer.eos_ids``, which the API, the engine and the server stop on), the
model file (``ModelFile.eos_token_ids``, what ``pyklei info`` shows) and the converters (which
write ``tokenizer.ggml.eot_token_id`` and ``pyklei.eos_token_ids``) all call
:func:`end_of_generation_ids`, so the set cannot differ between them.

The rule, in this order, without repeats:

1. the ids the metadata names: ``tokenizer.ggml.eos_token_id``, ``eot_token_id``,
   ``eom_token_id``, then every id of ``pyklei.eos_token_ids`` (a converter's list, from the
   checkpoint's generation_config);
2. every token of the vocabulary whose text is an end-of-turn or end-of-text token of a family
   pyklei knows (:data:`END_OF_TURN_TEXTS`), when it is a CONTROL token. Instruct models end
   a turn with a token their base model's ``eos_token_id`` does not name (Gemma's
   ``<end_of_turn>`` beside ``<eos>``, Qwen's ``<|im_end|>`` beside ``<|endoftext|>``), and
   llama.cpp files often name only one of them.

A USER_DEFINED token counts only when its text is ``<|...|>``-delimited: Gemma's vocabulary has
``</s>`` as a plain HTML tag (USER_DEFINED, beside ``<u>``, ``<sub>``), which must not stop
generation, while an ``<|im_end|>`` marked USER_DEFINED by some converter still ends a turn.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .gguf_keys import KEY_EOS_IDS, TOKEN_CONTROL, TOKEN_USER_DEFINED

__all__ = ["END_OF_TURN_TEXTS", "EOS_ID_KEYS", "EndOfGenerationError", "end_of_generation_ids",
           "turn_token_id"]

#: token text -> its role: "eot" ends an assistant turn (llama.cpp's eot_token_id), "eom" ends a
#: message that waits for a tool (eom_token_id), "eos" ends the text.
END_OF_TURN_TEXTS: dict[str, str] = {
    "<|eot_id|>": "eot", "<|eom_id|>": "eom", "<|end_of_text|>": "eos",   # Llama 3.x
    "<end_of_turn>": "eot", "<eos>": "eos",                               # Gemma 2/3
    "<|im_end|>": "eot", "<|endoftext|>": "eos",   # ChatML: Qwen2.5/3, SmolLM2/3; GPT-2's EOS
    "<|end|>": "eot",                                                     # Phi-3, Phi-4-mini
    "</s>": "eos",                                                        # Llama 2, Mistral
    "<|end_of_turn|>": "eot", "<|eot|>": "eot", "<EOT>": "eot",           # others seen in GGUFs
}

#: The metadata keys naming end-of-generation ids, in the order their ids come first.
EOS_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
               "tokenizer.ggml.eom_token_id")


class EndOfGenerationError(ValueError):
    """A key that names end-of-generation ids holds something that is not a token id."""


def _is_id(v: Any, n: int) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= v < n


def _counts(text: str, token_type: int) -> bool:
    if token_type == TOKEN_CONTROL:
        return True
    return token_type == TOKEN_USER_DEFINED and text.startswith("<|") and text.endswith("|>")


def end_of_generation_ids(meta: Mapping[str, Any], strict: bool = False) -> list[int]:
    """Every token id that ends a generation, by the rule of the module doc.

    ``meta`` holds the file's ``tokenizer.*`` metadata (numpy arrays or lists). With
    ``strict`` a key of rule 1 that holds anything but ids in [0, vocabulary size) raises
    :class:`EndOfGenerationError` naming it (the model loader refuses such a file); without,
    such values are left out (the tokenizer reads whatever a file has).
    """
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, (list, tuple)) else []     # a broken file's: no vocabulary
    n = len(tokens)
    out: list[int] = []

    def take(key: str, v: Any) -> None:
        if not _is_id(v, n):
            if strict:
                raise EndOfGenerationError(f"{key} holds {v!r}, not a token id in [0, {n})")
            return
        if int(v) not in out:
            out.append(int(v))

    for key in EOS_ID_KEYS:
        if meta.get(key) is not None:
            take(key, meta[key])
    listed = meta.get(KEY_EOS_IDS)
    if listed is not None:
        if isinstance(listed, np.ndarray):
            listed = listed.tolist()
        if not isinstance(listed, (list, tuple)):
            if strict:
                raise EndOfGenerationError(f"{KEY_EOS_IDS} is not an array of token ids")
            listed = []
        for v in listed:
            take(KEY_EOS_IDS, v)
    types = meta.get("tokenizer.ggml.token_type")
    if isinstance(types, (list, tuple, np.ndarray)) and len(types) == n:
        types = np.asarray(types)
        for i in np.nonzero((types == TOKEN_CONTROL) | (types == TOKEN_USER_DEFINED))[0].tolist():
            t = tokens[i]
            if t in END_OF_TURN_TEXTS and _counts(t, int(types[i])) and i not in out:
                out.append(i)
    return out


def turn_token_id(tokens, token_types, role: str, prefer=()) -> int | None:
    """The id a converter writes as ``tokenizer.ggml.<role>_token_id`` ("eot" or "eom"): the
    first of ``prefer`` (ids the checkpoint names as EOS) whose text has that role, else the
    first token of the vocabulary, in :data:`END_OF_TURN_TEXTS` order, with that role that
    :func:`end_of_generation_ids` counts."""
    for i in prefer:
        if 0 <= i < len(tokens) and END_OF_TURN_TEXTS.get(tokens[i]) == role:
            return int(i)
    index: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in END_OF_TURN_TEXTS:
            index.setdefault(t, i)
    for text, r in END_OF_TURN_TEXTS.items():
        i = index.get(text)
        if r == role and i is not None and _counts(text, int(token_types[i])):
            return i
    return None
