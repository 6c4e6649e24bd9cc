"""The model runtime: a pyklei GGUF file loaded and run, from the kernel layer up to requests.

    kernels            the one face of the compiled extension (pyklei._ext): CPU features, kernels
    options            the model options' schema; activation_policy: which int8 activations
    model              Model: the file memory-mapped, the C forward pass, KV cache slots
    sampler            SamplingParams, the sampling options' schema, the sampler
    request            GenerationRequest: a request checked once, where it enters
    grammar            constraints (JSON schema, regex, grammar) as token masks
    speculative        drafts (prompt lookup, a draft model) and their cost model
    generate           Generation and stream_generate: one request decoded
    engine             Engine: many requests batched on one Model (engine_drafts: their drafts)

It stands on the text layer (pyklei.text) and the format layer (pyklei.formats); the API
(pyklei.llm), the server and the CLI stand on it. Importing a module of it that runs the model
loads the extension.
"""
