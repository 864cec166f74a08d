"""Context switches of traced threads, from perf software events (PERF_RECORD_SWITCH).

One perf event per thread (`context_switch=1` on the dummy software event), with its own
small perf ring that the recorder polls.  Times are CLOCK_MONOTONIC (`use_clockid`), the
clock the in-process writer stamps its TIME records with, so the two can be merged.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

import numpy as np

SWITCH_DTYPE = np.dtype([("time", "<u8"), ("cpu", "<u4"), ("out", "u1")])

_SYS_PERF_EVENT_OPEN = 298
_PERF_TYPE_SOFTWARE = 1
_PERF_COUNT_SW_DUMMY = 9
_PERF_SAMPLE_TID = 1 << 1
_PERF_SAMPLE_TIME = 1 << 2
_PERF_SAMPLE_CPU = 1 << 7
_FLAG_SAMPLE_ID_ALL = 1 << 18
_FLAG_USE_CLOCKID = 1 << 25
_FLAG_CONTEXT_SWITCH = 1 << 26
_FLAG_EXCLUDE_KERNEL = 1 << 5
_FLAG_EXCLUDE_HV = 1 << 6
_PERF_FLAG_FD_CLOEXEC = 1 << 3
_CLOCK_MONOTONIC = 1
_PERF_RECORD_LOST = 2
_PERF_RECORD_SWITCH = 14
_MISC_SWITCH_OUT = 1 << 13
_ATTR_SIZE = 128
_DATA_PAGES = 16

_libc = ctypes.CDLL(None, use_errno=True)


class SwitchRecorder:
    """Context switches of one thread.  Raises OSError if perf_event_open refuses."""

    def __init__(self, tid: int) -> None:
        attr = bytearray(_ATTR_SIZE)
        struct.pack_into(
            "IIQQQQQ",
            attr,
            0,
            _PERF_TYPE_SOFTWARE,
            _ATTR_SIZE,
            _PERF_COUNT_SW_DUMMY,
            0,
            _PERF_SAMPLE_TID | _PERF_SAMPLE_TIME | _PERF_SAMPLE_CPU,
            0,
            _FLAG_SAMPLE_ID_ALL
            | _FLAG_USE_CLOCKID
            | _FLAG_CONTEXT_SWITCH
            | _FLAG_EXCLUDE_KERNEL
            | _FLAG_EXCLUDE_HV,
        )
        struct.pack_into("i", attr, 92, _CLOCK_MONOTONIC)
        buf = (ctypes.c_char * _ATTR_SIZE).from_buffer(attr)
        fd = _libc.syscall(_SYS_PERF_EVENT_OPEN, buf, tid, -1, -1, _PERF_FLAG_FD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.page = mmap.PAGESIZE
        try:
            # the mapping holds a descriptor of its own (mmap dups it), which keeps the event
            self.mm = mmap.mmap(fd, (1 + _DATA_PAGES) * self.page)
        finally:
            os.close(fd)
        self.events: list[np.ndarray] = []
        self.lost = 0

    def poll(self) -> int:
        """Move new switch records out of the perf ring; returns how many."""
        mm = self.mm
        head, tail = struct.unpack_from("QQ", mm, 1024)
        size = _DATA_PAGES * self.page
        if head == tail:
            return 0
        data = bytes(mm[self.page : self.page + size])
        out: list[tuple[int, int, int]] = []
        pos = tail
        while pos < head:
            off = pos % size
            hdr = _wrapped(data, off, 8, size)
            rtype, misc, rsize = struct.unpack("IHH", hdr)
            body = _wrapped(data, off, rsize, size)
            if rtype == _PERF_RECORD_SWITCH:
                _pid, _tid, time_ns, cpu = struct.unpack_from("IIQI", body, 8)
                out.append((time_ns, cpu, 1 if misc & _MISC_SWITCH_OUT else 0))
            elif rtype == _PERF_RECORD_LOST:
                self.lost += struct.unpack_from("Q", body, 16)[0]
            pos += rsize
        struct.pack_into("Q", mm, 1032, head)
        if out:
            self.events.append(np.array(out, dtype=SWITCH_DTYPE))
        return len(out)

    def switches(self) -> np.ndarray:
        return np.concatenate(self.events) if self.events else np.zeros(0, SWITCH_DTYPE)

    def close(self) -> None:
        self.poll()
        self.mm.close()


def _wrapped(data: bytes, off: int, n: int, size: int) -> bytes:
    if off + n <= size:
        return data[off : off + n]
    return data[off:] + data[: n - (size - off)]
