"""GPU memory and utilisation for the serving front-end's ``/metrics`` (:mod:`cluster.serve.metrics`), via pynvml
(the nvidia-ml-py package) when scraped."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger(__name__)


class GPUCollector:
    """GPU memory and utilisation via pynvml, initialised on the first scrape; any NVML failure (no library, no
    driver, no GPU) turns the collector off for good rather than erroring every scrape."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._disabled = False

    def collect(self):
        handles = self._handles()
        if not handles:
            return
        used = GaugeMetricFamily("duet_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
        total = GaugeMetricFamily("duet_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
        util = GaugeMetricFamily("duet_gpu_utilization_ratio", "GPU busy fraction over the last sample period",
                                 labels=["gpu"])
        nv = self._nvml
        try:
            for i, h in enumerate(handles):
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                used.add_metric([str(i)], float(mem.used))
                total.add_metric([str(i)], float(mem.total))
                util.add_metric([str(i)], nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
        except Exception as e:  # noqa: BLE001 - pynvml raises NVMLError subclasses; never fail a scrape
            logger.debug("GPU metrics unavailable: %s", e)
            return
        yield used
        yield total
        yield util

    def _handles(self) -> list:
        if self._disabled:
            return []
        try:
            if self._nvml is None:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            return [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self._nvml.nvmlDeviceGetCount())]
        except Exception as e:  # noqa: BLE001 - ImportError or NVMLError: no GPU metrics on this machine
            logger.debug("no GPU metrics: %s", e)
            self._disabled = True
            return []
