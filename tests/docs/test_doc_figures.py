"""Measured figures have one place: the results files the benchmarks write.

README.md's prose names no measured figure (its benchmark tables sit between `<!-- NAME:begin -->`
and `<!-- NAME:end -->` markers, which benchmarks/compare.py rewrites); it points to the docs
and benchmarks/results instead. docs/QUALITY.md's two tables of the default conversion and the
ladder repeat benchmarks/results/quality.json (`python benchmarks/quality.py`) cell by cell, and
its speed table beside llama.cpp repeats benchmarks/results/speed-vs-llamacpp.json
(`python benchmarks/speed_vs_llamacpp.py`); both are checked against their file here, so a rerun
of a benchmark that moves a figure fails this test until the doc is updated.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# a number with a unit of time, size, speed or ratio, or a bare 0.xx (a KL divergence, a rate)
FIGURE = re.compile(r"(?<![\w.])[±+]?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?"
                    r"(?:s|ms|min|KB|MB|GB|tok/s|%|x|×)(?![\w/])"
                    r"|(?<![\w.])0\.\d{2,}(?![\w.])")
GENERATED = re.compile(r"<!-- (\S+):begin -->.*?<!-- \1:end -->", re.S)


def typed_figures(text: str) -> list[str]:
    prose = GENERATED.sub("", text)
    return [f"line {i}: {m.group(0)!r} in {line.strip()[:80]!r}"
            for i, line in enumerate(prose.splitlines(), 1) for m in FIGURE.finditer(line)]


def test_readme_prose_types_no_measured_figure():
    bad = typed_figures((ROOT / "README.md").read_text())
    assert not bad, "README.md: measured figures belong in the results files: " + "; ".join(bad)


def test_the_figure_check_is_not_vacuous():
    assert typed_figures("SmolLM2: 76 s, 1.2 GB peak RSS, +0.7-4% KLD, 0.053 vs 0.035") == [
        "line 1: '76 s' in 'SmolLM2: 76 s, 1.2 GB peak RSS, +0.7-4% KLD, 0.053 vs 0.035'",
        "line 1: '1.2 GB' in 'SmolLM2: 76 s, 1.2 GB peak RSS, +0.7-4% KLD, 0.053 vs 0.035'",
        "line 1: '+0.7-4%' in 'SmolLM2: 76 s, 1.2 GB peak RSS, +0.7-4% KLD, 0.053 vs 0.035'",
        "line 1: '0.053' in 'SmolLM2: 76 s, 1.2 GB peak RSS, +0.7-4% KLD, 0.053 vs 0.035'",
        "line 1: '0.035' in 'SmolLM2: 76 s, 1.2 GB peak RSS, +0.7-4% KLD, 0.053 vs 0.035'"]
    # a generated block may hold any figure; version numbers are no figures
    assert typed_figures("<!-- t:begin -->\n| 237.3 tok/s | 0.54 s |\n<!-- t:end -->\n"
                         "llama-cpp-python 0.3.36, group 32, 4.5 bits/weight") == []


# docs/QUALITY.md's row labels -> quality.json's variant names
VARIANTS = {
    "plain rounding (`--no-calibrate`, the old default)": "pyklei rtn",
    "importance matrix (`--calibrate`)": "pyklei calibrated",
    "rotation alone (`--no-calibrate --rotate`)": "pyklei rotate",
    "GPTQ alone (`--no-rotate`)": "pyklei gptq",
    "rotation + GPTQ (default)": "pyklei default",
    "default": "pyklei default",
    "`--bits 4.9`": "pyklei b4.9",
    "`--recipe q4m`": "pyklei q4m",
    "`--bits 6.0`": "pyklei b6.0",
    "llama.cpp Q4_0": "llama.cpp Q4_0",
    "llama.cpp IQ4_NL": "llama.cpp IQ4_NL",
    "llama.cpp IQ4_NL + imatrix": "llama.cpp IQ4_NL +imatrix",
    "llama.cpp Q4_K_M": "llama.cpp Q4_K_M",
    "llama.cpp Q4_K_M + imatrix": "llama.cpp Q4_K_M +imatrix",
}
# the tables' KLD columns, left to right
CELLS = [("smollm2", "langref"), ("smollm2", "gpl3"), ("offgrid", "langref"), ("offgrid", "gpl3")]


def quality_tables() -> list[list[list[str]]]:
    """The tables of docs/QUALITY.md whose header names the four (bed, text) cells and whose
    first column is a method or a file: rows of cells, bold marks dropped."""
    tables, rows = [], None
    for line in (ROOT / "docs" / "QUALITY.md").read_text().splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip().replace("**", "") for c in line.strip("|").split("|")]
            if rows is None:
                rows = []
            rows.append(cells)
        elif rows is not None:
            header = rows[0]
            if header[0].startswith(("method", "file")) and header[-4:] == [
                    "SmolLM2 langref", "SmolLM2 gpl3", "off-grid langref", "off-grid gpl3"]:
                tables.append(rows)
            rows = None
    return tables


def test_quality_tables_are_the_results_file():
    results = json.loads((ROOT / "benchmarks" / "results" / "quality.json").read_text())
    row = {(r["bed"], r["text"], r["variant"]): r for r in results["rows"]}
    tables = quality_tables()
    assert len(tables) == 2, "docs/QUALITY.md: the method table and the ladder table"
    checked, bad = 0, []
    for header, _rule, *body in tables:
        # the method table names its pyklei files' size in its header, llama.cpp's in the label
        header_mb = re.search(r"\(([\d.]+) MB", header[0])
        for cells in body:
            label, mb = cells[0], None
            if m := re.fullmatch(r"(.*), ([\d.]+) MB", label):
                label, mb = m.group(1), m.group(2)
            elif header[1] == "size":
                mb = cells[1].removesuffix(" MB")
            elif header_mb:
                mb = header_mb.group(1)
            variant = VARIANTS.get(label)
            if variant is None:
                bad.append(f"{cells[0]!r}: no variant of quality.json named for it here")
                continue
            for (bed, text), doc in zip(CELLS, cells[-4:]):
                r = row[(bed, text, variant)]
                if doc != f"{r['kld']:.3f}":
                    bad.append(f"{cells[0]} {bed} {text}: doc {doc}, results {r['kld']:.3f}")
                if mb != f"{r['bytes'] / 1e6:.1f}":
                    bad.append(f"{cells[0]} {bed} {text}: doc {mb} MB, results "
                               f"{r['bytes'] / 1e6:.1f} MB")
                checked += 1
    assert not bad, "docs/QUALITY.md differs from benchmarks/results/quality.json: " + "; ".join(bad)
    assert checked >= 4 * 12


@pytest.mark.parametrize("label", ["rotation + GPTQ (default)", "`--bits 6.0`"])
def test_the_table_check_reads_the_doc(label):
    """The check sees the rows it claims to: each named row is in a table it reads."""
    assert any(cells[0] == label for table in quality_tables() for cells in table[2:])


def test_speed_table_is_the_results_file():
    """docs/QUALITY.md's speed table beside llama.cpp is what benchmarks/speed_vs_llamacpp.py
    writes from its results file (doc_table: each cell `A / B = R x`, the medians over the
    rounds and their ratio)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("speed_vs_llamacpp",
                                                  ROOT / "benchmarks" / "speed_vs_llamacpp.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = json.loads((ROOT / "benchmarks" / "results" / "speed-vs-llamacpp.json").read_text())
    block = bench.DOC_BLOCK.search((ROOT / "docs" / "QUALITY.md").read_text())
    assert block, "docs/QUALITY.md has no speed-vs-llamacpp block"
    table = bench.doc_table(results)
    assert "x**" in table and block.group(0) == block.group(1) + table + block.group(2), \
        "docs/QUALITY.md's speed table differs from speed-vs-llamacpp.json: rerun the benchmark"


def test_readme_speed_tables_are_the_results_files():
    """The speed tables beside llama.cpp (blocks named after their results file: the headline
    in README.md, every other in docs/BENCHMARKS.md) are what benchmarks/speed_vs_llamacpp.py
    writes from those files (readme_table)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("speed_vs_llamacpp",
                                                  ROOT / "benchmarks" / "speed_vs_llamacpp.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    named = [(doc, name) for doc in ("README.md", "docs/BENCHMARKS.md")
             for name in re.findall(r"<!-- (speed-vs-llamacpp[\w.-]*):begin -->", (ROOT / doc).read_text())]
    # every block the docs hold, found by its name: a new table cannot escape the check
    assert ("README.md", "speed-vs-llamacpp") in named and len(named) >= 11, named
    for doc, name in named:
        block = bench.readme_block(name).search((ROOT / doc).read_text())
        assert block, f"{doc} has no {name} block"
        results = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
        table = bench.readme_table(results)
        assert "x**" in table and block.group(0) == block.group(1) + table + block.group(2), \
            f"{doc}'s {name} table differs from {name}.json: rerun the benchmark"


def _kld(name: str) -> dict:
    rows = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]
    return {(r["bed"], r["text"], r["variant"]): r["kld"] for r in rows}


def test_gemma3_quality_table_is_the_results_file():
    """docs/BENCHMARKS.md's Gemma 3 270M quality rows are quality-gemma3.json's."""
    import re
    kld = _kld("quality-gemma3.json")
    rows = json.loads((ROOT / "benchmarks" / "results" / "quality-gemma3.json").read_text())["rows"]
    top1 = {(r["text"], r["variant"]): r["top1"] for r in rows}
    names = {"pyklei default": "pyklei default",
             "pyklei default, one activation plane": "pyklei default-qai8dx"}
    doc = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    seen = 0
    for text, variant, k, t in re.findall(
            r"^\| (langref|gpl3) \| ([^|]+?) \| [\d.]+ MB \| ([\d.]+) \| ([\d.]+)% \|$", doc, re.M):
        v = names.get(variant) or f"{variant} (llama-quantize)"
        assert float(k) == round(kld[("gemma3", text, v)], 4), (text, variant)
        assert float(t) == round(100 * top1[(text, v)], 1), (text, variant)
        seen += 1
    assert seen == 10


def test_activation_costs_are_the_results_files():
    """docs/QUALITY.md's "Activations" section: what one int8 plane costs against two, from
    quality.json (the four cells) and from the re-measurement in quality-activations.json."""
    text = " ".join((ROOT / "docs" / "QUALITY.md").read_text().split())
    kld = _kld("quality.json")
    pct = [f"{(kld[(b, t, 'pyklei default-qai8dx')] / kld[(b, t, 'pyklei default')] - 1) * 100:+.1f}%"
           for b, t in CELLS]
    said = (f"One plane costs, on the default file, {pct[0]} KLD against two planes (SmolLM2 "
            f"langref), {pct[1]} (SmolLM2 gpl3), {pct[2]} (off-grid langref), {pct[3]} "
            f"(off-grid gpl3)")
    act = _kld("quality-activations.json")
    one = [act[("smollm2", t, "pyklei default")] for t in ("langref", "gpl3")]
    two = [act[("smollm2", t, "pyklei default-qai8dx2")] for t in ("langref", "gpl3")]
    said2 = (f"one plane {one[0]:.4f} / {one[1]:.4f} against two planes {two[0]:.4f} / "
             f"{two[1]:.4f} (langref {(one[0] / two[0] - 1) * 100:+.1f}%, gpl3 "
             f"{(one[1] / two[1] - 1) * 100:+.1f}%)")
    missing = [s for s in (said, said2) if s not in text]
    assert not missing, f"docs/QUALITY.md should say, as the results files do: {missing}"


# benchmarks/attention_bf16.py's runs behind docs/QUALITY.md's "Attention in bf16 at depth", in
# the table's order
BF16_KLD_RESULTS = ("attention-bf16-kld-smollm2", "attention-bf16-kld-smollm2-long",
                    "attention-bf16-kld-smollm2-gpl3-long", "attention-bf16-kld-offgrid",
                    "attention-bf16-kld-offgrid-langref-long", "attention-bf16-kld-offgrid-gpl3-long",
                    "attention-bf16-kld-gemma3")


def test_bf16_attention_table_is_the_results_files():
    """docs/QUALITY.md's table of bf16 attention against f32 at depth is what
    benchmarks/attention_bf16.py's quality_table makes of its results files."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("attention_bf16", ROOT / "benchmarks" / "attention_bf16.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    q = [r for name in BF16_KLD_RESULTS
         for r in json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())["quality"]]
    block = bench.DOC_BLOCK.search((ROOT / "docs" / "QUALITY.md").read_text())
    assert block, "docs/QUALITY.md has no attention-bf16-kld block"
    table = bench.quality_table(q)
    assert table.count("\n") >= 2 * len(BF16_KLD_RESULTS) + 1
    assert block.group(2) == table + "\n", \
        "docs/QUALITY.md's bf16 attention table differs from its results files: rerun the benchmark"
