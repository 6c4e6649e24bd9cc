"""The layers import downward only (issue 14): read every module's imports with ast and fail on
an upward or sideways edge.

    CLI / pipeline / server (pyklei/cli/, pyklei/pipeline.py, pyklei/server/)
                                                          may import everything below
    runtime (the rest of pyklei/)                         formats, the kernel layer
    converters (pyklei/converters/)                       formats only
    formats (pyklei/formats/)                             nothing of pyklei outside itself
    kernel layer (pyklei._ext)                            imported through pyklei._native only
    hub (pyklei/hub.py: Hugging Face Hub ids -> files in the hub's cache)
                                                          a leaf: huggingface_hub only, used by
                                                          converters, runtime, top
    dev (pyklei_dev/: the real model files of the tests, examples and benchmarks, and the GGUF
         -> HF exporter)                                  not installed, so no module of pyklei
                                                          imports it; it may import any layer
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the pyklei modules `path` imports (at any depth of the file)."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}   # `from . import _ext`
    return {n for n in out
            if n in ("pyklei", "pyklei_dev") or n.startswith(("pyklei.", "pyklei_dev."))}


def _layer(name: str) -> str:
    if name == "pyklei_dev" or name.startswith("pyklei_dev."):
        return "dev"
    if name.startswith("pyklei.formats"):
        return "formats"
    if name.startswith("pyklei.converters"):
        return "converters"
    if (name.startswith(("pyklei.cli", "pyklei.server"))
            or name in ("pyklei.pipeline", "pyklei.__main__")):
        return "top"
    if name.startswith("pyklei.hub"):
        return "hub"
    if name == "pyklei._ext":
        return "ext"
    return "runtime"


ALLOWED = {
    "formats": {"formats"},
    "hub": set(),
    "converters": {"formats", "converters", "hub"},
    "runtime": {"formats", "runtime", "hub"},
    "top": {"formats", "converters", "runtime", "top", "hub"},
    "dev": {"formats", "converters", "runtime", "top", "hub", "dev"},
}

FILES = sorted(p for d in ("pyklei", "pyklei_dev") for p in (ROOT / d).rglob("*.py"))


def test_the_tree_is_seen():
    names = {_module_name(p) for p in FILES}
    assert {"pyklei.formats.registry", "pyklei.formats.llama_tensors", "pyklei.converters.core",
            "pyklei.model", "pyklei.cli", "pyklei_dev.gguf_to_hf"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down(path):
    me = _module_name(path)
    layer = _layer(me)
    bad = []
    for name in _imports(path):
        if name == "pyklei":           # the package itself: only its version or lazy API
            if layer in ("formats", "converters"):
                bad.append(name)
            continue
        if _layer(name) == "ext":
            if me != "pyklei._native":
                bad.append(f"{name} (only pyklei._native imports the extension)")
        elif _layer(name) not in ALLOWED[layer]:
            bad.append(f"{name} ({_layer(name)})")
    assert not bad, f"{me} ({layer}) imports upward or sideways: {bad}"


@pytest.mark.parametrize("where, line", [
    ("formats", "from ..model import Model\n"),
    # pyklei_dev is not installed: an import of it would fail in every installed pyklei
    ("cli", "from pyklei_dev.assets import cache_dir\n"),
])
def test_the_checker_catches_an_upward_edge(where, line):
    """The rule is not vacuous: a formats module importing the runtime is caught, and so is the
    CLI importing the checkout's development helpers."""
    f = ROOT / "pyklei" / where / "_layering_probe.py"
    try:
        f.write_text(line)
        with pytest.raises(AssertionError, match="imports upward"):
            test_imports_go_down(f)
    finally:
        f.unlink()


def test_the_tensor_table_is_a_leaf():
    """pyklei/formats/llama_tensors.py imports nothing of pyklei: every layer (gguf_keys
    included) can read it without a cycle."""
    assert _imports(ROOT / "pyklei" / "formats" / "llama_tensors.py") == set()


def test_hugging_face_names_live_in_the_tensor_table_only():
    """The Llama block's layout has one place (issue 27): no other module of pyklei or the
    converters spells a Hugging Face tensor name of the table; they ask llama_tensors."""
    from pyklei.formats.llama_tensors import TENSORS

    table = ROOT / "pyklei" / "formats" / "llama_tensors.py"
    # a block tensor's own part ("self_attn.q_proj"), a global tensor's full name ("lm_head.weight")
    hf_names = {s.hf if s.per_layer else s.hf_name() for s in TENSORS if s.hf}
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in FILES if p != table
           for n in hf_names if n in p.read_text()]
    assert not bad, f"Hugging Face tensor names spelled outside the table: {bad}"
