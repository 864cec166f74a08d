"""Store throughput: records moved from a writer process to a consuming reader, per second.

    python bench/store.py [--records N]

Rows (each moves N records through a 16 MiB stream ring, nothing lost, checked by count):
  C writer -> drain raw     the in-process writer's path: one record per call, words drained
  C writer -> drain parsed  the same, parsed into RECORD_DTYPE arrays by the reader
  Python bulk -> raw        RingWriter.write_blocks from numpy arrays
  parse only                parse_words on words already in memory
Baselines measured in the same run: a pipe between two processes carrying the same bytes,
and a single in-memory numpy copy of them (the ceiling for any reader).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from branchtrace.store import Flags, Mode, Ring, RingReader, RingWriter, parse_words
from branchtrace.store.format import WriterState, c_writer_source

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build  # noqa: E402  (the tests' cached gcc build)

RING = 16 << 20


def drain(ring: Ring, parse: bool) -> int:
    n = 0
    with RingReader(ring, consume=True) as reader:
        while True:
            closed = ring.writer_state == WriterState.CLOSED
            words, pos = reader.read_words()
            if words.size:
                n += parse_words(words, pos).size if parse else words.size
                reader.advance(pos + words.size * 8)
            elif closed:
                return n
            else:
                reader.wait(ring.head, 0.05)


def c_writer_run(exe: Path, n: int, parse: bool) -> float:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        ring = Ring.create(Path(d) / "b.bts", RING, Mode.STREAM, Flags.TRACE | Flags.SIGNAL)
        t0 = time.perf_counter()
        proc = subprocess.Popen([exe, ring.path, str(n)], stdout=subprocess.DEVNULL)
        got = drain(ring, parse)
        proc.wait()
        dt = time.perf_counter() - t0
        assert got == n and ring.lost_records == 0, (got, n)
        ring.close()
    return dt


def python_writer_run(n: int) -> float:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        ring = Ring.create(Path(d) / "b.bts", RING, Mode.STREAM, Flags.TRACE | Flags.SIGNAL)
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            with RingWriter(Ring.open(ring.path, writable=True)) as w:
                batch = 1 << 20
                for s in range(1, n + 1, batch):
                    w.write_blocks(np.arange(s, min(s + batch, n + 1), dtype=np.uint64))
            os._exit(0)
        got = drain(ring, parse=False)
        os.waitpid(pid, 0)
        dt = time.perf_counter() - t0
        assert got == n
        ring.close()
    return dt


def pipe_run(n: int) -> float:
    r, w = os.pipe()
    chunk = np.arange(1, (1 << 17) + 1, dtype=np.uint64).tobytes()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        left = n * 8
        while left:
            left -= os.write(w, chunk[: min(left, len(chunk))])
        os._exit(0)
    os.close(w)
    got = 0
    while data := os.read(r, 1 << 20):
        got += len(data)
    os.waitpid(pid, 0)
    os.close(r)
    assert got == n * 8
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000_000)
    n = ap.parse_args().records
    exe = build(
        ROOT / "tests" / "c" / "ring_writer.c", ["-O2"], {"bt_writer_full.h": c_writer_source()}
    )
    words = np.arange(1, n + 1, dtype=np.uint64)
    dest = np.ones_like(words)  # touched first: the copy measures bandwidth, not page faults
    t0 = time.perf_counter()
    np.copyto(dest, words)
    memcpy = time.perf_counter() - t0
    del dest
    t0 = time.perf_counter()
    for s in range(0, n, 2 << 20):
        parse_words(words[s : s + (2 << 20)], s * 8)
    parse_only = time.perf_counter() - t0
    del words
    rows = [
        ("C writer -> drain raw", c_writer_run(exe, n, parse=False)),
        ("C writer -> drain parsed", c_writer_run(exe, n, parse=True)),
        ("Python bulk -> drain raw", python_writer_run(n)),
        ("parse only (in memory)", parse_only),
        ("baseline: pipe, same bytes", pipe_run(n)),
        ("baseline: numpy copy", memcpy),
    ]
    pipe = rows[4][1]
    print(f"{n:,} records of 8 bytes, 16 MiB stream ring, {os.cpu_count()} CPUs")
    print(f"{'path':30} {'seconds':>8} {'M records/s':>12} {'vs pipe':>8}")
    for name, dt in rows:
        print(f"{name:30} {dt:8.2f} {n / dt / 1e6:12.1f} {pipe / dt:7.2f}x")


if __name__ == "__main__":
    main()
