"""The kernel layer seen from Python: the one module that imports the compiled extension
(pyklei._ext, built from pyklei_ext/), and what it offers -- CPU features, the kernels compiled
in, the quantized ops the model runs on.

`import pyklei` and the format layer (pyklei.formats, which the converters stand on) work
without the extension; importing this module (the runtime does) loads it. A missing or
unloadable extension gets an ImportError that says how to build it, rather than "cannot import
name '_ext'".
"""
from __future__ import annotations

import numpy as np


def load_ext():
    """The extension module pyklei._ext (imported once; later calls return it)."""
    try:
        from .. import _ext
    except ImportError as e:
        import pyklei

        raise ImportError(
            f"pyklei's compiled kernels (pyklei._ext) cannot be imported from "
            f"{pyklei.__path__[0]}: {e}. Build them with `pip install -e .` in the repository "
            f"(or `python setup.py build_ext --inplace`); after a plain `pip install .`, run "
            f"Python from outside the repository, where its source tree does not shadow the "
            f"installed package") from e
    return _ext


_ext = load_ext()
KernelError, Ops, QWeight = _ext.KernelError, _ext.Ops, _ext.QWeight
kernels, quantize_qai8dx, selected_kernel = _ext.kernels, _ext.quantize_qai8dx, _ext.selected_kernel


def cpu_features() -> list[str]:
    """Features the kernels may use on this CPU, e.g. ['avx2', 'avx512vnni']."""
    return _ext.cpu_features()


def selected_kernel_for(fmt: str, m: int, activations: str = "qai8dx") -> str:
    """The kernel a matmul of weight format `fmt` on m activation rows runs, named as the
    PYKLEI_LOG=kernels line names it (ops/pk_dispatch.c, pk_log_call): with qsi8d32 activations a
    kernel that takes them (its run_d32) is qsi8d32_<the rest of its name>; one that does not
    runs qai8dx (docs/KERNELS.md, "qsi8d32 activations")."""
    name = selected_kernel(fmt, m)
    if activations == "qsi8d32" and any(k["name"] == name and k["takes_qsi8d32"] for k in kernels()):
        return "qsi8d32" + name[name.index("_"):]
    return name


def available_kernels(supported_only: bool = True) -> list[dict]:
    """Kernels compiled in (name, isa, format, supported, priority, m_min, ...)."""
    return [k for k in kernels() if k["supported"] or not supported_only]


__all__ = ["KernelError", "Ops", "QWeight", "available_kernels", "cpu_features", "load_ext", "np",
           "quantize_qai8dx", "selected_kernel", "selected_kernel_for"]
