"""`branchtrace record`: trace a program from its start, or a running process, into DIR."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import click
from rich.console import Console

from ..engines import RecordOptions, RecordResult, Target
from ..engines.base import Trigger
from ..engines.forkwindow import proc_stat
from ..engines.stalker import StalkerEngine, resolve_program, script_command
from ..errors import InvalidArgumentError, UsageError
from ..store import Mode, parse_size
from ..store.tracedir import thread_label
from . import main as cli_main
from .signals import setting_on

err = Console(stderr=True, highlight=False, soft_wrap=True)


class _CliEvents:
    def started(self, description: str) -> None:
        err.print(f"branchtrace: {description}", markup=False)

    def warning(self, message: str) -> None:
        err.print(f"branchtrace: warning: {message}", markup=False)


def say_if_interpreted(script: tuple[str, ...], command: tuple[str, ...]) -> None:
    """The line that says `command` (script_command) runs `script` through its interpreter."""
    if command != script:
        err.print(
            f"branchtrace: {script[0]} is a script: running its interpreter, {shlex.join(command)}",
            markup=False,
        )


def _ending(what: str, exit_code: object, signum: object, detached: object) -> str:
    if isinstance(signum, int):
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"{what} was killed by {name}"
    if exit_code is not None:
        return f"{what} exited with status {exit_code}"
    if detached:
        return f"detached from {what}; it keeps running"
    return f"{what} ended"


#: the flags of a process's ending (meta.json's processes) that a warning of the recorder
#: named already
_NAMED_ALREADY = ("frozen", "stuck", "no_code_traced", "ended_unreported", "died_in_frida")

#: in the recorder a supervising `branchtrace record` runs: that process's pid
_SUPERVISOR = "BRANCHTRACE_SUPERVISOR"
_PR_SET_PDEATHSIG = 1
#: seconds a dying supervisor takes to be seen gone (_let_go_if_gone)
SUPERVISOR_DYING = 0.5


def _supervise() -> NoReturn:
    """With --follow-fork, the recording runs in a child process, this one waiting for it
    and exiting as it does: Frida's agent asks the recorder at every fork() of the program,
    and aborts the program when the recorder is gone (frida-core's do_prepare_to_fork calls
    error()), so a recorder killed with SIGKILL killed the program it traced (2 attaches
    of 6 to `forkloop 400 5000`, SIGKILL 2.5 s in: SIGSEGV once, SIGABRT once; spawned,
    `forkloop 40 20000`: 3 runs of 8).  Killed, this process leaves the recorder, which
    detaches from the program, attached or spawned, and its children: they run on, and
    the trace is whole."""
    child = subprocess.Popen(
        [sys.executable, "-m", "branchtrace.cli.main", *cli_main.raw_args()],
        env={**os.environ, _SUPERVISOR: str(os.getpid())},
    )

    def forward(signum: int, frame: object) -> None:
        # the recorder, in a process group of its own, gets the terminal's signals from here
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)
    code = child.wait()
    sys.exit(128 - code if code < 0 else code)


def _stop_when_gone(supervisor: int, stop: threading.Event, let_go: threading.Event) -> None:
    """The recorder's side of _supervise: SIGTERM, so a stop, when the supervisor dies
    (its SIGTERM reaches setting_on, which first calls _let_go_if_gone).  In a process group
    of its own, which a SIGKILL of the tool's job (`kill -9 %1`, a killed `timeout`) does
    not reach; the tool passes on what the terminal sends its group (a spawned program is
    in a session of its own, Frida's).  Writing to the terminal from there must not stop
    it (`stty tostop`): the program would wait at its next fork()."""
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != supervisor:  # it died before the prctl
        let_go.set()
        stop.set()


def _let_go_if_gone(supervisor: int | None, let_go: threading.Event) -> Callable[[set[int]], None]:
    """Before a stop: a supervisor that is gone was killed, and the spawned program is let
    go, not ended as at Ctrl-C (a SIGTERM the supervisor passes on ends it).  The death
    signal comes as the supervisor's first thread exits, before the others (Frida's) have
    and while getppid() still names it: it is looked at for up to SUPERVISOR_DYING s."""

    def check(signals: set[int]) -> None:
        if supervisor is None or signal.SIGTERM not in signals:
            return
        deadline = time.monotonic() + SUPERVISOR_DYING
        while time.monotonic() < deadline:
            state = proc_stat(supervisor)
            if os.getppid() != supervisor or state is None or state[0] in "ZX":
                let_go.set()
                return
            time.sleep(0.005)

    return check


def print_summary(result: RecordResult, what: str, sched: bool = False) -> None:
    """Warnings, then one line: how the program ended and what was recorded."""
    for w in result.warnings:
        _CliEvents().warning(w)
    crashed = [key for key, e in result.processes.items() if e.get("signal") is not None]
    crashed += [result.pid] * bool(result.signal)
    sites: dict[int, str] = {}
    if crashed:  # the views import numba: 0.5 s of start-up a recording need not pay
        from .views import crash_sites

        sites = crash_sites(result.output, result.pid, crashed)
    for key, ending in result.processes.items():
        if any(ending.get(named) for named in _NAMED_ALREADY):
            continue  # named in a warning of its own
        if ending.get("execd_by") and ending.get("ppid") is None:
            continue  # the program's own exec: the last line says how it ended
        child = f"forked child {thread_label(key)}"
        if ending.get("executable"):
            child += f" ({Path(str(ending['executable'])).name})"
        if ending.get("signal") is not None or ending.get("detached"):
            code, signum = ending.get("exit_code"), ending.get("signal")
            site = f"; {sites[key]}" if key in sites else ""
            _CliEvents().warning(_ending(child, code, signum, ending.get("detached")) + site)
    n = len(result.threads)
    processes = ""
    if result.processes:
        # a process's exec'ed images are not processes of their own; a child given an
        # earlier one's pid is
        keys = {key for key, e in result.processes.items() if "execd_by" not in e}
        count = len(keys | {result.pid})
        images = sum("execd_by" in e for e in result.processes.values())
        processes = f"{count} processes, " if count > 1 else ""
        if images:
            processes += f"{images} exec'ed program image{'s' if images != 1 else ''}, "
    switches = sum(t.switches for t in result.threads.values())
    untraced = f" ({result.untraced} more not traced)" if result.untraced else ""
    err.print(
        f"branchtrace: {_ending(what, result.exit_code, result.signal, result.detached)}; "
        f"{processes}{n} thread{'s' if n != 1 else ''}{untraced}, "
        f"{result.records:,} records, {result.lost:,} lost"
        + (f", {switches:,} context switches" if sched else "")
        + f" -> {result.output}",
        markup=False,
    )
    if result.pid in sites:
        err.print(
            f"branchtrace: {sites[result.pid]}; `branchtrace insns {result.output}` shows how",
            markup=False,
        )


def _triggers(
    specs: tuple[str, ...], command: tuple[str, ...], pid: int | None, mode: str, engine: str
) -> tuple[Trigger, ...]:
    """--trigger SPECs resolved against the program's files."""
    if not specs:
        return ()
    if mode != "wrap" or engine != "stalker":
        raise UsageError(
            "--trigger snapshots the wrap buffer of the stalker engine",
            hint="use --mode wrap (the default) and --engine stalker",
        )
    from ..probes.spec import Resolver, parse

    program = resolve_program(command[0]) if command else Path(os.readlink(f"/proc/{pid}/exe"))
    resolver = Resolver(program, pid)
    out = []
    for text in specs:
        point = resolver.resolve(parse(text))
        if point.spec.fetches or point.is_return:
            raise UsageError(f"--trigger {text}: a trigger is a code location, with no values")
        out.append(Trigger(point.label, str(point.path), point.vaddr - point.first_vaddr))
    return tuple(out)


