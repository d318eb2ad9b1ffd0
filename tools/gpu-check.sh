#!/usr/bin/env bash
# tools/gpu-check.sh: prove kvtier's GPU path on a machine with one CUDA GPU, in one run (< 8 min).
#
#   tools/gpu-check.sh [--dry-run] [--no-venv] [RESULT.json]
#
# Steps, each under its own time limit (30+200+90+60+90 s: 7.8 min at worst), each recorded in one JSON
# document:
#   venv     python3 -m venv $GPU_CHECK_VENV (default $TMPDIR/kvtier-gpu-check-venv; skipped with --no-venv)
#   install  pip install -e '.[test]'  (pip takes the CUDA build of torch from PyPI)
#   cuda     pytest -m cuda            (every CUDA test: pinned tier, GPU tier, connectors, engine)
#   gpu      kvtier bench gpu --json   (connector and layer-wise H2D/D2H vs raw cudaMemcpyAsync)
#   ttft     kvtier bench ttft --device cuda --engines engine --json
#            (reference engine hit vs recompute on the GPU, and the partial-hit row: layer-wise
#            overlapped vs load-then-compute)
# then checks read from the results: connector and layer-wise copies >= 0.8x the raw copies,
# layer-wise partial hits not slower than load-then-compute.
#
# The JSON goes to $OUT/gpu-check.json when $OUT is set, else to RESULT.json.
#
# --dry-run: the same steps on the CPU with tiny sizes (bench gpu --device cpu, ttft --device cpu);
#   what needs CUDA (the cuda tests, the speed checks) is skipped and the JSON says so. The test
#   suite runs it (tests/kvtier/bench/test_gpu_check.py) with --no-venv.
# --no-venv: use $PYTHON, else .venv/bin/python if present, else python3; install nothing.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dry_run=0
use_venv=1
result=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        --no-venv) use_venv=0 ;;
        -h|--help) sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu-check: unknown option $arg" >&2; exit 2 ;;
        *) result="$arg" ;;
    esac
done
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    result="$OUT/gpu-check.json"
fi
if [[ -z "$result" ]]; then
    echo "gpu-check: where should the JSON go? set \$OUT or give a path" >&2
    exit 2
fi
cd "$here"
started=$(date +%s)
steps_file="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
trap 'rm -rf "$steps_file"' EXIT

# record NAME RC SECONDS SKIPPED_REASON LOGFILE: one line of the step table the driver reads
record() {
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$steps_file/steps.tsv"
}

# run NAME LIMIT_S CMD...: run a step under a time limit, its output in a log
run() {
    local name="$1" limit="$2"
    shift 2
    local log="$steps_file/$name.log" t0 rc=0
    t0=$(date +%s)
    echo "gpu-check: $name: $*" >&2
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1 || rc=$?
    record "$name" "$rc" "$(( $(date +%s) - t0 ))" "" "$log"
    tail -n 3 "$log" | sed "s/^/gpu-check: $name: /" >&2
    return 0
}

if (( use_venv )); then
    venv="${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/kvtier-gpu-check-venv}"
    run venv 30 python3 -m venv "$venv"
    py="$venv/bin/python"
    run install 200 "$py" -m pip install --quiet --disable-pip-version-check -e '.[test]'
else
    py="${PYTHON:-}"
    if [[ -z "$py" ]]; then
        if [[ -x "$here/.venv/bin/python" ]]; then py="$here/.venv/bin/python"; else py="$(command -v python3)"; fi
    fi
    record venv 0 0 "--no-venv: using $py" ""
    record install 0 0 "--no-venv: nothing installed" ""
fi

work="$steps_file/work"
mkdir -p "$work"
if (( dry_run )); then
    record cuda 0 0 "dry run: the cuda tests need a CUDA device" ""
    run gpu 120 "$py" -m kvtier bench gpu --device cpu --repetitions 1 --blocks 2 --layers 1 \
        --work-dir "$work" --json "$steps_file/gpu.json"
    run ttft 120 "$py" -m kvtier bench ttft --device cpu --quick --engines engine --repetitions 1 \
        --lengths 64 --suffix 16 --json "$steps_file/ttft.json"
