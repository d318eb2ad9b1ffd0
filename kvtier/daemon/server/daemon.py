"""kvtierd's life cycle: assemble the services around its stores, serve, shut down in a fixed order.

::

    start:  store.start() -> each tenant's store.start() -> Auth -> Metrics -> EventHubs.start()
            -> DataPlane.start() -> REST site -> event pump -> ready (sd_notify READY=1, one log
            line per endpoint) -> garbage-collector policy (kvtier.daemon.server.collector)
    stop (SIGTERM / SIGINT):  STOPPING=1 -> not ready -> data plane and REST stop accepting and
            drain (drain_timeout_s) -> pump stops -> every store.close() (host blocks written to
            disk) -> last events published -> EventHubs close -> exit 0
    a second signal during stop: the step under way is cancelled and the rest is closed at once
            (no drain, no flush; the disk tier's log still holds every acknowledged write).

Start-up never waits for memory: the store pre-faults (and pins) the host tier in the background,
so the daemon is ready in well under 2 s whatever the tier sizes. Nothing here imports torch,
except the check of a configured GPU tier on a machine that has an NVIDIA driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable

from aiohttp import web

from kvtier_protocol.errors import KVTierError

from kvtier.daemon.config import DaemonConfig, nvidia_driver_present, split_hostport
from kvtier.daemon.server import tenancy
from kvtier.daemon.server.auth import Auth
from kvtier.daemon.server.collector import CollectorPolicy
from kvtier.daemon.server.context import DaemonContext, Scope
from kvtier.daemon.server.dataplane import DataPlane
from kvtier.daemon.server.events import EventHub
from kvtier.daemon.server.metrics import Metrics
from kvtier.daemon.server.rest import create_rest_app
from kvtier.daemon.server.rest_guard import GatedSite, handler_args, rest_connection_cap
from kvtier.daemon.server.sdnotify import SdNotifier
from kvtier.daemon.store.config import StoreConfig, StoreConfigError
from kvtier.daemon.store.owner import private_dir
from kvtier.daemon.server.remote_setup import remote_args
from kvtier.daemon.store.store import TieredStore

log = logging.getLogger(__name__)
SIGNAL_DEBOUNCE_S = 0.5  # a repeat of the stop signal within this window is the same request

PUMP_INTERVAL_S = 0.02  # store events reach subscribers within this
RECLAIM_INTERVAL_S = 1.0  # expired leases are freed this often even when no request arrives


async def run_daemon(config: DaemonConfig, *, ready_cb: Callable[[DaemonContext], None] | None = None) -> int:
    """Run kvtierd until SIGTERM or SIGINT.

    Args:
        config: the settings (:func:`kvtier.daemon.config.load_config`).
        ready_cb: called once every endpoint listens, with the running context.

    Returns:
        The exit status: 0 after a clean shutdown, 1 when start-up failed, 128 + the signal
        number when a second signal cut the shutdown short.
    """
    return await Daemon(config).run(ready_cb)


class Daemon:
    """One daemon run (see the module docstring for the order of things)."""

    def __init__(self, config: DaemonConfig, *, notifier: SdNotifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or SdNotifier()
        self.ctx: DaemonContext | None = None
        self._store: TieredStore | None = None
        self._tenants: dict[str, Scope] = {}
        self._events: EventHub | None = None
        self._metrics: Metrics | None = None
        self._dataplane: DataPlane | None = None
        self._runner: web.AppRunner | None = None
        self._pump: asyncio.Task[None] | None = None
        self._gc: CollectorPolicy | None = None
        self._stop_requested = asyncio.Event()
        self._stopping: asyncio.Task[None] | None = None
        self._forced = 0  # the signal that cut the shutdown short
        self._first_signal_at = 0.0

    async def run(self, ready_cb: Callable[[DaemonContext], None] | None = None) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            t0 = time.monotonic()
            try:
                await self.start()
            except Exception as e:
                if isinstance(e, (KVTierError, OSError)):
                    log.error("kvtierd cannot start: %s", e)
                else:
                    log.exception("kvtierd cannot start")
                await self._shutdown()
                return 1
            try:
                assert self.ctx is not None, "start() builds the context"
                log.info("kvtierd ready in %.2f s", time.monotonic() - t0)
                if ready_cb is not None:
                    ready_cb(self.ctx)
                await self._stop_requested.wait()
                log.info("kvtierd stopping (drain up to %.1f s)", self.config.drain_timeout_s)
            finally:
                await self._shutdown()
            if self._forced:
                log.warning("kvtierd stopped early (second signal): no drain, memory blocks not flushed")
                return 128 + self._forced
            log.info("kvtierd stopped")
            return 0
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        now = time.monotonic()
        if not self._stop_requested.is_set():
            self._first_signal_at = now
            self._stop_requested.set()
        elif now - self._first_signal_at < SIGNAL_DEBOUNCE_S:
            # One Ctrl-C, or `timeout`/`kill -- -PGID`, can deliver the same signal twice (to the
            # process and to its group); only a deliberate second signal skips the drain.
            return
        elif self._stopping is not None and not self._stopping.done() and not self._forced:
            log.warning("kvtierd: %s again, stopping now", signal.Signals(sig).name)
            self._forced = sig
            self._stopping.cancel()

    # --- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store and every service; raises KVTierError or OSError (the caller cleans up)."""
        cfg = self.config
        started_at = time.time()
        private_dir(cfg.data_dir)  # 0700 whatever the umask; a pre-existing one of ours is tightened
        store_cfg = gpu_checked(cfg.store)
        _log_tiers(store_cfg)
        self._store = TieredStore(store_cfg, **remote_args(cfg, None))
        await self._store.start()
        self._metrics = Metrics(gpu=nvidia_driver_present())
        self._tenants = await tenancy.open_tenants(cfg, self._metrics, gpu_checked)
        auth = Auth.from_config(cfg.auth, cfg.data_dir, cfg.tenants)
        self._events = EventHub(cfg.events, self._metrics, packed_endpoint=cfg.events.packed_endpoint)
        self.ctx = ctx = DaemonContext(cfg, self._store, auth, self._metrics, self._events, started_at,
                                       tenants=self._tenants)
        self._metrics.bind(ctx)
        events = self._events.start()
        ctx.endpoints.update(tenancy.start_hubs(self._tenants))
        self._dataplane = DataPlane(ctx)
        ctx.endpoints["dataplane"] = await self._dataplane.start()
        if cfg.rest.listen is not None:
            ctx.endpoints["rest"] = await self._start_rest(ctx, cfg.rest.listen)
        ctx.endpoints["events"] = events
        self._pump = asyncio.create_task(self._pump_loop(), name="kvtierd-event-pump")
        ctx.ready = True
        self.notifier.ready(f"serving {', '.join(ctx.endpoints['dataplane'])}")
        for ep in ctx.endpoints["dataplane"]:
            log.info("kvtierd listening %s", ep)
        for ep in ctx.endpoints.get("rest", []):
            log.info("kvtierd rest %s", ep)
        for name, ep in self._events.named_endpoints:
            log.info("kvtierd %s %s", name, ep)
        for tenant in self._tenants:
            for name, ep in zip(("events", "replay"), ctx.endpoints.get(f"events:{tenant}", [])):
                log.info("kvtierd tenant %s %s %s", tenant, name, ep)
        # Last: everything long-lived exists now (the index loaded from disk above all), and the
        # one full collection of the freeze is not counted in the time to ready.
        self._gc = CollectorPolicy(freeze=cfg.gc_freeze)
        self._gc.start()
        self._metrics.watch_gc(self._gc)

    async def _start_rest(self, ctx: DaemonContext, listen: str) -> list[str]:
        host, port = split_hostport(listen)
        # REST never takes what the data plane needs: capped connections, header and body
        # deadlines, descriptors kept for the data plane (kvtier.daemon.server.rest_guard).
        self._runner = web.AppRunner(create_rest_app(ctx), access_log=None,
                                     shutdown_timeout=self.config.drain_timeout_s, **handler_args(self.config))
        await self._runner.setup()
        await GatedSite(self._runner, host, port, cap=rest_connection_cap(self.config),
                        shutdown_timeout=self.config.drain_timeout_s).start()
        return [f"http://[{a[0]}]:{a[1]}" if ":" in a[0] else f"http://{a[0]}:{a[1]}"
                for a in self._runner.addresses]

    # --- events --------------------------------------------------------------------------------

    async def _pump_loop(self) -> None:
        last_reclaim = time.monotonic()
        while True:
            await asyncio.sleep(PUMP_INTERVAL_S)
            self._pump_once()
            if time.monotonic() - last_reclaim >= RECLAIM_INTERVAL_S and self._store is not None:
                last_reclaim = time.monotonic()
                for store in [self._store] + [s.store for s in self._tenants.values()]:
                    store.reclaim_expired()

    def _pump_once(self) -> None:
        if self._store is not None:
            self._publish(self._store, self._events)
        for scope in self._tenants.values():  # each store's events go to its own hub only
            self._publish(scope.store, scope.events)

    def _publish(self, store: TieredStore, hub: EventHub | None) -> None:
        """Hand the store's new events to its hub; a failure is logged, never fatal."""
        if hub is None:
            return
        events = store.take_events()
        if not events:
            return
        try:
            hub.publish(events, {ns.ns_id: ns for ns in store.namespaces()})
        except Exception:  # a bug in translation must not stop the daemon; the events are lost
            log.exception("kvtierd: publishing %d store events failed", len(events))

    # --- stop ----------------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Run :meth:`_stop` as a task a second signal may cancel; then close what is left, fast."""
        self._stopping = asyncio.create_task(self._stop(), name="kvtierd-stop")
        try:
            await asyncio.shield(self._stopping)
        except asyncio.CancelledError:
            if not self._forced:
                raise
        if self._forced:
            with contextlib.suppress(asyncio.CancelledError):
                await self._stopping
            await self._close_fast()

    async def _stop(self) -> None:
        if self.ctx is not None:
            self.ctx.ready = False
        self.notifier.stopping("draining")
        drain = self.config.drain_timeout_s
        dataplane, runner = self._dataplane, self._runner
        # The data plane and REST drain side by side, so the whole drain stays within drain_timeout_s.
        results = await asyncio.gather(dataplane.stop(drain) if dataplane else _nothing(),
                                       runner.cleanup() if runner else _nothing(), return_exceptions=True)
        for what, result in zip(("data plane", "REST"), results):
            if isinstance(result, Exception):  # keep going: the store must still be closed
                log.error("kvtierd: stopping the %s failed", what, exc_info=result)
        self._dataplane = self._runner = None
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
            self._pump = None
        store, self._store = self._store, None
        tenants, self._tenants = list(self._tenants.values()), {}
        try:
            if store is not None or tenants:
                self.notifier.status("writing memory blocks to disk")
            closing = [store.close()] if store is not None else []
            await asyncio.gather(*closing, tenancy.close_stores(tenants))
        finally:
            # After the close: its flush to disk is reported too (blocks now stored on disk).
            if store is not None:
                self._publish(store, self._events)
            for scope in tenants:
                self._publish(scope.store, scope.events)
            tenancy.close_hubs(tenants)
            self._close_services()
            await self._stop_gc()

    async def _close_fast(self) -> None:
        if self._dataplane is not None:
            with contextlib.suppress(Exception):
                await self._dataplane.stop(0.0)
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
        if self._pump is not None:
            self._pump.cancel()
        stores = [self._store] if self._store is not None else []
        stores += [s.store for s in self._tenants.values()]
        for store in stores:
            # No flush: the store's write-ahead log already holds every acknowledged disk write.
            store.config = dataclasses.replace(store.config, flush_on_close=False)
        await asyncio.gather(*(store.close() for store in stores), return_exceptions=True)
        self._store = None
        tenancy.close_hubs(list(self._tenants.values()))
        self._tenants = {}
        self._close_services()
        await self._stop_gc()

    async def _stop_gc(self) -> None:
        gc_policy, self._gc = self._gc, None
        if gc_policy is not None:
            await gc_policy.stop()

    def _close_services(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


async def _nothing() -> None:
    return None


def gpu_checked(cfg: StoreConfig) -> StoreConfig:
    """``cfg``, or ``cfg`` without its GPU tier when one is configured on a CUDA device and CUDA is
    not available here (a warning then: one config file may serve hosts with and without GPUs)."""
    if not cfg.gpu_bytes or not cfg.gpu_device.startswith("cuda"):
        return cfg
    reason = "no NVIDIA driver is loaded"
    if nvidia_driver_present():
        from kvtier.daemon.store.gpu_setup import check_gpu_device  # imports torch: only for a GPU tier

        try:
            check_gpu_device(cfg)
            return cfg
        except StoreConfigError as e:
            reason = e.message
    log.warning("kvtierd: GPU tier of %s configured but not available (%s); running without it",
                _size(cfg.gpu_bytes), reason)
    return dataclasses.replace(cfg, gpu_bytes=0)


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _log_tiers(cfg: StoreConfig) -> None:
    disk = f"{_size(cfg.disk_bytes)} at {cfg.disk_path}" if cfg.disk_path else "off"
    gpu = f"{_size(cfg.gpu_bytes)} on {cfg.gpu_device}" if cfg.gpu_bytes else "off"
    log.info("kvtierd starting: host %s, disk %s, gpu %s, %s", _size(cfg.host_bytes), disk, gpu,
             "write-through" if cfg.write_through else "write-back")
    try:
        shm = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm = None
    if shm is not None and cfg.host_bytes > shm:
        log.warning("kvtierd: host tier %s > free /dev/shm %s: writes may fail (SIGBUS) once it fills",
                    _size(cfg.host_bytes), _size(shm))
    if cfg.disk_path:
        parent = cfg.disk_path
        while not os.path.exists(parent) and os.path.dirname(parent) != parent:
            parent = os.path.dirname(parent)
        free = shutil.disk_usage(parent).free
        if cfg.disk_bytes > free:
            log.warning("kvtierd: disk tier budget %s > free space %s on %s", _size(cfg.disk_bytes),
                        _size(free), parent)
