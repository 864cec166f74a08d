"""Signals that stop a recording, taken without a lock in the signal handler."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def setting_on(
    signals: tuple[signal.Signals, ...],
    stop: threading.Event,
    first: Callable[[set[int]], None] | None = None,
) -> Iterator[None]:
    """While inside, any of `signals` sets `stop`.  Not from the handler itself: Python runs
    handlers in the main thread between two bytecodes, and `Event.set()` there waits for the
    event's lock, which the main thread holds inside its own `stop.wait()`: a recorder whose
    tool was killed (its SIGTERM from PR_SET_PDEATHSIG) hung that way for good.  The C
    handler writes the signal's number to a pipe (`signal.set_wakeup_fd`), and a thread
    reading it sets `stop`, after calling `first` with the signals' numbers (it may say how
    to stop)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    numbers = {int(s) for s in signals}

    def watch() -> None:
        with open(read_end, "rb", buffering=0) as wakeups:
            while data := wakeups.read(64):
                if seen := numbers.intersection(data):
                    if first is not None:
                        first(seen)
                    stop.set()

    watcher = threading.Thread(target=watch, name="bt-signals", daemon=True)
    watcher.start()
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    previous = {s: signal.signal(s, lambda signum, frame: None) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_end)  # the watcher reads its end and ends
        watcher.join()
