#!/usr/bin/env bash
# The connector tests inside the engines' own Python interfaces: vLLM 0.33.0 and SGLang 0.5.23,
# unpacked without CUDA (tools/engine-iface-env.sh builds them into DIR on first use, ~3 GB and a
# few minutes; later runs reuse DIR). Here every conformance test must run: a vLLM or SGLang
# module that does not import is a failure, not a skip (KVTIER_REQUIRE_ENGINES).
#
#   usage: tools/conformance.sh [DIR]      (default DIR: .engine-iface in the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(realpath -m "${1:-.engine-iface}")
bash tools/engine-iface-env.sh "$DIR"
"$DIR/venv/bin/pip" install -q -e '.[test]'
KVTIER_REQUIRE_ENGINES=1 PYTHONPATH="$DIR/src" "$DIR/venv/bin/python" -m pytest tests/connectors -q
