"""The compiled kernel layer, pyklei._ext, imported on first use.

`import pyklei` and the format layer (pyklei.formats, which the converters stand on) work
without it; the model runtime needs it. A missing or unloadable extension gets an ImportError
that says how to build it, rather than "cannot import name '_ext'".
"""
from __future__ import annotations


def load_ext():
    try:
        from . import _ext
    except ImportError as e:
        import pyklei

        raise ImportError(
            f"pyklei's compiled kernels (pyklei._ext) cannot be imported from "
            f"{pyklei.__path__[0]}: {e}. Build them with `pip install -e .` in the repository "
            f"(or `python setup.py build_ext --inplace`); after a plain `pip install .`, run "
            f"Python from outside the repository, where its source tree does not shadow the "
            f"installed package") from e
    return _ext
