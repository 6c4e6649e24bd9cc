"""Plain-text pieces of the reports that pyklei.info, pyklei.bench, pyklei.chat and the CLI print."""
from __future__ import annotations

import textwrap
from typing import Collection, Sequence


def plural(k: int, word: str) -> str:
    """'1 turn', '2 turns'."""
    return f"{k} {word}" + ("" if k == 1 else "s")


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def table(rows: Sequence[Sequence[str]], indent: int = 0, right: Collection[int] = (),
          rule: bool = False) -> list[str]:
    """rows[0] is the header. Columns are left-aligned, those in `right` right-aligned; rule
    adds a line of dashes under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    if rule:
        rows = [rows[0], ["-" * w for w in widths], *rows[1:]]
    pad = " " * indent
    return [pad + "  ".join(v.rjust(w) if i in right else v.ljust(w)
                            for i, (v, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def wrap(label: str, text: str, width: int = 100) -> list[str]:
    """text wrapped to width, the first line after label, the others indented under it."""
    return textwrap.wrap(text, width, initial_indent=label, subsequent_indent=" " * len(label),
                         break_on_hyphens=False)
