"""A walk through the pyklei API as an interactive session: each step is printed as you
would type it at the Python prompt, followed by its result.

    python examples/repl_session.py [MODEL.gguf]

MODEL defaults to ~/.cache/pyklei/smollm2-135m-instruct-q4.gguf, which
examples/convert_and_generate.py makes. Paste the `>>>` lines into `python` to try them.
"""
import code
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # pyklei_dev/ (not installed: its __init__.py)
from pyklei_dev.assets import cache_dir  # noqa: E402

STEPS = [
    "import pyklei, numpy as np",
    "llm = pyklei.load(MODEL, n_ctx=2048)      # mmaps the weights; threads = physical cores",
    "llm.model.hparams.n_layer, llm.n_ctx, llm.model.n_threads",
    "round(llm.model.load_seconds, 2), llm.model.weights_owned_bytes, llm.model.state_bytes",
    "pyklei.cpu_features()",
    "# 1. generate: one response with the whole text and its statistics",
    "r = llm.generate('The capital of France is', max_tokens=12, temperature=0)",
    "r.text, r.finish_reason, r.generation_tokens",
    "round(r.time_to_first_token, 3), round(r.prompt_tps), round(r.generation_tps)",
    "# 2. stream: one response per step, .text is the new piece",
    "for r in llm.generate('Three primary colours:', max_tokens=16, stream=True, temperature=0, "
    "stop=['\\n\\n']):\n    print(r.text, end='' if r.finish_reason is None else '\\n', flush=True)",
    "# 3. chat: the model's own template; the KV cache keeps the conversation",
    "msgs = [{'role': 'user', 'content': 'What is the capital of Japan?'}]",
    "reply = llm.chat(msgs, max_tokens=32, temperature=0)",
    "reply.text",
    "msgs += [{'role': 'assistant', 'content': reply.text}, "
    "{'role': 'user', 'content': 'And the capital of Italy?'}]",
    "r2 = llm.chat(msgs, max_tokens=32, temperature=0)",
    "r2.text, r2.prompt_tokens, r2.prompt_eval_tokens    # only the new turn ran",
    "# 4. sampling: temperature, top_k, top_p, min_p, repetition_penalty, seed",
    "llm.generate('Once upon a time', max_tokens=16, temperature=0.9, top_k=40, seed=7).text",
    "# 5. tokens and logits",
    "ids = llm.encode('The capital of France is')",
    "ids, llm.decode(ids)",
    "logits = llm.logits(ids)                 # float32 [len(ids), vocab], every position",
    "logits.shape",
    "llm.decode([int(logits[-1].argmax())])   # the most likely next token",
    "p = np.exp(logits[-1] - logits[-1].max()); p /= p.sum()",
    "[(llm.decode([int(i)]), round(float(p[i]), 3)) for i in np.argsort(-p)[:5]]",
]


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else str(cache_dir() / "smollm2-135m-instruct-q4.gguf")
    console = code.InteractiveConsole({"MODEL": model})
    print(f">>> MODEL = {model!r}")
    for step in STEPS:
        if step.startswith("#"):
            print(f"\n{step}")
            continue
        lines = step.split("\n")
        print(">>> " + lines[0])
        for line in lines[1:]:
            print("... " + line)
        src = step + ("\n" if len(lines) > 1 else "")
        more = False
        for line in src.split("\n"):
            more = console.push(line)
        if more:
            console.push("")
        if getattr(sys, "last_value", None) is not None:
            raise SystemExit(f"step failed: {step}")


if __name__ == "__main__":
    main()