else
    run cuda 90 "$py" -m pytest -q -p no:cacheprovider -m cuda tests
    run gpu 60 "$py" -m kvtier bench gpu --quick --repetitions 3 --work-dir "$work" --json "$steps_file/gpu.json"
    run ttft 90 "$py" -m kvtier bench ttft --device cuda --engines engine --lengths 1024,2048 --suffix 256 \
        --repetitions 3 --dtype bfloat16 --json "$steps_file/ttft.json"
fi

asm_py="$py"
[[ -x "$asm_py" ]] || asm_py="$(command -v python3)"  # a failed venv: the JSON still says why
"$asm_py" - "$steps_file" "$result" "$dry_run" "$started" <<'PY'
"""Assemble gpu-check's JSON: the steps, their results, and the checks read from them."""
import json
import platform
import sys
import time
from pathlib import Path

steps_dir, result, dry_run, started = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
doc = {"mode": "dry-run (CPU)" if dry_run else "gpu", "python": platform.python_version(), "steps": [],
       "checks": [], "skipped": []}
try:
    import torch
    doc["torch"] = torch.__version__
    doc["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        doc["device"] = torch.cuda.get_device_name(0)
except Exception as exc:  # an install that failed: the steps say why
    doc["torch"] = f"not importable: {type(exc).__name__}: {exc}"
    doc["cuda_available"] = False
ok = True
for line in (steps_dir / "steps.tsv").read_text().splitlines():
    name, rc, seconds, skipped, log = line.split("\t")
    step = {"name": name, "rc": int(rc), "seconds": int(seconds)}
    if skipped:
        step["skipped"] = skipped
        if name == "cuda":
            doc["skipped"].append(f"cuda tests: {skipped}")
    if log:
        step["tail"] = Path(log).read_text(errors="replace").splitlines()[-15:]
    produced = steps_dir / f"{name}.json"
    if produced.exists():
        step["result"] = json.loads(produced.read_text())
    elif name in ("gpu", "ttft"):
        step["result"] = None
    ok &= step["rc"] == 0
    doc["steps"].append(step)


def rows(name):
    for step in doc["steps"]:
        if step["name"] == name and step.get("result"):
            return step["result"].get("rows", [])
    return []


def check(what, value, floor):
    passed = value is not None and value >= floor
    doc["checks"].append({"check": what, "value": value, "at_least": floor, "passed": passed})
    return passed


if dry_run:
    doc["skipped"].append("speed checks: figures on the CPU say nothing about PCIe copies")
    got = {r["case"].rsplit(",", 1)[0] for r in rows("gpu")}
    partial = [r for r in rows("ttft") if "partial hit" in r["case"]]
    doc["checks"].append({"check": "bench gpu ran every connector row on the CPU code path",
                          "passed": {"connector load (daemon→device)", "connector layer-wise load (daemon→device)",
                                     "connector layer-wise save (device→daemon)"} <= got})
    doc["checks"].append({"check": "bench ttft has the partial-hit row", "passed": bool(partial)})
else:
    for r in rows("gpu"):
        if r["case"].startswith("connector"):
            check(f"{r['case']}: x raw {r['baseline_name']}", r["ratio"], 0.8)
    for r in rows("ttft"):
        if "partial hit" in r["case"]:
            check(f"{r['case']}: layer-wise vs load-then-compute", r["ratio"], 1.0)
doc["ok"] = ok and all(c["passed"] for c in doc["checks"])
doc["seconds"] = int(time.time()) - started
result.parent.mkdir(parents=True, exist_ok=True)
result.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
print(f"gpu-check: {'ok' if doc['ok'] else 'FAILED'} in {doc['seconds']} s -> {result}", file=sys.stderr)
sys.exit(0 if ok else 1)
PY
