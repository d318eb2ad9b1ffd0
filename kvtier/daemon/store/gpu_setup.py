"""Checking and opening the store's GPU tier from its settings.

Imports torch: the store loads this module only when ``gpu_bytes > 0``.
"""

from __future__ import annotations

import torch

from kvtier_protocol.errors import StorageError

from kvtier.daemon.store.config import StoreConfig, StoreConfigError
from kvtier.daemon.store.gpu import GpuTier


def check_gpu_device(cfg: StoreConfig) -> torch.device:
    """The torch device of the GPU tier, checked against this process.

    Raises:
        StoreConfigError: torch does not know the device, or it is a CUDA device and CUDA is not
            available here (a CPU-only torch build, no driver, no visible device) or the index
            is beyond the visible devices.
    """
    try:
        device = torch.device(cfg.gpu_device)
    except RuntimeError as e:
        raise StoreConfigError(f"gpu_device {cfg.gpu_device!r} is not a torch device: {e}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise StoreConfigError(
                f"gpu_bytes={cfg.gpu_bytes} on gpu_device {cfg.gpu_device!r}, but CUDA is not available in this "
                f"process (torch {torch.__version__}, CUDA build {torch.version.cuda}); set gpu_bytes = 0 to run "
                "without a GPU tier")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise StoreConfigError(f"gpu_device {cfg.gpu_device!r}: only {count} CUDA device(s) are visible")
    return device


def open_gpu_tier(cfg: StoreConfig) -> GpuTier:
    """Reserve the GPU tier's pools.

    Raises:
        StoreConfigError: see :func:`check_gpu_device`.
        CapacityError: ``gpu_bytes`` is below the slot alignment.
        StorageError: the device cannot hold the pools.
    """
    device = check_gpu_device(cfg)
    try:
        return GpuTier(cfg.gpu_bytes, device=device, segment_bytes=cfg.gpu_segment)
    except RuntimeError as e:  # torch.OutOfMemoryError, a device that cannot be used
        raise StorageError(f"GPU tier of {cfg.gpu_bytes} B on {device}: {e}") from e
