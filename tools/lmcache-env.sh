#!/usr/bin/env bash
# A venv of its own in which LMCache 0.5.6's CPU backend runs, for the LMCache rows of
# `kvtier bench peers` (kvtier/bench/peers/lmcache.py runs them in a subprocess with DIR/bin/python)
# and for tests/kvtier/bench/peers (tools/conformance.sh builds it and runs them).
#
# `pip install lmcache` would pull CUDA torch, cupy, cuda-python and cloud clients (GBs, none of
# which its CPU path needs), so lmcache goes in with --no-deps, next to torch 2.13.0 (the CPU build
# that lies on the project's machines; LMCache's extensions are built against 2.13.0, so no other
# release) and the pure-Python packages its CPU backend imports (found by importing it until nothing
# was missing), plus transformers, which it imports too. numpy and prometheus_client are held
# inside the ranges LMCache asks for. LMCache's usage telemetry (a POST to its vendor, on by
# default) is off in every command here and in the bench (LMCACHE_TRACK_USAGE=false, DO_NOT_TRACK=1).
#
#   usage: tools/lmcache-env.sh [DIR]      (default DIR: .lmcache-env in the checkout, git-ignored)
#   then:  kvtier bench peers              (finds DIR at its default place; elsewhere:
#                                           --lmcache-env DIR or KVTIER_LMCACHE_ENV=DIR)
#
# ~1.5 GB (torch alone is 1 GB); the first time 1.5-5 min on a 2-core host (~75 s of CPU, mostly
# pip; 5 min of wall clock on a busy shared one); later runs only check that a block goes through
# (~5 s).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(realpath -m "${1:-.lmcache-env}")
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
# Written last: a build that was cut short is finished by the next run (pip skips what is there).
DONE="$DIR/.kvtier-lmcache-env-complete"
if [ ! -f "$DONE" ]; then
  [ -x "$DIR/bin/python" ] || python3 -m venv "$DIR"
  # pip's resolver warns about every dependency left out (cupy, cuda-python, ...): expected, so not
  # shown; nor the mirror's notes on the index entries it lacks. Anything else, and pip's status, stay.
  pip() {
    "$DIR/bin/pip" "$@" 2>&1 | { grep -v -e "is ignored: it is neither" -e "^lmcache 0.5.6 requires" \
      -e "^lmcache 0.5.6 has requirement" -e "dependency resolver does not currently" || true; }
    return "${PIPESTATUS[0]}"
  }
  pip install -q torch==2.13.0
  pip install -q --no-deps lmcache==0.5.6
  pip install -q 'numpy<=2.2.6' numba cachetools pyyaml requests sortedcontainers \
     'prometheus_client>=0.18,<=0.24.1' py-cpuinfo psutil aiohttp aiofile msgspec pyzmq cryptography \
     transformers
  touch "$DONE"
fi
# kvtier itself is not installed there: the bench puts the checkout on PYTHONPATH, as here.
PYTHONPATH="$PWD:$PWD/protocol" LMCACHE_LOG_LEVEL=WARNING "$DIR/bin/python" -m kvtier.bench.peers.lmcache --check
echo "ready: kvtier bench peers --lmcache-env $DIR"
