"""A small terminal chat on the pyklei API (the `pyklei chat` command is the full version).

    python examples/chat.py ~/.cache/pyklei/smollm2-135m-instruct-q4.gguf

Replies stream as they are generated; the KV cache keeps the conversation, so each turn only
runs its new tokens. Ctrl-C stops a reply, Ctrl-D (or an empty line then Ctrl-D) quits.
"""
import sys

import pyklei


def main(path: str) -> None:
    llm = pyklei.load(path)
    messages = [{"role": "system", "content": "You are a helpful, concise assistant."}]
    print(f"chatting with {path} ({llm.n_ctx}-token context); Ctrl-D quits")
    while True:
        try:
            user = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not user:
            continue
        messages.append({"role": "user", "content": user})
        reply = []
        print("bot> ", end="", flush=True)
        try:
            for r in llm.chat(messages, max_tokens=256, stream=True, temperature=0.7):
                print(r.text, end="", flush=True)
                reply.append(r.text)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        except ValueError as e:          # e.g. the conversation no longer fits the context
            print(f"\n(error: {e}; starting over)")
            del messages[1:]
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/chat.py MODEL.gguf")
    main(sys.argv[1])
