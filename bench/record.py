"""Recording cost: `branchtrace record --mode stream` against native runs and peer tools.

    python bench/record.py [--only NAME] [--no-peers]

For each workload, in one invocation: the native time, our stream-mode recording (every
block, nothing lost), `uftrace record -P .` (Debian's uftrace: function entries only), and a
Frida JS Stalker tracer receiving block events in onReceive (queue enlarged so that it
loses nothing), each as wall time, slowdown against native, and events per second.
Times are the best of --repeat runs; native, stream and wrap runs take turns.  Each
tool's fixed start-up (spawning, injecting, compiling its agent) is measured on a trivial
program and shown; the slowdown columns are (tool time - its start-up) / native time, so
they compare the cost of tracing itself.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build  # noqa: E402  (the tests' cached gcc build)

FLAGS = ["-O2", "-g", "-fno-omit-frame-pointer"]

JS_TRACER = r"""
Stalker.queueCapacity = 1 << 22;
Stalker.queueDrainInterval = 10;
let bytes = 0;
let eventSize = 0;
function follow() {
  Stalker.follow(Process.getCurrentThreadId(), {
    events: { block: true },
    onReceive(events) {
      if (eventSize === 0) { eventSize = events.byteLength / Stalker.parse(events).length; }
      bytes += events.byteLength;
    },
  });
}
Interceptor.attach(findMain(), { onEnter() { follow(); } });
Process.attachThreadObserver({
  onAdded(t) { if (t.id === Process.getCurrentThreadId()) follow(); },
});
Interceptor.attach(Module.getGlobalExportByName('_exit'), {
  onEnter() {
    Stalker.flush();
    Thread.sleep(0.05);
    send({ events: eventSize ? bytes / eventSize : 0 });
    recv('ack', () => {}).wait();
  },
});
"""


#: a peer run that takes longer than this many times the native run is stopped and shown
#: as not finished (uftrace stalled for over 15 minutes on the 4-thread loop of 0.3 s)
PEER_LIMIT = 1000


def timed(argv: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    res = subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace", **kw
    )
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({res.returncode}): {res.stderr[-500:]}")
    return dt, res


def run_ours(argv: list[str], out: Path, mode: str = "stream") -> tuple[float, int]:
    bt = [sys.executable, "-m", "branchtrace.cli.main", "record", "--mode", mode]
    dt, _ = timed([*bt, "--buffer-size", "32M", "-o", str(out), "--", *argv])
    meta = json.loads((out / "meta.json").read_text())
    assert all(t["lost"] == 0 for t in meta["threads"].values())
    return dt, sum(t["records"] for t in meta["threads"].values())


def run_uftrace(argv: list[str], out: Path, limit: float | None = None) -> float:
    """Seconds, or infinity if it did not finish within `limit`."""
    shm = Path("/dev/shm")
    before = set(shm.glob("uftrace-*"))
    try:
        dt, _ = timed(["uftrace", "record", "-P", ".", "-d", str(out), *argv], timeout=limit)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-9", "-f", argv[0]], check=False)
        for buffer in set(shm.glob("uftrace-*")) - before:  # a killed uftrace leaves them
            buffer.unlink(missing_ok=True)
        return float("inf")
    return dt


def run_frida_js(argv: list[str], limit: float | None = None) -> tuple[float, int]:
    import frida

    device = frida.get_local_device()
    t0 = time.perf_counter()
    pid = device.spawn(argv, stdio="pipe")
    session = device.attach(pid)
    find_main = (ROOT / "src" / "branchtrace" / "engines" / "find_main.js").read_text()
    script = session.create_script(find_main + JS_TRACER)
    result: dict[str, int] = {}

    def on_message(message, data):
        if message["type"] == "send":
            result.update(message["payload"])
            script.post({"type": "ack"})

    script.on("message", on_message)
    script.load()
    device.resume(pid)
    while True:  # until the program is a zombie or gone (Frida reaps it, not us)
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                break
        except (OSError, IndexError):
            break
        if limit is not None and time.perf_counter() - t0 > limit:
            device.kill(pid)
            return float("inf"), 0
        time.sleep(0.005)
    return time.perf_counter() - t0, int(result.get("events", 0))


def has_symbols(path: str) -> bool:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        return ELFFile(f).get_section_by_name(".symtab") is not None


def make_gzip_input(path: Path) -> None:
    import random

    rng = random.Random(7)
    words = [
        bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    with open(path, "wb") as f:
        size = 0
        while size < 20 << 20:
            line = b" ".join(rng.choices(words, k=12)) + b"\n"
            f.write(line)
            size += len(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run one workload")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bt-bench-", dir="/dev/shm"))
    try:
        gz_input = work / "input.txt"
        make_gzip_input(gz_input)
        exe = {p.stem: build(p, FLAGS) for p in (ROOT / "bench" / "programs").glob("*.c")}
        workloads = {
            # sized so that each native run takes 0.25-0.6 s: a ratio then moves by well
            # under 1x when a tool's start-up varies by 0.1 s
            "call loop": [str(exe["calls"]), "300000000"],
            "fib(40)": [str(exe["fib"]), "40"],
            "qsort 2M": [str(exe["qsort"]), "2000000"],
            "indirect calls": [str(exe["indirect"]), "200000000"],
            "4 pthreads": [str(exe["pthreads"]), "600000000"],
            "gzip 20 MB": [shutil.which("gzip") or "gzip", "-c", str(gz_input)],
        }
        trivial = [str(exe["fib"]), "1"]
        have_uftrace = shutil.which("uftrace") is not None and not args.no_peers
        startup = {"ours": min(run_ours(trivial, work / "ours")[0] for _ in range(args.repeat))}
        startup["wrap"] = min(
            run_ours(trivial, work / "wrap", "wrap")[0] for _ in range(args.repeat)
        )
        if have_uftrace:
            startup["uftrace"] = min(
                run_uftrace(trivial, work / "uftrace") for _ in range(args.repeat)
            )
        if not args.no_peers:
            startup["frida_js"] = min(run_frida_js(trivial)[0] for _ in range(args.repeat))
        rows = []
        for name, argv in workloads.items():
            if args.only and args.only != name:
                continue
            # native and traced runs take turns, so that a slow spell of the machine (this
            # VM's speed drifts by up to 30% over minutes) falls on both sides of a ratio
            natives, ours, wraps = [], [], []
            for _ in range(args.repeat):
                natives.append(timed(argv)[0])
                ours.append(run_ours(argv, work / "ours"))
                wraps.append(run_ours(argv, work / "wrap", "wrap")[0])
            native = min(natives)
            ours_t, ours_n = min(ours)
            wrap_t = min(wraps)
            row = {
                "workload": name,
                "native": native,
                "ours": ours_t,
                "records": ours_n,
                "wrap": wrap_t,
            }
            limit = max(PEER_LIMIT * native, 60.0)
            if have_uftrace and has_symbols(argv[0]):  # uftrace -P needs a symbol table
                runs = [run_uftrace(argv, work / "uftrace", limit)]
                while len(runs) < args.repeat and runs[-1] != float("inf"):
                    runs.append(run_uftrace(argv, work / "uftrace", limit))
                row["uftrace"] = min(runs)
            if not args.no_peers:
                js_t, js_n = run_frida_js(argv, limit)
                if js_n or js_t == float("inf"):  # a tracer that saw nothing is no measurement
                    row["frida_js"], row["frida_js_events"] = js_t, js_n
            rows.append(row)
            print(f"... {name}: {row}", file=sys.stderr)
        print_table(rows, startup)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_table(rows: list[dict], startup: dict[str, float]) -> None:
    print(
        "start-up on a trivial program: " + ", ".join(f"{k} {v:.2f} s" for k, v in startup.items())
    )
    print(
        "| workload | native s | branchtrace stream s | slowdown | M records/s "
        "| branchtrace wrap s | slowdown "
        "| uftrace -P . s | slowdown | Frida JS Stalker s | slowdown | M events/s |"
    )
    print("|" + "---|" * 12)

    def traced(r: dict, key: str) -> float:
        return max(r[key] - startup.get(key, 0.0), 1e-9)

    slow: dict[str, list[float]] = {}
    for r in rows:
        cells = []
        for key in ("ours", "wrap", "uftrace", "frida_js"):
            if key not in r:
                cells.append("- | -")
                continue
            ratio = traced(r, key) / r["native"]
            slow.setdefault(key, []).append(ratio)
            if ratio == float("inf"):  # stopped at the limit: slower than that, counted so
                cells.append(f"stopped | > {PEER_LIMIT}x")
                continue
            cells.append(f"{r[key]:.2f} | {ratio:.1f}x")
            if key == "ours":
                cells[-1] += f" | {r['records'] / traced(r, key) / 1e6:.0f}"
        rate = (
            f"{r['frida_js_events'] / traced(r, 'frida_js') / 1e6:.1f}"
            if r.get("frida_js_events")
            else "-"
        )
        print(f"| {r['workload']} | {r['native']:.2f} | " + " | ".join(cells) + f" | {rate} |")
    for key, values in slow.items():
        print(f"median slowdown, {key}: {statistics.median(values):.1f}x")


if __name__ == "__main__":
    main()
