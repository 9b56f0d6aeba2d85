"""The NVML source: every second, what each GPU has free, what each process holds there, and
who those processes are.

NVML calls can block for a while on a busy or failing GPU, so sampling runs on a thread of its
own and hands each sample to its consumers (the core, through the engine, and the node status
publisher); none of them waits for NVML.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence

from appliance.core import events as ev
from appliance.core.identity import ClientIdentity
from appliance.gpu.nvml import GpuSample, Nvml

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0

Consumer = Callable[[Sequence[GpuSample]], None]
# The kernel's identity of each pid that can be read (host.process.ProcessIdentities).
Identify = Callable[[Collection[int]], Mapping[int, ClientIdentity]]


def gpu_sampled(samples: Sequence[GpuSample]) -> ev.GpuFreeMemory:
    """The core's event for one sample of every GPU."""
    return ev.GpuFreeMemory(
        {s.uuid: s.memory_free for s in samples},
        processes={s.uuid: s.processes for s in samples},
        used={s.uuid: s.memory_used for s in samples if s.memory_total},
        utilization={s.uuid: s.utilization_percent for s in samples},
    )


def processes_seen(samples: Sequence[GpuSample], identify: Identify) -> ev.GpuProcessesSeen:
    """The core's event for every compute process of the GPUs whose processes NVML listed.

    A process whose identity cannot be read (it exited since NVML listed it) is left out.
    """
    listed = [s for s in samples if s.pids is not None]
    idents = identify({pid for s in listed for pid in s.pids or ()})
    return ev.GpuProcessesSeen(
        gpus=frozenset(s.uuid for s in listed),
        processes=tuple(
            ev.GpuProcess(s.uuid, idents[pid], s.processes.get(pid))
            for s in listed
            for pid in s.pids or ()
            if pid in idents
        ),
    )


class NvmlSampler:
    """Samples `nvml` every `interval_s` on a thread and offers each sample to `consumers`."""

    def __init__(
        self,
        nvml: Nvml,
        consumers: Sequence[Consumer],
        *,
        interval_s: float = SAMPLE_INTERVAL_S,
    ) -> None:
        self._nvml = nvml
        self._consumers = list(consumers)
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            samples = self._nvml.sample()  # never raises: errors are logged once inside
            if samples:
                for consumer in self._consumers:
                    try:
                        consumer(samples)
                    except Exception:  # a broken consumer must not end sampling
                        log.exception("an NVML sample consumer failed; sampling goes on")
            self._stopping.wait(self._interval_s)
