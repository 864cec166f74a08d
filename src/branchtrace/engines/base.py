"""What every engine offers, so the command line never asks which engine it has."""

from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSegment
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from ..store import Mode
from ..store.tracedir import thread_label

#: the limit of open files the recorder was started with, which the programs it starts get:
#: importing frida (after this module: engines/__init__.py) raises this process's soft limit
#: to the hard one less one, and a program Frida or a fork of ours starts inherited that
USERS_FILE_LIMIT = resource.getrlimit(resource.RLIMIT_NOFILE)


@dataclass(frozen=True)
class Target:
    """A program to spawn (`argv`) or a running process to attach to (`pid`)."""

    argv: tuple[str, ...] = ()
    pid: int | None = None


@dataclass(frozen=True)
class Trigger:
    """A code address whose execution snapshots the wrap buffers (`record --trigger`)."""

    label: str
    path: str  #: the module's file
    offset: int  #: from the module's load base


@dataclass(frozen=True)
class RecordOptions:
    output: Path = Path("branchtrace.data")
    mode: Mode = Mode.WRAP
    buffer_size: int = 16 << 20  #: bytes per thread ring, a power of two
    duration: float | None = None  #: seconds; None: until the program ends or stop is set
    sched: bool = False  #: also record context switches (perf software events)
    follow_fork: bool = False  #: trace the children the program forks, too
    triggers: tuple[Trigger, ...] = ()
    snapshots: int = 10  #: at most this many trigger snapshots
    compress: bool = True  #: stream files LZ4-compressed (store/packed.py)
    #: entries in each thread's block table (0: buffer_size / 64, 4096 to 1M); blocks
    #: compiled once it is full are recorded through a slower path
    block_table: int = 0
    #: the program's blocks Stalker compiles for a thread before the thread takes a fresh
    #: context (0: stalker.CONTEXT_BLOCKS), as Stalker cannot keep compiling in one for good
    context_blocks: int = 0


@dataclass
class ThreadStats:
    pid: int = 0  #: the process the thread belongs to
    records: int = 0
    lost: int = 0
    switches: int = 0  #: context switches recorded (with --sched)
    gaps: dict[str, int] = field(default_factory=dict)  #: untraced stretches, by reason
    #: signals that came in Stalker's code at a block's end or inside its copy of an
    #: instruction, "held" to the next block's start or system call (their handlers traced
    #: from there), and "merged": more of the same meanwhile, delivered once with it as the
    #: kernel does a pending standard signal (only those not 0)
    signals: dict[str, int] = field(default_factory=dict)


@dataclass
class RecordResult:
    output: Path
    pid: int
    threads: dict[int, ThreadStats] = field(default_factory=dict)
    exit_code: int | None = None  #: the program's exit status, if it exited
    signal: int | None = None  #: the signal that killed it, if one did
    detached: bool = False  #: we let go of a process that is still running
    execd: bool = False  #: the program called exec: its trace ends there
    warnings: list[str] = field(default_factory=list)
    snapshots: list[Path] = field(default_factory=list)  #: --trigger snapshot directories
    #: --follow-fork: how each traced child ended: ppid, exit_code / signal / detached, exec
    processes: dict[int, dict[str, object]] = field(default_factory=dict)
    #: the program's threads seen and not traced (in meta.json's untraced_threads, which
    #: lists Frida's own too)
    untraced: int = 0

    @property
    def records(self) -> int:
        return sum(t.records for t in self.threads.values())

    @property
    def lost(self) -> int:
        return sum(t.lost for t in self.threads.values())


def start_meta(
    engine: str, options: RecordOptions, argv: tuple[str, ...], executable: str | None
) -> dict[str, Any]:
    """meta.json as a recording starts (docs/format.md, "a recording directory")."""
    return {
        "engine": engine,
        "mode": options.mode.name.lower(),
        "buffer_size": options.buffer_size,
        "started_ns": time.time_ns(),
        "argv": list(argv),
        "executable": executable,
        "attached": not argv,
        "sched": options.sched,
    }


def finish_meta(
    meta: dict[str, Any], result: RecordResult, untraced_threads: list[dict[str, Any]]
) -> None:
    """meta.json's account of how the recording ended."""
    meta.update(
        {
            "ended_ns": time.time_ns(),
            "pid": result.pid,
            "exit_code": result.exit_code,
            "signal": result.signal,
            "detached": result.detached,
            "exec": result.execd,
            "processes": {thread_label(p): e for p, e in result.processes.items()},
            "untraced_threads": untraced_threads,
            "warnings": result.warnings,
            "threads": {thread_label(t): s.__dict__ for t, s in result.threads.items()},
        }
    )


class Events(Protocol):
    """How an engine reports progress; only the CLI prints."""

    def started(self, description: str) -> None: ...

    def warning(self, message: str) -> None: ...


class Engine(Protocol):
    name: str

    def record(
        self, target: Target, options: RecordOptions, events: Events, stop: threading.Event
    ) -> RecordResult: ...


def statically_linked(program: Path) -> bool:
    """Whether the executable has no program interpreter (no dynamic loader, so no C
    library of its own loading: Go's programs by default, `gcc -static`).  False when it
    cannot be read."""
    try:
        with open(program, "rb") as f:
            return not any(s["p_type"] == "PT_INTERP" for s in ELFFile(f).iter_segments())
    except (OSError, ELFError):
        return False


def go_without_cgo(program: Path) -> bool:
    """Whether the executable is a Go program built without cgo, whose runtime starts its
    threads itself, not through the C library's pthread_create() (which a Go program
    imports only with cgo; without, it is most often statically linked).  False when it
    cannot be read."""
    try:
        with open(program, "rb") as f:
            elf = ELFFile(f)
            if elf.get_section_by_name(".go.buildinfo") is None:
                return False
            dynsym = elf.get_section_by_name(".dynsym")
            symbols = dynsym.iter_symbols() if isinstance(dynsym, SymbolTableSection) else []
            return "pthread_create" not in {symbol.name.split("@")[0] for symbol in symbols}
    except (OSError, ELFError):
        return False


def init_offset(program: Path) -> int | None:
    """The executable's `_init` (its DT_INIT function) as an offset from its load base (its
    lowest mapping), or None if it has none.  libc's start-up calls it right before the
    executable's constructors and main, and a program Frida spawns is held right there: the
    engines start tracing a program they spawn there (the libraries' constructors ran
    before, in the dynamic loader)."""
    try:
        with open(program, "rb") as f:
            elf = ELFFile(f)
            segments = list(elf.iter_segments())
            loads = [s["p_vaddr"] for s in segments if s["p_type"] == "PT_LOAD"]
            for segment in segments:
                if isinstance(segment, DynamicSegment) and loads:
                    for tag in segment.iter_tags("DT_INIT"):
                        return int(tag["d_ptr"]) - (min(loads) & ~0xFFF)
    except (OSError, ELFError):
        pass
    return None
