"""The GPU's SM clock while a benchmark runs, and whether the driver held it down.

The benchmarks print it beside their timings (``describe``): pympgu.bench.train per row.
"""


class Clocks:
    """The SM clock of one GPU while a block runs, sampled through NVML (libnvidia-ml, which
    every machine with the driver has; no Python package needed): ``with Clocks(i) as c:``
    then ``c.mhz``, the mean of the samples, and ``c.capped``, the share of samples in which
    the driver held the clock down for power (software or hardware power cap) or heat. Both
    are None where NVML cannot be loaded (no driver) or nothing was sampled. ``index`` is
    NVML's, which orders GPUs by PCI bus as CUDA does when they are all alike (NVML does not
    apply CUDA_VISIBLE_DEVICES).

    Why: after a few seconds of the wide MLP an H200 spends most samples held below its
    top clock for power, and its steps take longer. A timing that starts on a cool GPU does
    not see it, so a comparison must say at which clock each side ran (docs/DECISIONS.md,
    "Clocks beside timings")."""

    # nvmlClocksEventReasons: SwPowerCap, HwSlowdown, SwThermalSlowdown, HwThermalSlowdown,
    # HwPowerBrakeSlowdown.
    CAPS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
    SM = 1  # nvmlClockType_t NVML_CLOCK_SM

    # Every 10 ms: enough samples in a 0.2 s benchmark row, and the sampling thread takes
    # the GIL rarely enough not to slow a host-bound step's dispatch.
    def __init__(self, index, period=0.01):
        import ctypes
        self.period, self.mhz, self.capped, self.nvml = period, None, None, None
        if index is None:  # a CPU worker
            return
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return
        if nvml.nvmlInit_v2():
            return
        self.handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)):
            nvml.nvmlShutdown()
            return
        # Drivers before 535 know the reasons by their older name only.
        try:
            self.reasons = nvml.nvmlDeviceGetCurrentClocksEventReasons
        except AttributeError:
            self.reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self.nvml = nvml

    def __enter__(self):
        import threading
        self.samples, self.stop = [], threading.Event()
        if self.nvml is not None:
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        import ctypes
        mhz, reasons = ctypes.c_uint(), ctypes.c_ulonglong()
        while not self.stop.wait(self.period):
            if not (self.nvml.nvmlDeviceGetClockInfo(self.handle, self.SM, ctypes.byref(mhz)) or
                    self.reasons(self.handle, ctypes.byref(reasons))):
                self.samples.append((mhz.value, bool(reasons.value & self.CAPS)))

    def __exit__(self, *exc):
        self.stop.set()
        if self.nvml is not None:
            self.thread.join()
            self.nvml.nvmlShutdown()  # NVML counts its initializations
            self.nvml = None
        if self.samples:
            self.mhz = sum(m for m, _ in self.samples) / len(self.samples)
            self.capped = sum(c for _, c in self.samples) / len(self.samples)


def describe(mhz, capped):
    """Several GPUs' samplings (lists of ``Clocks.mhz`` and ``Clocks.capped``) as one
    'MHz (share)': the slowest GPU's mean clock, and the largest share held down, for a
    run whose ranks wait for one another. '-' where none was sampled (CPU workers, DDP
    rows, no NVML)."""
    mhz = [m for m in mhz if m is not None]
    if not mhz:
        return "-"
    return f"{min(mhz):.0f} ({max(c for c in capped if c is not None):.0%})"
