"""`kvtier bench`: suites that measure kvtier next to its reference in one run.

Each suite is a module exposing::

    DESCRIPTION: str
    def add_arguments(parser: argparse.ArgumentParser) -> None   # suite-specific flags
    def run(args: argparse.Namespace) -> SuiteResult             # measure, return rows

Common flags (added by the CLI for every suite): ``--quick`` (CI-sized), ``--repetitions N``,
``--json FILE``, ``--plot DIR`` (PNG charts; matplotlib). ``kvtier bench all`` runs every suite
(kvtier/bench/all.py). Only the suite that runs is imported, so one suite's dependencies (or a broken
suite) never slow or break another.
"""

from __future__ import annotations

SUITES: dict[str, tuple[str, str]] = {
    # name: (module, one-line help shown by `kvtier bench --help`)
    "codecs": ("kvtier.bench.codecs", "codec size ratio, error and encode/decode GB/s vs memcpy"),
    "precision": ("kvtier.bench.precision",
                  "top-1 agreement, KL and max logit error of lossy KV codecs on the reference engine"),
    "store": ("kvtier.bench.store.suite", "host-tier put/get vs torch copy_; disk write/read vs dd O_DIRECT"),
    "dataplane": ("kvtier.bench.dataplane",
                  "daemon data plane: put/get over shared memory and TCP vs memcpy; lookup p50/p99 vs ping"),
    "ttft": ("kvtier.bench.ttft",
             "time to first token on a prefix hit vs full prefill (reference engine and HF)"),
    "peers": ("kvtier.bench.peers.suite",
              "save/load workload through kvtier (shm, TCP) vs Redis and LMCache, several clients"),
    "lookup": ("kvtier.bench.lookup",
               "longest-prefix lookup latency for 1K-128K-token prompts; flat with 1K-1M blocks stored"),
    "events": ("kvtier.bench.events", "KV events published and received per second"),
    "gpu": ("kvtier.bench.gpu", "pinned host<->device copies through the connector vs raw cudaMemcpy (CUDA only)"),
    "crash": ("kvtier.bench.crash.suite", "SIGKILL the daemon under a durable writer; count recovered blocks"),
    "soak": ("kvtier.bench.soak.suite", "many clients of mixed lookup/save/load at full capacity: errors, RSS, leaks"),
    "fuzz": ("kvtier.bench.fuzz.suite", "feed every untrusted-input decoder random and mutated inputs"),
    "abuse": ("kvtier.bench.abuse", "a client's save/load p99 and the daemon's RSS under unauthenticated attacks"),
    "remote": ("kvtier.bench.remote", "remote tier on a Redis Cluster: kvtier's upload/fetch vs plain redis-py pipelines"),
}
