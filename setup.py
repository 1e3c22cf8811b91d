"""The native parts of kvdock: src/kvdock/_native.c with _copy.c (multi-threaded copies, page
helpers, token packing) and src/kvdock/_directory.c (the pool directory's seqlocked entries).
Everything else about the package is in pyproject.toml.

Building them needs a C compiler and Python's headers: without them the build stops with
:data:`NO_COMPILER`, which says what to install, instead of a bare "No such file or directory: 'gcc'"."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FLAGS = ["-O2", "-std=c11", "-pthread"]

NO_COMPILER = """
kvdock has two small C extensions and could not compile them: {error}
Install a C compiler and the Python headers, then install kvdock again:
  Debian/Ubuntu: apt-get install gcc python3-dev
  Fedora/RHEL:   dnf install gcc python3-devel
  Alpine:        apk add build-base python3-dev
  macOS:         xcode-select --install
(or set CC to a compiler that is installed)
"""


class BuildExt(build_ext):
    """build_ext whose failure to find or run the compiler says what to install."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # the compiler missing: FileNotFoundError or DistutilsExecError naming it
            text = str(e)
            if isinstance(e, FileNotFoundError) or "No such file" in text or "not found" in text:
                raise SystemExit(NO_COMPILER.format(error=text.strip())) from None
            raise


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "kvdock._native",
            ["src/kvdock/_native.c", "src/kvdock/_copy.c"],
            depends=["src/kvdock/_copy.h"],
            extra_compile_args=FLAGS,
        ),
        Extension("kvdock._directory", ["src/kvdock/_directory.c"], extra_compile_args=FLAGS),
    ],
)
