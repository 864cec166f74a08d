"""Reading cost: how fast a recorded trace turns into branches, a call history, symbols.

    python bench/decode.py [--records 100M]

Records two traces in stream mode (a call loop of --records blocks, and gzip of a 20 MB
file, a real program with thousands of distinct blocks and deep libc code), then times,
on each, with the trace already in the page cache:

* unpack     - reading the words back from the LZ4-packed stream file (`record`'s default;
               recorded here with --no-compress, packed in 32 MiB drains, so that the other
               columns time decoding alone, over mapped words) and expanding its 4-byte
               block ids into BLOCK words with the ring's block table
* scan       - raw words to the block sequence (numba: interning the distinct blocks)
* branches   - scan + decode to {from, to, kind} (capstone once per distinct block)
* calls      - scan + the function-call history with the shadow stack (numba)
* calls+sym  - all of it with symbols: every segment named (what `branchtrace calls` does)
* stats      - call counts per function (what `branchtrace stats` does)

and prints records per second for each.  The target: the symbolized call history at
>= 20M records/s (decoding keeps up with recording); raw decode far above.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from conftest import build  # noqa: E402
from record import FLAGS, make_gzip_input  # noqa: E402

import branchtrace  # noqa: E402
from branchtrace.analysis.decode import branches_of, scan  # noqa: E402
from branchtrace.analysis.kernels import scan_blocks  # noqa: E402
from branchtrace.store.packed import append_packed, read_packed  # noqa: E402
from branchtrace.store.records import count_records  # noqa: E402
from branchtrace.store.ring import Ring  # noqa: E402


def parse_count(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def unpack_time(out: Path, tid: int, work: Path, repeat: int) -> float:
    drained = np.memmap(out / f"T{tid}.stream", dtype="<u8", mode="r")  # as the ring held them
    packed = work / "T1.stream.lz4"
    fd = os.open(packed, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    raw = memoryview(np.ascontiguousarray(drained)).cast("B")
    for start in range(0, len(raw), 32 << 20):
        append_packed(fd, raw[start : start + (32 << 20)])
    os.close(fd)
    with Ring.open(out / f"T{tid}.bts") as ring:
        assert np.array_equal(read_packed(packed), drained)
        elapsed = best(lambda: ring.expand(read_packed(packed)), repeat)
    packed.unlink()
    return elapsed


def measure(name: str, out: Path, work: Path, repeat: int) -> dict:
    trace = branchtrace.open(out)
    (tid,) = trace.threads[:1]
    words = trace.words(tid)
    records, _ = count_records(words)
    modules = trace.modules(tid)
    scan_blocks(words[:1000])  # compiled (or loaded from numba's cache) before timing

    def fresh() -> branchtrace.Trace:
        t = branchtrace.open(out)
        t._modules[t.pid_of(tid)] = modules  # ELF tables loaded once, like a warm cache
        return t

    def calls_symbolized() -> None:
        history = fresh().calls(tid)
        fids = history.segments["function"]
        named = np.flatnonzero(np.bincount(fids[fids >= 0]))  # a name per distinct function
        _ = [history.function_name(int(f)) for f in named]

    timings = {
        "unpack": unpack_time(out, tid, work, repeat),
        "scan": best(lambda: scan_blocks(words), repeat),
        "branches": best(lambda: branches_of(scan(words, modules)), repeat),
        "calls": best(lambda: fresh().calls(tid), repeat),
        "calls+sym": best(calls_symbolized, repeat),
        "stats": best(lambda: fresh().stats(), repeat),
    }
    blocks = scan(words, modules)
    return {
        "name": name,
        "records": records,
        "distinct": int(blocks.start.size),
        "segments": int(fresh().calls(tid).segments.size),
        **{k: records / v for k, v in timings.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", default="100M", help="blocks in the call-loop trace")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    n = parse_count(args.records)
    work = Path(tempfile.mkdtemp(prefix="bt-bench-decode-", dir="/dev/shm"))
    try:
        bigloop = build(ROOT / "tests" / "programs" / "bigloop.c", FLAGS)
        gz_input = work / "input.bin"
        make_gzip_input(gz_input)
        workloads = {
            f"call loop ({n / 1e6:g}M blocks)": [str(bigloop), str(n // 3)],
            "gzip 20 MB": [shutil.which("gzip") or "gzip", "-c", str(gz_input)],
        }
        rows = []
        for name, argv in workloads.items():
            out = work / "trace"
            record = [sys.executable, "-m", "branchtrace.cli.main", "record", "--mode", "stream"]
            subprocess.run(
                [*record, "--no-compress", "--buffer-size", "32M", "-o", str(out), "--", *argv],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            rows.append(measure(name, out, work, args.repeat))
            shutil.rmtree(out)
        print_table(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_table(rows: list[dict]) -> None:
    cols = ["unpack", "scan", "branches", "calls", "calls+sym", "stats"]
    print("records per second (millions), best of runs; one thread, trace in the page cache")
    head = f"| {'trace':<26} | {'records':>12} | {'distinct blocks':>15} | {'segments':>11} |"
    print(head + "".join(f" {c:>9} |" for c in cols))
    print(
        "|"
        + "|".join("-" * (len(p) + 0) for p in head.split("|")[1:-1])
        + "|"
        + "|".join("-" * 11 for _ in cols)
        + "|"
    )
    for r in rows:
        line = (
            f"| {r['name']:<26} | {r['records']:>12,} | {r['distinct']:>15,} "
            f"| {r['segments']:>11,} |"
        )
        print(line + "".join(f" {r[c] / 1e6:>9.1f} |" for c in cols))


if __name__ == "__main__":
    main()
