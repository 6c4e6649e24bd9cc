"""Regenerates the command-line samples of docs/CLI.md by running the commands they show, and
the flag tables of docs/ from the commands' argparse parsers.

    python scripts/update_cli_docs.py           # run every sample's commands, rewrite the docs
    python scripts/update_cli_docs.py --check   # rewrite nothing; exit 1 if an exact sample or a
                                                # flag table is stale

A sample is the fenced block after a marker line `<!-- sample: KIND; ... -->`. In it a line
`$ COMMAND` (continued over the next lines while a quote is open or the line ends in `\\`) is
run by bash, and everything up to the next `$ ` line is what it printed (stdout and stderr, as a
terminal shows them). After a `pyklei chat` command, the lines `> TEXT` are what the user
typed: the chat runs under a pseudo-terminal (pexpect) that types them at its prompts, so the
transcript is the one a user sees. KIND is `exact` (help texts, errors, `info`, greedy replies:
the same on every run on the same CPU) or `timing` (bench and --stats figures: only their
shape repeats). The script rewrites each sample and its marker, which records the date and the
CPU features the sample was made on.

The commands run as the doc says, in a session of their own: HOME is a temporary directory
whose ~/.cache/pyklei holds links to the model files of the real cache (the file
examples/convert_and_generate.py writes, and llama.cpp's SmolLM2 GGUF), `M` is what the doc's
own `M=...` line sets, the working directory is an empty temporary one shared by every
command, COLUMNS=100 fixes the help texts' width, and the temporary HOME is written back as
`~` in the output. tests/docs/test_docs.py runs the same session on the test's own model file.

A flag table is the block between `<!-- flags: pyklei COMMAND ... -->` and `<!-- flags: end -->`
(docs/SERVE.md's for `pyklei serve`): one row per option of the command's own argument groups,
its flags and its help as `pyklei COMMAND --help` words it (defaults filled in), then one row
naming the flags of the shared "model" group, which docs/CLI.md describes. The help strings in
pyklei/cli/ are the one place of that text.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # pyklei_dev/ (not installed: its __init__.py)
CLI_DOC = ROOT / "docs" / "CLI.md"
FLAG_DOCS = [ROOT / "docs" / "SERVE.md"]
# the model files a session's ~/.cache/pyklei holds (names as the docs write them)
MODEL = "smollm2-135m-instruct-q4.gguf"
LLAMACPP_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

MARKER = re.compile(r"^<!-- sample: (exact|timing)(?:;[^>]*)? -->\n```\n(.*?)^```\n", re.S | re.M)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")
CHAT_PROMPT = "> "


def split_sample(body: str) -> list[tuple[str, list[str]]]:
    """A sample's (command, output lines) pairs, in order."""
    pairs: list[tuple[str, list[str]]] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            raise ValueError(f"a sample must start with a `$ ` command line: {lines[i]!r}")
        cmd = lines[i][2:]
        while not _complete(cmd):
            i += 1
            cmd += "\n" + lines[i]
        i += 1
        out = []
        while i < len(lines) and not lines[i].startswith("$ "):
            out.append(lines[i])
            i += 1
        pairs.append((cmd, out))
    return pairs


def _complete(cmd: str) -> bool:
    if cmd.endswith("\\"):
        return False
    try:
        shlex.split(cmd)
    except ValueError:                    # a quote still open
        return False
    return True


def cpu_features() -> str:
    from pyklei.runtime.kernels import cpu_features as features
    return " ".join(features()) or "baseline"


