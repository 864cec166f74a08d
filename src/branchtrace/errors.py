"""Every error branchtrace raises on purpose.

Each class carries the process exit code the command line uses for it and the errno of the
seed's ptrace BTS request it mirrors, so a script can tell "no buffer" from "over the cap"
without parsing text.  Messages are one line; `hint` says what to do.
"""

from __future__ import annotations

import errno


class BranchtraceError(Exception):
    """Base class.  `str(e)` is the one-line message; `e.hint` says what to do."""

    exit_code = 1
    errno: int | None = None

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class UsageError(BranchtraceError):
    exit_code = 2


class StoreError(BranchtraceError):
    """Something about a branch trace store."""

    exit_code = 3


class NotSupportedError(StoreError):
    """EOPNOTSUPP: the request is not supported here (no tracing support for it)."""

    errno = errno.EOPNOTSUPP


class NoBufferError(StoreError):
    """ENXIO: the task has no trace buffer (configure one first)."""

    errno = errno.ENXIO


class InvalidArgumentError(StoreError, ValueError):
    """EINVAL: a bad index, size or flag."""

    errno = errno.EINVAL


class NoMemoryError(StoreError):
    """ENOMEM: the buffer could not be allocated."""

    errno = errno.ENOMEM


class OverCapError(StoreError):
    """EPERM: the buffer would exceed the memory accounting cap."""

    errno = errno.EPERM


class BusyError(StoreError):
    """EBUSY: the ring already has a writer (or a consumer); the message names its pid."""

    errno = errno.EBUSY


class ModeConflictError(StoreError):
    """A consuming reader was asked of a wrap-mode ring (the writer owns data_tail)."""

    errno = errno.EINVAL


class CorruptStoreError(StoreError):
    """The file is not a store, is truncated, or holds records that do not parse."""

    exit_code = 4


class LaunchError(BranchtraceError):
    """The program to trace could not be started (missing, not executable, not ELF)."""

    exit_code = 10


class NoSuchProcessError(BranchtraceError):
    exit_code = 11


class PermissionDeniedError(BranchtraceError):
    exit_code = 12


class EngineUnavailableError(BranchtraceError):
    """The engine cannot run here (Frida cannot inject, no such hardware...)."""

    exit_code = 13


class AlreadyTracedError(BranchtraceError):
    """Another tracer (a debugger, another branchtrace) owns the process."""

    exit_code = 14
