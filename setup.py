"""The one native part of kvdock (src/kvdock/_native.c: multi-threaded copies, page helpers,
token packing). Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvdock._native", ["src/kvdock/_native.c"], extra_compile_args=["-O2", "-std=c11", "-pthread"])
    ]
)
