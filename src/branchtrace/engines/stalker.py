"""The stalker engine: Frida Stalker follows every thread; a CModule transform writes a
4-byte block id per executed block straight into the thread's ring (stalker_agent.c; the
ids' blocks are in the ring's block table).

The host creates a ring per thread in the trace directory, hands it to the agent, drains
it to `T<tid>.stream.lz4` (or raw `T<tid>.stream`) in stream and drop modes, and collects
the exit status.  Nothing the program recorded depends on the agent's cooperation at the
end: when the process dies (exit, crash, SIGKILL) its writer locks go with it and the last
records are recovered from the rings (docs/format.md, "a late reader").
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import itertools
import json
import os
import queue
import re
import resource
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import frida
import numpy as np

from ..errors import (
    AlreadyTracedError,
    BranchtraceError,
    EngineUnavailableError,
    InvalidArgumentError,
    LaunchError,
    NoSuchProcessError,
    PermissionDeniedError,
    StoreError,
)
from ..store import Flags, Mode, Ring, RingReader
from ..store.format import GapReason, RecordType, WriterState, c_writer_source
from ..store.records import count_records, parse_words
from ..store.tracedir import (
    META,
    MODULES,
    SNAPSHOTS,
    ModuleEvent,
    TraceDir,
    drain_to_file,
    thread_id,
    thread_key,
    thread_label,
    thread_of_file,
)
from .asleep import let_go
from .base import (
    USERS_FILE_LIMIT,
    Events,
    RecordOptions,
    RecordResult,
    Target,
    ThreadStats,
    finish_meta,
    go_without_cgo,
    init_offset,
    start_meta,
    statically_linked,
)
from .forkwindow import (
    ForksUnderFrida,
    StopClock,
    child_pids,
    kill_held,
    proc_stat,
    stopped_by_us,
    stuck_on,
    waits_in_frida,
)
from .fridatmp import remove_daemon_copies
from .mainhold import MainThreadHold
from .procevents import ExitWatcher, describe
from .sched import SwitchRecorder

#: how often the rings of finished threads give their unused space back, seconds
RELEASE_EVERY = 0.25
#: the drain thread waits DRAIN_PAUSE seconds before its next pass unless a ring had at
#: least this share of its size to drain: passes right after one another took 2-3 chunks
#: each (35,000 compressions and 29,000 passes for 7.2 GB of 4 pthreads), and their cost
#: in Python came out of the CPU time the traced threads need.  Stream mode only: a thread
#: whose ring fills waits for the drain there, but loses what it writes in drop mode
DRAIN_BATCH = 1 / 8
DRAIN_PAUSE = 0.001

_T = TypeVar("_T")
CHUNK = 64 * 1024  #: the inline writer's chunk: its end is found by a 16-bit test
#: each ring's metadata log: the agent writes none (modules go to modules.jsonl), and the
#: default 1 MiB would be allocated for every thread while it runs
META_LOG = 4096
#: targets per indirect branch in Stalker's inline cache once widened (stalker_agent.c)
INLINE_CACHE = 32
#: the program's blocks Stalker compiles for a thread before the thread is followed again in
#: a fresh context (renew_context in stalker_agent.c): Stalker failed at some 2.1 million
CONTEXT_BLOCKS = 1_000_000
MIN_BUFFER = 8 * CHUNK
#: seconds an agent may take to stop or detach before the host gives up on it
AGENT_TIMEOUT = 10.0
#: the stop lets go of every thread, and Gum stops each thread once for each hooked function
#: it invalidates (letGoOfAll in stalker_agent.js): attached to 9 threads, 8 of them busy, on
#: 2 CPUs, it took 0.12-4 s in 12 attaches; with 4 to 6 other busy processes there, the
#: answer came up to 5 s (once 21 s) after the agent's 0.12-0.38 s of work
STOP_TIMEOUT = 30.0
#: seconds a detach may take once the agent has stopped, when a thread the host could not let
#: go of keeps the agent loaded anyway (_detached)
DETACH_WAIT = 2.0
#: and when none is known to: on a loaded machine a detach that ends by itself took up to
#: 2.2 s (`loopers` and 4 to 6 other busy processes on 2 CPUs; 0.1 s otherwise)
DETACH_PATIENCE = 10.0
#: how many times the host tries to let go of a thread asleep at the end (_let_go_asleep),
#: and the pause between two tries, in s: short, because the program runs on meanwhile (a
#: main thread in wait4() for children exiting every 5 ms, under --follow-fork, was let go
#: of at its second or third try in 2 of 8 stops, 0.2 s apart)
LET_GO_TRIES, LET_GO_PAUSE = 3, 0.05
#: how often a recording of a running process looks for children stuck on Frida's locks
FORK_CHECK_INTERVAL = 0.25
#: how long a process found on its way out may take to end (dumping core)
ENDING_WAIT = 30.0
#: how long Frida's injector holds a thread stopped inside Frida's recovery from a fork()
#: before the process counts as frozen there (_ForkCounters._held_by_frida)
FROZEN_AFTER = 1.0
#: how long a forked child Frida has not reported may sleep in Frida's code (waits_in_frida)
#: before it counts as stuck in Frida's recovery for good; Frida reports a child within
#: milliseconds
STUCK_AFTER = 5.0
#: for how long after it is listed (or its take-up failed) such a child is also stopped for
#: a moment, now and then, to see whether it spins on a lock (stuck_on): a child that runs
#: the program's code untraced is not stopped for the rest of the recording
SPIN_CHECKS_FOR = 30.0

_PRELUDE = """
#include <gum/gumstalker.h>
#include <gum/guminterceptor.h>
typedef guint8 uint8_t;
typedef guint16 uint16_t;
typedef guint32 uint32_t;
typedef guint64 uint64_t;
extern int bt_is_frida_code(uint64_t address);
extern long syscall(long n, ...);
extern int open(const char *path, int flags, ...);
extern int close(int fd);
extern int fcntl(int fd, int cmd, ...);
extern long lseek(int fd, long offset, int whence);
extern void *mmap(void *addr, unsigned long len, int prot, int flags, int fd, long off);
extern int munmap(void *addr, unsigned long len);
extern int getpid(void);
extern int clock_gettime(int clock, long *ts);
extern void *memset(void *s, int c, unsigned long n);
extern unsigned long strlen(const char *s);
extern int *__errno_location(void);
#define BT_IC_ENTRIES INLINE_CACHE
#define BT_CONTEXT_BLOCKS BLOCKS_PER_CONTEXT
struct bt_flock { short l_type; short l_whence; long l_start; long l_len; int l_pid; };
static void bt_futex_wait(uint32_t *addr, uint32_t expected, long timeout_ns) {
  long ts[2] = {timeout_ns / 1000000000L, timeout_ns % 1000000000L};
  syscall(202 /* futex */, addr, 0 /* FUTEX_WAIT */, expected, ts, 0, 0);
}
static void bt_futex_wake(uint32_t *addr) {
  syscall(202, addr, 1 /* FUTEX_WAKE */, 0x7fffffff, 0, 0, 0);
}
static void bt_notify(uint32_t pid, uint32_t sig) { syscall(62 /* kill */, pid, sig); }
"""

_FLAGS = {
    Mode.WRAP: Flags.TRACE,
    Mode.STREAM: Flags.TRACE | Flags.SIGNAL,
    Mode.DROP: Flags.TRACE | Flags.DROP,
}


def agent_c_source(context_blocks: int = CONTEXT_BLOCKS) -> str:
    body = resources.files(__package__).joinpath("stalker_agent.c").read_text()
    prelude = _PRELUDE.replace("INLINE_CACHE", str(INLINE_CACHE)).replace(
        "BLOCKS_PER_CONTEXT", str(context_blocks)
    )
    return prelude + c_writer_source() + body


def agent_script(params: dict[str, Any]) -> str:
    here = resources.files(__package__)
    js = here.joinpath("stalker_agent.js").read_text()
    find_main = here.joinpath("find_main.js").read_text()
    return f"const PARAMS = {json.dumps(params)};\n{find_main}\n{js}"


def resolve_program(name: str) -> Path:
    """The executable `name` names, checked: one clear LaunchError otherwise."""
    found = name if "/" in name else shutil.which(name)
    if found is None:
        raise LaunchError(f"{name}: command not found", hint="give a path or check PATH")
    path = Path(found)
    if not path.exists():
        raise LaunchError(f"{name}: no such file")
    if path.is_dir():
        raise LaunchError(f"{name} is a directory")
    if not os.access(path, os.X_OK) or not path.stat().st_mode & 0o111:  # root passes access()
        raise LaunchError(f"{name}: permission denied (not executable)", hint=f"chmod +x {name}")
    with open(path, "rb") as f:
        head = f.read(20)
    if head[:4] != b"\x7fELF":
        hint = f"a script without a #! line is run by a shell: branchtrace record -- sh {name}"
        raise LaunchError(f"{name} is not an ELF executable", hint=hint)
    if head[4] != 2 or int.from_bytes(head[18:20], "little") != 62:
        raise LaunchError(f"{name} is not an x86-64 program; branchtrace traces x86-64 only")
    return path.resolve()


#: the kernel's limits on a script's `#!` line and on nested interpreters (binfmt_script)
_SHEBANG_LINE = 256
_SHEBANG_DEPTH = 4
_SHEBANG = re.compile(rb"#![ \t]*([^ \t\n]*)[ \t]*([^\n]*?)[ \t]*(?:\n|$)")


def script_command(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The command line the kernel runs for `argv`: its interpreter's (`#!INTERPRETER
    [ARG]`, then the script's path and the arguments) when argv[0] is a script, with
    `#!/usr/bin/env NAME` run as NAME found on PATH, so that the trace is of the interpreter
    and not of env (which would exec it, untraced); `argv` itself otherwise (or empty)."""
    command = argv
    for _ in range(_SHEBANG_DEPTH if argv else 0):
        found = command[0] if "/" in command[0] else shutil.which(command[0])
        try:
            with open(found or command[0], "rb") as f:
                head = f.read(_SHEBANG_LINE)
        except OSError:
            return command  # resolve_program says what is wrong with it
        shebang = _SHEBANG.match(head)
        if shebang is None or not os.access(found or command[0], os.X_OK):
            return command
        interpreter, arg = (part.decode(errors="surrogateescape") for part in shebang.groups())
        if not interpreter:
            raise LaunchError(f"{command[0]}: its #! line names no interpreter")
        if Path(interpreter).name == "env" and arg and not arg.startswith("-") and " " not in arg:
            on_path = shutil.which(arg)
            if on_path is None:
                raise LaunchError(
                    f"{command[0]}: {arg}, the interpreter its #! line names, is not on PATH"
                )
            interpreter, arg = on_path, ""
        if not Path(interpreter).exists():
            crlf = (arg or interpreter).endswith("\r")
            raise LaunchError(
                f"{command[0]}: {interpreter.rstrip()}, the interpreter its #! line names: no "
                "such file" + (" (the line ends in CR LF, as on Windows)" if crlf else ""),
                hint=f"convert its line ends: sed -i 's/\\r$//' {command[0]}" if crlf else None,
            )
        command = (interpreter, *([arg] if arg else []), str(found), *command[1:])
    return command


def _traced_by_branchtrace(pid: int) -> tuple[str, list[int]] | None:
    """The trace directory whose rings of its own threads the process has mapped, and
    those threads if that recording has ended (every ring closed: threads asleep since,
    which keep Frida's agent until they wake); None if no branchtrace has rings there, or
    if Frida's agent is gone (rings left behind, which nothing writes: _rings_left_behind).
    Rings of other threads are what a forked child still maps of its parent's (a child
    maps private memory over them as it starts, a child's child may not): they made a
    child that a recording had left running look traced."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    if "frida-agent" not in maps:
        return None
    own = set(_tasks(pid))
    rings = []
    for path in sorted(
        {p for line in maps.splitlines() if (p := line.split(maxsplit=5)[-1]).endswith(".bts")}
    ):
        with contextlib.suppress(ValueError):
            if thread_id(thread_of_file(os.path.basename(path))) in own:
                rings.append(path)
    if not rings:
        return None
    asleep = []
    for path in rings:
        try:
            ring = Ring.open(path)
        except (OSError, StoreError):
            return os.path.dirname(rings[0]), []
        if ring.writer_state != WriterState.CLOSED:
            return os.path.dirname(rings[0]), []
        asleep.append(ring.tid)
    return os.path.dirname(rings[0]), asleep


def _check_attachable(pid: int) -> None:
    if pid <= 0 or not Path(f"/proc/{pid}").exists():
        raise NoSuchProcessError(f"no process with pid {pid}")
    if pid == os.getpid():
        raise InvalidArgumentError("branchtrace cannot trace itself")
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError as e:
        raise PermissionDeniedError(f"cannot inspect process {pid}: {e.strerror}") from None
    tracer = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("TracerPid:")), 0
    )
    if tracer:
        comm = (
            Path(f"/proc/{tracer}/comm").read_text().strip()
            if Path(f"/proc/{tracer}/comm").exists()
            else "?"
        )
        raise AlreadyTracedError(
            f"process {pid} is already traced by pid {tracer} ({comm})",
            hint="detach the other tracer first",
        )
    other = _traced_by_branchtrace(pid)
    if other and other[1]:
        tids, many = ", ".join(map(str, other[1])), len(other[1]) > 1
        raise AlreadyTracedError(
            f"process {pid} still holds Frida's agent from a recording into {other[0]} that "
            f"has ended: {'threads' if many else 'thread'} {tids} "
            f"{'have' if many else 'has'} not run since (asleep in a system call)",
            hint=f"record it again once {'they have' if many else 'it has'} woken up",
        )
    if other:
        raise AlreadyTracedError(
            f"process {pid} is already traced by branchtrace into {other[0]}",
            hint="stop that recording first",
        )


def _check_frida_can_run_in(executable: Path, target: Target) -> None:
    """Frida loads its agent through the program's own dynamic loader and C library; in a
    statically linked program, which has neither, its loader crashed (`gcc -static`, and
    Go's programs by default: "Frida failed: loader crashed with signal 11", and 17 lines
    of registers).  And its code on a program's thread expects the C library's thread
    state: a Go program linked dynamically without cgo, whose runtime makes its threads
    itself, died traced in pthread_getspecific() (3 runs of 3)."""
    what = target.argv[0] if target.argv else f"pid {target.pid}"
    if go_without_cgo(executable):  # (the step engine, which starts at main, cannot either)
        raise EngineUnavailableError(
            f"{what} is a Go program built without cgo: its runtime makes its threads itself, "
            "and Frida needs the C library's",
            hint='build it with cgo: CGO_ENABLED=1 and import "C", or a package that uses it '
            "such as net",
        )
    if statically_linked(executable):
        raise EngineUnavailableError(
            f"{what} is statically linked: Frida cannot load the stalker engine's agent into it",
            hint="record it with --engine step (much slower), or link it dynamically",
        )


def _frida_error(e: Exception, what: str) -> BranchtraceError:
    if isinstance(e, frida.ProcessNotFoundError):
        return NoSuchProcessError(f"{what}: no such process")
    if isinstance(e, frida.PermissionDeniedError):
        return PermissionDeniedError(
            f"{what}: permission denied ({e})",
            hint="run as root, or set kernel.yama.ptrace_scope=0",
        )
    if isinstance(e, frida.ExecutableNotFoundError):
        return LaunchError(f"{what}: executable not found")
    if isinstance(e, frida.ProcessNotRespondingError):
        # Frida's loader, before our agent, gets 5 s: seen once in some 75 attaches to 8
        # busy threads on 2 cores (tests/programs/loopers.c)
        return EngineUnavailableError(
            f"{what}: Frida's agent did not answer in time as it loaded ({e})",
            hint="the process may be too busy to answer: try again",
        )
    if "timed out while waiting for stop" in str(e):
        # Frida's injector, before any agent: seen on a program forking a child every
        # millisecond that handles SIGCHLD (README, How it ends)
        return EngineUnavailableError(
            f"{what}: Frida failed: {e}",
            hint="Frida could not stop it to load its agent: check that it still runs",
        )
    if "connection is closed" in str(e):
        # Frida's session ended as its agent loaded: seen once in a loaded CI run, attached
        # with --follow-fork to a python whose subprocesses started as the attach ended
        return EngineUnavailableError(
            f"{what}: Frida failed: {e}",
            hint="Frida lost the process as its agent loaded: check that it still runs, "
            "and try again",
        )
    return EngineUnavailableError(f"{what}: Frida failed: {e}")


class AgentTimeoutError(Exception):
    """The agent did not answer in time (Frida can deadlock in a process that forks while
    child gating is on: a lock of its own held across fork())."""


def _bounded(call: Any, *args: Any, timeout: float = AGENT_TIMEOUT) -> Any:
    """call(*args), or AgentTimeoutError after `timeout` s: a Frida RPC or detach has no
    timeout of its own, and the recording must end (keeping what the rings hold) even when
    the agent is stuck."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call(*args)))
        except BaseException as e:  # handed to the caller's thread
            outcome.append((False, e))

    worker = threading.Thread(target=run, name="bt-agent-call", daemon=True)
    worker.start()
    worker.join(timeout)
    if not outcome:
        raise AgentTimeoutError(f"no answer within {timeout:.0f} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def _forks_held(
    agent: _Agent, tids: list[int], gating: Callable[[], None] | None = None
) -> Iterator[None]:
    """The attached process's fork() calls wait meanwhile, and none is under way: a thread
    followed from outside on its way into fork() is taken through it by Stalker and its
    child dies.  That includes a fork() that began before the agent's fork() hook (waited
    for 2 s at most; its thread is followed where it comes out): so its child is born while
    ForksUnderFrida still watches new children, and is freed if it hangs on Frida's heap
    lock.  `gating` (turning child gating on) runs first,
    while no fork() is under way nor held inside fork(): one that is as Frida adds its own
    fork() hook dies in Frida's code, or its child does (bt_hold_forks in stalker_agent.c);
    once none is under way again, a fork() counts as under way until Frida has recovered
    from it too (bt_on_fork_done).  `tids`: the process's threads, which are looked at for
    such a fork()."""
    try:
        _bounded(agent.script.exports_sync.find_forks_begun_before, tids)
        if gating is not None:
            _wait_for_forks(agent, 2)  # gated in front of fork(), not held inside it
            gating()
        _wait_for_forks(agent, 1)
        if gating is not None:
            _bounded(agent.script.exports_sync.fork_done_last)
        yield
    finally:
        _release_forks(agent)


