"""Build hook for the one compiled part of kvtier; all metadata lives in pyproject.toml.

``kvtier.client._memcopy`` (kvtier/client/_memcopy.c, Python's C API only) gives the client's shared-memory
copies non-temporal stores. It is optional: where no C compiler or Python headers exist the
install goes on without it and :mod:`kvtier.client.memcopy` falls back to an ordinary copy, slower for
multi-MiB blocks and otherwise the same (``kvtier.client.memcopy.NATIVE`` says which one runs).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.client._memcopy", ["kvtier/client/_memcopy.c"], optional=True,
                             extra_compile_args=["-O2"])])
