"""Shared fixtures: C programs compiled once per session, cached by a hash of source+flags."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from branchtrace.cli import main as cli_main
from branchtrace.store.format import c_writer_source

TESTS = Path(__file__).parent
PROGRAMS = TESTS / "programs"
#: the flags uftrace uses for its fixtures: every call stays a call, frames stay walkable
FIXTURE_FLAGS = ["-O0", "-g", "-fno-inline", "-fno-omit-frame-pointer"]
BUILD_DIR = Path(
    os.environ.get("BRANCHTRACE_TEST_BUILD", Path(tempfile.gettempdir()) / "branchtrace-test-build")
)


def build(source: Path, flags: list[str], headers: dict[str, str] | None = None) -> Path:
    """Compile `source` with gcc; reuse an earlier build of the same inputs."""
    headers = headers or {}
    h = hashlib.sha256(source.read_bytes() + "\0".join(flags).encode())
    for name in sorted(headers):
        h.update(name.encode() + headers[name].encode())
    out_dir = BUILD_DIR / h.hexdigest()[:16]
    exe = out_dir / source.stem
    if exe.exists():
        return exe
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in headers.items():
        (out_dir / name).write_text(text)
    tmp = Path(tempfile.mkdtemp(dir=out_dir)) / source.stem
    libs = ["-lpthread"] + (["-lstdc++"] if source.suffix == ".cpp" else [])
    subprocess.run(
        ["gcc", *flags, "-I", str(out_dir), "-o", str(tmp), str(source), *libs], check=True
    )
    tmp.rename(exe)
    return exe


@pytest.fixture(scope="session")
def programs() -> dict[str, Path]:
    """Every tests/programs/*.c built with the fixture flags (or those its `cflags:` line
    names), by name."""
    sources = sorted([*PROGRAMS.glob("*.c"), *PROGRAMS.glob("*.cpp")])
    return {src.stem: build(src, fixture_flags(src)) for src in sources}


def build_go(name: str, cgo: bool) -> Path:
    """tests/programs/NAME built with the Go toolchain (its cache beside the C fixtures')."""
    out = BUILD_DIR / name
    env = {
        **os.environ,
        "CGO_ENABLED": "1" if cgo else "0",
        "GOCACHE": str(BUILD_DIR / "go-cache"),
        "GOPATH": str(BUILD_DIR / "go-path"),
        "GOFLAGS": "-mod=mod",
    }
    subprocess.run(
        ["go", "build", "-o", str(out), "."],
        cwd=PROGRAMS / name,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


@pytest.fixture(scope="session")
def gocgo() -> Path:
    return build_go("gocgo", cgo=True)


@pytest.fixture(scope="session")
def gonocgo() -> Path:
    return build_go("gonocgo", cgo=False)


def fixture_flags(source: Path) -> list[str]:
    for line in source.read_text().splitlines()[:3]:
        if "cflags:" in line:
            return line.split("cflags:", 1)[1].split()
    return FIXTURE_FLAGS


@pytest.fixture(scope="session")
def ring_writer() -> Path:
    """The C writer test program, built against the generated format definitions."""
    return build(
        TESTS / "c" / "ring_writer.c",
        ["-O2", "-Wall", "-Werror"],
        {"bt_writer_full.h": c_writer_source()},
    )


@pytest.fixture
def shm_dir():
    """A private directory under /dev/shm (where stores live by default), removed after."""
    d = Path(tempfile.mkdtemp(prefix="bt-test-", dir="/dev/shm"))
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def in_process(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """`branchtrace ARGV` through the same main() (its error lines, its exit codes), in the
    test process: a reading command started as a process of its own spends 1.5 s loading
    numba."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_main.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(
        [sys.executable, "-m", "branchtrace.cli.main", *argv], code, out.getvalue(), err.getvalue()
    )


def recorded_burst(
    out: Path, burst: Path, n: int, *options: str, drain_held: bool
) -> subprocess.CompletedProcess[str]:
    """`branchtrace record -o OUT OPTIONS -- burst N`.  With `drain_held` the recorder is
    stopped from before the burst until after it, so nothing drains the ring meanwhile: a
    drop-mode ring smaller than the burst loses records however fast the machine is (a
    drain left running kept up with fib(26) in a 512K ring on CI)."""
    argv = ["record", "-o", str(out), *options, "--", str(burst), str(n)]
    tool = subprocess.Popen(
        [sys.executable, "-m", "branchtrace.cli.main", *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    held = False
    try:
        ready = tool.stdout.readline()
        assert ready == "ready\n", (ready, tool.stderr.read() if not ready else "")
        if drain_held:
            os.kill(tool.pid, signal.SIGSTOP)
            held = True
        tool.stdin.write("\n")
        tool.stdin.flush()
        done = tool.stdout.readline()
        assert done.startswith("done "), done
    except BaseException:
        tool.kill()
        raise
    finally:
        if held:
            os.kill(tool.pid, signal.SIGCONT)
    stdout, stderr = tool.communicate("\n", timeout=300)
    return subprocess.CompletedProcess(tool.args, tool.returncode, ready + done + stdout, stderr)