def _wait_for_forks(agent: _Agent, hold: int) -> None:
    """Until no fork() of the process of `agent` is under way; new ones wait at the gate in
    front of fork() (`hold` 2), or at fork()'s entry too (1): bt_hold_forks."""
    deadline = time.monotonic() + AGENT_TIMEOUT
    while _bounded(agent.script.exports_sync.hold_forks, hold) and time.monotonic() < deadline:
        time.sleep(0.001)


def _hold_forks_quietly(agent: _Agent) -> None:
    """Until no fork() of the process of `agent` is under way and new ones wait at the gate
    in front of fork(), as _wait_for_forks(agent, 2) -- but with nothing on its way to or
    from the agent while a fork() under Frida's child gating is (_ForkCounters)."""
    counters = agent.fork_counters
    held = counters.hold(True) if counters is not None else None  # at fork()'s entry
    if counters is None or held is None:  # its memory cannot be written: by calls, as before
        _wait_for_forks(agent, 2)
        return
    if not held:
        # stuck inside Frida's recovery from that fork(): frozen there (_ForkCounters), or
        # still under way after 10 s; should it ever come out, later fork()s must not wait
        counters.hold(False, wait=False)
        agent.stuck = True
        agent.frozen = counters.frozen()
        raise AgentTimeoutError("a fork() still under way")
    try:
        _wait_for_forks(agent, 3)  # and, now that none is under way, at the gate in front too
    except Exception:
        # an agent that does not answer would never let them go: the process's next fork()
        # would wait for good (a shell's subshell did, 2 attaches in 10)
        counters.let_go()
        raise
    counters.hold(False)  # those that waited at the entry go on; then none is under way


def _stop_agent(agent: _Agent) -> Any:
    """Ends the recording in the process of `agent` (its `stop`), or AgentTimeoutError (and
    the agent may stay loaded: _agent_left_loaded)."""
    try:
        if agent.stuck:  # no answer could come: not another 10 s of waiting
            raise AgentTimeoutError("stuck in Frida's recovery from a fork()")
        return _bounded(agent.script.exports_sync.stop, timeout=STOP_TIMEOUT)
    except AgentTimeoutError:
        _agent_left_loaded.set()
        raise


def _release_forks(agent: _Agent) -> None:
    with contextlib.suppress(frida.InvalidOperationError):  # gone: it let them go itself
        agent.script.post({"type": "release-forks"})


def _detached(session: Any, patient: bool = False) -> bool:
    """Detach from `session`, whose agent has stopped; False if Frida is still at it after
    DETACH_WAIT s, or DETACH_PATIENCE s if `patient` (no thread is known to hold it).  It
    goes on by itself: it frees what Stalker keeps for a thread only once the thread runs
    again, so a detach waits for every thread that sits in a system call it entered traced
    (a program sleeping, or waiting for input) -- for as long as that takes."""
    try:
        _bounded(session.detach, timeout=DETACH_PATIENCE if patient else DETACH_WAIT)
    except AgentTimeoutError:
        _agent_left_loaded.set()
        return False
    return True


def _stop_and_detach(
    pid: int, agent: _Agent, session: Any, rec: _Recording, result: RecordResult, guard: _StopGuard
) -> bool:
    """End the recording of process `pid`, running, and leave it running: True if Frida
    unloads its agent only later (_unloading_later).  An agent that does not answer leaves
    the process as it is, its rings read as a killed recorder's; any other failure (the
    process ended meanwhile) is raised."""
    guard.on()
    try:
        stopped = _stop_agent(agent)
        far = stopped.get("farBlocks", 0)
        for tid in stopped.get("stillInFork", []):
            rec.untraced_threads.append(
                {"pid": pid, "tid": int(tid), "start": "inside fork(), never seen out"}
            )
            rec._error(
                f"thread {tid} of pid {pid} was inside fork() at the attach and was not "
                "seen coming out before the recording ended: not traced (following it "
                "inside fork() would kill its child)"
            )
        if far:
            result.warnings.append(
                f"{far} blocks were not traced (above 2^47, or no memory for them)"
            )
        asleep = _let_go_asleep(pid, agent, stopped.get("asleep", []))
        stays = not _detached(session, patient=not asleep)
        result.detached = True
        if stays:
            result.warnings.append(_unloading_later(f"pid {pid}", asleep))
            return True
        if left := _rings_left_behind(pid, rec.tracedir.path):
            result.warnings.append(_rings_left_warning(f"pid {pid}", left))
    except AgentTimeoutError:
        result.warnings.append(_stuck_agent(f"pid {pid}", agent))
        rec.orphaned.add(pid)  # its rings were never closed
        result.detached = True  # left as it is: not ended, as the summary said
    finally:
        guard.off()
    return False


def _let_go_asleep(pid: int, agent: _Agent, asleep: list[int]) -> list[int]:
    """Let go of the threads of `pid` that sleep in a system call since the recording ended
    (asleep.let_go), so that Frida can unload its agent now and the process keeps no ring
    mapped; the threads that could not be let go of.  Those are tried again a few times
    (LET_GO_TRIES): a stop that comes too late under load, or a thread that woke meanwhile
    and leaves by itself.  One asleep in the program's own code holds Frida's agent in
    nothing, so the detach goes on without it, and its ring stays mapped in the process
    (_rings_left_behind; a CI run once left a main thread asleep in read() so, for a reason
    not known)."""
    exports = agent.script.exports_sync

    def let_go_of(tid: int) -> bool:
        def address() -> int | None:
            at = _bounded(exports.asleep_at, tid)
            return int(at) if at else None

        def signal_stack() -> int | None:
            stack = _bounded(exports.signal_stack, tid)
            return int(stack) if stack else None

        def done(how: str, disarmed: bool) -> bool:
            return bool(_bounded(exports.let_go_asleep, tid, how, disarmed))

        return let_go(pid, tid, address, done, signal_stack)

    kept = [tid for tid in map(int, asleep) if not let_go_of(tid)]
    for _ in range(LET_GO_TRIES - 1):
        if not kept:
            break
        time.sleep(LET_GO_PAUSE)
        kept = [t for t in kept if _bounded(exports.still_asleep, t) and not let_go_of(t)]
    return kept


def _rings_left_behind(pid: int, directory: Path) -> list[int]:
    """The threads whose rings in `directory` process `pid` still maps once Frida's agent has
    unloaded: threads asleep in the program's own code that the host could not let go of
    (_let_go_asleep).  Nothing writes those rings any more."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    mapped = {Path(line.split(maxsplit=5)[-1]) for line in maps if line.endswith(".bts")}
    where = directory.resolve()  # as the kernel names it
    return sorted(
        int(p.stem[1:])
        for p in mapped
        if p.parent == where and p.stem.startswith("T") and p.stem[1:].isdigit()
    )


def _rings_left_warning(process: str, tids: list[int]) -> str:
    many = len(tids) > 1
    return (
        f"{process} still maps the {'rings' if many else 'ring'} of "
        f"{'threads' if many else 'thread'} {', '.join(map(str, tids))} (asleep in a system "
        f"call where the recorder could not let go of {'them' if many else 'it'}); nothing "
        f"writes {'them' if many else 'it'} any more, the trace is complete, and the mapping "
        "goes when the process ends"
    )


def _unloading_later(process: str, asleep: list[int]) -> str:
    """`asleep`: the threads that had not run since the recording ended (the agent's)."""
    if not asleep:
        which = "its threads that sit in a system call (sleeping, or waiting for input) run again"
    else:
        tids = ", ".join(map(str, sorted(asleep)))
        which = (
            f"{'threads' if len(asleep) > 1 else 'thread'} {tids}, asleep in a system call "
            "since the recording ended (sleeping, or waiting for input), "
            f"{'run' if len(asleep) > 1 else 'runs'} again"
        )
    return (
        f"Frida unloads its agent from {process} only once {which}; the trace is complete, "
        "and until then the agent stays loaded, idle"
    )


_FROZEN_KILLED = "it could never run again: branchtrace killed it"


def _frozen(process: str, fate: str, traced: bool = True) -> str:
    return (
        f"{process} faulted inside Frida's recovery from a fork(), and Frida's injector holds "
        "it stopped there for good (a Frida bug, which Frida alone meets too; under "
        f"--follow-fork about once in 200 to 600 forks of a program forking every 2 ms): {fate}; "
        + ("the trace up to there is kept" if traced else "it was not traced")
    )


def _stuck_agent(process: str, agent: _Agent) -> str:
    if agent.frozen:
        return _frozen(
            process, "it never runs again, and dies of that fault (SIGSEGV) as branchtrace exits"
        )
    why = (
        " (Frida can deadlock when a process forks while --follow-fork holds its children)"
        if agent.fork_counters is not None
        else ""
    )
    return (
        f"the agent in {process} did not answer within {STOP_TIMEOUT:.0f} s{why}; the trace "
        "up to here is kept, the process may be left stuck"
    )


class _ForkCounters:
    """BtState's fork() counters in one traced process (bt_hold_forks in stalker_agent.c),
    read and written through /proc/PID/mem, with no call to its agent.

    At the end of a recording under --follow-fork nothing may be on its way to or from the
    agent while the program forks: Frida's own fork() hook (child gating) stops the agent's
    thread for the fork() and restarts it in its recovery, and a call or answer caught in
    between made that recovery crash in the program (at agent+0x31d855, after the host
    waited 10 s for an answer: 8 in about 225 recordings of `slowfork 50 60`).  So the host
    first holds new fork() calls at fork()'s entry, where they wait before Frida's hook, and
    waits for those under way, by writing and reading these counters; a fork() counts as
    under way until Frida's recovery from it is over (bt_on_fork_done)."""

    def __init__(self, pid: int, where: dict[str, str]) -> None:
        self.pid = pid
        self.held = int(where["held"], 16)
        self.in_flight = int(where["inFlight"], 16)
        self.passing = int(where["passing"], 16)
        self.gated = int(where["gated"], 16)
        self._held = StopClock()  #: see _held_by_frida

    def _under_way(self, mem: int) -> bool:
        return any(os.pread(mem, 4, self.in_flight) + os.pread(mem, 4, self.passing))

    def _held_by_frida(self, under_way: bool) -> bool:
        """Whether, for FROZEN_AFTER s on end, a fork() has been under way and Frida's
        injector has held a thread of the process stopped: the process faulted in Frida's
        recovery from that fork() and the injector waits for something else (in every case
        looked at, a fault in Frida's heap code as the injector re-created the agent's
        thread).  It never runs again; it dies of that fault once the recorder exits, and
        the injector with it (docs/fork.md).  The injector stops a thread for milliseconds
        otherwise."""
        stopped = under_way and stopped_by_us(self.pid) is not None
        held_for = self._held.held_for(self.pid, stopped)
        return held_for is not None and held_for >= FROZEN_AFTER

    def frozen(self) -> bool:
        """_held_by_frida, looked at now."""
        try:
            mem = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY)
        except OSError:
            return False
        try:
            return self._held_by_frida(self._under_way(mem))
        except OSError:  # gone
            return False
        finally:
            os.close(mem)

    def let_go(self) -> None:
        """Every fork() held at its entry or at the gate in front goes on (they look every
        millisecond), with no call to the agent."""
        with contextlib.suppress(OSError):
            mem = os.open(f"/proc/{self.pid}/mem", os.O_RDWR)
            try:
                for word in (self.held, self.gated):
                    os.pwrite(mem, bytes(4), word)
            finally:
                os.close(mem)

    def hold(self, held: bool, wait: bool = True) -> bool | None:
        """New fork() calls wait at fork()'s entry (`held`) or no longer; True once none is
        under way past it (none was for 5 ms on end: one between the GOT and the hook is not
        counted yet, and one held wakes every millisecond to look), False if one still is
        after AGENT_TIMEOUT s, None if the process's memory cannot be written.  Without
        `wait`, True once written.  False as soon as the process is found frozen (frozen())."""
        try:
            mem = os.open(f"/proc/{self.pid}/mem", os.O_RDWR)
        except OSError:
            return None
        try:
            try:
                os.pwrite(mem, (1 if held else 0).to_bytes(4, "little"), self.held)
            except OSError:
                return None
            if not wait:
                return True
            deadline = time.monotonic() + AGENT_TIMEOUT
            quiet_since = None
            next_look = 0.0
            while time.monotonic() < deadline:
                try:
                    under_way = self._under_way(mem)
                except OSError:  # gone: nothing of it is under way
                    return True
                if time.monotonic() > next_look:
                    if self._held_by_frida(under_way):
                        return False
                    next_look = time.monotonic() + 0.05
                if under_way:
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since >= 0.005:
                    return True
                time.sleep(0.0005)
            return False
        finally:
            os.close(mem)


class _Agent:
    """The agent loaded into one process of the recording."""

    def __init__(self, pid: int, key: int | None = None) -> None:
        self.pid = pid
        #: the process in the recording (tracedir.thread_key): its pid, or "pid#2" for the
        #: image it exec'ed (with --follow-fork)
        self.key = pid if key is None else key
        self.script: Any = None  # frida.core.Script
        self.ready = threading.Event()
        self.errors: list[str] = []
        self.fork_counters: _ForkCounters | None = None  #: with --follow-fork
        #: a fork() of its process never came out of Frida's recovery: no call can be answered
        self.stuck = False
        #: and Frida's injector holds the process stopped there (_ForkCounters.frozen)
        self.frozen = False
        #: rings handed to it for its next threads and not yet taken (_Recording._hand)
        self.spares = 0

    def check_ready(self) -> None:
        """The agent set itself up, or the recording of this process cannot start."""
        if not self.ready.wait(30) or self.errors:
            why = self.errors[0] if self.errors else "no answer from the agent"
            raise EngineUnavailableError(f"the stalker agent failed to start: {why}")


#: a thread or child given the id of an earlier one of the recording
_REUSED_ID = (
    "id {} was that of a child killed frozen earlier in this recording (the kernel reuses "
    "ids once they reach /proc/sys/kernel/pid_max)"
)

#: each agent's notes for the end of the recording (stalker_agent.js): this + its pid, in DIR
_NOTES_FILE = ".agent-notes."

#: the ring header's count of GAP records, by reason, that the agent keeps
_COUNTED_GAPS = {
    GapReason.FORK: "counted_gap_fork",
    GapReason.SIGNAL: "counted_gap_signal",
    GapReason.LEFT_HANDLER: "counted_gap_left_handler",
}


def _agent_counts(ring: Ring) -> tuple[int, dict[int, int]]:
    """The records and GAPs per reason the agent counted in the ring's header as it wrote."""
    gaps = {int(reason): n for reason, field in _COUNTED_GAPS.items() if (n := ring._get(field))}
    return ring._get("counted_records"), gaps


def _out_of_files(error: BaseException) -> bool:
    """Whether `error` (or the OSError it was raised from) is EMFILE or ENFILE."""
    cause = error if isinstance(error, OSError) else error.__cause__
    return isinstance(cause, OSError) and cause.errno in (errno.EMFILE, errno.ENFILE)


#: what to do when the recorder is out of descriptors
_MORE_FILES = (
    "the recorder holds up to 4 per thread alive: raise its limit (ulimit -n) to trace more "
    "threads at once"
)


def _writer_done(ring: Ring) -> bool:
    """Whether the agent that wrote `ring` will never write to it again: it closed the ring
    (its thread ended, or tracing stopped), or no process holds the ring open any more (its
    writer lock goes with the last descriptor and mapping of the ring: its process is gone)."""
    state = ring.writer_state
    return state == WriterState.CLOSED or (state == WriterState.ACTIVE and not ring.writer_alive())


