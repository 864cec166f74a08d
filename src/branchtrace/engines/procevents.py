"""Exit statuses from the kernel's process-events connector (netlink, CN_IDX_PROC).

Frida's own child watch reaps a spawned program, and whoever reaps first gets its wait
status.  The connector reports every exit, with the status, before any reaping, so the
recorder learns how the program ended without racing anyone.  It needs CAP_NET_ADMIN
(root); without it `ExitWatcher.available` is False and callers fall back to waitid.

The kernel hands a pid out again once pids reach pid_max, so each event keeps its time
(CLOCK_MONOTONIC, as time.monotonic_ns()): a caller asks for the process that had a pid
from a given time on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import threading
from pathlib import Path

_NETLINK_CONNECTOR = 11
_CN_IDX_PROC = 1
_CN_VAL_PROC = 1
_PROC_CN_MCAST_LISTEN = 1
_PROC_EVENT_FORK = 0x00000001
_PROC_EVENT_EXEC = 0x00000002
_PROC_EVENT_EXIT = 0x80000000
_NLMSG_HDR = 16
_SO_RCVBUFFORCE = 33  # not in Python's socket module
_CN_MSG_HDR = 20
#: exits (and execs) kept per pid, the newest: one per process that had it
_EXITS_KEPT = 8


class ExitWatcher:
    """Collects the wait statuses of exiting processes; start it before the process runs."""

    def __init__(self) -> None:
        self._exits: dict[int, list[tuple[int, int]]] = {}  #: pid -> [(time, status)]
        self._born: dict[int, int] = {}  #: pid -> when the process that has it now forked
        self.execs: dict[int, list[int]] = {}  #: pids that called exec -> when
        #: parent pid (watch_children) -> [(when, child pid, the parent's thread that forked
        #: it)]: the processes it forked
        self._children: dict[int, list[tuple[int, int, int]]] = {}
        self._kept: set[int] = set()  #: the children in _children
        self.names: dict[int, str] = {}  #: one of them that called exec -> its name then
        self._cond = threading.Condition()
        self._sock: socket.socket | None = None
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_CONNECTOR)
            # every process of the system reports here: room for bursts while this thread
            # waits for the GIL (SO_RCVBUFFORCE: root may exceed rmem_max)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 4 << 20)
            sock.bind((0, _CN_IDX_PROC))
            op = struct.pack("I", _PROC_CN_MCAST_LISTEN)
            cn = struct.pack("IIIIHH", _CN_IDX_PROC, _CN_VAL_PROC, 0, 0, len(op), 0) + op
            sock.send(struct.pack("IHHII", _NLMSG_HDR + len(cn), 3, 0, 0, 0) + cn)
        except OSError:
            return
        self._sock = sock
        threading.Thread(target=self._run, name="bt-procevents", daemon=True).start()

    @property
    def available(self) -> bool:
        return self._sock is not None

    def _run(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # events of the whole system overflowed it
                    continue
                return
            off = 0
            while off + _NLMSG_HDR <= len(data):
                (length,) = struct.unpack_from("I", data, off)
                event = off + _NLMSG_HDR + _CN_MSG_HDR
                if length < _NLMSG_HDR or event + 32 > len(data):
                    break
                what, _cpu, when = struct.unpack_from("IIQ", data, event)
                if what == _PROC_EVENT_FORK:
                    forker, parent, pid, tgid = struct.unpack_from("IIII", data, event + 16)
                    if pid == tgid:  # a process, not a thread
                        with self._cond:
                            self._born[pid] = when
                            if parent in self._children:
                                self._children[parent].append((when, pid, forker))
                                self._kept.add(pid)
                elif what == _PROC_EVENT_EXEC:
                    pid, tgid = struct.unpack_from("II", data, event + 16)
                    if tgid in self._kept:  # no name in the event: read while it still runs
                        with contextlib.suppress(OSError):
                            comm = Path(f"/proc/{tgid}/comm").read_text().rstrip("\n")
                            self.names[tgid] = comm
                    with self._cond:
                        execs = self.execs.setdefault(tgid, [])
                        execs.append(when)
                        del execs[:-_EXITS_KEPT]
                        # an exec from a thread other than the leader reports an "exit" of
                        # the leader first: forgotten (one of an earlier process with that
                        # pid is older than this one)
                        exits = self._exits.get(tgid)
                        if exits and exits[-1][0] >= self._born.get(tgid, 0):
                            exits.pop()
                elif what == _PROC_EVENT_EXIT:
                    pid, tgid, code, _sig = struct.unpack_from("IIII", data, event + 16)
                    if pid == tgid:
                        with self._cond:
                            self._kept.discard(pid)  # its pid may go to another process
                            exits = self._exits.setdefault(pid, [])
                            exits.append((when, code))
                            del exits[:-_EXITS_KEPT]
                            self._cond.notify_all()
                off += (length + 3) & ~3

    def status(self, pid: int, timeout: float, since: int = 0) -> int | None:
        """The wait status (as os.waitpid gives it) of `pid`, once it has exited: of the
        process that had that pid at `since` (time.monotonic_ns()) or first after."""
        with self._cond:
            if self.available:
                self._cond.wait_for(lambda: self._exit(pid, since) is not None, timeout)
            found = self._exit(pid, since)
            return None if found is None else found[1]

    def execed(self, pid: int, since: int = 0) -> bool:
        """Whether the process that had `pid` at `since` or first after called exec."""
        with self._cond:
            end = self._exit(pid, since)
            until = end[0] if end is not None else 1 << 64
            return any(since <= when < until for when in self.execs.get(pid, ()))

    def watch_children(self, pid: int) -> None:
        """Keep the processes `pid` forks from now on, for children()."""
        with self._cond:
            self._children.setdefault(pid, [])

    def children(self, pid: int, since: int = 0, until: int = 1 << 64) -> list[int]:
        """The processes that the process which had `pid` at `since` forked from then until
        `until` or its exit, oldest first (times as time.monotonic_ns()), of those kept
        since watch_children(pid)."""
        with self._cond:
            return [child for child, _ in self._forks(pid, since, until)]

    def forks(self, pid: int, since: int = 0, until: int = 1 << 64) -> list[tuple[int, int]]:
        """As children(), each with the thread of `pid` that forked it: (child, thread id)."""
        with self._cond:
            return self._forks(pid, since, until)

    def _forks(self, pid: int, since: int, until: int) -> list[tuple[int, int]]:
        end = self._exit(pid, since)
        until = min(until, end[0]) if end is not None else until
        return [
            (child, thread)
            for when, child, thread in self._children.get(pid, ())
            if since <= when < until
        ]

    def _exit(self, pid: int, since: int) -> tuple[int, int] | None:
        return next((e for e in self._exits.get(pid, ()) if e[0] >= since), None)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()

    def __enter__(self) -> ExitWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def describe(status: int) -> tuple[int | None, int | None]:
    """(exit code, signal) of a wait status."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.WEXITSTATUS(status), None
