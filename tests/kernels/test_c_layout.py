"""The C layers of pyklei_ext/ stand on each other in one direction (issue 41), read from the
sources with regular expressions:

    model/      the Llama forward pass                 may use ops/, contract/
    ops/        the kernel layer (dispatch, weights,   may use isa/ (through the registry's
                matmul, quantizers, attention, ...)     tables and the attention's template
                                                        headers), contract/
    isa/        one file per ISA and concern           contract/ only
    contract/   what ops/ and isa/ agree on: formats,  nothing above it
                operands, packed layouts, the kernel
                record, the KV cache layout

and no file of them (nor the Cython sources) is over 700 lines. Within ops/, the files call
each other without a loop: a file's public functions (pk_*, defined at the start of a line)
are called only by files above it. The test hook (tests/kernels/c/pk_testhook.c) is outside them all:
test builds link it, the dispatcher holds a weak reference to it.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

EXT = Path(__file__).resolve().parents[2] / "pyklei_ext"
LAYERS = ("contract", "isa", "ops", "model")
MAX_LINES = 700
# the folders each layer's #include lines may name (its own included)
MAY_INCLUDE = {"contract": {"contract"}, "isa": {"isa", "contract"},
               "ops": {"ops", "isa", "contract"}, "model": {"model", "ops", "contract"}}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
DEFINITION = re.compile(r"^[A-Za-z_][\w \t\*]*?\b(pk_\w+)\s*\([^;{]*\)\s*\{", re.M)
CALL = re.compile(r"\b(pk_\w+)\s*\(")


def _sources(*layers: str) -> list[Path]:
    return sorted(p for layer in layers for p in (EXT / layer).glob("*.[ch]"))


def _included_layer(path: Path, name: str) -> str:
    """The layer folder the #include "name" of path resolves to."""
    target = (path.parent / name).resolve()
    if not target.exists():
        target = (EXT / name).resolve()   # -Ipyklei_ext
    assert target.exists(), f"{path.relative_to(EXT)}: #include \"{name}\" not found"
    return target.relative_to(EXT).parts[0]


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)


def test_every_folder_is_a_layer():
    folders = {p.name for p in EXT.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders == set(LAYERS), f"folders of pyklei_ext/ not in the layer table: {folders ^ set(LAYERS)}"


@pytest.mark.parametrize("path", [p for p in sorted(EXT.rglob("*"))
                                  if p.suffix in (".c", ".h", ".pyx", ".pxi", ".pxd")
                                  and p.name != "_ext.c"],   # _ext.c: Cython's output, not a source
                         ids=lambda p: str(p.relative_to(EXT)))
def test_no_source_over_700_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(EXT)} has {n} lines (at most {MAX_LINES}: split it by concern)"


def test_includes_point_down():
    bad = []
    for layer in LAYERS:
        for path in _sources(layer):
            for name in INCLUDE.findall(path.read_text()):
                to = _included_layer(path, name)
                if to not in MAY_INCLUDE[layer]:
                    bad.append(f"{layer}/{path.name} includes {name} ({to}/)")
    assert not bad, "includes that point up or sideways:\n" + "\n".join(bad)


def _call_graph(paths: list[Path]) -> dict[str, set[str]]:
    """file -> the files (among paths) whose public functions it calls."""
    # `fail(...)` is pk_set_error's short name in ops/ (pk_ops_internal.h)
    texts = {p.name: re.sub(r"\bfail\s*\(", "pk_set_error(", _strip_comments(p.read_text()))
             for p in paths if p.suffix == ".c"}
    defined = {fn: name for name, text in texts.items() for fn in DEFINITION.findall(text)}
    return {name: {defined[fn] for fn in CALL.findall(text) if defined.get(fn, name) != name}
            for name, text in texts.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}   # 1: on the path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_the_call_graph_reader_sees_the_calls():
    """The regular expressions find the known edges (so an empty graph cannot pass)."""
    graph = _call_graph(_sources("ops"))
    assert "pk_selfcheck.c" in graph["pk_dispatch.c"]    # pk_self_check
    assert "pk_rhs.c" in graph["pk_selfcheck.c"]          # pk_rhs_prepare_canonical
    assert "pk_dispatch.c" in graph["pk_weights.c"]       # pk_dispatch_init
    assert "pk_error.c" in graph["pk_rhs.c"]              # fail -> pk_set_error


def test_no_call_loop_among_ops_files():
    cycle = _cycle(_call_graph(_sources("ops")))
    assert cycle is None, "ops/ files that call each other in a loop: " + " -> ".join(cycle)


def test_no_call_loop_across_the_layers():
    """contract/, isa/ and ops/ together: an ISA file calls nothing above contract/."""
    paths = _sources("contract", "isa", "ops")
    graph = _call_graph(paths)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    layer_of = {p.name: p.parent.name for p in paths}
    up = [f"{a} -> {b}" for a, tos in graph.items() for b in tos
          if layer_of[a] in ("contract", "isa") and layer_of[b] not in MAY_INCLUDE[layer_of[a]]]
    assert not up, "calls from below into ops/: " + ", ".join(up)


def test_the_test_hook_is_not_in_the_library():
    """tests/kernels/c/pk_testhook.c is linked into test builds only; the library refers to it weakly."""
    assert not list(EXT.rglob("*testhook*"))
    decl = (EXT / "ops" / "pk_ops_internal.h").read_text()
    assert re.search(r"pk_test_hook_kernels_to_check\([^;]*\)\s*__attribute__\(\(weak\)\)", decl)
