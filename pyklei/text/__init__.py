"""Text in and out of a model, read from its GGUF file alone (no runtime, no extension).

    tokenizer          Tokenizer: byte-level BPE (tiktoken) or SentencePiece, as Hugging Face's
    sentencepiece_proto  the SentencePiece ModelProto serialized from GGUF metadata
    detokenizer        StreamingDetokenizer: token ids to text, never a broken UTF-8 sequence
    chat_template      the model's own Jinja chat template, sandboxed
    tool_calls         tool calling: tools rendered into a prompt, calls parsed out of replies
    reasoning          a thinking model's <think> part kept apart from its answer

It stands on the format layer (pyklei.formats) alone.
"""
