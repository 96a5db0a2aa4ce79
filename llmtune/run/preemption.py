"""Signals end a run at a step boundary with a checkpoint, and a run stuck where no boundary comes ends anyway.

SIGTERM / SIGINT / SIGUSR1 (a scheduler's cancel or preemption, Ctrl-C) set a flag that the loop checks after each
step; all processes then save together and exit with EXIT_PREEMPTED. Python runs a signal handler only between
bytecodes, which a process blocked in a collective never returns to (a peer that died or hangs): it would ignore
the signal and hold its devices until SIGKILL. So the signal also wakes a thread (through the interpreter's wakeup
fd, written by the C-level handler even then), and a process that has not reached a boundary `grace_s` later exits
with EXIT_PREEMPTED without saving: the last checkpoint stays, and `checkpoint.resume: auto` continues from it.

The grace is 3x the longest whole step seen (`timed`): its batches, a rollout's generation among them, its update,
evaluation and checkpoint; at least SIGNAL_GRACE_S. Before the first step is timed nothing tells a slow step from a
stuck one: its compilation, a first generation, may take any time, so it gets `distributed.timeout`, the longest a
process waits in a collective anyway (`first_grace_s`).

A save in progress (`Preemption.saving`: a checkpoint, or the final model) is never cut by that exit: the first
checkpoint of a large model may take longer than any step, and cutting it loses it. The watchdog waits for the save
to end, then gives the loop a fresh grace to reach its boundary. A save stuck in a collective because a peer died
ends at `distributed.timeout` (the process group's own limit) instead.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from llmtune.errors import EXIT_PREEMPTED
from llmtune.parallel.engines import sum_on_host

log = logging.getLogger(__name__)

# The least time a step, its evaluation and its checkpoint get after a signal once a step was timed; the loop raises it
# to 3x the longest step it has seen (`Preemption.timed`), so a slow step is never cut short.
SIGNAL_GRACE_S = 60.0


class Preemption:
    """Context manager around the loop: `requested` once a signal came; a second SIGINT aborts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, first_grace_s: float, release: Callable[[], None] = lambda: None) -> None:
        self.requested = False
        self.release = release  # what must not outlive the process (the run's lock): called before the watchdog's exit
        self.grace_s = max(SIGNAL_GRACE_S, first_grace_s)  # until a step is timed (module docstring)
        self._longest = 0.0
        self.then = "saving a checkpoint at the end of this step"  # what a signal leads to, logged when one comes
        self._reached = threading.Event()  # the loop reached its boundary after the signal: it saves and stops
        self._saves = 0  # saves in progress (`saving`), guarded by `_changed`
        self._changed = threading.Condition()

    def __enter__(self) -> Preemption:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        self._woken, notify = socket.socketpair()
        notify.setblocking(False)  # the interpreter requires it of a wakeup fd
        self._notify = notify
        self._previous_fd = signal.set_wakeup_fd(notify.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="llmtune-preemption", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._reached.set()
        with self._changed:
            self._changed.notify_all()
        self._woken.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv, which then returns
        self._woken.close()
        self._notify.close()

    def requested_anywhere(self, group: Any) -> bool:
        """True on every process when a signal reached any process (all must save together). Agreed over the host
        group (`parallel.host_group`; None in one process): a flag sent through the device would wait twice a step
        for all the work queued there."""
        return bool(sum_on_host([int(self.requested)], group)[0])

    def timed(self, seconds: float) -> None:
        """A whole step took `seconds`, from the wait for its batches to its checkpoint: a signal from now on gives 3x
        the longest so far."""
        self._longest = max(self._longest, seconds)
        self.grace_s = max(SIGNAL_GRACE_S, 3 * self._longest)

    def boundary(self) -> None:
        """Every process reached the step boundary after a signal: saving and stopping are the loop's now."""
        if self.requested:
            self._reached.set()

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around a save: the watchdog does not exit while it runs (module docstring)."""
        with self._changed:
            self._saves += 1
        try:
            yield
        finally:
            with self._changed:
                self._saves -= 1
                self._changed.notify_all()

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.warning("received %s: %s", signal.Signals(signum).name, self.then)
        self.requested = True

    def _watch(self) -> None:
        ours = {int(s) for s in self.SIGNALS}
        while True:
            try:
                received = self._woken.recv(64)
            except OSError:
                return
            if not received or self._reached.is_set():
                return
            if ours & set(received):
                break
        if self._boundary_in_time():
            return
        log.error(
            "no step boundary %.0f s after the signal (waiting on another process?): exiting without a checkpoint;"
            " the last one is kept (exit %d)",
            self.grace_s,
            EXIT_PREEMPTED,
        )
        self.release()
        logging.shutdown()
        os._exit(EXIT_PREEMPTED)  # not an exception: the main thread is blocked where it cannot see one

    def _boundary_in_time(self) -> bool:
        """Whether the loop reaches its boundary (or leaves the block) within the grace; a grace that runs out while a
        save is in progress waits for the save, then starts again."""
        while not self._reached.wait(self.grace_s):
            with self._changed:
                if not self._saves:
                    return False
                log.warning("a save is in progress %.0f s after the signal: waiting for it to finish", self.grace_s)
                self._changed.wait_for(lambda: not self._saves or self._reached.is_set())
        return True
