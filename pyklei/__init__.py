"""pyklei: 4-bit Llama-family inference on CPUs from Python.

KleidiAI-style int8-activation x int4-weight kernels (qai8dx x qsi4c32) in a llama.cpp-like
GGUF workflow. The floors, top to bottom (tests/test_layering.py holds each to its imports):

    cli/, server/          the command line, the OpenAI-compatible server
    bench, info, chat, perplexity, calibration     jobs over the API (calibration also converts)
    llm                    the API: load(), LLM
    runtime/               Model, Engine, generation, sampling, grammars, drafts, the kernel face
    converters/            checkpoints -> pyklei GGUF files
    text/                  tokenizers, detokenizer, chat templates, tool calling
    formats/, hub          GGUF reading/writing and the weight formats; Hub ids -> files
    pyklei._ext            the compiled kernel layer (pyklei_ext/: model, ops, ISA kernels)
"""
__version__ = "0.1.0"

# The API is imported on first use (PEP 562): `import pyklei` and pyklei.formats then work
# without the compiled extension, which only the runtime needs (pyklei.runtime.kernels).
_LAZY = {"LLM": ".llm", "load": ".llm", "Tokenizer": ".text.tokenizer",
         "available_kernels": ".runtime.kernels", "cpu_features": ".runtime.kernels"}

#: Public module paths from before runtime/ and text/ (issue 41), and where each module lives
#: now. `from pyklei.engine import Engine` keeps working and gives the very objects of
#: pyklei.runtime.engine: the old name is the same module object, registered on first import.
#: pyklei's own code imports the new paths only (tests/test_layering.py checks it).
MOVED = {
    "model": "runtime.model", "engine": "runtime.engine", "generate": "runtime.generate",
    "request": "runtime.request", "sampler": "runtime.sampler",
    "speculative": "runtime.speculative", "grammar": "runtime.grammar",
    "options": "runtime.options", "activation_policy": "runtime.activation_policy",
    "kernels": "runtime.kernels",
    "tokenizer": "text.tokenizer", "detokenizer": "text.detokenizer",
    "chat_template": "text.chat_template", "tools": "text.tool_calls",
    "imatrix": "calibration", "pipeline": "calibration",
}

__all__ = ["LLM", "Tokenizer", "__version__", "available_kernels", "cpu_features", "load"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pyklei' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _MovedModuleFinder:
    """Finds `pyklei.<old>` for the names of MOVED and loads it as the module it moved to.

    A meta path finder, so that `import pyklei.engine` and `from pyklei.engine import X` work
    and nothing is imported before it is asked for (the runtime needs the extension)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        package, _, old = fullname.partition(".")
        if package != __name__ or old not in MOVED:
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(fullname, cls())

    def create_module(self, spec):
        import importlib

        module = importlib.import_module("." + MOVED[spec.name.partition(".")[2]], __name__)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # the import system has just stamped the old name's spec on the module: give it back
        # its own, so that the module still knows its one true name (importlib.reload, pickle)
        module.__spec__ = self._own_spec


def _install_finder():
    import sys

    if not any(f is _MovedModuleFinder for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder)


_install_finder()
