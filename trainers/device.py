"""Choosing where a trainer computes: CUDA with bf16 autocast when present, else CPU."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DevicePlan:
    """The device a trainer computes on, and how."""

    device: torch.device
    """Where tensors live."""
    autocast_dtype: torch.dtype | None
    """Mixed-precision dtype for the forward pass (bf16 on CUDA), None for full fp32."""
    threads: int
    """CPU threads for intra-op parallelism."""
    flush_denormal: bool = False
    """Denormal floats are flushed to zero in this process's CPU arithmetic (:func:`plan_device`)."""

    @property
    def kind(self) -> str:
        """``"cuda"`` or ``"cpu"``."""
        return self.device.type

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Context for the forward pass: bf16 autocast on CUDA, a no-op on CPU."""
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
                yield


def plan_device(requested: str = "auto", threads: int = 0, mixed_precision: bool = True, *,
                flush_denormal: bool = False) -> DevicePlan:
    """Pick the device: ``auto`` takes CUDA when available, else CPU.

    Args:
        requested: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        threads: CPU threads (0 keeps torch's default).
        mixed_precision: use bf16 autocast on a CUDA device that supports it.
        flush_denormal: flush denormal floats (below 1.18e-38 in float32) to zero in the CPU's
            arithmetic (``torch.set_flush_denormal``: the x86 FTZ and DAZ flags), for the calling
            thread and every thread it starts afterwards (they inherit its floating-point
            environment): the trainer's worker threads, torch's and numpy's. A CPU computes on a
            denormal operand many times slower; a trainer's digits step took 2.2 ms with them against
            1.4 ms flushed (docs/parameter-plane.md). Call it before the process starts its threads.

    Raises:
        ValueError: ``requested`` names CUDA but none is available, or is not a device.
    """
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise ValueError(f"--device: not a device: {requested!r}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: CUDA is not available on this machine")
    if threads > 0:
        torch.set_num_threads(threads)
    amp = None
    if device.type == "cuda" and mixed_precision and torch.cuda.is_bf16_supported():
        amp = torch.bfloat16
    flushed = bool(flush_denormal and torch.set_flush_denormal(True))  # False where the CPU cannot
    plan = DevicePlan(device, amp, torch.get_num_threads(), flushed)
    logger.info("computing on %s (autocast %s, %d threads, denormals %s)", device, amp, plan.threads,
                "flushed to zero" if flushed else "kept")
    return plan
