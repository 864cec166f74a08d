"""`branchtrace demo`: the store at work, end to end, on this machine.

A child process writes numbered records into a stream-mode ring while this process drains
them, checking that every one arrives; then the same through a small wrap-mode ring, which
keeps only the newest.  TODO(recorder): once the stalker engine lands, the demo records the
bundled example program instead.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import click
import numpy as np
from rich.console import Console

from ..errors import StoreError
from ..store import Flags, Mode, RecordType, Ring, RingReader, RingWriter, parse_words
from ..store.format import WriterState
from .info import info

BATCH = 1 << 16


def _write(path: str, n: int) -> None:
    with RingWriter(Ring.open(path, writable=True)) as w:
        for start in range(1, n + 1, BATCH):
            w.write_blocks(np.arange(start, min(start + BATCH, n + 1), dtype=np.uint64))
        w.write(RecordType.THREAD_EXIT, 1, time.time_ns(), 0)


@click.command()
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default="branchtrace.data",
    show_default=True,
    help="directory for the demo stores",
)
@click.option(
    "-n",
    "--records",
    default=20_000_000,
    show_default=True,
    help="records to move through the stream ring",
)
@click.pass_context
def demo(ctx: click.Context, output: Path, records: int) -> None:
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
