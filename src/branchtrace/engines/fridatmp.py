"""What Frida leaves in the temporary directory, removed.

Frida 17's device manager starts every backend it has when a host asks for the local
device, Apple's too: unless a daemon of that backend (`idund`) runs already, the host
copies the daemon's 10 MB binary to `$TMPDIR/frida-<random>/idund` and starts it from
there.  The daemon exits about 30 s after its last client; no one removes the copy.  Each
recording made more than 30 s after the one before left one: 77 directories, 770 MB, in
five hours of use of this machine (measured: `ls -d /tmp/frida-*`).  Nothing asks Frida
not to start it (`DeviceManager` has no local-only constructor in Python)."""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path

DAEMON = "idund"
#: a copy no process runs is left alone this long: another host may be about to start it
UNSTARTED_GRACE = 60.0


def temporary_directory() -> Path:
    """Where GLib's g_get_tmp_dir(), and so Frida, puts its files."""
    return Path(os.environ.get("TMPDIR") or "/tmp")


def _running_executables() -> set[str]:
    running = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            # gone, a kernel thread, or not ours to read
            with contextlib.suppress(OSError):
                running.add(os.readlink(f"/proc/{entry.name}/exe").removesuffix(" (deleted)"))
    return running


def remove_daemon_copies() -> list[Path]:
    """Remove each `frida-*` directory that holds nothing but a copy of the daemon which a
    process runs (it needs the file no more) or which is older than UNSTARTED_GRACE; the
    directories removed.  A directory with anything else in it is another host's."""
    now = time.time()
    running: set[str] | None = None
    removed = []
    for directory in temporary_directory().glob("frida-*"):
        binary = directory / DAEMON
        try:
            if os.listdir(directory) != [DAEMON]:
                continue
            info = binary.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                continue
            if now - info.st_mtime < UNSTARTED_GRACE:
                running = _running_executables() if running is None else running
                if str(binary.resolve()) not in running:
                    continue
            binary.unlink()
            directory.rmdir()
        except OSError:  # removed meanwhile by its own host, or not ours
            continue
        removed.append(directory)
    return removed
