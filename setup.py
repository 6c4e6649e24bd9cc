"""Build of pyklei: the Python packages and the C kernel extension pyklei._ext.

Kernels compile at the architecture's baseline (x86-64 / armv8-a); SIMD code paths carry
per-function target attributes and are chosen at run time, so one binary runs everywhere.
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

# the C layers of pyklei_ext/: contract (what ops and isa agree on), isa, ops, model
c_sources = sorted(glob.glob("pyklei_ext/contract/*.c") + glob.glob("pyklei_ext/isa/*.c")
                   + glob.glob("pyklei_ext/ops/*.c") + glob.glob("pyklei_ext/model/*.c"))
# A test build (PYKLEI_TEST_HOOKS=1; scripts/test.sh) also links the PYKLEI_TEST_BREAK_KERNEL
# hook, which tests/kernels/test_kernels.py's self-check tests use; elsewhere the dispatcher's weak
# reference to it is NULL and the extension holds no test code (docs/KERNELS.md).
if os.environ.get("PYKLEI_TEST_HOOKS") == "1":
    c_sources.append("tests/kernels/c/pk_testhook.c")


def read_cflags(path="pyklei_ext/cflags.txt"):
    """The C flags shared with scripts/cflags.sh (why -ffp-contract=off: in that file)."""
    with open(path) as f:
        return [w for line in f if not line.lstrip().startswith("#") for w in line.split()]


compile_args = ["-O3"] + read_cflags()
if os.environ.get("PYKLEI_DEBUG_BUILD"):   # sanitizer / debug builds
    compile_args = (["-O1", "-g", "-fno-omit-frame-pointer"] + read_cflags()
                    + os.environ["PYKLEI_DEBUG_BUILD"].split())

ext = Extension(
    "pyklei._ext",
    sources=["pyklei_ext/_ext.pyx"] + c_sources,
    include_dirs=["pyklei_ext", numpy.get_include()],
    extra_compile_args=compile_args,
    extra_link_args=["-pthread"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

setup(
    # every package under pyklei/, so a new one cannot be left out of a regular install;
    # pyklei_dev/ (the tests' and examples' model files) stays out on purpose: its __init__.py
    packages=find_packages(include=["pyklei", "pyklei.*"]),
    package_data={"pyklei.server": ["static/*.html"]},   # the chat page of `pyklei serve`
    ext_modules=cythonize([ext], compiler_directives={"language_level": "3"}),
)
