"""The house's floors (issues 14 and 41): every module's imports, read with ast, go down only; the
package stays shallow and small enough to find one's way in.

A room is a folder of pyklei/ or a module directly in it (farm-studio draws the same rooms).
Each room, bottom to top, and what it may import besides itself:

    formats      pyklei/formats/      GGUF reading and writing, the weight formats: nothing
    hub          pyklei/hub.py        Hugging Face Hub ids -> files in the hub's cache: nothing
                                      (huggingface_hub only)
    text         pyklei/text/         tokenizers, detokenizer, chat templates, tool calling:
                                      formats
    converters   pyklei/converters/   checkpoints -> pyklei GGUF files: formats, hub (never the
                                      runtime)
    runtime      pyklei/runtime/      Model, Engine, generation, sampling, grammars, drafts:
                                      formats, text, and the kernel layer (pyklei._ext), which
                                      pyklei.runtime.kernels imports (never the converters; the
                                      formats' C search, formats/_native.py, optionally)
    llm          pyklei/llm.py        the API (load, LLM): runtime, text, formats, hub
    jobs         calibration, bench, info, chat, perplexity (pyklei/*.py) and _report (their
                                      tables): the API and everything under it; calibration
                                      alone meets the converters and the runtime
    server       pyklei/server/       runtime, text, formats
    distributed  pyklei/distributed/  replicas routed by conversation (serve --ray, pyklei
                                      route), Ray's import and connection: server, llm and what
                                      they stand on
    batch        pyklei/batch/        OpenAI Batch API files through engines, here or on Ray
                                      Data: the server's request checks and replies, the API,
                                      runtime, text, formats, distributed
    cli          pyklei/cli/, pyklei/__main__.py: everything
    dev          pyklei_dev/ (the real model files of the tests, examples and benchmarks, and the
                 GGUF -> HF exporter): not installed, so no module of pyklei imports it; it may
                 import any layer

pyklei/__init__.py is the package's face: lazy names (pyklei.load, pyklei.LLM, ...) and the
old module paths of MOVED, which pyklei's own modules never import.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MAX_TOP_LEVEL_MODULES = 12     # .py files directly in pyklei/, __init__ and __main__ included
MAX_FLOORS = 8                 # rooms on top of each other (a room stands above all it imports)
MAX_LINES = 700                # per file of pyklei/

JOBS = ("calibration", "bench", "info", "chat", "perplexity", "_report")
LAYER_OF_ROOM = {"formats": "formats", "hub": "hub", "text": "text", "converters": "converters",
                 "runtime": "runtime", "llm": "llm", "server": "server", "cli": "cli",
                 "distributed": "distributed", "batch": "batch",
                 "__main__": "cli", **{j: "jobs" for j in JOBS}}

ALLOWED = {
    "formats": set(),
    "hub": set(),
    "text": {"formats"},
    "converters": {"formats", "hub"},
    "runtime": {"formats", "text", "ext"},
    "llm": {"runtime", "text", "formats", "hub"},
    "jobs": {"llm", "jobs", "runtime", "text", "converters", "formats", "hub"},
    "server": {"runtime", "text", "formats"},
    "distributed": {"server", "llm", "runtime", "text", "formats", "hub"},
    "batch": {"server", "llm", "runtime", "text", "formats", "distributed"},
    "cli": {"llm", "jobs", "server", "batch", "distributed", "runtime", "text", "converters",
            "formats", "hub"},
    "dev": {"cli", "llm", "jobs", "server", "batch", "distributed", "runtime", "text",
            "converters", "formats", "hub"},
}

FILES = sorted(p for d in ("pyklei", "pyklei_dev") for p in (ROOT / d).rglob("*.py"))
PYKLEI = [p for p in FILES if p.is_relative_to(ROOT / "pyklei")]


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


MODULES = {_module_name(p) for p in FILES}
MOVED = __import__("pyklei").MOVED     # the old public paths (pyklei/__init__.py)


def _module(name: str) -> str | None:
    """The module of pyklei that an imported name is, or is in (`pyklei.formats.qsi4c32.x` ->
    pyklei.formats.qsi4c32); None for a name of the package itself (pyklei.__version__)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _room(module: str) -> str:
    """pyklei.runtime.engine -> runtime; pyklei.llm -> llm; pyklei._ext -> _ext."""
    parts = module.split(".")
    if parts[0] == "pyklei_dev":
        return "dev"
    return parts[1] if len(parts) > 1 else "pyklei"


