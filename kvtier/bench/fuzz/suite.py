"""`kvtier bench fuzz`: every decoder of untrusted input fed random and mutated inputs.

Decoders (one row group each): frames (``decode_frame``, ``FrameDecoder``, ``read_frame``, each
followed by ``validate_request`` / ``parse_response``), block headers (``decode_header`` +
``split_record``), whole records (``decode_block``, codecs and layout conversion included), KV
event batches and their ZMQ frames, namespace maps (``Namespace.from_wire``), key inputs, REST
bodies and query values, the TOML config file, ``KVTIER_*`` variables, and command-line sizes
and addresses. Inputs: random bytes, byte-level mutations of the golden vectors in
``protocol/vectors`` and structure-aware mutations that keep lengths and checksums valid.

Rows per decoder:
  * ``inputs``: inputs that reached the decoder, next to the required count (ratio >= 1: done);
  * ``crashes``: exceptions that are not a typed KVTierError (allowed: 0; ratio 1 / (1 + n));
  * ``hangs``: inputs over the per-input time bound (allowed: 0; ratio 1 / (1 + n));
  * ``slowest``: the slowest input, ms, next to the bound (ratio bound / slowest).

Full run: ``kvtier bench fuzz`` (100,000 inputs per decoder); CI: ``--quick`` (2,000).
Reproducers of every distinct crash go to ``--findings DIR`` (input bytes + traceback).
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from pathlib import Path

from kvtier.bench.fuzz.engine import TargetStats, fuzz_target
from kvtier.bench.fuzz.targets import build_targets
from kvtier.bench.report import Row, SuiteResult, progress

DESCRIPTION = "feed every untrusted-input decoder random and mutated inputs: crashes, hangs per decoder"
FULL_INPUTS = 100_000
QUICK_INPUTS = 2_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inputs", type=int, default=None,
                        help=f"inputs per decoder (default {FULL_INPUTS:,}; --quick {QUICK_INPUTS:,})")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (a run is reproducible from it)")
    parser.add_argument("--bound-ms", type=float, default=2000.0,
                        help="per-input time bound; a slower input counts as a hang (default 2000)")
    parser.add_argument("--targets", default="", help="comma-separated decoder names (default: all)")
    parser.add_argument("--findings", metavar="DIR", default=None,
                        help="write a reproducer (input + traceback) of each distinct crash or hang here")


def rows_for(stats: TargetStats, required: int, bound_s: float) -> list[Row]:
    """The four rows of one decoder."""
    slowest_ms, bound_ms = stats.slowest_s * 1e3, bound_s * 1e3
    return [
        Row(stats.name, "inputs", "inputs", stats.inputs, "required", required, stats.inputs / required),
        Row(stats.name, "crashes", "inputs", stats.crashes, "allowed", 0, 1 / (1 + stats.crashes)),
        Row(stats.name, "hangs", "inputs", stats.hangs, "allowed", 0, 1 / (1 + stats.hangs)),
        Row(stats.name, "slowest", "ms", slowest_ms, "bound", bound_ms, bound_ms / slowest_ms if slowest_ms else 0.0),
    ]


def write_findings(folder: Path, stats: TargetStats) -> None:
    """One ``<decoder>-<kind>-<digest>.bin`` (the input) and ``.txt`` (error, traceback) per finding."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in stats.findings:
        stem = f"{stats.name}-{f.kind}-{hashlib.sha256(f.data).hexdigest()[:12]}"
        (folder / f"{stem}.bin").write_bytes(f.data)
        (folder / f"{stem}.txt").write_text(f"{f.error}\n\n{f.trace}")


def run(args: argparse.Namespace) -> SuiteResult:
    required = args.inputs or (QUICK_INPUTS if args.quick else FULL_INPUTS)
    bound_s = args.bound_ms / 1e3
    wanted = {t.strip() for t in args.targets.split(",") if t.strip()}
    result = SuiteResult("fuzz")
    with tempfile.TemporaryDirectory(prefix="kvtier-fuzz-") as work:
        targets = build_targets(work)
        unknown = wanted - {t.name for t in targets}
        if unknown:
            raise SystemExit(f"unknown fuzz targets {sorted(unknown)}; choose from {[t.name for t in targets]}")
        for target in targets:
            if wanted and target.name not in wanted:
                target.close()
                continue
            progress(f"fuzz: {target.name}: {required:,} inputs ({len(target.seeds)} seeds)")
            try:
                stats = fuzz_target(target, required, seed=args.seed, bound_s=bound_s)
            finally:
                target.close()
            progress(f"fuzz: {target.name}: {stats.inputs:,} inputs in {stats.seconds:.1f} s: {stats.typed:,} typed "
                     f"errors, {stats.accepted:,} accepted, {stats.crashes} crashes, {stats.hangs} hangs, "
                     f"{stats.skipped:,} not shaped into an input")
            for sig, count in stats.signatures.items():
                progress(f"fuzz: {target.name}: {count} x {sig}")
            if args.findings and stats.findings:
                write_findings(Path(args.findings), stats)
            result.rows.extend(rows_for(stats, required, bound_s))
    return result
