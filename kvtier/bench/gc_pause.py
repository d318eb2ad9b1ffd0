"""``python -m kvtier.bench.gc_pause --blocks N``: the pause of one full collection of CPython's
cyclic garbage collector over an index of N blocks (``kvtier bench lookup``'s index), before and
after ``gc.freeze()`` (the figure in :mod:`kvtier.daemon.server.collector`'s docstring, which
explains the daemon's collector policy)."""

from __future__ import annotations

import argparse
import gc
import time

from kvtier.bench.lookup import build_index


def main() -> None:
    """Build the index, then time a full collection before and after a freeze."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    built = build_index(args.blocks)
    print(f"{len(built.index)} blocks indexed, {len(gc.get_objects())} objects tracked")
    t0 = time.perf_counter()
    gc.collect()
    print(f"full collection: {time.perf_counter() - t0:.3f} s")
    gc.freeze()
    t0 = time.perf_counter()
    gc.collect()
    print(f"full collection after gc.freeze(): {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