#: what a hook Frida had not written 2 s after it was placed (await_hook in stalker_agent.c)
#: cost, by the hook
_LATE_HOOK = {
    "refollow": "thread {tid} of pid {pid} ran on untraced after its signal handler moved its "
    "pc: Frida had not written the hook that follows it again within 2 s",
    "handler": "a signal handler set by thread {tid} of pid {pid} may have run unmarked (no "
    "GAP) at first: Frida had not written its hook within 2 s",
    "restorer": "thread {tid} of pid {pid}: a signal handler that returned at first may have "
    "left its thread untraced: Frida had not written the hook on the restorer within 2 s",
}
#: where the rings made ahead for the next thread wait (hidden: no thread's store)
_SPARE_RING = ".spare{}.bts"
#: rings each agent holds for its next threads (_Recording._top_up), once one has started
SPARES_PER_AGENT = 2
#: what of a new ring is read in before its thread gets it (Ring.prefault): the agent maps
#: further pages in as the thread comes near them (populate_ahead in stalker_agent.c)
_PREFAULT_DATA = 1 << 20
_PREFAULT_TABLE = 256 << 10


def _discard(ring: Ring) -> None:
    ring.close()
    with contextlib.suppress(OSError):
        ring.path.unlink()


def _table_entries(buffer_size: int) -> int:
    """Block table entries per thread: 1/64 of the ring (8 bytes an entry, so an eighth of
    its size), 4096 to 1M.  A thread rarely runs more distinct blocks than that (gzip of
    2.7 MB: 837); more are still recorded, through a callout."""
    return min(1 << 20, max(4096, buffer_size // 64))


class _Recording:
    """The rings of one recording, their consumers, and the drain thread."""

    def __init__(self, tracedir: TraceDir, options: RecordOptions) -> None:
        self.tracedir = tracedir
        self.options = options
        #: all by thread key (tracedir.thread_key)
        self.rings: dict[int, tuple[Ring, RingReader | None, int | None]] = {}
        self.switches: dict[int, SwitchRecorder] = {}
        self.thread_pid: dict[int, int] = {}  #: the process of each traced thread
        self.ids_seen: dict[int, int] = {}  #: how many traced threads had each id
        self.live_key: dict[int, int] = {}  #: the key of the last thread with each id
        #: what Frida opened in each process (_open_files)
        self.frida_files: dict[int, set[str]] = {}
        #: processes that run on after Frida dropped their session: their threads' last
        #: records are taken from the live rings (recovered_head)
        self.orphaned: set[int] = set()
        #: threads seen and not traced, and why (meta.json's untraced_threads)
        self.untraced_threads: list[dict[str, Any]] = []
        #: those of them that started at code in no module (Frida's own): not the program's
        self.threads_at_no_module = 0
        self.snapshots: list[Path] = []  #: --trigger snapshot directories, in order
        #: entries of Stalker's inline cache per indirect branch (stalker_agent.c)
        self.inline_cache: int | None = None
        #: a spawned program's init_offset, and where its trace started: "_init" or "main"
        #: (stalker_agent.js)
        self.init: int | None = None
        self.traced_from: str | None = None
        #: whether every agent found Frida's heap locks, which its fork()s take
        #: (bt_on_fork_syscall in stalker_agent.c), or None if none said
        self.fork_heap_locks: bool | None = None
        #: whether every agent put its stub around the pthread_create() of Frida's loader,
        #: which the injector runs on the main thread after each fork() (stalker_agent.js:
        #: injectorGuarded), or None if none said
        self.injector_guard: bool | None = None
        #: whether every agent under --follow-fork sealed Frida's loader against the
        #: injector's munmap() by a reused pid (injectorGuarded), or None if none said
        self.loader_sealed: bool | None = None
        #: runs of the program's signal handlers on threads not traced (Frida's own), by
        #: process (bt_note_off_trace)
        self.handlers_off_trace: dict[int, int] = {}
        #: whether every agent found Gum's one-instruction disassembler and put its own in
        #: its place (bt_disassemble_at in stalker_agent.c), or None if none said
        self.gum_reader: bool | None = None
        #: where the first agent that looked found GLib's signal lock, from the agent's
        #: start, or -1 if nowhere: the same in every process's agent, so the others are
        #: handed it (stalker_agent.js)
        self.signal_lock_offset: int | None = None
        #: where the first agent that found Gum's one-instruction disassembler by a scan of
        #: the agent's code found it, from the agent's start, handed to the others likewise
        self.gum_reader_match: int | None = None
        #: how many agents scanned for it (those not handed it, nor forked with it in place)
        self.gum_reader_scans = 0
        #: whether every agent found GLib's signal lock, which a fork() takes with them
        self.fork_signal_lock: bool | None = None
        #: faults in Frida's code that a process was about to die of, as its agent noted
        #: them (note_frida_fault in stalker_agent.c), each with its pid
        self.frida_faults: list[dict[str, Any]] = []
        #: by thread: how often it was followed again in a fresh Stalker context
        self.contexts_renewed: dict[str, int] = {}
        self.main_key: int | None = None  #: the spawned program's process
        self.lock = threading.Lock()
        #: threads whose rings gave their unused space back (_release_finished)
        self.released: set[int] = set()
        #: threads whose writers are done, their rings drained, counted and closed
        #: (_retire): a program that starts and ends thousands of threads would otherwise
        #: hold three descriptors each, four with --sched (a ulimit of 1024 stopped tracing
        #: at the 335th)
        self.retired: dict[int, ThreadStats] = {}
        self.retired_spilled = 0
        self._retiring = threading.Lock()
        #: threads whose stream file could not be written on (_cannot_write)
        self.unwritable: set[int] = set()
        #: the drain thread died: new threads get no consumer (their writers drop)
        self.drain_failed = False
        self.errors: list[str] = []
        self._done = threading.Event()
        self._drainer: threading.Thread | None = None
        #: a ring made ahead for the next thread (_keep_a_spare): a new thread otherwise
        #: waits while its ring is made (a 16 MiB ring: 7 ms, as long as the rest of its start)
        self._spare: Ring | None = None
        self._spare_wanted = threading.Event()
        self._spare_maker: threading.Thread | None = None
        #: rings handed to an agent ahead of its next threads, by path (_hand): a thread
        #: takes one without waiting for an answer from here (followNewThread)
        self._handed: dict[str, tuple[Ring, RingReader | None, _Agent]] = {}
        #: agents owed a ring for their next threads, once each per ring (_top_up)
        self._owed: list[_Agent] = []
        #: a release pass of the drain thread wanted now (_ask_for_release, _make_room),
        #: and how many passes it made
        self._release_asked = threading.Event()
        #: threads that could not open the ring made for them (_not_opened)
        self._not_opened_keys: set[int] = set()
        self._release_passes = 0
        self._released = threading.Condition()
        self._file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    def load_agent(
        self,
        session: Any,
        pid: int,
        spawn: bool,
        main_ring: Path | None,
        park: bool,
        init: int | None = None,
        before: set[str] | None = None,
        forked_from: int | None = None,
        key: int | None = None,
        hold_page: tuple[int, int] | None = None,
    ) -> _Agent:
        """Load the agent into the process of `session`; raises if it does not start.  With
        `park` (--follow-fork) the agent parks a thread of its own, without which Frida drops
        our session with the process once a child it forked has closed its copy of the
        script (park in stalker_agent.js); a forked child is covered by its parent's.
        `init`: a spawned program's init_offset, where tracing starts.  `before`: what the
        process had open before Frida came in (_open_files); `forked_from`: else, the
        parent of the forked child it is.  `key`: the process's key in the recording, when
        it is not `pid` (an exec'ed image, a child given an earlier process's pid).
        `hold_page`: (base, size) of the stub the main thread was held in while Frida
        attached (mainhold.py), which the agent unmaps at the end."""
        agent = _Agent(pid, key)
        if spawn and key is None:
            self.init = init
            self.main_key = pid
        params = {
            "cSource": agent_c_source(self.options.context_blocks or CONTEXT_BLOCKS),
            "mainRing": str(main_ring) if main_ring else None,
            "spawn": spawn,
            # not in a forked child: its parent's stub is there already
            "forkStub": forked_from is None,
            "initOffset": init,
            "park": park,
            "followFork": self.options.follow_fork,
            "triggers": [t.__dict__ for t in self.options.triggers],
            "snapshots": self.options.snapshots,
            "notesPath": str(self.tracedir.path / f"{_NOTES_FILE}{agent.key}"),
            "spared": self._frida_fds_of(pid, before, forked_from),
            "signalLockOffset": self.signal_lock_offset,
            "gumReaderMatch": self.gum_reader_match,
            "holdPage": [str(hold_page[0]), hold_page[1]] if hold_page else None,
        }
        agent.script = session.create_script(agent_script(params))
        agent.script.on("message", lambda message, data: self.on_message(agent, message))
        agent.script.load()
        agent.check_ready()
        if self.options.follow_fork:  # before the process forks under child gating
            where = _bounded(agent.script.exports_sync.fork_counters)
            agent.fork_counters = _ForkCounters(pid, where)
        return agent

    def _frida_fds_of(
        self, pid: int, before: set[str] | None, forked_from: int | None
    ) -> list[list[int]]:
        """Frida's files in process `pid` (its connections with us, its event fds), which
        its close_range() must leave open (on_close_range in stalker_agent.c), as [fd,
        is an event fd, its eventfd-id or inode]:
        what it opened since `before` (_open_files); in a child forked from `forked_from`,
        the sockets and event fds its parent does not have (Frida makes them anew after a
        fork) and what Frida had opened in its parent."""
        files = _open_files(pid)
        if forked_from is None:
            frida = set(files.values()) - (before or set())
        else:
            theirs = set(_open_files(forked_from).values())
            frida = {
                what
                for what in files.values()
                if what.startswith(("socket:", "anon_inode:[eventfd]")) and what not in theirs
            }
            frida |= self.frida_files.get(forked_from, set())
        self.frida_files[pid] = frida
        spared = []
        for fd, what in sorted(files.items()):
            if what not in frida:
                continue
            if what.startswith("anon_inode:[eventfd] "):
                eventfd_id = what.rsplit(" ", 1)[1]
                if eventfd_id.isdigit():  # else not one to tell apart from the program's
                    spared.append([fd, 1, int(eventfd_id)])
            else:
                with contextlib.suppress(OSError):
                    spared.append([fd, 0, os.stat(f"/proc/{pid}/fd/{fd}").st_ino])
        return spared

    def add_thread(self, tid: int, pid: int) -> Path:
        """A ring for thread `tid` of process `pid`, and its drain.  A thread that got the
        id of an earlier thread of the recording (ids wrap at pid_max) is stored under a key
        of its own (tracedir.thread_key): the earlier one's trace is never replaced."""
        key = self._new_key(tid)
        path = self.tracedir.ring_path(key)
        ring = self._take_spare(path, tid) or self._with_room(lambda: self._new_ring(path, tid))
        self._want_a_spare()
        # the consumer exists before the writer: a full ring always has someone to wait for
        reader = self._consumer(ring)
        try:
            stream_fd = self._stream_file(key, reader)
        except StoreError:  # a full disk: no ring either, the thread is not traced
            _discard(ring)
            raise
        self._register(key, pid, ring, reader, stream_fd)
        return path

    def _new_key(self, tid: int) -> int:
        """The key of a new thread with id `tid` (the id of an earlier one: a key of its own)."""
        with self.lock:
            earlier = self.ids_seen.get(tid, 0)
            self.ids_seen[tid] = earlier + 1
        return thread_key(tid, earlier)

    def _consumer(self, ring: Ring) -> RingReader | None:
        if self.options.mode == Mode.WRAP or self.drain_failed:
            return None
        return RingReader(ring, consume=True)

    def _stream_file(self, key: int, reader: RingReader | None) -> int | None:
        if reader is None:
            return None
        stream = self.tracedir.stream_path(key, packed=self.options.compress)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        try:
            return self._with_room(lambda: os.open(stream, flags, 0o644))
        except OSError as e:
            raise StoreError(f"cannot create {stream}: {e.strerror}") from e

    def _register(
        self, key: int, pid: int, ring: Ring, reader: RingReader | None, stream_fd: int | None
    ) -> None:
        with self.lock:
            self.rings[key] = (ring, reader, stream_fd)
            self.thread_pid[key] = pid
            self.live_key[thread_id(key)] = key
        if self.options.sched:
            self._watch_switches(key)
        self._ask_for_release()

    def adopt(self, agent: _Agent, tid: int, handed: str, named: str | None) -> None:
        """Thread `tid` of `agent` took the ring handed to it at `handed` and renamed it
        `named` (None: that name was taken, by a thread of an earlier generation of the id:
        it is named here)."""
        with self.lock:
            entry = self._handed.pop(handed, None)
            if entry is None:
                return  # take_back() found it taken first
            agent.spares -= 1
        ring, reader, _ = entry
        self._adopt(agent, tid, ring, reader, Path(named or handed))
        self._top_up(agent)

    def _adopt(
        self, agent: _Agent, tid: int, ring: Ring, reader: RingReader | None, at: Path
    ) -> None:
        key = self._new_key(tid)
        path = self.tracedir.ring_path(key)
        if at != path:
            try:
                os.rename(at, path)
            except OSError as e:
                self._error(f"thread {thread_label(key)}: its ring stays at {at}: {e.strerror}")
                path = at
        ring.path = path
        ring._set("created_ns", time.time_ns())
        try:
            stream_fd = self._stream_file(key, reader)
        except StoreError as e:
            # the thread runs on: once its ring is full, what it does is counted as lost
            if reader is not None:
                reader.close()
            reader, stream_fd = None, None
            self._error(f"thread {thread_label(key)}: only its first records are kept: {e}")
        self._register(key, agent.key, ring, reader, stream_fd)

    def _top_up(self, agent: _Agent) -> None:
        """Hand `agent` rings for its next threads, up to SPARES_PER_AGENT.  Not with
        --sched: a thread's context switches are watched before it runs, which the host
        does as the thread waits for its ring.  Nor with --follow-fork: a ring handed is a
        message to the agent at any moment, and one on its way as the program forks under
        Frida's child gating kills the child or the program (docs/fork.md section 17); a
        thread that waits for its ring lets no fork() go on meanwhile."""
        if self.options.sched or self.options.follow_fork:
            return
        with self.lock:
            if self._done.is_set():
                return
            owed = SPARES_PER_AGENT - agent.spares - self._owed.count(agent)
            self._owed.extend([agent] * owed)
        if owed > 0:
            self._want_a_spare()

    def _hand(self, agent: _Agent, spare: Ring) -> None:
        reader = self._consumer(spare)
        path = str(spare.path)
        with self.lock:
            kept = not self._done.is_set()
            if kept:
                self._handed[path] = (spare, reader, agent)
                agent.spares += 1
        if kept:
            try:
                agent.script.post({"type": "spare", "path": path})
                return
            except (frida.InvalidOperationError, frida.TransportError):  # its process is gone
                with self.lock:
                    kept = self._handed.pop(path, None) is not None
                    if kept:
                        agent.spares -= 1
                if not kept:
                    return  # take_back() has it
        if reader is not None:
            reader.close()
        _discard(spare)

    def _new_ring(self, path: Path, tid: int) -> Ring:
        ring = Ring.create(
            path,
            self.options.buffer_size,
            self.options.mode,
            _FLAGS[self.options.mode],
            tid=tid,
            chunk_size=CHUNK,
            table_entries=self.options.block_table or _table_entries(self.options.buffer_size),
            meta_size=META_LOG,
        )
        ring.prefault(_PREFAULT_DATA, _PREFAULT_TABLE)
        return ring

    def _take_spare(self, path: Path, tid: int) -> Ring | None:
        with self.lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return None
        try:
            os.rename(spare.path, path)
        except OSError:
            _discard(spare)
            return None
        spare.path = path
        spare._set("tid", tid)
        spare._set("created_ns", time.time_ns())
        return spare

    def _want_a_spare(self) -> None:
        self._spare_wanted.set()
        with self.lock:
            if self._spare_maker is not None or self._done.is_set():
                return
            self._spare_maker = threading.Thread(
                target=self._keep_a_spare, name="bt-spare-ring", daemon=True
            )
            self._spare_maker.start()

    def _keep_a_spare(self) -> None:
        """Make the spare ring, then the rings owed to agents (_top_up), as they are wanted."""
        for made in itertools.count():
            with self.lock:
                if self._done.is_set():
                    return
                agent = None
                if self._spare is not None and self._owed:
                    agent = self._owed.pop(0)
                idle = self._spare is not None and agent is None
            if idle:
                self._spare_wanted.wait()
                self._spare_wanted.clear()
                continue
            # Each at a path of its own.  Made at the path of the spare a thread had just
            # taken, and not yet renamed to its ring's, it replaced that file: the thread's
            # ring became the new one's file and the host's ring object the old, unlinked
            # one, never written (1 attach in 5 to `loopers`, wrap mode: a thread counted
            # 0 records, or another thread's; in stream mode, its records undrained).
            try:
                spare = self._new_ring(self.tracedir.path / _SPARE_RING.format(made), 0)
            except (BranchtraceError, OSError) as e:
                if _out_of_files(e):
                    # the next thread makes room (_make_room) and wants another
                    self._spare_wanted.wait()
                    self._spare_wanted.clear()
                    continue
                return  # a full disk: each thread's ring is made as it starts, and fails there
            if agent is not None:
                self._hand(agent, spare)
                continue
            with self.lock:
                if not self._done.is_set():
                    self._spare = spare
                    continue
            _discard(spare)
            return

    def _drop_spare(self) -> None:
        """After _done is set: no spare ring is left in the recording."""
        self._spare_wanted.set()
        if self._spare_maker is not None:
            self._spare_maker.join()
        with self.lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            _discard(spare)
        self.take_back()

    def take_back(self, agent: _Agent | None = None) -> None:
        """The rings handed to `agent` (None: to any), whose process is gone or done: those
        no thread took go; one a thread took (it wrote its id in it) and no message named
        is that thread's."""
        with self.lock:
            handed = {p: e for p, e in self._handed.items() if agent in (None, e[2])}
            for path, (_, _, owner) in handed.items():
                del self._handed[path]
                owner.spares -= 1
            self._owed = [a for a in self._owed if agent not in (None, a)]
        for path, (ring, reader, owner) in handed.items():
            if ring.tid != 0:
                at = Path(path)
                if not at.exists():
                    at = self.tracedir.ring_path(ring.tid)
                self._adopt(owner, ring.tid, ring, reader, at)
                continue
            if reader is not None:
                reader.close()
            _discard(ring)

    def traced_anything(self) -> bool:
        """Whether any thread has written to its ring (before `finish`)."""
        with self.lock:
            rings = [ring for ring, _, _ in self.rings.values()]
            retired = bool(self.retired)
        return retired or any(ring.writer_state != WriterState.NONE for ring in rings)

    def _watch_switches(self, key: int) -> None:
        try:
            recorder = self._with_room(lambda: SwitchRecorder(thread_id(key)))
        except OSError as e:
            self._error(
                f"no context switches for thread {thread_label(key)}: perf_event_open failed "
                f"({e.strerror}{'; ' + _MORE_FILES if _out_of_files(e) else ''}); recording "
                "continues without them"
            )
            return
        with self.lock:
            self.switches[key] = recorder

    def on_message(self, agent: _Agent, message: Any) -> None:
        if message.get("type") == "error":
            problem = f"agent: {message.get('description', message)}"
            agent.errors.append(problem)
            self._error(problem)
            agent.ready.set()
            return
        payload = message.get("payload") or {}
        kind = payload.get("type")
        if kind == "ready":
            if self.signal_lock_offset is None and payload.get("signalLockOffset") is not None:
                self.signal_lock_offset = int(payload["signalLockOffset"])
            if self.gum_reader_match is None and payload.get("gumReaderMatch") is not None:
                self.gum_reader_match = int(payload["gumReaderMatch"])
            self.gum_reader_scans += bool(payload.get("gumReaderScanned"))
            agent.ready.set()
        elif kind == "thread-start" and payload.get("handed"):
            self.adopt(agent, int(payload["tid"]), payload["handed"], payload.get("named"))
        elif kind == "thread-start":
            tid = int(payload["tid"])
            try:
                path = self.add_thread(tid, agent.key)
                reply: dict[str, Any] = {"type": f"ring:{tid}", "path": str(path)}
            except BranchtraceError as e:
                more = f" ({_MORE_FILES})" if _out_of_files(e) else ""
                self._error(f"thread {tid} not traced: {e}{more}")
                with self.lock:
                    self.untraced_threads.append(
                        {"pid": agent.pid, "tid": tid, "start": f"no ring: {e}"}
                    )
                reply = {"type": f"ring:{tid}", "path": None}
            agent.script.post(reply)
            self._top_up(agent)
        elif kind == "module":
            event = ModuleEvent(
                payload["event"],
                int(payload["base"], 16),
                int(payload["size"]),
                payload["path"],
                time.time_ns(),
                agent.key,
            )
            try:
                self.tracedir.append_module(event)
            except OSError as e:  # a full disk
                self._error(
                    f"the {event.event} of {event.path} was not saved ({e.strerror}): "
                    "addresses in it are shown unsymbolized"
                )
        elif kind == "trigger":
            tid = int(payload["tid"])
            try:
                trigger = self.options.triggers[int(payload["index"])].label
                self.snapshot(trigger, self.live_key.get(tid, tid), agent.key)
            finally:
                agent.script.post({"type": f"snapshot:{tid}"})
        elif kind == "ring-not-opened":
            self._not_opened(agent, int(payload["tid"]), Path(payload["path"]), payload["why"])
        elif kind == "error":
            agent.errors.append(str(payload.get("message")))
            self._error(str(payload.get("message")))
            agent.ready.set()

    def _not_opened(self, agent: _Agent, tid: int, path: Path, why: str) -> None:
        """Thread `tid` of `agent` could not open its ring at `path`: it runs on untraced.
        A ring made for it here goes (_forget_not_opened): the thread is listed among the
        untraced, not counted among the traced with 0 records."""
        with self.lock:
            self.untraced_threads.append(
                {"pid": agent.pid, "tid": tid, "start": f"cannot open its ring: {why}"}
            )
            handed = self._handed.pop(str(path), None)
            if handed is not None:
                agent.spares -= 1
            # else a ring made here on its thread-start message
            key = self.live_key.get(tid, -1)
            entry = self.rings.get(key)
            if entry is not None and entry[0].path == path and self.thread_pid[key] == agent.key:
                self._not_opened_keys.add(key)
        ring = (
            "the ring made ahead for it"
            if handed is not None
            else f"its ring {Path(self.options.output) / path.name}"
        )
        self._error(f"thread {tid} not traced: cannot open {ring}: {why}")
        if handed is not None:
            spare, reader, _ = handed
            if reader is not None:
                reader.close()
            _discard(spare)
            self._top_up(agent)
        self._release_asked.set()

    def _forget_not_opened(self) -> None:
        """The rings that their threads could not open go, unless a writer came after all
        (one never goes with records in it).  On the drain thread, or once it is done."""
        with self.lock:
            keys, self._not_opened_keys = self._not_opened_keys, set()
        for key in keys:
            with self.lock:
                ring, reader, fd = self.rings[key]
                if ring.writer_state != WriterState.NONE:
                    continue
                del self.rings[key], self.thread_pid[key]
                if self.live_key.get(thread_id(key)) == key:
                    del self.live_key[thread_id(key)]
                recorder = self.switches.pop(key, None)
            if recorder is not None:
                recorder.close()
            if reader is not None:
                reader.close()
            if fd is not None:
                os.close(fd)
                self.tracedir.stream_path(key, packed=self.options.compress).unlink(missing_ok=True)
            _discard(ring)

    def read_notes(self) -> None:
        """What each agent noted for the end (stalker_agent.js): its inline cache's entries
        per branch, and threads left untraced because they started at code in no module
        (Frida's own, one per fork() with --follow-fork).  The files go."""
        for path in sorted(self.tracedir.path.glob(f"{_NOTES_FILE}*")):
            pid = int(path.name.rsplit(".", 1)[1])
            for line in path.read_text().splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # cut short by the agent's end
                if event.get("type") == "inline-cache":
                    self.inline_cache = int(event["entries"])
                elif event.get("type") == "traced-from" and pid == self.main_key:
                    self.traced_from = str(event["at"])
                elif event.get("type") == "fork-heap-locks":
                    self.fork_heap_locks = (
                        bool(event["found"]) and self.fork_heap_locks is not False
                    )
                    self.fork_signal_lock = (
                        bool(event.get("signalLock")) and self.fork_signal_lock is not False
                    )
                elif event.get("type") == "gum-reader":
                    self.gum_reader = bool(event["found"]) and self.gum_reader is not False
                elif event.get("type") == "injector-guard":
                    self.injector_guard = bool(event["found"]) and self.injector_guard is not False
                    if event.get("sealed") is not None:
                        self.loader_sealed = (
                            bool(event["sealed"]) and self.loader_sealed is not False
                        )
                elif event.get("type") == "handlers-off-trace":
                    n = int(event["n"])  # a count so far: noted at exit and at the end
                    self.handlers_off_trace[pid] = max(n, self.handlers_off_trace.get(pid, 0))
                elif event.get("type") == "frida-fault":
                    self.frida_faults.append({"pid": pid, **event})
                    del self.frida_faults[-1]["type"]
                elif event.get("type") == "context-renewed":
                    label = str(event["tid"])
                    self.contexts_renewed[label] = self.contexts_renewed.get(label, 0) + 1
                elif event.get("type") == "late-hook":
                    self._error(_LATE_HOOK[str(event["what"])].format(tid=event["tid"], pid=pid))
                elif event.get("type") == "thread-untraced" and event.get("inFork"):
                    tid = int(event["tid"])
                    self._error(
                        f"thread {tid} of pid {pid} was started inside a fork() of its own "
                        "process (by an atfork handler), so not traced: it cannot have its "
                        "ring while Frida handles that fork() (docs/fork.md section 18)"
                    )
                    self.untraced_threads.append({"pid": pid, "tid": tid, "start": "inside fork()"})
                elif event.get("type") == "thread-untraced":
                    self.threads_at_no_module += 1
                    self.untraced_threads.append(
                        {"pid": pid, "tid": int(event["tid"]), "start": event["routine"]}
                    )
            path.unlink()
        if self.options.follow_fork and self.fork_heap_locks is False:
            self._error(
                "Frida's heap locks were not found (this Frida's layout is not the one "
                "branchtrace knows): a child forked while another thread is inside Frida's "
                "heap can be stuck in Frida's recovery (docs/fork.md section 21)"
            )
        elif self.options.follow_fork and self.fork_signal_lock is False:
            self._error(
                "GLib's signal lock was not found in Frida's agent (this Frida is not one "
                "branchtrace knows): a child forked while another thread starts or ends can "
                "be stuck in Frida's recovery (docs/fork.md section 22)"
            )
        if self.options.follow_fork and self.injector_guard is False:
            self._error(
                "Frida's loader was not found (this Frida is not one branchtrace knows): "
                "after each fork(), Frida's injector can leave the main thread of the parent "
                "and of each child with its vector registers changed (docs/fork.md section 29)"
            )
        if self.gum_reader is False:
            self._error(
                "Gum's one-instruction disassembler was not found (this Frida is not one "
                "branchtrace knows): Stalker builds capstone's tables anew for each link "
                "between two blocks, and large programs record much more slowly"
            )
        if self.inline_cache is not None and self.inline_cache != INLINE_CACHE:
            self._error(
                "Stalker's inline cache stays at its default of 2 targets per indirect "
                "branch (this Frida's layout is not the one branchtrace knows): indirect "
                "calls with more targets are traced much more slowly"
            )

    def snapshot(self, label: str, tid: int, pid: int) -> None:
        """Copy the tail of every thread's ring into snapshots/N: the triggering thread waits
        meanwhile, so its part ends exactly at the trigger."""
        when = time.time_ns()
        out = self.tracedir.path / SNAPSHOTS / str(len(self.snapshots) + 1)
        out.mkdir(parents=True)
        with self._retiring:  # no ring is closed under this
            with self.lock:
                rings: list[tuple[int, Ring | None]] = [
                    (t, ring) for t, (ring, _, _) in self.rings.items()
                ]
                rings += [(t, None) for t in self.retired]
                pids = dict(self.thread_pid)
            for t, live_ring in rings:
                with contextlib.ExitStack() as stack:
                    # a thread that ended: its ring is only in its file now
                    ring = live_ring or stack.enter_context(Ring.open(self.tracedir.ring_path(t)))
                    words, _ = RingReader(ring).read_words(live=True)
                    ring.expand(words).tofile(TraceDir(out).stream_path(t))
        modules = self.tracedir.path / MODULES
        if modules.exists():
            shutil.copyfile(modules, out / MODULES)
        meta = self.tracedir.meta() if (self.tracedir.path / META).exists() else {}
        meta.update(
            {
                "snapshot": {"trigger": label, "tid": tid, "pid": pid, "time_ns": when},
                "threads": {thread_label(t): {"pid": pids.get(t, pid)} for t, _ in rings},
            }
        )
        TraceDir(out).write_meta(meta)
        self.snapshots.append(out)

    def _error(self, message: str) -> None:
        if message not in self.errors:
            self.errors.append(message)

    def start_draining(self) -> None:
        self._drainer = threading.Thread(target=self._drain_loop, name="bt-drain", daemon=True)
        self._drainer.start()

    def _drain_loop(self) -> None:
        try:
            self._drain_until_done()
        except Exception as e:  # a bug of ours: the program must not wait for us for good
            self.drain_failed = True
            with self.lock:
                rings = list(self.rings.items())
            for tid, (_ring, reader, _fd) in rings:
                if reader is not None:
                    self.unwritable.add(tid)
                    reader.close()  # its writer finds its consumer gone and drops from then on
            self._error(
                f"the recorder stopped draining rings ({type(e).__name__}: {e}): the threads "
                "went on without waiting, and what no longer fit in their rings was lost "
                "(counted in lost)"
            )

    def _drain_until_done(self) -> None:
        drains = self.options.mode != Mode.WRAP or self.options.sched
        released_at = time.monotonic()
        while not self._done.is_set():
            moved, fullest = self._drain_once(final=False) if drains else (0, 0.0)
            if self._release_asked.is_set() or time.monotonic() - released_at >= RELEASE_EVERY:
                self._release_asked.clear()
                self._release_finished()
                released_at = time.monotonic()
                with self._released:
                    self._release_passes += 1
                    self._released.notify_all()
            if not drains:
                self._release_asked.wait(RELEASE_EVERY)
            elif moved == 0 or (fullest < DRAIN_BATCH and self.options.mode == Mode.STREAM):
                time.sleep(DRAIN_PAUSE)

    def _files_per_thread(self) -> int:
        # a ring's file and its mapping's (Python's mmap dups it), its stream, its perf event
        return 2 + (self.options.mode != Mode.WRAP) + self.options.sched

    def _ask_for_release(self) -> None:
        """With half the descriptors the recorder may open held by threads' files, a
        release pass now rather than at the next RELEASE_EVERY: a program that starts
        threads one after another faster than a pass retires them (3-10 ms a thread,
        as slow as its start) would otherwise run the recorder out of them."""
        with self.lock:
            held = len(self.rings) * self._files_per_thread()
        if 2 * held >= self._file_limit:
            self._release_asked.set()

    def _make_room(self) -> bool:
        """Out of descriptors: wait for the drain thread to retire the threads that ended
        (two passes: the one under way may have looked before they did); whether it did.
        A new thread waits meanwhile, as it waits for a full ring in stream mode."""
        if self._drainer is None or not self._drainer.is_alive():
            return False
        with self._released:
            wanted = self._release_passes + 2
            self._release_asked.set()
            while self._release_passes < wanted:
                if not self._released.wait(timeout=1) and self._done.is_set():
                    return False
                self._release_asked.set()
        return True

    def _with_room(self, make: Callable[[], _T]) -> _T:
        """`make()`, once more after _make_room when it found no descriptor free."""
        try:
            return make()
        except (OSError, StoreError) as e:
            if not _out_of_files(e) or not self._make_room():
                raise
        return make()

    def _release_finished(self) -> None:
        """Give back the unused space of the rings whose writers are done for good (a
        forked child that exited, a thread that ended), so that a program that forks often
        needs the disk its children's records take, not a whole ring per child
        (Ring.release_unused).  A stream ring is drained to its end first."""
        self._forget_not_opened()
        with self.lock:
            rings = [(tid, r) for tid, r in self.rings.items() if tid not in self.released]
        for tid, (ring, reader, fd) in rings:
            if not _writer_done(ring) or tid in self.unwritable:
                continue
            if reader is not None and fd is not None:
                try:
                    drain_to_file(reader, fd, final=True, packed=self.options.compress, count=False)
                except OSError as e:
                    self._cannot_write(tid, reader, fd, e)
                    continue
            ring.release_unused(drained=reader is not None)
            self.released.add(tid)
            self._retire(tid)

    def _retire(self, tid: int) -> None:
        with self._retiring:
            with self.lock:
                ring, reader, fd = self.rings.pop(tid)
            stats, spilled = self._close_ring(tid, ring, reader, fd)
            with self.lock:
                recorder = self.switches.pop(tid, None)
            if recorder is not None:  # its last switch, out as it died, is in by now
                stats.switches = self._save_switches(tid, recorder)
            with self.lock:
                self.retired[tid] = stats
                self.retired_spilled += spilled

    def _drain_once(self, final: bool) -> tuple[int, float]:
        """One pass over the rings: what it moved (records of switches, bytes of rings),
        and the largest share of its ring size a ring had to drain."""
        moved, fullest = 0, 0.0
        with self.lock:
            rings = list(self.rings.items())
            switches = list(self.switches.values())
        for recorder in switches:
            moved += recorder.poll()
        for tid, (ring, reader, fd) in rings:
            if reader is not None and fd is not None and tid not in self.unwritable:
                # not counted here: the agent counts what it writes (see finish)
                try:
                    drained = drain_to_file(
                        reader,
                        fd,
                        final=final,
                        live=self.thread_pid[tid] in self.orphaned,
                        packed=self.options.compress,
                        count=False,
                    )[0]
                except OSError as e:
                    self._cannot_write(tid, reader, fd, e)
                    continue
                moved += drained
                fullest = max(fullest, drained / ring.data_size)
        return moved, fullest

    def _cannot_write(self, tid: int, reader: RingReader, fd: int, error: OSError) -> None:
        """The stream file of thread `tid` cannot grow (a full disk): stop draining its ring
        and let its writer go on without a consumer, dropping and counting what no longer
        fits, rather than hold the thread for good.  What the file and the ring hold is
        kept: they read as one stream, up to where the ring filled up."""
        self.unwritable.add(tid)
        reader.close()  # the writer finds its consumer gone and drops from then on
        self._error(
            f"thread {thread_label(tid)}: its stream could not be written on "
            f"({error.strerror}) after {os.fstat(fd).st_size:,} bytes: what it recorded after "
            "its ring filled up was lost (counted in lost), the rest is kept"
        )

    def _close_ring(
        self, tid: int, ring: Ring, reader: RingReader | None, fd: int | None
    ) -> tuple[ThreadStats, int]:
        """Count what thread `tid` recorded and close its ring, its consumer and its stream
        file, the last records drained.  Its stats, and its blocks recorded through a callout
        once its block table was full."""
        lost = ring.lost_records
        spilled = ring._get("table_spilled")
        if reader is not None:
            reader.close()
        if fd is not None:
            os.close(fd)
        if reader is None:  # wrap: what the ring holds
            live = self.thread_pid[tid] in self.orphaned
            words, _ = RingReader(ring).read_words(live=live)
            records, gaps = count_records(words, slots=True)
        elif ring.writer_state == WriterState.CLOSED:  # counted as it was written
            records, gaps = _agent_counts(ring)
        else:  # the thread died with its ring open: count what was drained
            try:
                records, gaps = self.tracedir.record_counts(tid)
            except StoreError as e:
                records, gaps = _agent_counts(ring)
                self._error(f"thread {thread_label(tid)}: records not counted exactly: {e}")
        signals = {
            how: n for how in ("held", "merged") if (n := ring._get(f"counted_signals_{how}"))
        }
        if tid not in self.released and _writer_done(ring):
            ring.release_unused(drained=reader is not None)
        ring.close()
        stats = ThreadStats(
            pid=self.thread_pid[tid],
            records=records,
            lost=lost,
            gaps={GapReason(r).name.lower(): n for r, n in gaps.items()},
            signals=signals,
        )
        return stats, spilled

    def finish(self) -> dict[int, ThreadStats]:
        """Stop draining, take the last records (recovering past data_head), close."""
        self._done.set()
        self._release_asked.set()
        self._drop_spare()
        if self._drainer is not None:
            self._drainer.join()
        self._forget_not_opened()
        self._drain_once(final=True)
        with self.lock:
            spilled = self.retired_spilled
            closed = {}
            for tid, (ring, reader, fd) in self.rings.items():
                closed[tid], n = self._close_ring(tid, ring, reader, fd)
                spilled += n
            # in the order the threads started
            stats = {tid: self.retired.get(tid) or closed[tid] for tid in self.thread_pid}
            if spilled:
                self._error(
                    f"{spilled} blocks compiled after a thread's block table was full were "
                    "recorded through a slower path (a larger --buffer-size has a larger table)"
                )
            for tid, recorder in self.switches.items():
                stats[tid].switches = self._save_switches(tid, recorder)
        return stats

    def _save_switches(self, tid: int, recorder: SwitchRecorder) -> int:
        """Close thread `tid`'s context switch recorder and save what it took; how many."""
        recorder.close()
        switches = recorder.switches()
        try:
            np.save(self.tracedir.sched_path(tid), switches)
        except OSError as e:
            self.tracedir.sched_path(tid).unlink(missing_ok=True)
            self._error(f"thread {thread_label(tid)}: its context switches not saved: {e.strerror}")
            return 0
        if recorder.lost:
            self._error(f"thread {thread_label(tid)}: {recorder.lost} context switches lost")
        return int(switches.size)


class _ForkFollower:
    """--follow-fork: Frida holds each child a traced process forks before it runs (child
    gating); the child gets its own agent and rings, its thread is followed, then it runs.
    Its trace starts where fork() returns in the child."""

    def __init__(self, device: Any, rec: _Recording, watcher: ExitWatcher) -> None:
        self.device = device
        self.rec = rec
        self.watcher = watcher
        self.children: dict[int, tuple[Any, _Agent | None]] = {}  #: pid -> session, agent
        self.parents: dict[int, int] = {}
        self.ended: set[int] = set()
        self.replaced: set[int] = set()  #: children that called exec (Frida says so)
        #: the program image each process exec'ed (by key), as Frida reported it held
        self.exec_images: dict[int, str] = {}
        #: each process's current image, by pid: its key in the recording (thread_key),
        #: the pid itself until it calls exec, then "pid#2", ...
        self.image: dict[int, int] = {}
        self.exec_of: dict[int, int] = {}  #: the image each exec'ed one replaced, by key
        #: when each image was taken up (time.monotonic_ns()), by key: its pid may have been
        #: an earlier process's, whose exit the watcher knows too
        self.since: dict[int, int] = {}
        self.started: dict[int, int | None] = {}  #: its process's start time, by key
        #: children made by posix_spawn(), system(), popen(), by key: their program
        self.spawned: dict[int, str] = {}
        #: children whose session Frida dropped while they ran on, and why
        self.dropped: dict[int, str] = {}
        self._let_go_of: set[int] = set()  #: children we detach from ourselves
        self.untraced: dict[int, str] = {}  #: children Frida could not trace, and why
        #: children Frida reported, or held, only once the recording was stopping: let go
        #: untraced, by pid -> their parent
        self._too_late: dict[int, int] = {}
        self._gating: list[Any] = []  #: sessions holding their process's new children
        self._agents: dict[Any, _Agent] = {}  #: ours in the processes of those sessions
        self._watched: set[int] = set()  #: their processes
        self._reported: set[int] = set()  #: children Frida told us of
        self._held = StopClock()  #: see frozen
        self._listed_since: dict[int, float] = {}  #: children not reported to us yet
        #: each child listed so far, with its parent then and its start time: one whose parent
        #: ended since (a spawned program killed at the end) is looked for by that
        self._listed_with: dict[int, tuple[int, int | None]] = {}
        #: when child gating began in each watched process (clock ticks since boot)
        self._gated_since: dict[int, int] = {}
        #: the same as time.monotonic_ns(), the process events' clock (ExitWatcher)
        self._watched_since: dict[int, int] = {}
        #: when Frida dropped its session with a watched process that ran on: its children
        #: from then on are forked ungated, untraced by design
        self._gating_lost: dict[int, int] = {}
        #: children found frozen in Frida's recovery from their fork() and killed -> parent
        self.killed: dict[int, int] = {}
        #: those of them found stuck on a lock there rather than stopped (STUCK_AFTER)
        self.stuck: set[int] = set()
        #: since when each unreported child has been seen asleep in Frida's code
        self._waiting_since: dict[int, float] = {}
        #: forked children Frida reported that could not be traced -> (parent, when): looked
        #: at as unreported ones are (a child stuck in Frida's recovery times the agent's
        #: load out)
        self._failed_forks: dict[int, tuple[int, float]] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closing = False
        self._closing_lock = threading.Lock()
        # Loading an agent waits for messages that Frida's dispatch thread delivers, so
        # the children are handled on a thread of our own, never in the signal handler.
        self._worker = threading.Thread(target=self._run, name="bt-forks", daemon=True)
        self._worker.start()
        device.on("child-added", self._on_child_added)

    def _on_child_added(self, child: Any) -> None:
        self._reported.add(int(child.pid))
        with self._closing_lock:
            if not self._closing:
                self._queue.put(child)
                return
        # forked after the end: let it go untraced (not from Frida's own thread, whose
        # calls a resume waits for)
        if child.origin != "exec":  # a new image of a traced process is no new process
            self._too_late[int(child.pid)] = int(child.parent_pid)
        threading.Thread(target=self._let_go, args=(int(child.pid),), daemon=True).start()

    def _let_go(self, pid: int) -> None:
        with contextlib.suppress(Exception):
            _bounded(self.device.resume, pid)

    def watch(self, session: Any, pid: int, agent: _Agent | None = None) -> None:
        """Frida holds each child of process `pid` (of `session`, with our `agent`) before it
        runs, and the new image of the process when it calls exec."""
        if agent is not None:
            self._agents[session] = agent
        self.image.setdefault(pid, pid)
        self.started.setdefault(self.image[pid], _start_time(pid))
        self._gated_since.setdefault(pid, _ticks_now())
        self._watched_since.setdefault(pid, time.monotonic_ns())
        self.watcher.watch_children(pid)
        session.on("detached", lambda reason, _: self._on_gating_session_detached(pid, reason))
        session.enable_child_gating()
        self._gating.append(session)
        self._watched.add(pid)

    def _on_gating_session_detached(self, pid: int, reason: str) -> None:
        if reason not in ("process-terminated", "process-replaced"):  # an exec is re-watched
            self._gating_lost.setdefault(pid, time.monotonic_ns())

    def _run(self) -> None:
        while (child := self._queue.get()) is not None:
            self._trace(child)

    def _trace(self, child: Any) -> None:
        pid = int(child.pid)
        current = self._current(pid)
        if child.origin == "exec" and current is not None:
            self._trace_image(pid, child, current)
            return
        if child.origin in ("exec", "spawn") and current is None:
            parent = _parent_of(pid)
            if parent in self._watched and self._current(parent) is not None:
                # made by posix_spawn(), system() or popen() in a process of ours: it shares
                # its parent's memory until its exec, and comes to us as that exec
                self._trace_image(pid, child, None, parent)
                return
        if child.origin != "fork" or pid in self.killed:
            # an exec'ed or spawned image, not a fork of our program (a traced child that
            # calls exec is reported again, under its id); or a child given the pid of one
            # killed frozen, which its ending in meta.json keeps
            if child.origin == "fork":
                self.rec._error(
                    f"forked child {pid} of pid {child.parent_pid} is not traced: "
                    + _REUSED_ID.format(pid)
                )
            with contextlib.suppress(Exception):
                self.device.resume(pid)
            return
        # a child given the pid of an earlier process of the recording (pids wrap at
        # pid_max) is traced under a key of its own, "pid#2" (as an exec'ed image is): the
        # earlier one's trace and ending are kept
        with self.rec.lock:  # the key add_thread gives its first thread
            key = thread_key(pid, self.rec.ids_seen.get(pid, 0))
        self.parents[key] = int(child.parent_pid)
        self.image[pid] = key
        self._take_up(pid, key, f"forked child {thread_label(key)}")

    def _trace_image(
        self, pid: int, child: Any, old: int | None, parent: int | None = None
    ) -> None:
        """Process `pid` called exec: one of ours, whose image was `old`, or (`parent`) a
        child one of ours made with posix_spawn() (which runs no code of its own before).
        Frida holds the new image at its start, as a spawned program; it is traced from its
        _init (or main) as one, with its own agent and rings, under a key of its own
        ("pid#2" after an image of ours)."""
        with self.rec.lock:  # the key add_thread gives the image's first thread
            key = thread_key(pid, self.rec.ids_seen.get(pid, 0))
        self.image[pid] = key
        exe = _executable_of(pid) or str(child.path)
        if old is not None:
            self.exec_of[key] = old
            self.exec_images[old] = exe
            if old in self.parents:
                self.parents[key] = self.parents[old]
        else:
            self.spawned[key] = exe
            if parent is not None:
                self.parents[key] = parent
        self._take_up(pid, key, f"{Path(exe).name} (pid {pid}, from its exec)", Path(exe))

    def _current(self, pid: int) -> int | None:
        """The key of the image that process `pid` runs, if it is one of ours: not an
        earlier process of the recording that had the pid (a process keeps its start time
        through exec)."""
        key = self.image.get(pid)
        if key is None:
            return None
        started = self.started.get(key)
        return key if started is None or started == _start_time(pid) else None

    def _take_up(self, pid: int, key: int, what: str, image: Path | None = None) -> None:
        """Trace process `pid`, which Frida holds, under `key`, then let it run: a forked
        child from where fork() returns in it, or (`image`: the program it exec'ed) a new
        image from its start, as a spawned program.  A failure leaves it untraced, named
        as `what` in a warning."""
        before = set(_open_files(pid).values()) if image else None  # before Frida's own
        self.since[key] = time.monotonic_ns()
        self.started[key] = _start_time(pid)
        session = agent = None
        try:
            session = self.device.attach(pid)
            session.on("detached", lambda reason, crash: self._on_detached(key, reason))
            ring = self.rec.add_thread(pid, key)
            if image is None:  # it has its parent's Frida agent, whose fork() hook is in
                self.watch(session, pid)
                agent = self.rec.load_agent(
                    session, pid, False, None, park=False, forked_from=self.parents[key], key=key
                )
            else:
                agent = self.rec.load_agent(
                    session,
                    pid,
                    True,
                    ring,
                    park=True,
                    init=init_offset(image),
                    before=before,
                    key=key,
                )
                # only now, as for a spawned program: Frida's fork() hook comes after our
                # listener, which takes the fork turn ahead of it (docs/fork.md section 20)
                self.watch(session, pid)
            self._agents[session] = agent
            if image is None:
                _bounded(agent.script.exports_sync.follow_all, {str(pid): str(ring)}, False)
            # Not started yet, or still held inside the fork() that made it: no fork() of
            # its own is under way.  A forked child's threads take their fork turns too,
            # ahead of Frida's hook (bt_fork_first; docs/fork.md section 20).
            _bounded(agent.script.exports_sync.fork_done_last)
        except Exception as e:
            why = str(e) or type(e).__name__
            self.untraced[key] = why
            self.rec._error(f"{what} is not traced: {why}")
            if image is None:
                self._failed_forks[pid] = (self.parents[key], time.monotonic())
        finally:
            self.children[key] = (session, agent)
            with contextlib.suppress(Exception):
                self.device.resume(pid)

    def exec_traced(self, key: int) -> bool:
        """Whether the image that image `key` exec'ed is traced."""
        return self._superseded(key) and self._next_image(key) not in self.untraced

    def _next_image(self, key: int) -> int:
        return next(new for new, old in self.exec_of.items() if old == key)

    def _superseded(self, key: int) -> bool:
        """Whether the image `key` exec'ed another, which is traced under a key of its own."""
        return key in self.exec_of.values()

    def _status(self, key: int, timeout: float) -> int | None:
        """The wait status of the process of image `key`, once it has exited."""
        return self.watcher.status(thread_id(key), timeout, self.since.get(key, 0))

    def _ended(self, key: int) -> bool:
        """Whether the process of image `key` has exited (as far as is known now)."""
        return key in self.ended or self._status(key, 0) is not None

    def _on_detached(self, key: int, reason: str) -> None:
        _, agent = self.children.get(key, (None, None))
        if agent is not None:  # a child that started threads holds rings for more
            self.rec.take_back(agent)
        if reason == "process-replaced":
            self.replaced.add(key)
        ours = reason == "application-requested" and key in self._let_go_of
        lost = reason not in ("process-terminated", "process-replaced")
        if not ours and lost and not self._superseded(key) and _running(thread_id(key)):
            self.dropped[key] = reason
            self.rec.orphaned.add(key)  # its last records are read from the live rings
        self.ended.add(key)

    def frozen(self) -> list[int]:
        """The processes newly found frozen in Frida's recovery from a fork()
        (_ForkCounters.frozen), once each; no call to their agents is made from then on.

        Children in that state are killed: they never run again, and their parent may be
        waiting for them.  That includes a child Frida has not reported to us yet, found
        held stopped by Frida's injector for FROZEN_AFTER s: it faulted as Frida re-created
        its agent thread (the same kernel stack as a frozen program's).  Seen in 4 of 180
        recordings of a program forking every 2 ms, each time in one of the first children
        forked once child gating was on: before this, the program sat in waitpid() for the
        rest of the recording, and the child died of SIGSEGV as branchtrace exited."""
        found = []
        for agent in list(self._agents.values()):
            counters = agent.fork_counters
            if agent.key in self.ended:  # its pid may be another process's by now
                continue
            if not agent.stuck and counters is not None and counters.frozen():
                agent.stuck = agent.frozen = True
                found.append(agent.pid)
                if agent.key in self.parents:
                    self._kill(agent.pid, self.parents[agent.key])
        self._kill_frozen_unreported()
        return found

    def _kill_frozen_unreported(self, young_too: bool = False) -> bool:
        """Kills the children not reported to us that are frozen (frozen); True if another
        one is held stopped by Frida's injector, for less time so far.  Unless `young_too`,
        only a child listed for FROZEN_AFTER s already is looked at: Frida is busy with a
        young one, and while the recorder read young children's /proc files every 0.25 s the
        program itself froze in 9 of 128 recordings of a program forking every 2 ms, against
        1 in 120 without (docs/fork.md)."""
        now = time.monotonic()
        unreported = {}
        for parent in list(self._watched):
            if self._ended(self.image.get(parent, parent)):
                continue
            for kid in child_pids(parent):
                if kid not in self._reported and kid not in self.killed:
                    unreported[kid] = parent
        for kid, parent in unreported.items():
            self._listed_with.setdefault(kid, (parent, _start_time(kid)))
        orphans = {
            kid
            for kid in self._listed_since
            if kid not in unreported and _orphaned(kid, self._listed_with.get(kid))
        }
        self._listed_since = {
            kid: self._listed_since.get(kid, now) for kid in [*unreported, *orphans]
        }
        self._listed_with = {kid: self._listed_with[kid] for kid in self._listed_since}
        looked_at = {
            kid for kid in unreported if young_too or now - self._listed_since[kid] >= FROZEN_AFTER
        }
        self._held.keep(looked_at)
        failed = {
            kid: (parent, since)
            for kid, (parent, since) in self._failed_forks.items()
            if kid not in self.killed and _parent_of(kid) == parent
        }
        self._waiting_since = {
            kid: since
            for kid, since in self._waiting_since.items()
            if kid in looked_at or kid in failed
        }
        for kid, (parent, since) in failed.items():
            if self._stuck_for(kid, now, now - since < SPIN_CHECKS_FOR) >= STUCK_AFTER:
                self._kill(kid, parent)
                self.stuck.add(kid)
        held = False
        for kid in looked_at:
            parent = unreported[kid]
            held_for = self._held.held_for(kid)
            if held_for is not None and held_for >= FROZEN_AFTER:
                self._kill(kid, parent)
            elif held_for is not None:
                held = True
            elif (
                self._stuck_for(kid, now, now - self._listed_since[kid] < SPIN_CHECKS_FOR)
                >= STUCK_AFTER
            ):
                self._kill(kid, parent)
                self.stuck.add(kid)
        return held

    def _stuck_for(self, kid: int, now: float, spin_check: bool) -> float:
        """For how long `kid`, not reported by Frida (or not taken up), has been seen waiting
        in Frida's code (waits_in_frida), or, of one thread, on a lock of Frida's held by a
        thread it does not have (stuck_on: spinning on Frida's heap lock, most often), on
        end.  Seen: a child forked while another thread of its parent held a lock of
        Frida's, which Frida's recovery in the child waits on for good, and its parent waits
        for the child (docs/fork.md section 18)."""
        if not waits_in_frida(kid) and (not spin_check or stuck_on(kid) is None):
            self._waiting_since.pop(kid, None)
            return 0.0
        return now - self._waiting_since.setdefault(kid, now)

    def _never_reported(self, let_go: set[int]) -> dict[int, list[int]]:
        """The children of the watched processes, forked since child gating began there,
        that Frida has not told us of for FROZEN_AFTER s and that still run (not frozen, nor
        pending at the end, `let_go`), by parent.  Seen: a child of a program whose threads
        started while others forked, never reported, waiting in Frida's code with Frida's
        threads in it, and its parent waiting for it (docs/fork.md section 16)."""
        now = time.monotonic()
        known = self._reported | let_go | self.killed.keys()
        found: dict[int, list[int]] = {}
        for kid, since in self._listed_since.items():
            parent = _parent_of(kid)
            start = _start_time(kid)
            if _orphaned(kid, self._listed_with.get(kid)):
                parent = self._listed_with[kid][0]
            if (
                parent in self._watched
                and start is not None
                and start >= self._gated_since.get(parent, start + 1)
                and now - since >= FROZEN_AFTER
                and kid not in known
                and _running(kid)
            ):
                found.setdefault(parent, []).append(kid)
        return {parent: sorted(kids) for parent, kids in found.items()}

    def _ended_unreported(self, named: set[int], until: int) -> dict[int, list[tuple[int, int]]]:
        """The children that traced threads of the watched processes forked while child
        gating was on there (up to `until`, as time.monotonic_ns(), or until Frida dropped
        its session with the process) and that ended, without an exec, before Frida told us
        of them (and are not `named` already): (pid, wait status) by parent.  Seen: a child
        killed by SIGSEGV in a thread of Frida's as Frida recovered from its fork(), which
        the recording named nowhere (docs/fork.md section 19).  Forks by threads not traced
        are Frida's own: Gum stops a thread with a helper process (clone() without
        CLONE_THREAD), in a forked child too."""
        with self.rec.lock:
            traced = {(thread_id(pid), thread_id(key)) for key, pid in self.rec.thread_pid.items()}
        found: dict[int, list[tuple[int, int]]] = {}
        for parent in sorted(self._watched):
            since = self._watched_since.get(parent, 0)
            gated_until = min(until, self._gating_lost.get(parent, until))
            for kid, forker in self.watcher.forks(parent, since, gated_until):
                if (parent, forker) not in traced:
                    continue
                if kid in self._reported or kid in self.killed or kid in named:
                    continue
                status = self.watcher.status(kid, 0.0, since)
                if status is not None and not self.watcher.execed(kid, since):
                    found.setdefault(parent, []).append((kid, status))
        return found

    def held_up(self) -> bool:
        """Whether a process frozen in Frida's recovery from a fork() is left so (the attached
        program): Frida's host then answers no call (enumerate_pending_children: no answer
        within 10 s, twice; frida.shutdown: none within 2 s)."""
        return any(a.frozen and a.pid not in self.killed for a in self._agents.values())

    def _kill(self, pid: int, parent: int) -> None:
        kill_held(pid)
        self.killed[pid] = parent

    def running(self) -> list[int]:
        """The keys of the images still running (a child's, or an exec'ed one's)."""
        return [
            key
            for key in self.children
            if key not in self.ended and not self._superseded(key) and self._status(key, 0) is None
        ]

    def wait(self, stop: threading.Event, deadline: float | None) -> None:
        """Until every traced child has ended, or the recording is stopped.  A child frozen
        meanwhile is killed (frozen)."""
        next_check = 0.0
        while self.running() and not stop.is_set():
            now = time.monotonic()
            if deadline is not None and now > deadline:
                break
            if now > next_check:
                self.frozen()
                next_check = now + FORK_CHECK_INTERVAL
            stop.wait(0.01)

    def close(self) -> dict[int, dict[str, Any]]:
        """Stop following; detach from the children still running.  Each child's ending."""
        # Children reported from here on are let go untraced; those reported before are
        # traced first.  Only then is gating turned off: Frida lets the children it holds go
        # at that (one would run untraced before we follow it).
        with self._closing_lock:
            self._closing = True
            self._queue.put(None)
        self._worker.join()
        # the children forked from here on are reported too late, or forked untraced
        # once gating is off
        gating_ends = time.monotonic_ns()
        for session in self._gating:
            # as at the attach: a fork() under way as Frida removes its fork() hook gets its
            # preparation without its recovery, and the program hangs, then dies in Frida
            agent = self._agents.get(session)
            if self.held_up() or (agent is not None and agent.stuck):  # no answer would come
                continue
            with contextlib.suppress(Exception):
                if agent is not None:
                    _hold_forks_quietly(agent)
                    # Its threads are let go before Frida's hooks go (the recording of the
                    # process ends here), each out of Stalker at the next hooked function
                    # it reaches (unfollowAll in stalker_agent.js): one still running code
                    # Stalker compiled with a hook in place either went on into the removed
                    # hook, or had Stalker recompile the block into a larger one, which
                    # Frida 17 does wrong when the block has callouts; either way the
                    # program died (docs/fork.md, section 8).  Only now that forks wait: a
                    # call's answer on its way as the program forks kills the child.  The
                    # agent's stop() comes later, after the message that lets them go.
                    _bounded(agent.script.exports_sync.unfollow)
                _bounded(session.disable_child_gating)
            if agent is not None and not agent.stuck:
                _release_forks(agent)
        # a child forked as gating went off may be held without ever being reported to us;
        # left so, it and the parent waiting for it would hang
        let_go: set[int] = set()
        with contextlib.suppress(Exception):
            for child in [] if self.held_up() else _bounded(self.device.enumerate_pending_children):
                if int(child.parent_pid) in self._watched:
                    let_go.add(int(child.pid))
                    if child.origin != "exec":
                        self._too_late[int(child.pid)] = int(child.parent_pid)
                    self._let_go(int(child.pid))
        self.device.off("child-added", self._on_child_added)
        # a child that froze shortly before the end, as late as gating going off, is told
        # apart from one Frida holds for a moment only by waiting
        deadline = time.monotonic() + FROZEN_AFTER + 0.5
        while self._kill_frozen_unreported(young_too=True) and time.monotonic() < deadline:
            time.sleep(0.05)
        never_reported = self._never_reported(let_go)
        running = set(self.running())
        # each may take DETACH_PATIENCE s (_detached)
        detaching = [threading.Thread(target=self._detach, args=(pid,)) for pid in running]
        for thread in detaching:
            thread.start()
        for thread in detaching:
            thread.join()
        processes: dict[int, dict[str, Any]] = {}
        for pid, parent in self.killed.items():
            if pid in self.stuck:
                reported = pid in self._reported
                self.rec._error(_stuck_child_warning(pid, parent, reported))
                if pid not in self.children:  # never taken up: no ending of its own below
                    processes[pid] = {"ppid": parent, "untraced": "stuck before Frida reported it"}
                continue
            self.rec._error(
                _frozen(
                    f"forked child {pid} of pid {parent}",
                    f"{_FROZEN_KILLED}, so that its parent could go on",
                    traced=pid in self.children,
                )
            )
            if pid not in self.children:  # never reported to us
                processes[pid] = {"ppid": parent, "untraced": "frozen before Frida reported it"}
        for parent, kids in never_reported.items():
            self.rec._error(_never_reported_warning(parent, kids))
            for pid in kids:
                processes[pid] = {"ppid": parent, "untraced": "never reported by Frida"}
        # the fork() is in the parent's trace (a GAP); the child must be in the recording too
        too_late: dict[int, list[int]] = {}
        for pid, parent in sorted(self._too_late.items()):
            if pid not in processes:
                processes[pid] = {"ppid": parent, "untraced": "forked as the recording stopped"}
                too_late.setdefault(parent, []).append(pid)
        for parent, kids in too_late.items():
            self.rec._error(_too_late_warning(parent, kids))
        for parent, ended in self._ended_unreported(set(processes), gating_ends).items():
            self.rec._error(_ended_unreported_warning(parent, ended))
            for pid, wait_status in ended:
                code, signum = describe(wait_status)
                # named in that warning: whether its own code or Frida's ran is not known
                processes[pid] = {
                    "ppid": parent,
                    "untraced": "ended before Frida reported it",
                    "ended_unreported": True,
                    "exit_code": code,
                    "signal": signum,
                }
        # one wait for them all: a status not in by then will not come (a pid namespace of
        # its own gets no process events: 2 s for each child)
        statuses_due = time.monotonic() + 2
        for key in self.children:
            pid = thread_id(key)
            ending: dict[str, Any] = {"ppid": self.parents.get(key)}
            if key in self.exec_of:
                ending["execd_by"] = thread_label(self.exec_of[key])
                ending["executable"] = self.exec_images.get(self.exec_of[key])
            if key in self.spawned:  # a child that ran no code of the parent's
                ending["spawned"] = True
                ending["executable"] = self.spawned[key]
            if key in self.untraced:
                ending["untraced"] = self.untraced[key]
            if key in self.dropped:
                self.rec._error(_dropped_warning(f"forked child {pid}", self.dropped[key]))
                ending["dropped"] = self.dropped[key]
            superseded = self._superseded(key)
            if key in running or key in self.dropped:
                ending["detached"] = True
            elif not superseded:
                status = self._status(key, max(0.0, statuses_due - time.monotonic()))
                if status is not None:
                    ending["exit_code"], ending["signal"] = describe(status)
            # the execs of its process from its take-up on: an image traced as exec'ed or
            # spawned has them as images of their own (a spawned child's is the one that
            # made it)
            first_execd = (
                key not in self.exec_of
                and key not in self.spawned
                and self.watcher.execed(pid, self.since.get(key, 0))
            )
            if superseded or key in self.replaced or first_execd:
                ending["exec"] = True  # its trace ends at its exec
                if key in self.exec_images:
                    ending["exec_image"] = self.exec_images[key]
                if self.exec_traced(key):
                    ending["exec_traced"] = thread_label(self._next_image(key))
            processes[key] = ending
        execd = [
            key
            for key, ending in processes.items()
            if ending.get("exec") and not ending.get("exec_traced") and key in self.parents
        ]
        if execd:
            self.rec._error(_children_exec_warning(execd, processes))
        for pid in self.killed:
            key = self.image.get(pid, pid)  # killed in the image it ran then
            entry = processes[key if key in processes else pid]
            entry["stuck" if pid in self.stuck else "frozen"] = True
            entry.setdefault("signal", signal.SIGKILL.value)
        return processes

    def _detach(self, key: int) -> None:
        session, agent = self.children[key]
        self._let_go_of.add(key)
        what = f"forked child {thread_label(key)}"
        try:
            asleep: list[int] = []
            if agent is not None:
                try:
                    stopped = _stop_agent(agent)
                except AgentTimeoutError:
                    self.rec._error(_stuck_agent(what, agent))
                    return
                asleep = _let_go_asleep(thread_id(key), agent, stopped.get("asleep", []))
            if not _detached(session, patient=agent is not None and not asleep):
                self.rec._error(_unloading_later(what, asleep))
            elif left := _rings_left_behind(thread_id(key), self.rec.tracedir.path):
                self.rec._error(_rings_left_warning(what, left))
        except Exception:
            pass  # it ended meanwhile


#: an attached program was left frozen in Frida's recovery from a fork() (_ForkCounters)
_frida_held_up = threading.Event()
#: an agent did not unload within its detach, or did not answer: it may stay for long
_agent_left_loaded = threading.Event()


def _close_frida() -> None:
    """At exit.  Frida frees what it injected into a process once its agent has left, after
    the detach: through ptrace it has a thread of the process call munmap() with 0x320 for a
    return address, and catches the thread there.  Should the host exit meanwhile, the
    thread returns to 0x320 and the program dies of SIGSEGV after the recording ended (2
    attaches in about 540 to `slowfork 50 60`).  Closing Frida's device manager waits
    for that -- bounded, because it also waits for an agent that unloads only once its
    threads run again; when no agent is known to stay, as long as a detach may take (the
    agent of a program asleep in a system call was still unloading 2 s after the tool
    exited, once in a run of the test suite)."""
    if not _frida_held_up.is_set():  # else no answer would come (_ForkFollower.close)
        wait = DETACH_WAIT if _agent_left_loaded.is_set() else DETACH_PATIENCE
        with contextlib.suppress(Exception):
            _bounded(frida.shutdown, timeout=wait)
    remove_daemon_copies()


class StalkerEngine:
    name = "stalker"
    _closes_frida_at_exit = False

    def record(
        self,
        target: Target,
        options: RecordOptions,
        events: Events,
        stop: threading.Event,
        let_go: threading.Event | None = None,
    ) -> RecordResult:
        """`let_go`, set before `stop`: a spawned program is detached from and runs on
        (with its children), where a stop ends it otherwise (as perf record does)."""
        if not StalkerEngine._closes_frida_at_exit:
            atexit.register(_close_frida)
            StalkerEngine._closes_frida_at_exit = True
        size = 1 << (options.buffer_size.bit_length() - 1) if options.buffer_size > 0 else 0
        if size < MIN_BUFFER:
            raise InvalidArgumentError(
                f"buffer size {options.buffer_size} is too small for the stalker engine",
                hint=f"use at least {MIN_BUFFER // 1024}K",
            )
        options = dataclasses.replace(options, buffer_size=size)
        program = resolve_program(target.argv[0]) if target.argv else None
        if target.pid is not None:
            _check_attachable(target.pid)
        _check_frida_can_run_in(program or Path(f"/proc/{target.pid}/exe"), target)
        tracedir = TraceDir.create(options.output)
        rec = _Recording(tracedir, options)
        meta = start_meta(self.name, options, target.argv, str(program) if program else None)
        started = False
        try:
            if program is not None:
                let_go = let_go or threading.Event()
                result = self._spawn(program, target.argv, rec, meta, events, stop, let_go, options)
            else:
                assert target.pid is not None
                # before the attach: a process not our child tells how it ended only there
                with ExitWatcher() as watcher:
                    result = self._attach(target.pid, rec, meta, events, stop, options, watcher)
            started = True
        finally:
            if not started:
                # nothing half-written is left behind a start that failed, but what a
                # program wrote before a failure later on is its trace: `info` recovers it
                traced = rec.traced_anything()
                with contextlib.suppress(Exception):
                    rec.finish()
                if not traced:
                    tracedir.remove()
        rec.read_notes()
        result.warnings += rec.errors
        result.warnings += _children_faulted_before_their_code(tracedir, result, rec.frida_faults)
        result.warnings += _deaths_in_fridas_code(result, rec.frida_faults, rec.untraced_threads)
        result.snapshots = list(rec.snapshots)
        untraced: dict[str, int] = {}
        for stats in result.threads.values():
            for reason, n in stats.gaps.items():
                untraced[reason] = untraced.get(reason, 0) + n
        if untraced.get("signal"):
            left = untraced.get("left_handler", 0)
            runs = untraced["signal"]
            result.warnings.append(
                f"signal handlers ran {'once' if runs == 1 else f'{runs} times'} untraced "
                "(the signal came inside Stalker's lookups or Frida's own code, or the handler "
                "returns through a restorer not libc's); GAP records mark where"
                + (
                    f"; {left} left elsewhere (siglongjmp, or a pc moved), traced again from there"
                    if left
                    else ""
                )
            )
        if rec.handlers_off_trace:
            runs = sum(rec.handlers_off_trace.values())
            result.warnings.append(
                f"signal handlers ran {'once' if runs == 1 else f'{runs:,} times'} on threads "
                "outside the trace (Frida's own, mostly: the kernel gives a signal sent to the "
                "process to any thread not blocking it)"
            )
        if rec.traced_from == "main" and rec.init is not None:
            result.warnings.append(
                "the trace starts at main: the executable's _init and constructors had run "
                "already when the agent was loaded"
            )
        result.untraced = len(rec.untraced_threads) - rec.threads_at_no_module
        finish_meta(meta, result, rec.untraced_threads)
        meta["inline_cache"] = rec.inline_cache
        meta["gum_reader"] = rec.gum_reader
        meta["gum_reader_scans"] = rec.gum_reader_scans
        meta["traced_from"] = rec.traced_from
        meta["fork_heap_locks"] = rec.fork_heap_locks
        meta["fork_signal_lock"] = rec.fork_signal_lock
        meta["injector_guard"] = rec.injector_guard
        meta["loader_sealed"] = rec.loader_sealed
        meta["handlers_off_trace"] = sum(rec.handlers_off_trace.values())
        meta["frida_faults"] = rec.frida_faults
        meta["contexts_renewed"] = rec.contexts_renewed
        tracedir.write_meta(meta)
        return result

    # -- spawn -------------------------------------------------------------------------------

    def _spawn(
        self,
        program: Path,
        argv: tuple[str, ...],
        rec: _Recording,
        meta: dict[str, Any],
        events: Events,
        stop: threading.Event,
        let_go: threading.Event,
        options: RecordOptions,
    ) -> RecordResult:
        init = init_offset(program)
        device = frida.get_local_device()
        try:
            pid = device.spawn([str(program), *argv[1:]])
        except frida.InvalidArgumentError as e:
            raise LaunchError(f"{argv[0]}: cannot start: {e}") from None
        except Exception as e:
            raise _frida_error(e, argv[0]) from None
        with contextlib.suppress(OSError):  # gone already: attaching says so
            resource.prlimit(pid, resource.RLIMIT_NOFILE, USERS_FILE_LIMIT)
        meta["pid"] = pid
        rec.tracedir.write_meta(meta)
        try:
            inherited = set(_open_files(pid).values())
            session = device.attach(pid)
            main_ring = rec.add_thread(pid, pid)
            agent = rec.load_agent(
                session,
                pid,
                True,
                main_ring,
                park=options.follow_fork,
                init=init,
                before=inherited,
            )
        except BaseException as e:
            with contextlib.suppress(Exception):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            if isinstance(e, frida.InvalidArgumentError | frida.TransportError):
                raise EngineUnavailableError(f"the agent failed to load: {e}") from None
            if isinstance(e, Exception) and not isinstance(e, BranchtraceError):
                raise _frida_error(e, argv[0]) from None
            raise
        replaced = threading.Event()
        dropped: list[str] = []  #: why Frida ended the session while the program ran on

        def on_detached(reason: str, crash: object) -> None:
            if reason == "process-replaced":
                replaced.set()
            elif reason != "process-terminated" and _running(pid):
                dropped.append(reason)

        session.on("detached", on_detached)
        start = "main" if init is None else "_init (before its constructors and main)"
        events.started(
            f"recording {argv[0]} (pid {pid}) from {start} with {_how(options)}; Ctrl-C to stop"
        )
        rec.start_draining()
        exited, status = _watch_child(pid)
        watcher = ExitWatcher()
        forks = None
        if options.follow_fork:
            forks = _ForkFollower(device, rec, watcher)
            forks.watch(session, pid, agent)
            # not started yet, so no fork() is under way (_forks_held says why)
            _bounded(agent.script.exports_sync.fork_done_last)
        deadline = None if options.duration is None else time.monotonic() + options.duration
        watcher.watch_children(pid)
        device.resume(pid)
        ending = self._wait_child(
            pid,
            stop,
            let_go,
            deadline,
            exited,
            status,
            lambda: forks is not None and pid in forks.frozen(),
        )
        # what forks from here on may be Frida's injector detaching (let go), not the program
        traced_until = time.monotonic_ns()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        result = RecordResult(options.output, pid)
        if dropped:
            rec.orphaned.add(pid)
            result.warnings.append(_dropped_warning(f"{argv[0]} (pid {pid})", dropped[0]))
        if ending == "killed":
            rec.orphaned.add(pid)  # its rings were never closed
            result.warnings.append(_frozen(f"{argv[0]} (pid {pid})", _FROZEN_KILLED))
        under_frida = None
        if ending == "let go":
            # its children forked from here on, untraced, may hang on Frida's locks
            # while the agent unloads (ForksUnderFrida), as after an attach
            under_frida = ForksUnderFrida(pid)
            under_frida.attached(follow_new=False)
        if forks is not None:
            forks.wait(stop, deadline)
            result.processes = forks.close()
        if under_frida is not None:
            under_frida.detaching()
            agent_stays = False
            if not (dropped or replaced.is_set() or exited.is_set()):
                with contextlib.suppress(Exception):  # it ended meanwhile: as if not let go
                    guard = _StopGuard(pid, rec)
                    agent_stays = _stop_and_detach(pid, agent, session, rec, result, guard)
            elif replaced.is_set() and forks is not None:  # its exec'ed image was let go
                image = result.processes.get(forks.image.get(pid, pid), {})
                result.detached = bool(image.get("detached"))
            at_risk = under_frida.settle(timeout=0.2 if agent_stays or agent.frozen else 2.0)
            result.warnings += _forks_under_frida_warnings(pid, under_frida, at_risk)
        if not result.detached:
            with contextlib.suppress(Exception):
                _detached(session)
        result.threads = rec.finish()
        # the watcher reads the exec event before the exit event (one socket, in order):
        # once it has the exit status it knows of any exec
        running = result.detached and not exited.is_set()
        wait_status = watcher.status(pid, timeout=2) if watcher.available and not running else None
        if forks is None:
            children = watcher.children(pid, until=traced_until)
            result.warnings += _untraced_children(argv[0], children, watcher.names)
        watcher.close()
        if replaced.is_set() or pid in watcher.execs:
            result.execd = True
            if forks is None or not forks.exec_traced(pid):
                hint = "--follow-fork traces it too" if forks is None else None
                result.warnings.append(_exec_warning(argv[0], *([hint] if hint else [])))
        if wait_status is not None:
            result.exit_code, result.signal = describe(wait_status)
        elif status:  # without root: waitid, when it won the race against Frida's reaper
            if status[0].si_code == os.CLD_EXITED:
                result.exit_code = status[0].si_status
            else:
                result.signal = status[0].si_status
        elif not running:
            result.warnings.append("the program's exit status could not be observed")
        return result

    @staticmethod
    def _wait_child(
        pid: int,
        stop: threading.Event,
        let_go: threading.Event,
        deadline: float | None,
        exited: threading.Event,
        status: list[os.waitid_result],
        frozen: Callable[[], bool],
    ) -> str:
        """Until the spawned program `pid` has ended ("ended"), or is to be let go of,
        running ("let go": `let_go` and `stop`); "killed" if it froze in Frida's recovery
        from a fork() (_ForkCounters.frozen) and was killed for it: it would never have run
        again, and would have died of SIGSEGV as branchtrace exits."""
        interrupted_at = None
        next_check = 0.0
        while not exited.wait(0.005):
            now = time.monotonic()
            if now > next_check:
                next_check = now + FORK_CHECK_INTERVAL
                if frozen():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    exited.wait(5)
                    return "killed"
            if interrupted_at is None and stop.is_set() and let_go.is_set():
                return "let go"
            if interrupted_at is None and (stop.is_set() or (deadline and now > deadline)):
                # like perf record: stopping the recording of a spawned program ends it
                interrupted_at = now
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
            elif interrupted_at is not None and now - interrupted_at > 3:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return "ended"

    # -- attach ------------------------------------------------------------------------------

    def _attach(
        self,
        pid: int,
        rec: _Recording,
        meta: dict[str, Any],
        events: Events,
        stop: threading.Event,
        options: RecordOptions,
        watcher: ExitWatcher,
    ) -> RecordResult:
        meta["pid"] = pid
        try:
            meta["executable"] = os.readlink(f"/proc/{pid}/exe")
            meta["argv"] = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .decode(errors="replace")
                .rstrip("\0")
                .split("\0")
            )
        except OSError:
            pass
        rec.tracedir.write_meta(meta)
        watcher.watch_children(pid)
        under_frida = ForksUnderFrida(pid)
        gone = threading.Event()
        why_gone: list[str] = []

        def on_detached(reason: str, crash: object) -> None:
            why_gone.append(reason)
            gone.set()

        guard = _StopGuard(pid, rec)
        try:
            device = frida.get_local_device()
            own = set(_open_files(pid).values())
            hold = MainThreadHold.take(pid)
            try:
                session = device.attach(pid)
            finally:
                meta["main_thread_held"] = None if hold is None else hold.release()
            if meta["main_thread_held"] is False:
                rec._error(
                    f"the main thread of pid {pid} had not left the recorder's stub 2 s after "
                    "Frida attached (stopped?); it gets its registers back when it runs"
                )
            # the stub's page goes with the agent, once the thread has left it
            hold_page = (hold.base, hold.size) if hold and meta["main_thread_held"] else None
            # at once: a session dropped while the agent loads is reported with its reason
            session.on("detached", on_detached)
            agent = rec.load_agent(
                session,
                pid,
                False,
                None,
                park=options.follow_fork,
                before=own,
                hold_page=hold_page,
            )
            guard.on()  # not while Frida's injector has the process stopped
            tids = agent.script.exports_sync.threads(_tasks(pid))
            paths = {str(tid): str(rec.add_thread(tid, pid)) for tid in tids}
        except Exception as e:
            guard.off()
            _settle_forks(pid, under_frida, events)
            if isinstance(e, BranchtraceError):
                raise
            if why_gone:
                raise EngineUnavailableError(
                    f"Frida dropped its session with pid {pid} as the agent loaded ({why_gone[0]})",
                    hint="try again",
                ) from None
            raise _frida_error(e, f"pid {pid}") from None
        rec.start_draining()
        forks = None
        try:
            gating: Callable[[], None] | None = None
            if options.follow_fork:
                follower = forks = _ForkFollower(device, rec, watcher)

                def hold_children() -> None:
                    # from here on Frida holds each child forked: not ours to free
                    under_frida.attached(follow_new=False)
                    # and the new image of the program when it calls exec
                    follower.watch(session, pid, agent)

                gating = hold_children
            with _forks_held(agent, tids, gating):
                untraced = agent.script.exports_sync.follow_all(paths, True)
            guard.off()
            for tid, why in untraced.items():
                rec.untraced_threads.append({"pid": pid, "tid": int(tid), "start": why})
                rec._error(f"thread {tid} of pid {pid} is not traced: {why}")
            if forks is None:
                under_frida.attached(follow_new=True)
        except frida.InvalidOperationError as e:  # "script has been destroyed"
            guard.off()
            # Frida dropped the session as tracing started, as it could later on (README,
            # fork): a program that runs on keeps what was traced, as after a later drop
            if not (gone.wait(1) and _running(pid)):
                if forks is not None:
                    forks.close()
                _settle_forks(pid, under_frida, events)
                raise EngineUnavailableError(
                    f"the agent in pid {pid} went away while tracing started "
                    f"({why_gone[0] if why_gone else e})",
                    hint="try again",
                ) from None
        except AgentTimeoutError:  # seen once: Frida's ptrace helper stuck reading registers
            guard.off()
            if forks is not None:
                forks.close()
            _settle_forks(pid, under_frida, events)
            raise EngineUnavailableError(
                f"the agent in pid {pid} did not answer within {AGENT_TIMEOUT:.0f} s as tracing "
                "started; the process may be left stuck",
                hint="try again",
            ) from None
        # Frida's injector forks helpers off the program as it attaches and detaches: only
        # the program's own children, forked in between, are named untraced
        traced_since = time.monotonic_ns()
        cpu_since = {tid: _user_ticks(pid, tid) for tid in tids}
        if not gone.is_set():
            # once the threads are followed: from this line on, what the program does is traced
            threads = f"{len(tids)} thread{'s' if len(tids) != 1 else ''}"
            events.started(
                f"recording pid {pid} ({threads}) with {_how(options)}; Ctrl-C to stop and detach"
            )
        deadline = None if options.duration is None else time.monotonic() + options.duration
        next_check = 0.0
        while not stop.is_set() and not (gone.is_set() and not _image_traced(forks, pid, why_gone)):
            now = time.monotonic()
            if deadline is not None and now > deadline:
                break
            if gone.is_set() and watcher.status(pid, timeout=0) is not None:
                break  # the program it exec'ed has ended
            if now > next_check:
                under_frida.free_stuck()
                if forks is not None and pid in forks.frozen():
                    break  # it never runs again (_stuck_agent says so)
                next_check = now + FORK_CHECK_INTERVAL
            stop.wait(0.01)
        traced_until = time.monotonic_ns()
        cpu_used = {tid: _user_ticks(pid, tid) - cpu_since[tid] for tid in tids}
        result = RecordResult(options.output, pid)
        if forks is not None:
            result.processes = forks.close()
            if forks.held_up():
                _frida_held_up.set()
        under_frida.detaching()
        agent_stays = False  #: Frida unloads its agent only later (_detached)
        if gone.is_set():  # before the end, or while the children were wound up
            traced = forks is not None and forks.exec_traced(pid)
            self._attached_gone(pid, why_gone[0], rec, result, watcher, traced)
        else:
            try:
                agent_stays = _stop_and_detach(pid, agent, session, rec, result, guard)
            except Exception as e:
                if gone.wait(1):  # dropped while we stopped it
                    self._attached_gone(pid, why_gone[0], rec, result, watcher)
                else:
                    result.warnings.append(f"detaching failed: {e}")
                    rec.orphaned.add(pid)
        # children are watched until the agent has left, unless it stays on for now
        # an agent that stays, or cannot leave a frozen program, is not waited for
        at_risk = under_frida.settle(timeout=0.2 if agent_stays or agent.frozen else 2.0)
        result.warnings += _forks_under_frida_warnings(pid, under_frida, at_risk)
        if forks is None:
            children = watcher.children(pid, traced_since, traced_until)
            result.warnings += _untraced_children(f"pid {pid}", children, watcher.names)
        result.threads = rec.finish()
        named = {entry["tid"] for entry in rec.untraced_threads if entry["pid"] == pid}
        for tid in _ran_untraced(cpu_used, result.threads, named):
            stats = result.threads[tid]
            rec._error(
                f"thread {tid} of pid {pid} used {cpu_used[tid] * 1000 // _TICKS_PER_S} ms of "
                "CPU in its own code while recorded, but its trace holds "
                f"{stats.records - sum(stats.gaps.values())} records besides its signal "
                "handlers' GAPs: Stalker did not take it over, or lost it at once (Frida's "
                "reach into a thread can lose to a signal of the program's, which the "
                "recorder warns of when it sees the process stopped); that code ran untraced"
            )
        return result

    @staticmethod
    def _attached_gone(
        pid: int,
        reason: str,
        rec: _Recording,
        result: RecordResult,
        watcher: ExitWatcher,
        exec_traced: bool = False,
    ) -> None:
        """The session with attached process `pid` ended before the recording did
        (`exec_traced`: by an exec whose new image was traced on, with --follow-fork)."""
        # a process that dumps core, or lets go of its memory, is still there when Frida
        # reports it gone: one that overflowed its 8 MiB stack read as running on
        ending = _ending(pid)
        running = _running(pid) and not ending
        # the watcher reads an exec event before the exit event: once it has the exit
        # status, it knows of any exec
        status = None if running else watcher.status(pid, ENDING_WAIT if ending else 2)
        called_exec = reason == "process-replaced" or pid in watcher.execs
        if called_exec:
            result.execd = True
            if not exec_traced:
                result.warnings.append(_exec_warning(f"pid {pid}", "--follow-fork traces it too"))
        if status is not None:
            result.exit_code, result.signal = describe(status)
        elif running:
            rec.orphaned.add(pid)
            result.detached = True
            if not called_exec:
                result.warnings.append(_dropped_warning(f"pid {pid}", reason))
        else:
            result.warnings.append(f"pid {pid} ended; its exit status could not be observed")


#: signals a process raises itself, by faulting
_FAULTS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGTRAP}
#: a thread with more records than this ran blocks: the others (TIME, GAP, LOST) come one
#: per ring chunk of blocks, or per interruption of the code
_FEW_RECORDS = 64


