"""`pyklei chat`: the terminal REPL around pyklei.chat.ChatSession (line input, /commands,
Ctrl-C stops a reply, Ctrl-D leaves)."""
from __future__ import annotations

import sys
from pathlib import Path

from .._report import plural
from ._common import (CLIError, _add_chat_template_option, _add_command, _add_constraint_options,
                      _add_model_options, _add_sampling_options, _add_speculative_options,
                      _chat_template_kwargs, _check_constraint, _constraint, _load, _sampling,
                      _speculative)

CHAT_HELP = """\
commands:
  /help           this help
  /stats          speed and memory of the last reply, context in use
  /reset          forget the conversation (keeps the system prompt)
  /system [TEXT]  show, or set (and reset the conversation with) a system prompt
  /exit           leave (or Ctrl-D)
Ctrl-C stops a reply; what was written of it stays in the conversation.
End a line with \\ to continue the message on the next line."""


def add_parser(sub):
    ch = _add_command(
        sub, "chat", "interactive chat in the terminal",
        "Chat with the model in the terminal; replies stream as they are written.\n\n"
        + CHAT_HELP + "\n\n"
        "The conversation stays in the context window: when the next turn would not fit "
        "(prompt + --max-tokens > --ctx-size), the oldest turns are dropped, oldest first "
        "(the system prompt is kept), and a note says so. The KV cache keeps the "
        "conversation, so a turn only runs its new tokens (except after turns are dropped).")
    ch.add_argument("model", metavar="MODEL", help="pyklei .gguf file with a chat template")
    ch.add_argument("--system", metavar="TEXT", help="system prompt (default: the chat template's own, if any)")
    _add_chat_template_option(ch)
    _add_sampling_options(ch, max_tokens=512, n_help="reply length at most, in tokens")
    _add_constraint_options(ch)
    _add_speculative_options(ch)
    _add_model_options(ch)
    ch.set_defaults(func=run)
    return ch


def _read_message(prompt="> ", more="... "):
    """One message from the user (a trailing backslash continues it). None on EOF."""
    lines = []
    while True:
        try:
            line = input(prompt if not lines else more)
        except EOFError:
            if lines:
                return "\n".join(lines)
            return None
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def _command(session, cmd: str, out) -> bool:
    """Runs a /command; False when it says to leave."""
    word, _, rest = cmd.partition(" ")
    if word in ("/exit", "/quit", "/bye"):
        return False
    if word in ("/help", "/?"):
        print(CHAT_HELP, file=out)
    elif word == "/reset":
        session.reset()
        print("(conversation reset)", file=out)
    elif word == "/stats":
        print(session.stats_text(), file=out)
    elif word == "/system":
        if rest.strip():
            session.system = rest.strip()
            session.reset()
            print("(system prompt set; conversation reset)", file=out)
        else:
            print(f"system prompt: {session.system or '(none: the template default)'}", file=out)
    else:
        print(f"unknown command {word}; /help lists the commands", file=out)
    out.flush()
    return True


def run(args) -> int:
    from ..chat import ChatSession, MessageTooLongError

    constrain = _constraint(args)
    template_kwargs = _chat_template_kwargs(args)      # a bad one fails before the model loads
    llm = _load(args)
    if not llm.tokenizer.chat_template:
        raise CLIError(f"{args.model} has no chat template; pass one with --chat-template FILE, "
                       f"or use `pyklei generate`")
    _check_constraint(llm, constrain)
    session = ChatSession(llm, system=args.system, max_tokens=args.max_tokens,
                          sampling=_sampling(args), stop=args.stop, constrain=constrain,
                          speculative=_speculative(args),
                          template_kwargs=template_kwargs)
    session.prepare("hello")  # renders the template once: template errors show up now
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    out = sys.stdout
    name = llm.model.file.metadata.get("general.name") or Path(args.model).stem
    print(f"pyklei chat: {name} ({llm.n_ctx}-token context, {plural(llm.model.n_threads, 'thread')}). "
          f"/help for commands, Ctrl-C stops a reply, Ctrl-D or /exit leaves.", file=out)
    out.flush()

    tty = out.isatty()
    thinking = False             # inside a reply's reasoning, which is shown apart (dimmed)

    def write(text):
        nonlocal thinking
        if thinking:             # the answer starts: close the reasoning as ollama does
            out.write(("\033[0m" if tty else "") + "\n...done thinking.\n\n")
            thinking = False
        out.write(text)
        out.flush()

    def write_reasoning(text):
        nonlocal thinking
        if not thinking:
            out.write(("\033[2m" if tty else "") + "Thinking...\n")
            thinking = True
        out.write(text)
        out.flush()

    while True:
        try:
            msg = _read_message()
        except KeyboardInterrupt:      # Ctrl-C at the prompt: a fresh prompt, like a shell
            print(file=out)
            continue
        if msg is None:                # Ctrl-D
            print(file=out)
            return 0
        cmd = msg.strip()
        if not cmd:
            continue
        if cmd.startswith("/"):
            if not _command(session, cmd, out):
                return 0
            continue
        try:
            text, interrupted, dropped = session.reply(msg, write, write_reasoning)
        except MessageTooLongError as e:
            print(f"error: {e}", file=out)
            continue
        if thinking:             # the reply ended (or was cut) while still reasoning
            out.write(("\033[0m" if tty else "") + "\n")
            thinking = False
        if interrupted:
            write("\n[stopped]\n")
        elif not text.endswith("\n"):
            write("\n")
        if dropped:
            print(f"[dropped the oldest {plural(dropped, 'turn')} to stay within the {llm.n_ctx}-token "
                  f"context]", file=out)
        out.flush()
