"""The activation quantizers' implementations a test can force (`impl=` of _ext.quantize_qai8dx
and _ext.quantize_qsi8d32), as pytest params: the default pick, the scalar record's and each
SIMD one, skipped where this CPU lacks its feature."""
import pytest

from pyklei import _ext

FEATURES = set(_ext.cpu_features())
QUANT_IMPL = {"default": None, "scalar": None, "avx2": "avx2", "avx512": "avx512vnni"}   # impl -> feature


def quant_params():
    out = []
    for impl, feat in QUANT_IMPL.items():
        marks = [] if feat is None or feat in FEATURES else [
            pytest.mark.skip(reason=f"quantizer {impl}: this CPU lacks {feat}")]
        out.append(pytest.param(None if impl == "default" else impl, marks=marks, id=impl))
    return out
