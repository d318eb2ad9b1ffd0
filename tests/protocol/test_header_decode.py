"""The header modules import in any order (no import cycle between types, decode and encode)."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = ["kvtier_protocol.header", "kvtier_protocol.header_decode", "kvtier_protocol.header_types",
           "kvtier_protocol.header_templates"]


@pytest.mark.parametrize("first", MODULES)
def test_each_header_module_imports_first_in_a_fresh_interpreter(first):
    code = (f"import {first}; from kvtier_protocol.header import decode_header, encode_header; "
            "import kvtier_protocol.header_decode as d; assert decode_header is d.decode_header")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