output_option = click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default="branchtrace.data",
    show_default=True,
    help="directory for the recording",
)


@click.command(context_settings={"allow_interspersed_args": False})
@output_option
@click.option(
    "--mode",
    type=click.Choice(["wrap", "stream", "drop"]),
    default="wrap",
    show_default=True,
    help="wrap: keep the newest records (debugging); stream: keep everything, "
    "the program waits for the recorder; drop: never wait, count losses",
)
@click.option(
    "--buffer-size",
    default="16M",
    show_default=True,
    help="ring per thread, bytes (K/M/G); wrap mode keeps about this much",
)
@click.option("-p", "--pid", type=int, help="attach to a running process instead")
@click.option("--duration", type=float, help="stop after this many seconds")
@click.option(
    "--sched",
    is_flag=True,
    help="also record context switches (departs/arrives, time, CPU) per thread",
)
@click.option(
    "--engine",
    type=click.Choice(["stalker", "step"]),
    default="stalker",
    show_default=True,
    help="stalker: Frida dynamic instrumentation (fast); step: ptrace single-step, "
    "exact and slow (~5k instructions/s here), the reference",
)
@click.option(
    "--follow-fork",
    is_flag=True,
    help="also trace the child processes the program forks or spawns, and the programs "
    "they and it exec (each as a process of its own, its threads into DIR)",
)
@click.option(
    "--trigger",
    "triggers",
    multiple=True,
    metavar="SPEC",
    help="snapshot the wrap buffers when SPEC (func, func+0xOFF, lib:func, file.c:LINE) "
    "runs, into DIR/snapshots/N; may repeat",
)
@click.option(
    "--snapshots",
    type=click.IntRange(1),
    default=10,
    show_default=True,
    help="at most this many trigger snapshots",
)
@click.option(
    "--compress/--no-compress",
    default=True,
    show_default=True,
    help="stream and drop modes: LZ4-compress what is drained into DIR (~33x smaller here, "
    "and faster on most machines); --no-compress leaves raw words that readers map "
    "instead of loading",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def record(
    output: Path,
    mode: str,
    buffer_size: str,
    pid: int | None,
    duration: float | None,
    sched: bool,
    engine: str,
    follow_fork: bool,
    triggers: tuple[str, ...],
    snapshots: int,
    compress: bool,
    command: tuple[str, ...],
) -> None:
    """Record the branch trace of COMMAND (after --) or of a running process (-p PID).

    A spawned program is traced from the start of its main function, every thread; an
    attached one from now until Ctrl-C or --duration, then it is left running.
    """
    if bool(command) == (pid is not None):
        raise UsageError(
            "give a program to run (after --) or -p PID, not both",
            hint="branchtrace record -- ./prog args, or branchtrace record -p 1234",
        )
    script = command
    command = script_command(command)
    resolved = _triggers(triggers, command, pid, mode, engine)
    try:
        size = parse_size(buffer_size)
    except InvalidArgumentError as e:  # a typo on the command line, not a store's
        raise UsageError(f"--buffer-size: {e}", hint=e.hint) from None
    options = RecordOptions(
        triggers=resolved,
        snapshots=snapshots,
        output=output,
        mode=Mode[mode.upper()],
        buffer_size=size,
        duration=duration,
        sched=sched,
        follow_fork=follow_fork,
        compress=compress,
    )
    supervisor_pid = os.environ.pop(_SUPERVISOR, None)
    if follow_fork and engine == "stalker" and supervisor_pid is None:
        _supervise()
    supervisor = None if supervisor_pid is None else int(supervisor_pid)
    stop, let_go = threading.Event(), threading.Event()
    say_if_interpreted(script, command)
    target = Target(argv=command, pid=pid)
    # supervised, a hang-up (the terminal's, or passed on) stops the recording too: dying of
    # it would leave the program to Frida's abort at its next fork()
    stops = (signal.SIGINT, signal.SIGTERM) + (signal.SIGHUP,) * (supervisor is not None)
    with setting_on(stops, stop, _let_go_if_gone(supervisor, let_go)):
        if supervisor is not None:
            _stop_when_gone(supervisor, stop, let_go)
        if engine == "step":
            from ..engines.step import StepEngine  # capstone and pyelftools: ~40 ms to import

            result = StepEngine().record(target, options, _CliEvents(), stop)
        else:
            result = StalkerEngine().record(target, options, _CliEvents(), stop, let_go)
    if let_go.is_set():
        result.warnings.append(
            f"branchtrace's own process (pid {supervisor}) was killed; its recorder stopped"
            + (" and detached: the program runs on, untraced" if result.detached else "")
        )
    print_summary(result, command[0] if command else f"pid {pid}", sched)
    if result.snapshots:
        err.print(
            f"branchtrace: {len(result.snapshots)} trigger snapshot(s): "
            f"{result.snapshots[0].parent}/1..{len(result.snapshots)} "
            f"(e.g. branchtrace show {result.snapshots[0]})",
            markup=False,
        )
    if result.signal is not None:
        sys.exit(128 + result.signal)
    sys.exit(result.exit_code or 0)