def _layer(name: str) -> str:
    if name == "pyklei._ext":
        return "ext"
    room = _room(name)
    if room == "dev":
        return "dev"
    if room not in LAYER_OF_ROOM:
        raise AssertionError(f"{name}: pyklei/{room} is in no layer: give it one in "
                             f"tests/test_layering.py (LAYER_OF_ROOM, ALLOWED, the module doc)")
    return LAYER_OF_ROOM[room]


def _imported_modules(path: Path) -> set[str]:
    """The modules of pyklei that `path` imports: `from . import gptq` imports the module gptq,
    not its package; `from .converters import convert` imports the package."""
    out = set()
    for name in _imports(path):
        module = _module(name)
        if module not in (None, "pyklei"):
            out.add(module)
    # a package is imported only if a name other than its submodules is taken from it
    return {m for m in out
            if not any(n.startswith(m + ".") for n in out)
            or any(_module(n) == m and n != m for n in _imports(path))}


def _edges() -> dict[str, set[str]]:
    """{module: the modules of pyklei it imports} (the package's face left out: it imports
    nothing by `import`, and a name taken from it is its version or a lazy API name)."""
    return {_module_name(p): _imported_modules(p) - {_module_name(p)} for p in FILES}


def test_the_tree_is_seen():
    assert {"pyklei.formats.registry", "pyklei.formats.llama_tensors", "pyklei.converters.core",
            "pyklei.runtime.model", "pyklei.text.tokenizer", "pyklei.cli",
            "pyklei_dev.gguf_to_hf"} <= MODULES


def test_every_room_has_a_layer():
    """A new folder or module of pyklei/ is placed on a floor here before it can be imported."""
    rooms = {_room(_module_name(p)) for p in PYKLEI} - {"pyklei"}
    assert rooms <= set(LAYER_OF_ROOM), sorted(rooms - set(LAYER_OF_ROOM))


