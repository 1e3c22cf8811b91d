"""The native parts of kvdock: src/kvdock/_native.c (multi-threaded copies, page helpers, token
packing) and src/kvdock/_directory.c (the pool directory's seqlocked entries). Everything else
about the package is in pyproject.toml."""

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11", "-pthread"]

setup(
    ext_modules=[
        Extension("kvdock._native", ["src/kvdock/_native.c"], extra_compile_args=FLAGS),
        Extension("kvdock._directory", ["src/kvdock/_directory.c"], extra_compile_args=FLAGS),
    ]
)
