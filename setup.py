"""Build of pyklei: the Python packages and the C kernel extension pyklei._ext.

Kernels compile at the architecture's baseline (x86-64 / armv8-a); SIMD code paths carry
per-function target attributes and are chosen at run time, so one binary runs everywhere.

The build says what it does, a line per step (Cython, then each C file), so that the minutes of
a first `pip install -e .` are not silent: pip hides a build's own output unless -v, so the lines
go to the terminal when there is one, else to stderr (pip -v, a CI log).
"""
import glob
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

T0 = time.monotonic()
_said = []


def say(line: str) -> None:
    """One line of the build's progress, past pip's capture when a terminal is open (the first
    on a line of its own: pip's "Building ... -" spinner line stays open)."""
    text = f"[pyklei build {time.monotonic() - T0:4.0f} s] {line}\n"
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(text if _said else "\n" + text)
            _said.append(line)
            return
    except OSError:
        pass
    sys.stderr.write(text)
    sys.stderr.flush()


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
    # -fno-wrapv undoes the -fwrapv of Python's own CFLAGS (which come first): with it, UBSan
    # cannot see a signed overflow, and gcc 12 took 5x as long over the attention files
    compile_args = (["-O1", "-g", "-fno-omit-frame-pointer", "-fno-wrapv"] + read_cflags()
                    + os.environ["PYKLEI_DEBUG_BUILD"].split())

class BuildExtSaying(build_ext):
    """build_ext that compiles the extension's C files one at a time, naming each, or N at a
    time with `build_ext -j N` (the option distutils has for several extensions; ours is one
    extension of many files, so it is spent on the files: a many-core machine builds in seconds)."""

    def build_extension(self, ext):
        compile_all = self.compiler.compile
        jobs = int(self.parallel or 1) if self.parallel is not True else (os.cpu_count() or 1)

        def compile_each(sources, *args, **kwargs):     # not called when the build is up to date
            if jobs > 1:
                say(f"compiling {ext.name}: {len(sources)} C files, {jobs} at a time")
                with ThreadPoolExecutor(jobs) as pool:  # each call waits on its own gcc
                    parts = list(pool.map(lambda src: compile_all([src], *args, **kwargs), sources))
                say(f"linking {ext.name}")
                return [o for part in parts for o in part]
            say(f"compiling {ext.name}: {len(sources)} C files, one at a time (a few minutes "
                f"on one core)")
            objects = []
            for i, src in enumerate(sources, 1):
                say(f"  {i}/{len(sources)} {src}")
                objects += compile_all([src], *args, **kwargs)
            say(f"linking {ext.name}")
            return objects

        self.compiler.compile = compile_each
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_all


PYX = "pyklei_ext/_ext.pyx"
generated = PYX[:-4] + ".c"
cython_inputs = [PYX] + glob.glob("pyklei_ext/*.pxi") + glob.glob("pyklei_ext/*.pxd")
if not os.path.exists(generated) or os.path.getmtime(generated) < max(map(os.path.getmtime,
                                                                          cython_inputs)):
    say(f"Cython: translating {PYX} and its .pxi files to C (tens of seconds)")

ext = Extension(
    "pyklei._ext",
    sources=[PYX] + c_sources,
    # every header: a change to one rebuilds the C files (distutils compares the .c files only,
    # and an edited ISA header once went unbuilt under a passing test run)
    depends=sorted(glob.glob("pyklei_ext/**/*.h", recursive=True)),
    include_dirs=["pyklei_ext", numpy.get_include()],
    extra_compile_args=compile_args,
    extra_link_args=["-pthread"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

setup(
    # every package under pyklei/, so a new one cannot be left out of a regular install;
    # pyklei_dev/ (the tests' and examples' model files) stays out on purpose: its __init__.py
    packages=find_packages(include=["pyklei", "pyklei.*"]),
    package_data={"pyklei.server": ["static/*.html", "static/*.svg"]},   # `pyklei serve`'s chat page
    ext_modules=cythonize([ext], compiler_directives={"language_level": "3"}),
    cmdclass={"build_ext": BuildExtSaying},
)