def _children_faulted_before_their_code(
    tracedir: TraceDir, result: RecordResult, frida_faults: list[dict[str, Any]]
) -> list[str]:
    """Forked children that died of a fault signal before one block of their own code ran
    traced.  Their trace starts where fork() returns, and a block is recorded as it starts,
    so no code of theirs faulted: Frida's did, taking them over.  Marked `"no_code_traced"`
    in `processes` and named, so that the crash is not taken for the program's; where the
    child's agent noted the fault (`frida_faults`: _deaths_in_fridas_code), with its
    instruction."""
    warnings = []
    for pid, ending in result.processes.items():
        signum = ending.get("signal")
        if not isinstance(signum, int) or signum not in _FAULTS:
            continue
        if "untraced" in ending or ending.get("frozen"):
            continue
        threads = [(tid, stats) for tid, stats in result.threads.items() if stats.pid == pid]
        if not threads or any(
            stats.records > _FEW_RECORDS or _ran_blocks(tracedir, tid) for tid, stats in threads
        ):
            continue
        ending["no_code_traced"] = True
        noted = [f for f in frida_faults if f["pid"] == thread_id(pid) and f["signal"] == signum]
        at = (
            f" at {noted[0]['pc']} (an instruction of Frida's agent, in thread "
            f"{noted[0]['tid']}, touching {noted[0]['address']})"
            if noted
            else ""
        )
        warnings.append(
            f"forked child {pid} was killed by {signal.Signals(signum).name}{at} before one "
            "block of its own code ran (its trace holds none), so not by a fault in the "
            "program's code: it died while Frida took it over after fork() (a Frida bug, met "
            "in 2 of 32 recordings of a program forking 400 times, 2 ms apart, under "
            "--follow-fork here), unless that signal was sent to it"
        )
    return warnings