# the modules that import pyklei._ext: the runtime's kernel layer, and the format layer's C
# block-scale search, which falls back to numpy when the extension is not built
EXT_IMPORTERS = {"pyklei.runtime.kernels", "pyklei.formats._native"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down(path):
    me = _module_name(path)
    if me == "pyklei":            # the face: lazy names only (test_the_old_paths_are_...)
        return
    layer = _layer(me)
    bad = []
    for name in _imports(path):
        if name == "pyklei._ext" or name.startswith("pyklei._ext."):
            if me not in EXT_IMPORTERS:
                bad.append(f"{name} (only {', '.join(sorted(EXT_IMPORTERS))} import the extension)")
            continue
        if name.split(".")[:2][-1] in MOVED:
            bad.append(f"{name} (an old path: pyklei's own modules import pyklei.{MOVED[name.split('.')[1]]})")
            continue
        module = _module(name)
        if name == "pyklei" or module == "pyklei" or (module is None and name.startswith("pyklei.__")):
            if layer in ("formats", "converters", "text"):   # the face: version, lazy API
                bad.append(name)
            continue
        if module is None:
            bad.append(f"{name} (no such module: an old path of pyklei.MOVED?)")
            continue
        other = _layer(module)
        if other != layer and other not in ALLOWED[layer]:
            bad.append(f"{name} ({other})")
    assert not bad, f"{me} ({layer}) imports upward or sideways: {bad}"


@pytest.mark.parametrize("where, line", [
    ("formats", "from ..runtime.model import Model\n"),
    ("converters", "from ..runtime.model import Model\n"),
    ("text", "from ..runtime.sampler import SamplingParams\n"),
    # pyklei_dev is not installed: an import of it would fail in every installed pyklei
    ("cli", "from pyklei_dev.assets import cache_dir\n"),
    # an old path is the users' alias, never pyklei's own import
    ("runtime", "from ..engine import Engine\n"),
    ("server", "from .. import _ext\n"),
])
def test_the_checker_catches_an_upward_edge(where, line):
    """The rule is not vacuous: a formats module importing the runtime is caught, and so are
    the CLI importing the checkout's development helpers and a module importing an old path."""
    f = ROOT / "pyklei" / where / "_layering_probe.py"
    try:
        f.write_text(line)
        with pytest.raises(AssertionError, match="imports upward"):
            test_imports_go_down(f)
    finally:
        f.unlink()


def test_the_top_level_holds_at_most_12_modules():
    top = sorted(p.name for p in (ROOT / "pyklei").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def _floors(graph: dict[str, set[str]]) -> dict[str, int]:
    floors: dict[str, int] = {}

    def floor(n, path=()):
        if n in path:
            raise AssertionError(f"import loop: {' -> '.join(path[path.index(n):] + (n,))}")
        if n not in floors:
            floors[n] = 1 + max((floor(m, path + (n,)) for m in graph.get(n, ())), default=0)
        return floors[n]

    for n in graph:
        floor(n)
    return floors


def test_no_module_imports_itself_back():
    """No loop among pyklei's modules (the tokenizer made its detokenizer, which imported the
    tokenizer back: issue 41)."""
    _floors(_edges())


def test_the_loop_check_catches_a_loop():
    with pytest.raises(AssertionError, match="import loop: .*tokenizer -> .*detokenizer"):
        _floors({"text.tokenizer": {"text.detokenizer"}, "text.detokenizer": {"text.tokenizer"}})


def test_the_rooms_stand_at_most_8_floors_high():
    """A room stands above every room it imports; no loop among rooms either."""
    rooms: dict[str, set[str]] = {}
    for me, deps in _edges().items():
        if me.startswith("pyklei."):
            rooms.setdefault(_room(me), set()).update(
                _room(d) for d in deps if d.startswith("pyklei.") and _room(d) != _room(me))
    floors = _floors(rooms)
    assert max(floors.values()) <= MAX_FLOORS, sorted(floors.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize("path", PYKLEI, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_is_over_700_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)}: {n} lines; split it by concern"


def test_the_old_paths_are_the_new_modules():
    """Each public module path from before runtime/ and text/ (pyklei.MOVED) imports, lazily,
    the very module of its new path: the same object, its own name, its names the same."""
    code = """if True:
        import importlib, sys
        import pyklei
        assert not any(m.startswith(("pyklei.runtime", "pyklei.text")) for m in sys.modules)
        for old, new in pyklei.MOVED.items():
            a = importlib.import_module("pyklei." + old)
            b = importlib.import_module("pyklei." + new)
            assert a is b and a.__name__ == a.__spec__.name == "pyklei." + new, (old, a.__spec__)
            assert getattr(pyklei, old) is b
        from pyklei.engine import Engine
        from pyklei.runtime.engine import Engine as E
        from pyklei.grammar import constraint
        from pyklei.sampler import SamplingParams
        from pyklei.model import Model
        from pyklei.generate import stream_generate
        from pyklei.tokenizer import Tokenizer
        import pyklei.chat_template, pyklei.tools
        assert Engine is E and pyklei.Tokenizer is Tokenizer
        assert pyklei.tools is importlib.import_module("pyklei.text.tool_calls")
        print("ok")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_old_paths_name_modules_that_exist():
    import pyklei

    for old, new in pyklei.MOVED.items():
        assert f"pyklei.{new}" in MODULES, (old, new)
        assert f"pyklei.{old}" not in MODULES, f"pyklei/{old}.py is back beside its alias"


def test_the_tensor_table_is_a_leaf():
    """pyklei/formats/llama_tensors.py imports nothing of pyklei: every layer (gguf_keys
    included) can read it without a cycle."""
    assert _imports(ROOT / "pyklei" / "formats" / "llama_tensors.py") == set()


def test_hugging_face_names_live_in_the_tensor_table_only():
    """The block's layout has one place (issues 27 and 42): no other module of pyklei or the
    converters spells a Hugging Face tensor name of the table or of a family's own names; they
    ask llama_tensors and families."""
    from pyklei.formats.families import FAMILIES
    from pyklei.formats.llama_tensors import TENSORS

    table = {ROOT / "pyklei" / "formats" / "llama_tensors.py", ROOT / "pyklei" / "formats" / "families.py"}
    # a block tensor's own part ("self_attn.q_proj"), a global tensor's full name ("lm_head.weight")
    hf_names = {s.hf if s.per_layer else s.hf_name() for s in TENSORS if s.hf}
    hf_names |= {n for f in FAMILIES.values() for n in f.hf_names.values()}
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in FILES if p not in table
           for n in hf_names if n in p.read_text()]
    assert not bad, f"Hugging Face tensor names spelled outside the table: {bad}"
