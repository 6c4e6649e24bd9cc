"""A small terminal chat on the pyklei API (the `pyklei chat` command is the full version).

    python examples/chat.py ~/.cache/pyklei/smollm2-135m-instruct-q4.gguf

pyklei.chat.ChatSession keeps the conversation: replies stream as they are generated, the KV
cache keeps what came before, so each turn only runs its new tokens, and the oldest turns are
dropped when the next one would not fit the context. Ctrl-C stops a reply, Ctrl-D quits.
"""
import sys

import pyklei
from pyklei.chat import ChatSession


def main(path: str) -> None:
    llm = pyklei.load(path)
    session = ChatSession(llm, system="You are a helpful, concise assistant.", max_tokens=256,
                          sampling={"temperature": 0.7})
    print(f"chatting with {path} ({llm.n_ctx}-token context); Ctrl-D quits")
    while True:
        try:
            user = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not user:
            continue
        print("bot> ", end="", flush=True)
        try:
            _, interrupted, dropped = session.reply(
                user, write=lambda text: print(text, end="", flush=True))
        except ValueError as e:          # the message alone does not fit the context
            print(f"\n(error: {e})")
            continue
        print(" [stopped]" if interrupted else "")
        if dropped:
            print(f"(forgot the oldest {dropped} turn(s) to stay within the context)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/chat.py MODEL.gguf")
    main(sys.argv[1])
