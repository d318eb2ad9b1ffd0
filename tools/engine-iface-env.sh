#!/bin/bash
# Copied from the team's shared/tools/engine-iface-env.sh, so that CI builds the same environment from a
# clean clone (tools/conformance.sh calls it with DIR=.engine-iface).
# Builds an environment in which the Python interfaces of vLLM 0.33.0 and SGLang 0.5.23 import on a
# CPU-only machine (no CUDA, no GPU kernels): both wheels are downloaded from PyPI without their
# dependencies and unpacked without their compiled .so files, next to torch 2.13.0 (CPU) and the
# pure-Python packages their connector, event and hashing modules need.
#
#   usage:  ../shared/tools/engine-iface-env.sh [DIR]        (default DIR: /tmp/engine-iface)
#   then:   DIR/venv/bin/pip install -e '.[test]'            (kvtier itself, into that venv)
#           PYTHONPATH=DIR/src DIR/venv/bin/python -m pytest tests/...   (vllm / sglang importable)
#
# What imports: vllm.distributed.kv_transfer.kv_connector.v1.base, ...kv_connector.factory,
# vllm.distributed.kv_events, vllm.v1.core.kv_cache_utils, vllm.utils.hashing,
# sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory (check).
# Needs ~2.5 GB of disk and a few minutes the first time; later runs reuse DIR.
set -euo pipefail
DIR=${1:-/tmp/engine-iface}
mkdir -p "$DIR/src" "$DIR/dl"
if [ ! -x "$DIR/venv/bin/python" ]; then
  python3 -m venv "$DIR/venv"
  "$DIR/venv/bin/pip" install -q torch==2.13.0
  "$DIR/venv/bin/pip" install -q msgspec pyzmq cbor2 pydantic numpy psutil cachetools regex pyyaml packaging \
     transformers aiohttp openai openai-harmony pillow pybase64 cloudpickle uvloop py-cpuinfo prometheus_client \
     xgrammar fastapi partial_json_parser llguidance urllib3 requests orjson ipython
fi
unpack() {  # name version
  if [ ! -d "$DIR/src/$1" ]; then
    "$DIR/venv/bin/pip" download -q --no-deps -d "$DIR/dl" "$1==$2"
    "$DIR/venv/bin/python" - "$DIR" "$1" "$2" <<'PY'
import glob, sys, zipfile
d, name, ver = sys.argv[1:]
z = zipfile.ZipFile(glob.glob(f"{d}/dl/{name}-{ver}-*.whl")[0])
for n in z.namelist():
    if not n.endswith(".so"):
        z.extract(n, f"{d}/src")
PY
  fi
}
unpack vllm 0.33.0
unpack sglang 0.5.23
PYTHONPATH="$DIR/src" "$DIR/venv/bin/python" -c "
import vllm.distributed.kv_transfer.kv_connector.v1.base, vllm.distributed.kv_transfer.kv_connector.factory
import vllm.distributed.kv_events, vllm.v1.core.kv_cache_utils
print('vllm interfaces import')" 2>&1 | tail -1
PYTHONPATH="$DIR/src" "$DIR/venv/bin/python" -c "
import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory
print('sglang HiCacheStorage imports')" 2>&1 | tail -1
echo "ready: PYTHONPATH=$DIR/src $DIR/venv/bin/python"