#: how a warning names a thread of Frida's (its agent's), not the program's
FRIDAS_OWN_THREAD = "one of Frida's own threads"


def _deaths_in_fridas_code(
    result: RecordResult, faults: list[dict[str, Any]], untraced: list[dict[str, Any]]
) -> list[str]:
    """Processes that died of a fault whose instruction was in Frida's agent, as the agent
    noted just before (note_frida_fault in stalker_agent.c): no FAULT record names a site
    of the program's then, and the summary alone would read as the program's crash.  A
    child so named is marked `"died_in_frida"` in `processes`.  A thread neither traced nor
    among the `untraced` program threads is one of Frida's own: neither Stalker's need for
    memory nor the program's pointers reach it there."""
    warnings = []
    named: set[int] = set()
    programs_threads = {int(t["tid"]) for t in untraced} | set(result.threads)
    for fault in faults:
        pid, signum = int(fault["pid"]), int(fault["signal"])
        if pid in named:
            continue  # another of its threads noted the same death
        if pid == result.pid and result.signal == signum:
            what = "the program"
        else:
            endings = [e for key, e in result.processes.items() if thread_id(key) == pid]
            if not endings or endings[-1].get("signal") != signum:
                continue
            if endings[-1].get("no_code_traced"):
                continue  # named with its instruction (_children_faulted_before_their_code)
            endings[-1]["died_in_frida"] = True
            what = f"forked child {pid}"
        named.add(pid)
        tid = int(fault["tid"])
        touching = (
            f" (touching {fault['address']})" if signum in (signal.SIGSEGV, signal.SIGBUS) else ""
        )
        if tid in programs_threads:
            why = (
                f"in thread {tid}, an instruction of Frida's agent, not of the program's code"
                f"{touching}: Frida failed there, as Stalker does when it finds no memory for "
                "a thread's code (README, \"Stalker's limit\"), unless the program handed one "
                "of Frida's hooks a bad pointer"
            )
        else:
            why = (
                f"in thread {tid}, {FRIDAS_OWN_THREAD} (not one of the program's), an "
                f"instruction of Frida's agent{touching}: a bug of Frida's, which no code of "
                "the program's ran into; the trace up to there is kept"
            )
        warnings.append(
            f"{what} was killed by {signal.Signals(signum).name} at {fault['pc']} {why}"
        )
    return warnings


