#!/usr/bin/env bash
# The tests that need other projects' code installed apart from kvtier's venv:
#   * the connector tests inside the engines' own Python interfaces: vLLM 0.33.0 and SGLang 0.5.23,
#     unpacked without CUDA (tools/engine-iface-env.sh builds them into DIR on first use, ~3 GB and
#     a few minutes; later runs reuse DIR). Here every conformance test must run: a vLLM or SGLang
#     module that does not import is a failure, not a skip (KVTIER_REQUIRE_ENGINES).
#   * the LMCache peer of `kvtier bench peers`: LMCache 0.5.6's CPU backend in a venv of its own
#     (tools/lmcache-env.sh builds it into LMC_DIR on first use, ~1.5 GB and 1.5-5 minutes; later
#     runs reuse it), driven by tests/kvtier/bench/peers, whose LMCache tests and rows
#     must run here (KVTIER_REQUIRE_LMCACHE): ~1 min.
#
#   usage: tools/conformance.sh [DIR [LMC_DIR]]   (defaults: .engine-iface and .lmcache-env in the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(realpath -m "${1:-.engine-iface}")
LMC_DIR=$(realpath -m "${2:-.lmcache-env}")
bash tools/engine-iface-env.sh "$DIR"
"$DIR/venv/bin/pip" install -q -e '.[test]'
KVTIER_REQUIRE_ENGINES=1 PYTHONPATH="$DIR/src" "$DIR/venv/bin/python" -m pytest tests/connectors -q
bash tools/lmcache-env.sh "$LMC_DIR"
# kvtier's side runs in a venv with kvtier and its test extra (the one above); the LMCache peer in
# a subprocess of LMC_DIR's python, which the bench finds through KVTIER_LMCACHE_ENV.
KVTIER_REQUIRE_LMCACHE=1 KVTIER_LMCACHE_ENV="$LMC_DIR" "$DIR/venv/bin/python" -m pytest tests/kvtier/bench/peers -q
