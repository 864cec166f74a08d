"""`branchtrace probe`: breakpoints with handlers in a program or a running process."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ..engines.base import Target
from ..engines.stalker import resolve_program, script_command
from ..errors import NoSuchProcessError, PermissionDeniedError, UsageError
from ..probes.base import Hit, ProbeEngine, ProbeResult, format_value
from ..probes.hitstore import RING_SIZE as HIT_RING_SIZE
from ..probes.hitstore import HitWriter
from ..probes.spec import ProbePoint, Resolver, parse
from ..probes.uprobe import UprobeEngine
from ..probes.uprobe import available as uprobe_unavailable
from ..probes.xol import XolEngine
from . import main as cli_main
from .record import _ending, say_if_interpreted
from .signals import setting_on

err = Console(stderr=True, highlight=False, soft_wrap=True)


def split_command(args: tuple[str, ...]) -> tuple[list[str], tuple[str, ...]]:
    """SPECs before `--`, the program and its arguments after (click hands us both in one
    tuple, so the raw command line says where the program starts)."""
    raw = cli_main.raw_args()
    if "--" in raw:
        n_after = len(raw) - raw.index("--") - 1
        if n_after:
            return list(args[:-n_after]), tuple(args[-n_after:])
    return list(args), ()


def choose_engine(name: str, displaced: str, points: list[ProbePoint]) -> tuple[ProbeEngine, str]:
    """The engine, and why it was chosen (for the startup line)."""
    if name == "xol" or (name == "auto" and displaced != "auto"):
        return XolEngine(displaced), ""
    late = [p.label for p in points if reads_memory_late(p)]
    if name == "uprobe":
        return UprobeEngine(), (
            f"note: {', '.join(late)} read memory after the hit with this engine" if late else ""
        )
    why_not = uprobe_unavailable() or (None if os.geteuid() == 0 else "not root")
    if late:
        return XolEngine(displaced), (
            "default here: values read memory, which the xol engine does while the thread "
            "is stopped at the hit"
        )
    if why_not is None:
        return UprobeEngine(), "default here: the kernel has uprobes, no ptrace stop per hit"
    return XolEngine(displaced), f"default here: kernel uprobes unusable ({why_not})"


@click.command()
@click.option("-p", "--pid", type=int, help="probe a running process instead")
@click.option("-l", "--list", "pattern", help="list the functions matching a glob (lib:glob)")
@click.option(
    "--engine",
    type=click.Choice(["auto", "uprobe", "xol"]),
    default="auto",
    show_default=True,
    help="uprobe: the kernel's uprobes (perf_event_open); xol: ptrace breakpoints, the "
    "displaced instruction run out of line; auto: uprobe where the kernel allows",
)
@click.option(
    "--displaced",
    type=click.Choice(["auto", "boost", "step"]),
    default="auto",
    show_default=True,
    help="xol: how the probed instruction runs: auto (emulate simple ones, boost the rest), "
    "boost (an XOL slot with a jump back), step (single-step the XOL slot)",
)
@click.option(
    "--inline-step",
    is_flag=True,
    help="xol: put the original byte back and single-step in place (unsafe with threads: "
    "another thread can run through the probe unseen)",
)
@click.option("--json", "as_json", is_flag=True, help="one JSON object per hit")
@click.option("-q", "--quiet", is_flag=True, help="no line per hit: only the counts")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="also write every hit into this trace directory (PROBE_HIT records)",
)
@click.option("--duration", type=float, help="stop after this many seconds")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def probe(
    pid: int | None,
    pattern: str | None,
    engine: str,
    displaced: str,
    inline_step: bool,
    as_json: bool,
    quiet: bool,
    output: Path | None,
    duration: float | None,
    args: tuple[str, ...],
) -> None:
    """Probe SPEC... in COMMAND (after --) or in a running process (-p PID).

    \b
    SPEC: func, func+0xOFF, lib.so:func, file.c:LINE, func%return, with values:
      'parse(arg1, arg2:string)'  'parse%return($retval)'  'f(+8(%rsp):u64, %rdi:x64)'
    types: s8..s64 (default s64), u8..u64, x8..x64 (hex), string, string[N]
    """
    specs, command = split_command(args)
    if bool(command) == (pid is not None):
        raise UsageError(
            "give a program to run (after --) or -p PID, not both",
            hint="branchtrace probe main -- ./prog, or branchtrace probe f -p 1234",
        )
    script = command
    command = script_command(command)
    program = _program(command, pid)
    resolver = Resolver(program, pid)
    if pattern is not None:
        _list(resolver, pattern, program)
        return
    if not specs:
        raise UsageError("no probe given", hint=f"e.g. branchtrace probe main -- {program.name}")
    points = [resolver.resolve(parse(text)) for text in specs]
    chosen, why = choose_engine(engine, "inline" if inline_step else displaced, points)
    writer = None
    if output is not None:
        writer = HitWriter(output, points)
    start = time.monotonic_ns()
    printer = _Printer(points, as_json, quiet, start)

    def on_hit(hit: Hit) -> None:
        printer(hit)
        if writer is not None:
            writer(hit)

    def started(line: str) -> None:
        err.print(f"branchtrace: {line}" + (f" [{why}]" if why else ""), markup=False)

    say_if_interpreted(script, command)
    stop = threading.Event()
    timer = threading.Timer(duration, stop.set) if duration else None

    try:
        with setting_on((signal.SIGINT, signal.SIGTERM), stop):
            if timer is not None:
                timer.start()
            result = chosen.run(Target(argv=command, pid=pid), points, on_hit, started, stop)
    finally:
        if timer is not None:
            timer.cancel()
        printer.flush()
    if writer is not None:
        writer.close(_meta(chosen.name, command, pid, program, result, start))
    _summary(points, result, command[0] if command else f"pid {pid}", writer)
    if result.signal is not None:
        sys.exit(128 + result.signal)
    sys.exit(result.exit_code or 0)


def reads_memory_late(point: ProbePoint) -> bool:
    """Whether the uprobe engine could only read this probe's values after the hit (it
    copies registers and the stack at the hit, nothing else)."""
    return any(
        f.kind == "string" or (f.source == "mem" and f.reg != "rsp") for f in point.spec.fetches
    )


def _program(command: tuple[str, ...], pid: int | None) -> Path:
    if command:
        return resolve_program(command[0])
    assert pid is not None
    if pid <= 0 or not Path(f"/proc/{pid}").is_dir():
        raise NoSuchProcessError(f"no process with pid {pid}")
    try:
        return Path(os.readlink(f"/proc/{pid}/exe"))
    except PermissionError:
        raise PermissionDeniedError(f"no permission to probe process {pid}") from None
    except OSError:
        raise NoSuchProcessError(f"process {pid} has no executable (a kernel thread?)") from None


def _list(resolver: Resolver, pattern: str, program: Path) -> None:
    found = resolver.matching(pattern)
    for module, name, _address in sorted(found, key=lambda m: (m[0] != program.name, m)):
        click.echo(name if module == program.name else f"{module}:{name}")
    if not found:
        raise UsageError(f"no function matches {pattern!r}")


class _Printer:
    """One line (or JSON object) per hit, buffered: stdout may be a pipe to `head`."""

    def __init__(self, points: list[ProbePoint], as_json: bool, quiet: bool, start: int):
        self.points = points
        self.as_json = as_json
        self.quiet = quiet
        self.start = start
        self.lines: list[str] = []
        self.flushed = time.monotonic()

    def __call__(self, hit: Hit) -> None:
        if self.quiet:
            return
        point = self.points[hit.probe]
        fetches = point.spec.fetches
        if self.as_json:
            obj: dict[str, object] = {
                "time_ns": hit.time_ns,
                "tid": hit.tid,
                "probe": point.label,
                "args": {f.name: v for f, v in zip(fetches, hit.values, strict=True)},
            }
            if point.is_return:
                obj["retval"] = hit.retval
            self.lines.append(json.dumps(obj, ensure_ascii=False))
        else:
            line = f"{(hit.time_ns - self.start) / 1e9:12.6f} {hit.tid:>7} {point.label}"
            if fetches:
                shown = (
                    f"{f.name}={format_value(v, f)}"
                    for f, v in zip(fetches, hit.values, strict=True)
                )
                line += "(" + ", ".join(shown) + ")"
            if point.is_return:
                line += f" = {hit.retval}"
            self.lines.append(line)
        now = time.monotonic()
        if len(self.lines) >= 4096 or now - self.flushed > 0.1:
            self.flush()
            self.flushed = now

    def flush(self) -> None:
        if self.lines:
            sys.stdout.write("\n".join(self.lines) + "\n")
            sys.stdout.flush()
            self.lines.clear()


def _summary(
    points: list[ProbePoint], result: ProbeResult, what: str, writer: HitWriter | None
) -> None:
    for w in result.warnings:
        err.print(f"branchtrace: warning: {w}", markup=False)
    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("probe")
    table.add_column("hits", justify="right")
    table.add_column("threads", justify="right")
    for i, point in enumerate(points):
        per_tid = result.hits.get(i, {})
        table.add_row(point.label, f"{sum(per_tid.values()):,}", str(len(per_tid)))
    err.print(table)
    lost = f", {result.lost:,} hits lost (kernel ring full)" if result.lost else ", 0 lost"
    saved = f" -> {writer.tracedir.path}" if writer is not None else ""
    ending = _ending(what, result.exit_code, result.signal, result.detached)
    err.print(f"branchtrace: {ending}{lost}{saved}", markup=False)


def _meta(
    engine: str,
    command: tuple[str, ...],
    pid: int | None,
    program: Path,
    result: ProbeResult,
    start: int,
) -> dict[str, object]:
    return {
        "kind": "probes",
        "engine": engine,
        "mode": "stream",
        "buffer_size": HIT_RING_SIZE,
        "argv": list(command),
        "executable": str(program),
        "attached": pid is not None,
        "pid": result.pid,
        "started_monotonic_ns": start,
        "exit_code": result.exit_code,
        "signal": result.signal,
        "detached": result.detached,
        "lost": result.lost,
        "warnings": result.warnings,
        "hits": {str(i): {str(t): n for t, n in h.items()} for i, h in result.hits.items()},
        "threads": {},
    }
