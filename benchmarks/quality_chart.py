"""KLD against file size, one panel per test bed: benchmarks/results/quality.png.

    python benchmarks/quality_chart.py          # redraws it from benchmarks/results/quality.json

quality.py draws it after every run. Each point is one file: x its size in MB, y its KL
divergence from transformers fp32 (log scale), the mean over the texts of the run; pyklei's
variants and llama.cpp's files (benchmarks/llamacpp_quality.py) in their own colours, each
labelled. Lower and further left is better.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
STYLE = {  # engine -> (colour, marker)
    "pyklei": ("tab:blue", "o"),
    "llama.cpp": ("tab:orange", "s"),
    "llama.cpp +imatrix": ("tab:red", "^"),
}


def _engine(variant: str) -> str:
    engine = variant.split(" ", 1)[0]
    if engine == "llama.cpp" and variant.endswith("+imatrix"):
        return "llama.cpp +imatrix"
    return engine


def points(rows: list[dict]) -> dict[str, list[tuple[str, str, float, float]]]:
    """{bed: [(engine, label, MB, mean KLD over texts)]} for every row with a file."""
    acc: dict[tuple[str, str], list] = {}
    for r in rows:
        if r.get("bytes"):
            acc.setdefault((r["bed"], r["variant"]), [r["bytes"], []])[1].append(r["kld"])
    out: dict[str, list] = {}
    for (bed, variant), (nbytes, klds) in acc.items():
        label = variant.split(" ", 1)[1].replace(" +imatrix", "+imatrix")
        out.setdefault(bed, []).append((_engine(variant), label, nbytes / 1e6,
                                        sum(klds) / len(klds)))
    return out


def _label_heights(pts) -> list[float]:
    """Heights of the labels: each at its point, moved down (log scale) past the labels already
    placed near it, so that files of about the same size (Q4_0, IQ4_NL) stay readable."""
    logs = [math.log10(p[3]) for p in pts]
    mbs = [p[2] for p in pts]
    span = max(max(logs) - min(logs), 0.5)
    step, near = 0.045 * span, 0.06 * (max(mbs) - min(mbs) or 1.0)
    placed: list[tuple[float, float]] = []
    out = [0.0] * len(pts)
    for i in sorted(range(len(pts)), key=lambda i: -logs[i]):
        y = logs[i]
        while any(abs(mb - mbs[i]) < near and abs(py - y) < step for mb, py in placed):
            y -= step / 2
        placed.append((mbs[i], y))
        out[i] = 10 ** y
    return out


def draw(rows: list[dict], texts: list[str], tokens: int, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_bed = points(rows)
    fig, axes = plt.subplots(1, len(by_bed), figsize=(6.5 * len(by_bed), 5.2), squeeze=False)
    for ax, (bed, pts) in zip(axes[0], by_bed.items()):
        for engine, (colour, marker) in STYLE.items():
            sel = [p for p in pts if p[0] == engine]
            if sel:
                ax.scatter([p[2] for p in sel], [p[3] for p in sel], c=colour, marker=marker,
                           s=42, label=engine, zorder=3)
        span_mb = max(p[2] for p in pts) - min(p[2] for p in pts) or 1.0
        for (engine, label, mb, kld), y in zip(pts, _label_heights(pts)):
            ax.annotate(label, (mb, kld), xytext=(mb + 0.018 * span_mb, y), textcoords="data",
                        fontsize=7.5, color=STYLE[engine][0], va="center",
                        arrowprops=None if y == kld else dict(arrowstyle="-", lw=0.5, color="0.6"))
        ax.set_yscale("log")
        ax.set_xlabel("file size (MB)")
        ax.set_ylabel("KLD vs transformers fp32 (log)")
        ax.set_title(f"{bed}: mean of {' + '.join(texts)}, {tokens} tokens each", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        x0, x1 = ax.get_xlim()
        ax.set_xlim(x0, x1 + 0.12 * (x1 - x0))      # room for the labels on the right
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    report = json.loads((RESULTS / "quality.json").read_text())
    rows = report["rows"]
    texts = list(dict.fromkeys(r["text"] for r in rows))
    print(draw(rows, texts, report["tokens"], RESULTS / "quality.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