def _user_ticks(pid: int, tid: int) -> int:
    """The user-mode CPU time thread `tid` of `pid` has used, in clock ticks (0: gone)."""
    try:
        text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return 0
    return int(text[text.rindex(")") + 2 :].split()[11])  # utime, field 14


#: user CPU time (clock ticks: 10 ms on Linux) that a thread which recorded next to nothing
#: must have used meanwhile to be named: it ran code of its own, which a followed thread
#: records
_UNTRACED_TICKS = 3
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _ran_untraced(
    cpu_used: dict[int, int], threads: dict[int, ThreadStats], named: set[int]
) -> list[int]:
    """The threads attached to that used user CPU time while recorded (`cpu_used`, in
    ticks) but recorded hardly anything besides GAP records, other than those already
    `named` untraced: Stalker never took them over, or lost them at once.  In user mode a
    thread runs code, which it records once followed (a millisecond of it thousands of
    blocks); a thread asleep in a system call throughout records nothing and uses none.
    The GAP records are its signal handlers' runs, which their entry hooks mark (25,351 in
    one second of `handshake`, whose main thread had compiled 2 blocks and then ran on
    natively after Frida's reach into it met a signal of the program's).  Not with
    `--follow-fork`'s children, which are not attached to."""
    return [
        tid
        for tid, used in sorted(cpu_used.items())
        if used >= _UNTRACED_TICKS
        and tid not in named
        and (stats := threads.get(tid)) is not None
        and stats.records - sum(stats.gaps.values()) <= _FEW_RECORDS
    ]


