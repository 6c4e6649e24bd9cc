"""The kernel layer seen from Python: CPU features, kernels, and a quantized linear op."""
from __future__ import annotations

import numpy as np

from ._native import load_ext

_ext = load_ext()
KernelError, Ops, QWeight = _ext.KernelError, _ext.Ops, _ext.QWeight
kernels, quantize_qai8dx, selected_kernel = _ext.kernels, _ext.quantize_qai8dx, _ext.selected_kernel


def cpu_features() -> list[str]:
    """Features the kernels may use on this CPU, e.g. ['avx2', 'avx512vnni']."""
    return _ext.cpu_features()


def available_kernels(supported_only: bool = True) -> list[dict]:
    """Kernels compiled in (name, isa, format, supported, priority, m_min, ...)."""
    return [k for k in kernels() if k["supported"] or not supported_only]


__all__ = ["KernelError", "Ops", "QWeight", "available_kernels", "cpu_features", "np",
           "quantize_qai8dx", "selected_kernel"]
