"""Build hook for the compiled parts of kvtier; all metadata lives in pyproject.toml.

``kvtier.client._memcopy`` (kvtier/client/_memcopy.c, Python's C API only) gives the client's shared-memory
copies non-temporal stores. It is optional: where no C compiler or Python headers exist the
install goes on without it and :mod:`kvtier.client.memcopy` falls back to an ordinary copy, slower for
multi-MiB blocks and otherwise the same (``kvtier.client.memcopy.NATIVE`` says which one runs).

``kvtier_protocol._codecs`` (protocol/kvtier_protocol/_codecs.c, the same rules) runs the quantizing
codecs' inner loops; without it :mod:`kvtier_protocol.codecs` uses its torch path, which writes the
same bytes more slowly (``kvtier_protocol.codecs.NATIVE``).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvtier.client._memcopy", ["kvtier/client/_memcopy.c"], optional=True, extra_compile_args=["-O2"]),
    # Exact IEEE arithmetic: no FMA contraction, no fast-math (the bytes must equal the torch path's).
    # -fno-trapping-math changes no value (only whether FP exception flags may be raised
    # speculatively): it lets gcc if-convert, hence vectorize, the float16 conversion loops.
    Extension("kvtier_protocol._codecs", ["protocol/kvtier_protocol/_codecs.c"], optional=True,
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math",
                                  "-fno-strict-aliasing"]),
])
