"""`branchtrace demo`: record the bundled example program as it crashes, and show how it got
there.  `--store` instead shows the store alone: records streamed between two processes.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import shutil
import subprocess
import threading
import time
from importlib import resources
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from ..analysis import Trace
from ..engines import RecordOptions, Target
from ..engines.stalker import StalkerEngine
from ..errors import LaunchError, StoreError
from ..store import BranchKind, Flags, Mode, RecordType, Ring, RingReader, RingWriter, parse_words
from ..store.format import WriterState
from .info import info
from .record import _CliEvents, output_option, print_summary

BATCH = 1 << 16


def build_example() -> Path:
    """Compile the bundled example once (it is C source: gcc is part of the contract)."""
    source = resources.files("branchtrace").joinpath("examples", "linked_list.c").read_bytes()
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise LaunchError(
            "the demo compiles a small C program, and there is no gcc", hint="apt-get install gcc"
        )
    flags = ["-O0", "-g", "-fno-omit-frame-pointer"]
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    exe = Path.home() / ".cache" / "branchtrace" / "demo" / digest / "linked_list"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        src = exe.with_suffix(".c")
        src.write_bytes(source)
        res = subprocess.run(
            [gcc, *flags, "-o", str(exe), str(src)], capture_output=True, text=True
        )
        if res.returncode != 0:
            raise LaunchError(f"compiling the demo example failed: {res.stderr.strip()[:200]}")
    return exe


def show_last_branches(output: Path, tid: int, last: int) -> None:
    trace = Trace(output)
    branches = trace.branches(tid, last=last)
    modules = trace.modules(tid)
    sources, targets = modules.symbolize(branches["from"]), modules.symbolize(branches["to"])
    lines = modules.source_lines(branches["to"])
    targets = [f"{t} {line}" if line else t for t, line in zip(targets, lines, strict=True)]
    Console(highlight=False, soft_wrap=True).print(
        f"how it got there: the last {len(branches)} branches of thread {tid}", markup=False
    )
    table = Table(box=None, header_style="bold")
    for col in ("#", "from", "to", "kind"):
        table.add_column(col, justify="right" if col == "#" else "left")
    for i, (b, src, dst) in enumerate(zip(branches, sources, targets, strict=True)):
        kind = BranchKind(int(b["kind"])).name.lower() if 0 < b["kind"] < 255 else "?"
        table.add_row(str(len(branches) - 1 - i), src, dst, kind.replace("_", " "))
    Console(highlight=False).print(table)


@click.command()
@output_option
@click.option("--last", default=12, show_default=True, help="branches to show")
@click.option(
    "--store",
    "store_only",
    is_flag=True,
    help="instead: stream records between two processes through the store",
)
@click.option(
    "-n",
    "--records",
    default=20_000_000,
    show_default=True,
    help="with --store: records to move through the stream ring",
)
@click.pass_context
def demo(ctx: click.Context, output: Path, last: int, store_only: bool, records: int) -> None:
    """Record the bundled example as it crashes, and show how it got there."""
    if store_only:
        store_demo(ctx, output, records)
        return
    exe = build_example()
    result = StalkerEngine().record(
        Target(argv=(str(exe),)),
        RecordOptions(output=output, mode=Mode.WRAP),
        _CliEvents(),
        threading.Event(),
    )
    print_summary(result, exe.name)
    show_last_branches(output, result.pid, last)
    Console(highlight=False).print(
        "(# 0 is the newest branch: it leads into the function that faulted.)\nMore: "
        f"branchtrace calls {output} (who called whom), branchtrace insns {output} "
        f"(the last instructions), branchtrace show {output} -n 50",
        markup=False,
        soft_wrap=True,
    )


def _write(path: str, n: int) -> None:
    with RingWriter(Ring.open(path, writable=True)) as w:
        for start in range(1, n + 1, BATCH):
            w.write_blocks(np.arange(start, min(start + BATCH, n + 1), dtype=np.uint64))
        w.write(RecordType.THREAD_EXIT, 1, time.time_ns(), 0)


def store_demo(ctx: click.Context, output: Path, records: int) -> None:
    """Move records between two processes through the store, and show the result."""
    out = Console(highlight=False)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create {output}: {e.strerror}") from None
    stream = Ring.create(
        output / "demo-stream.bts", 16 << 20, Mode.STREAM, Flags.TRACE | Flags.SIGNAL, tid=1
    )
    out.print(
        f"stream: a child process writes {records:,} records into a 16 MiB ring; "
        "this process drains them"
    )
    ctx_mp = multiprocessing.get_context("fork")
    child = ctx_mp.Process(target=_write, args=(str(stream.path), records))
    t0 = time.perf_counter()
    child.start()
    received, expected = 0, 1
    with RingReader(stream, consume=True) as reader:
        while True:
            closed = stream.writer_state == WriterState.CLOSED
            words, pos = reader.read_words()
            if words.size:
                recs = parse_words(words, pos)
                blocks = recs["a"][recs["type"] == RecordType.BLOCK]
                if not np.array_equal(blocks, np.arange(expected, expected + blocks.size)):
                    raise StoreError("demo: records arrived out of order")
                expected += blocks.size
                received += recs.size
                reader.advance(pos + words.size * 8)
            elif closed:
                break
            else:
                reader.wait(stream.head, 0.05)
    child.join()
    dt = time.perf_counter() - t0
    out.print(
        f"  received {received:,} records in {dt:.2f} s ({received / dt / 1e6:.1f} M/s), "
        f"lost {stream.lost_records}, the writer waited {stream.header()['writer_waits']!s} "
        "times for space"
    )
    stream.close()

    wrap = Ring.create(output / "demo-wrap.bts", 64 << 10, Mode.WRAP, Flags.TRACE, tid=2)
    with RingWriter(wrap) as w:
        w.write_blocks(np.arange(1, 1_000_001, dtype=np.uint64))
    newest = RingReader(wrap).read()
    out.print(
        f"wrap: 1,000,000 records into a 64 KiB ring; it keeps the newest "
        f"{newest.size:,}: {int(newest['a'][0]):,} .. {int(newest['a'][-1]):,}"
    )
    wrap.close()
    ctx.invoke(info, path=output, as_json=False)