def _ran_blocks(tracedir: TraceDir, tid: int) -> bool:
    try:
        words, pos = tracedir.words(tid)
        return bool((parse_words(words, pos)["type"] == RecordType.BLOCK).any())
    except StoreError:
        return True  # not known: not claimed


def _image_traced(forks: _ForkFollower | None, pid: int, why_gone: list[str]) -> bool:
    """Whether attached process `pid`, whose session is gone, is traced on in the program
    image it exec'ed: Frida ends the session as the exec happens, and the follower takes up
    the new image a moment later (Frida holds it meanwhile)."""
    if forks is None or why_gone[:1] != ["process-replaced"]:
        return False
    deadline = time.monotonic() + 10
    while forks.image.get(pid, pid) == pid and time.monotonic() < deadline and _running(pid):
        time.sleep(0.01)
    return forks.exec_traced(pid)


def _exec_warning(what: str, hint: str = "record the new program by itself to trace it") -> str:
    return (
        f"{what} called exec: the new program image was not traced (the trace ends at the "
        f"exec; {hint})"
    )


def _children_exec_warning(pids: list[int], processes: dict[int, dict[str, Any]]) -> str:
    names = sorted({Path(processes[p].get("exec_image") or "?").name for p in pids} - {"?"})
    images = f" ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})" if names else ""
    if len(pids) == 1:
        who = f"forked child {thread_label(pids[0])} called exec{images}: the new program image was"
    else:
        listed = ", ".join(map(thread_label, pids[:5])) + (", ..." if len(pids) > 5 else "")
        who = f"{len(pids)} forked children ({listed}) called exec{images}: the new images were"
    return (
        f"{who} not traced (a child's trace ends at its exec; record the new program by "
        "itself to trace it)"
    )


