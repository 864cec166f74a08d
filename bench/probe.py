"""Cost of a probe hit, per engine, against the unprobed call — in one run.

    python bench/probe.py [--calls N] [--repeat R]

The program calls probed(i, n) N times and times the loop itself (so attaching and start-up
are not counted).  Every engine probes `probed(arg1, arg2)` (two register values per hit)
and must count exactly N+1 hits.  Peer: a plain Frida JS `Interceptor.attach` reading the
same two arguments (the in-process way, as `frida-trace` does it).  ns per hit = probed
ns per call - native ns per call; the best of --repeat runs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build  # noqa: E402  (the tests' cached gcc build)

FRIDA_JS = """
let hits = 0, total = 0;
const probed = Process.mainModule.enumerateSymbols().find((s) => s.name === 'probed');
Interceptor.attach(probed.address, {
  onEnter(args) { hits++; total += args[0].toInt32() + args[1].toInt32(); },
});
Interceptor.attach(Module.getGlobalExportByName('_exit'), {
  onEnter() { send({ hits }); recv('ack', () => {}).wait(); },
});
"""

ENGINES = [
    ("uprobe", ["--engine", "uprobe"], "kernel uprobe (perf_event_open)"),
    ("xol auto", ["--engine", "xol"], "ptrace int3, push emulated"),
    ("xol boost", ["--engine", "xol", "--displaced", "boost"], "ptrace int3, boosted slot"),
    ("xol step", ["--engine", "xol", "--displaced", "step"], "ptrace int3 + XOL single-step"),
    ("xol inline", ["--engine", "xol", "--inline-step"], "ptrace int3 + inline single-step"),
]


def per_call(output: str) -> float:
    m = re.search(r"ns_per_call ([\d.]+)", output)
    if not m:
        raise RuntimeError(f"no timing in the program's output: {output!r}")
    return float(m.group(1))


def run_native(program: Path, calls: int) -> float:
    out = subprocess.run([str(program), str(calls)], capture_output=True, text=True, check=True)
    return per_call(out.stdout)


def run_engine(program: Path, calls: int, args: list[str]) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "branchtrace.cli.main", "probe", "-q", *args]
    cmd += ["probed(arg1, arg2)", "--", str(program), str(calls)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    hits = int(re.search(r"probed\s+([\d,]+)", out.stderr).group(1).replace(",", ""))  # type: ignore[union-attr]
    return per_call(out.stdout), hits


def run_frida(program: Path, calls: int) -> tuple[float, int]:
    import frida

    device = frida.get_local_device()
    pid = device.spawn([str(program), str(calls)], stdio="pipe")
    session = device.attach(pid)
    got: dict[str, int] = {}
    done = threading.Event()
    output: list[bytes] = []
    script = session.create_script(FRIDA_JS)

    def on_message(message: dict, data: object) -> None:
        if message.get("type") == "error":
            print(f"Frida peer: {message.get('description')}", file=sys.stderr)
            done.set()
        if message.get("type") == "send":
            got.update(message["payload"])
            script.post({"type": "ack"})
            done.set()

    script.on("message", on_message)
    device.on("output", lambda p, fd, data: output.append(data))
    script.load()
    device.resume(pid)
    done.wait(120)
    session.on("detached", lambda *a: None)
    import time

    time.sleep(0.3)
    return per_call(b"".join(output).decode()), got.get("hits", -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    program = build(ROOT / "bench" / "programs" / "probe_loop.c", ["-O2", "-g"])
    native = min(run_native(program, a.calls) for _ in range(a.repeat))
    rows = [("native", "no probe", native, None, a.calls + 1)]
    for name, args, how in ENGINES:
        best, hits = min(run_engine(program, a.calls, args) for _ in range(a.repeat))
        rows.append((name, how, best, best - native, hits))
    best, hits = min(run_frida(program, a.calls) for _ in range(a.repeat))
    rows.append(("peer: Frida JS", "Interceptor.attach, JS onEnter", best, best - native, hits))
    print(f"probe cost per hit, {a.calls:,} calls of probed(i, n), best of {a.repeat}")
    print(f"| {'engine':<15} | {'how':<32} | {'ns/call':>9} | {'ns/hit':>9} | {'hits':>8} |")
    print(f"|{'-' * 17}|{'-' * 34}|{'-' * 11}|{'-' * 11}|{'-' * 10}|")
    for name, how, call, hit, hits in rows:
        cost = f"{hit:,.0f}" if hit is not None else "-"
        exact = "" if hits == a.calls + 1 else " (!)"
        print(f"| {name:<15} | {how:<32} | {call:>9,.1f} | {cost:>9} | {hits:>8,}{exact} |")


if __name__ == "__main__":
    main()