class Session:
    """The environment every sample command runs in (see the module's docstring)."""

    def __init__(self, model: Path, llamacpp_gguf: Path | None, doc_text: str):
        self.tmp = Path(tempfile.mkdtemp(prefix="pyklei-docs-"))
        self.home = self.tmp / "home"
        self.cwd = self.tmp / "work"
        cache = self.home / ".cache" / "pyklei"
        cache.mkdir(parents=True)
        self.cwd.mkdir()
        (cache / MODEL).symlink_to(Path(model).resolve())
        if llamacpp_gguf is not None:
            (cache / LLAMACPP_GGUF).symlink_to(Path(llamacpp_gguf).resolve())
        bindir = Path(sys.executable).parent     # the `pyklei` of this Python's environment
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYKLEI_CACHE", "PYKLEI_KERNEL", "PYKLEI_LOG")}
        self.env.update(HOME=str(self.home), COLUMNS="100", LC_ALL="C.UTF-8",
                        PATH=f"{bindir}{os.pathsep}{self.env.get('PATH', '')}")
        m = re.search(r"^M=(\S+)$", doc_text, re.M)      # the doc's own `M=...` line
        if m:
            self.env["M"] = m.group(1).replace("~", str(self.home), 1)

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def tidy(self, text: str) -> list[str]:
        text = ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
        text = text.replace(str(self.home), "~")
        lines = [ln.rstrip() for ln in text.split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    def run(self, cmd: str, doc_out: list[str]) -> list[str]:
        """Runs one command; its output lines (a chat's with the typed lines, as `> TEXT`)."""
        if re.match(r"pyklei chat\b", cmd):
            typed = [ln[len(CHAT_PROMPT):] for ln in doc_out if ln.startswith(CHAT_PROMPT)]
            if not typed or typed[-1] not in ("/exit", "/quit"):
                raise ValueError(f"a chat sample types lines `> TEXT`, the last /exit: {cmd}")
            return self._chat(cmd, typed)
        r = subprocess.run(["bash", "-c", cmd], cwd=self.cwd, env=self.env, timeout=300,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self.tidy(r.stdout)

    def _chat(self, cmd: str, typed: list[str]) -> list[str]:
        import io

        import pexpect
        child = pexpect.spawn("bash", ["-c", cmd], cwd=str(self.cwd), env=self.env,
                              encoding="utf-8", timeout=120, dimensions=(50, 200))
        child.logfile_read = transcript = io.StringIO()   # all it printed, the typing echoed
        try:
            for text in typed:
                child.expect_exact("\n" + CHAT_PROMPT)
                child.send(text + "\n")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
        return self.tidy(transcript.getvalue())


def regenerate_sample(session: Session, body: str) -> str:
    out = []
    for cmd, doc_out in split_sample(body):
        out += ["$ " + cmd] + session.run(cmd, doc_out)
    return "\n".join(out) + "\n"


def regenerate(doc_text: str, session: Session) -> tuple[str, list[tuple[str, str, str]]]:
    """The doc with every sample made again, and each sample's (kind, old body, new body)."""
    stamp = f"regenerated by scripts/update_cli_docs.py on {datetime.date.today()}, " \
            f"CPU {cpu_features()}"
    samples = []

    def one(m: re.Match) -> str:
        kind, body = m.group(1), m.group(2)
        new = regenerate_sample(session, body)
        samples.append((kind, body, new))
        return f"<!-- sample: {kind}; {stamp} -->\n```\n{new}```\n"

    return MARKER.sub(one, doc_text), samples


FLAGS = re.compile(r"^(<!-- flags: pyklei (\w+)\b[^>]*-->\n)(.*?)^(<!-- flags: end -->\n)",
                   re.S | re.M)
# argparse's own groups: the positional MODEL and --help/--debug are not the command's options
ARGPARSE_GROUPS = ("positional arguments", "options")
SHARED_GROUP = "model"                  # pyklei/cli/_common.py's _add_model_options


def command_parser(command: str):
    """`pyklei COMMAND`'s argparse parser, as the CLI builds it."""
    import argparse

    from pyklei.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flags_table(command: str) -> str:
    """The markdown table of `pyklei COMMAND`'s flags (see the module's docstring)."""
    p = command_parser(command)
    fmt = p._get_formatter()

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    rows = ["| flag | what it does |", "|---|---|"]
    for group in p._action_groups:
        if group.title in ARGPARSE_GROUPS or not group._group_actions:
            continue
        if group.title == SHARED_GROUP:
            flags = ", ".join(f"`{a.option_strings[0]}`" for a in group._group_actions)
            rows.append(f"| {flags} | the model options of every command (docs/CLI.md) |")
            continue
        for a in group._group_actions:
            invocation = fmt._format_action_invocation(a)        # "--parallel N, -np N"
            flags = ", ".join(f"`{f}`" for f in invocation.split(", "))
            rows.append(f"| {flags} | {cell(fmt._expand_help(a))} |")
    return "\n".join(rows) + "\n"


def regenerate_flags(doc_text: str) -> tuple[str, list[tuple[str, str, str]]]:
    """The doc with every flag table made again, and each table's (command, old, new)."""
    tables = []

    def one(m: re.Match) -> str:
        new = flags_table(m.group(2))
        tables.append((m.group(2), m.group(3), new))
        return m.group(1) + new + m.group(4)

    return FLAGS.sub(one, doc_text), tables


def main(argv=None) -> int:
    from pyklei_dev.assets import cache_dir
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="rewrite nothing; exit 1 if an exact sample differs from a fresh run")
    ap.add_argument("--model", type=Path, default=cache_dir() / MODEL,
                    help="the pyklei SmolLM2 file (default: the one examples/convert_and_generate.py writes)")
    ap.add_argument("--llamacpp-gguf", type=Path, default=cache_dir() / LLAMACPP_GGUF)
    args = ap.parse_args(argv)
    text = CLI_DOC.read_text()
    with Session(args.model, args.llamacpp_gguf, text) as session:
        new_text, samples = regenerate(text, session)
    stale = [(old, new) for kind, old, new in samples if kind == "exact" and old != new]
    flag_docs = {doc: regenerate_flags(doc.read_text()) for doc in FLAG_DOCS}
    stale_tables = [(doc, command, old, new) for doc, (_, tables) in flag_docs.items()
                    for command, old, new in tables if old != new]
    if args.check:
        for old, new in stale:
            print(f"stale sample:\n{old}---- now:\n{new}", file=sys.stderr)
        for doc, command, old, new in stale_tables:
            print(f"stale flag table of pyklei {command} in {doc.relative_to(ROOT)}:\n{old}"
                  f"---- now:\n{new}", file=sys.stderr)
        return 1 if stale or stale_tables else 0
    CLI_DOC.write_text(new_text)
    for doc, (doc_text, _) in flag_docs.items():
        doc.write_text(doc_text)
    print(f"{len(samples)} samples regenerated in {CLI_DOC.relative_to(ROOT)} "
          f"({len(stale)} exact ones changed); "
          f"{sum(len(t) for _, t in flag_docs.values())} flag tables ({len(stale_tables)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