def _untraced_children(what: str, children: list[int], ran: dict[int, str]) -> list[str]:
    """Without --follow-fork: the warning that the processes `what` forked (`children`, in
    the kernel's reports) ran untraced, naming what they exec'ed (`ran`)."""
    if not children:
        return []
    n = len(children)
    listed = ", ".join(map(str, children[:5])) + (", ..." if n > 5 else "")
    images = sorted({ran[c] for c in children if c in ran})
    programs = ", ".join(images[:6]) + (", ..." if len(images) > 6 else "")
    if n == 1:
        who = f"a child process (pid {listed}{f', which ran {programs}' if images else ''})"
    else:
        who = f"{n} child processes (pids {listed}{f'; they ran {programs}' if images else ''})"
    return [f"{what} forked {who}, not traced: --follow-fork traces children too"]


def _dropped_warning(what: str, reason: str) -> str:
    return (
        f"Frida dropped its session with {what} ({reason}) while it ran on: its trace ends "
        "there, and it ran on untraced"
    )


def _ticks_now() -> int:
    """Now, in the clock ticks since boot of a process's start time (_start_time)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _stuck_child_warning(pid: int, parent: int, reported: bool) -> str:
    when = "after Frida reported it" if reported else "before Frida reported it"
    return (
        f"forked child {pid} of pid {parent} waited for good inside Frida's recovery from a "
        f"fork(), {when}: on a lock of Frida's that another thread of its "
        "parent held at the fork() (a Frida bug; docs/fork.md section 18): it could never "
        f"run again: branchtrace killed it after {STUCK_AFTER:.0f} s, so that its parent "
        "could go on; it was not traced"
    )


def _never_reported_warning(parent: int, kids: list[int]) -> str:
    return (
        f"{_children_of(parent, kids)}, forked during the recording, "
        f"{'was' if len(kids) == 1 else 'were'} never reported by Frida, so not traced: "
        "forked past Frida's fork() hook, or lost by Frida, which leaves such a child "
        "waiting in its code for good (a Frida bug; docs/fork.md section 16)"
    )


def _ended_unreported_warning(parent: int, ended: list[tuple[int, int]]) -> str:
    endings = []
    for pid, status in ended:
        code, signum = describe(status)
        if signum is None:
            endings.append(f"{pid}: exit status {code}")
        else:
            name = signal.Signals(signum).name if signum in signal.valid_signals() else signum
            endings.append(f"{pid}: killed by {name}")
    kids = [pid for pid, _ in ended]
    return (
        f"{_children_of(parent, kids)}, forked during the recording, ended before Frida "
        f"reported {'it' if len(kids) == 1 else 'them'} ({'; '.join(endings)}), so not "
        "traced: killed by a signal in Frida's takeover after its fork(), or forked past "
        "Frida's fork() hook (docs/fork.md sections 16 and 19)"
    )


def _too_late_warning(parent: int, kids: list[int]) -> str:
    return (
        f"{_children_of(parent, kids)}, forked as the recording stopped, "
        f"{'was' if len(kids) == 1 else 'were'} let go untraced"
    )


def _start_time(pid: int) -> int | None:
    """When process `pid` started (in clock ticks since boot), or None if it is gone."""
    stat = proc_stat(pid)
    return int(stat[19]) if stat else None


def _parent_of(pid: int) -> int | None:
    stat = proc_stat(pid)
    return int(stat[1]) if stat else None


def _orphaned(pid: int, listed_with: tuple[int, int | None] | None) -> bool:
    """Whether `pid` is still the process listed as a child (`listed_with`: its parent then
    and its start time) and has another parent now: that one ended."""
    if listed_with is None:
        return False
    parent, start = listed_with
    now_parent = _parent_of(pid)
    return now_parent is not None and now_parent != parent and _start_time(pid) == start


def _executable_of(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/exe")
    return None


def _open_files(pid: int) -> dict[int, str]:
    """What process `pid` has open: fd -> what it is ("socket:[inode]", a path, or, for
    an eventfd, which of them: its eventfd-id)."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError, ValueError):
                what = os.readlink(f"/proc/{pid}/fd/{name}")
                if what == "anon_inode:[eventfd]":
                    info = Path(f"/proc/{pid}/fdinfo/{name}").read_text()
                    what += " " + (re.findall(r"eventfd-id:\s*(\d+)", info) or ["?"])[0]
                found[int(name)] = what
    return found


def _tasks(pid: int) -> list[int]:
    """The threads of `pid`, Frida's own included."""
    try:
        return sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def _ending(pid: int) -> bool:
    """Whether process `pid` is on its way out: dumping core, or without its memory."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nCoreDumping:\t1" in status or "\nCoreDumping:" not in status


class _StopGuard:
    """While on (`on()` to `off()`), process `pid`, running, is continued should it stop.
    Frida reaches a thread other than the one calling (Stalker.follow, a thread's registers)
    from a helper that ptrace-attaches it (gum_linux_modify_thread) and takes the first stop
    it sees for the SIGSTOP its attach sent: when a signal of the program's comes first (a
    timer's), it detaches giving SIGCONT in that signal's place and leaves the SIGSTOP
    pending, which then stops the whole process, the agent's thread too (1 attach in 8 to a
    program with a 10 kHz timer: the recording waited 10 s for the agent and gave up, the
    program left stopped).  Only around the attach and the detach, where Frida does that:
    a stop of the program's own (job control) while it is traced stays."""

    def __init__(self, pid: int, rec: _Recording) -> None:
        self.pid = pid
        self.rec = rec
        self.continued = 0
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None

    def on(self) -> None:
        stat = proc_stat(self.pid)
        if stat is None or stat[0] in "Tt":  # stopped by someone else: not ours to continue
            return
        self._done.clear()
        self._watcher = threading.Thread(target=self._watch, name="bt-continue", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._done.wait(0.005):
            stat = proc_stat(self.pid)
            if stat is not None and stat[0] == "T":
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGCONT)
                    self.continued += 1

    def off(self) -> None:
        if self._watcher is None:
            return
        self._done.set()
        self._watcher.join()
        self._watcher = None
        if self.continued:
            self.rec._error(
                f"pid {self.pid} stopped as Frida reached into its threads (a SIGSTOP of its "
                "ptrace attach, left behind when a signal of the program came first) and was "
                f"continued ({self.continued} times); a signal of the program's may have been "
                "lost each time"
            )


def _running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in "ZX"


def _settle_forks(pid: int, forks: ForksUnderFrida, events: Events) -> None:
    """On a failed attach: the children stuck meanwhile are released all the same."""
    forks.detaching()
    for warning in _forks_under_frida_warnings(pid, forks, forks.settle()):
        events.warning(warning)


def _forks_under_frida_warnings(pid: int, forks: ForksUnderFrida, at_risk: list[int]) -> list[str]:
    warnings = []
    if forks.freed:
        warnings.append(
            f"{_children_of(pid, forks.freed)}, forked while a thread of Frida's held a lock "
            f"of Frida's agent (its heap lock or a mutex), hung on that lock (a Frida bug, "
            f"frida/frida#467): branchtrace released it, and "
            f"{'it' if len(forks.freed) == 1 else 'they'} went on"
        )
    if forks.stuck:
        warnings.append(
            f"{_children_of(pid, forks.stuck)} waited on the same lock of Frida's again after "
            "its release, holding it itself: it will not end by itself; kill it"
        )
    at_risk = [kid for kid in at_risk if kid not in forks.stuck]
    if at_risk:
        warnings.append(
            f"{_children_of(pid, at_risk)}, forked while Frida's agent was loading or "
            f"unloading, still {'runs' if len(at_risk) == 1 else 'run'}: if a thread of "
            "Frida's held one of its locks at that fork, it will hang when it exits "
            "(frida/frida#467)"
        )
    return warnings


def _children_of(pid: int, kids: list[int]) -> str:
    if len(kids) == 1:
        return f"child {kids[0]} of pid {pid}"
    shown = ", ".join(map(str, kids[:8])) + (", ..." if len(kids) > 8 else "")
    return f"{len(kids)} children of pid {pid} ({shown})"


def _watch_child(pid: int) -> tuple[threading.Event, list[os.waitid_result]]:
    """Observe the child's end without reaping it: Frida's own child watch reaps it, and
    whoever reaps first gets the status, so we wait with WNOWAIT from before it runs."""
    exited = threading.Event()
    status: list[os.waitid_result] = []
    native: list[int] = []

    def wait() -> None:
        native.append(threading.get_native_id())
        while True:
            try:
                res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            except InterruptedError:
                continue
            except ChildProcessError:
                break
            if res is None or res.si_code not in (os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED):
                # Frida ptrace-stops the program around exec: a trap, not its end
                time.sleep(0.01)
                continue
            status.append(res)
            break
        exited.set()

    threading.Thread(target=wait, name="bt-waitid", daemon=True).start()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:  # resume only once the waiter sleeps in waitid
        if native:
            with contextlib.suppress(OSError):
                if Path(f"/proc/self/task/{native[0]}/wchan").read_text() == "do_wait":
                    break
        time.sleep(0.0005)
    return exited, status


def _how(options: RecordOptions) -> str:
    return (
        f"the stalker engine, {options.mode.name.lower()} mode, "
        f"{_human(options.buffer_size)} per thread"
        + (", following forks and execs" if options.follow_fork else "")
        + f", into {options.output}"
    )


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


__all__ = ["StalkerEngine", "agent_c_source"]
