# A PeerGroup as pympgu's XLA operations see it: its registration (the pmg_group of
# csrc/pympgu.h, by id), and the watchdog thread that gives its stream barriers a timeout.


cdef int64_t _xla_register(PeerGroup self, bint shadow) except -1:
    """Register the group for the XLA operations, or update its registration."""
    cdef pmg_group g
    self._fill(&g)
    set_device(self.device)
    if self.side is None:
        self.side = Stream(high_priority=True)
        self.side_in = Event(timing=False)
        self.side_out = Event(timing=False)
        self.side_first = Event(timing=False)
    g.side = self.side.handle
    g.side_in, g.side_out = self.side_in.handle, self.side_out.handle
    g.side_first = self.side_first.handle
    if self.rank_flags:
        g.stream_sync = &self.sync
        for r in range(self.nranks):
            g.stream_flags[r] = <uint32_t *>(<HostFlags>self.rank_flags[r]).device
        _start_watchdog(self)
    if self.marks is not None:
        for i, ev in enumerate(self.marks):
            g.marks[i] = (<Event>ev).handle
    if shadow or self.shadow_offset or self.shadow is not None:
        g.shadow = self._shadow()
        g.shadow_offset = self.shadow_offset
    check(pmg_xla_register(&g, &self._xla_id))  # a new id, or the same id updated
    return self._xla_id


cdef _start_watchdog(PeerGroup self):
    import threading
    if self.watchdog is not None:
        return
    self.watch_stop = threading.Event()
    self.watchdog = threading.Thread(target=_watch, args=(self,), daemon=True,
                                     name=f"pympgu-barrier-watchdog-{self.rank}")
    self.watchdog.start()


cdef _stop_watchdog(PeerGroup self):
    if self.watchdog is not None:
        self.watch_stop.set()
        self.watchdog.join()
        self.watchdog = None


def _watch(PeerGroup self):
    """The stream barriers' timeout (a barrier kernel has its own): every so often, read
    how far this rank's stream got (its flag of its own) and what each peer announced.
    When the stream has waited more than the group's timeout for a peer that made no
    progress, mark the group, so that every later start fails with an error naming that
    peer (xla_ffi.cc, peers_in_step), say so, and from then on let the stream past every
    barrier it waits at (write the number it waits for in the late peers' place): XLA's
    stream, and the host behind it, are not held for good. The exchanges let go that way
    end without the late peer's values. When the group closes, every barrier still queued
    is let go, so that nothing on the device waits for good.

    Plain loads and stores in host memory, and no CUDA call: the first launch of a kernel
    that CUDA loads lazily waits for a pending stream wait and holds the driver meanwhile,
    so a copy here could wait behind the very barrier it should release (docs/DECISIONS.md,
    "Stream barriers")."""
    import logging
    import time
    n, rank = self.nranks, self.rank
    flags = self.flags.view
    watch = BarrierWatch(rank, self.timeout_ns / 1e9)
    while not self.watch_stop.wait(min(0.25, watch.timeout / 8)):
        found = watch.late
        late = watch.look([int(flags[p]) for p in range(n)], time.monotonic())
        if found is None and watch.late is not None:
            # Marked before the stream goes on: the start that follows must see it.
            self.sync.late_rank_plus_one = watch.late + 1
            logging.getLogger("pympgu").warning(
                "rank %d of %d waited more than %g s at an exchange's barrier for rank %d, "
                "which died or stopped exchanging; its next exchange fails", rank, n,
                watch.timeout, watch.late)
        for p in late:
            flags[p] = flags[rank]
    # Closing: no barrier is queued after this, so every one a peer has not announced yet
    # is let go.
    queued = self.sync.queued
    for p in watch.behind([int(flags[p]) for p in range(n)], queued):
        flags[p] = queued
