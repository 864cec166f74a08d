"""Children forked while Frida's agent loads, stuck on its heap lock or on a mutex of its:
or on the C library's exit lock: found and freed (engines/forkwindow.py), on fixtures that
build the same stuck states without Frida (tests/programs/heaplock.c, mutexlock.c,
exitlock.c); test_record.py has the real attach."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from branchtrace.engines import forkwindow, stalker
from branchtrace.engines import ptrace as pt
from branchtrace.engines.procevents import ExitWatcher


@contextlib.contextmanager
def heaplock(program, how: str = "frida") -> Iterator[subprocess.Popen]:
    """heaplock (or mutexlock) started, then made to fork: the program and its child, the
    child spinning (or asleep on the mutex)."""
    target = subprocess.Popen(
        [str(program), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert target.stdout.readline() == "ready\n"
        yield target
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(target.pid, signal.SIGKILL)
        target.communicate()


def fork_now(target: subprocess.Popen) -> int:
    target.stdin.write("go\n")
    target.stdin.flush()
    child = int(target.stdout.readline().split()[1])
    time.sleep(0.05)  # into its loop
    return child


def asleep(child: int) -> bool:
    """Whether `child` is (back) asleep within a second: let go after a ptrace stop, it runs
    for a moment as its system call starts again."""
    deadline = time.monotonic() + 1
    while forkwindow.proc_stat(child)[0] != "S" and time.monotonic() < deadline:
        time.sleep(0.01)
    return forkwindow.proc_stat(child)[0] == "S"


def child_status(target: subprocess.Popen) -> str:
    try:
        return target.communicate(timeout=5)[0].strip()
    except subprocess.TimeoutExpired:
        return "still waiting for its child"


@pytest.mark.parametrize("how", ["frida", "gum"])
def test_a_child_spinning_on_a_lock_no_thread_of_it_holds_is_freed_and_exits_0(programs, how):
    # "frida": Frida's heap lock (dlmalloc's, which yields); "gum": one of Gum's spin locks
    with heaplock(programs["heaplock"], how) as target:
        child = fork_now(target)
        assert forkwindow.free_if_stuck(child)
        assert child_status(target) == "status 0"


def test_gums_spin_lock_is_found_from_every_pc_of_its_loop_and_nowhere_else(programs):
    with heaplock(programs["heaplock"], "gum") as target:
        child = fork_now(target)
        assert forkwindow._stop(child)
        try:
            regs = pt.getregs(child)
            lock = regs["rdi"]
            assert forkwindow._read(child, lock, 4) == (1).to_bytes(4, "little")
            start = next(
                regs.rip - at
                for at in forkwindow._GUM_SPIN_LOOP
                if forkwindow._read(child, regs.rip - at, 16) == forkwindow._GUM_SPIN
            )
            for at in range(len(forkwindow._GUM_SPIN)):
                regs.rip = start + at
                found = forkwindow._spin_lock(child, regs)
                assert found == (lock if at in forkwindow._GUM_SPIN_LOOP else None), at
        finally:
            forkwindow._let_go(child)


@pytest.mark.parametrize("how", ["plain", "threads"])
def test_other_children_are_left_alone(programs, how):
    # a plain busy loop is no Frida lock; with a second thread the lock may yet be released
    with heaplock(programs["heaplock"], how) as target:
        child = fork_now(target)
        assert not forkwindow.free_if_stuck(child)
        time.sleep(0.2)
        assert forkwindow.proc_stat(child)[0] == "R"  # still spinning, and not left stopped
        os.kill(child, signal.SIGKILL)
        assert child_status(target) == f"status {signal.SIGKILL}"


def test_a_child_asleep_on_a_mutex_of_frida_held_by_a_thread_it_has_not_is_freed(programs):
    with heaplock(programs["mutexlock"]) as target:
        child = fork_now(target)
        assert Path(f"/proc/{child}/wchan").read_text() == "futex_do_wait"
        lock = forkwindow.stuck_on(child)
        assert lock is not None and lock.kind == "mutex"
        lock_word, count, owner, users, kind = forkwindow._mutex(child, lock.address)
        assert (lock_word, count, users, kind) == (2, 1, 1, 1)  # held once, recursive
        assert owner not in (0, child)
        assert forkwindow.release(child, lock)
        # it took the mutex for itself: unlocking it, as its owner, returned 0
        assert child_status(target) == "status 0"


@pytest.mark.parametrize("how", ["plain", "threads"])
def test_a_child_asleep_on_a_mutex_the_program_took_itself_or_with_a_second_thread_is_left_alone(
    programs, how
):
    # "plain": a deadlock of the program's own, natively too, not Frida's
    with heaplock(programs["mutexlock"], how) as target:
        child = fork_now(target)
        assert forkwindow.stuck_on(child) is None
        assert not forkwindow.free_if_stuck(child)
        time.sleep(0.2)
        assert asleep(child)  # still asleep, and not left stopped
        os.kill(child, signal.SIGKILL)
        assert child_status(target) == f"status {signal.SIGKILL}"


def test_a_mutex_is_released_only_while_its_child_still_sleeps_on_it(programs):
    with heaplock(programs["mutexlock"]) as target:
        child = fork_now(target)
        lock = forkwindow.stuck_on(child)
        assert lock is not None
        elsewhere = lock._replace(address=lock.address + 64)
        assert not forkwindow.release(child, elsewhere)  # not the word its wait is on
        assert forkwindow._mutex(child, lock.address)[0] == 2  # untouched
        assert asleep(child)
        assert forkwindow.free_if_stuck(child)
        assert child_status(target) == "status 0"


def test_a_child_asleep_in_exit_on_the_c_librarys_lock_is_freed_only_if_forked_at_risk(programs):
    with heaplock(programs["exitlock"]) as target:
        child = _stuck_exiting(target)
        # forked at any other time, that lock was held by the program's own thread
        assert forkwindow.stuck_on(child) is None
        lock = forkwindow.stuck_on(child, libc_too=True)
        assert lock is not None and lock.kind == "libc"
        path, start, end = forkwindow._libc(forkwindow._mappings(child))
        assert Path(path).name.startswith("libc.so") and start <= lock.address < end
        watch = forkwindow.ForksUnderFrida(target.pid)
        watch.attached(follow_new=True)  # forked before the watch: not looked at
        watch.free_stuck()
        assert watch.freed == [] and asleep(child)
        assert forkwindow.release(child, lock)
        assert child_status(target) == "status 0"


def _stuck_exiting(target: subprocess.Popen) -> int:
    target.stdin.write("go\n")
    target.stdin.flush()
    child = int(target.stdout.readline().split()[1])
    assert child != 0, "no child stuck in 5,000 forks"
    return child


def test_the_lock_is_found_from_every_pc_of_the_loop_and_from_the_yield_it_calls(programs):
    with heaplock(programs["heaplock"]) as target:
        child = fork_now(target)
        assert forkwindow._stop(child)
        try:
            regs = pt.getregs(child)
            back = int.from_bytes(forkwindow._read(child, regs["rsp"], 8), "little")
            head = back - forkwindow._AFTER_YIELD_CALL
            code = forkwindow._read(child, head, forkwindow._SPIN_LOOP_LEN)
            assert forkwindow._SPIN_LOOP.fullmatch(code), "stopped outside the yield call"
            lock = regs["rbx"]
            assert forkwindow._read(child, lock, 4) == (1).to_bytes(4, "little")
            assert forkwindow._spin_lock(child, regs) == lock  # in the yield it calls
            regs.rsp += 8  # no return into the loop on the stack: only the pc can tell
            for pc in range(head, head + forkwindow._SPIN_LOOP_LEN):
                regs.rip = pc
                assert forkwindow._spin_lock(child, regs) == lock, hex(pc - head)
            for pc in (head - 1, head + forkwindow._SPIN_LOOP_LEN):
                regs.rip = pc
                assert forkwindow._spin_lock(child, regs) is None, hex(pc - head)
        finally:
            forkwindow._let_go(child)
        assert forkwindow.free_if_stuck(child)
        assert child_status(target) == "status 0"


@pytest.mark.parametrize("program", ["heaplock", "mutexlock"])  # spinning, or asleep
def test_only_children_forked_since_the_watch_began_are_watched(programs, program):
    with heaplock(programs[program]) as target:
        child = fork_now(target)
        late = forkwindow.ForksUnderFrida(target.pid)
        late.attached(follow_new=True)
        late.free_stuck()
        assert late.freed == []
        assert forkwindow.free_if_stuck(child)
        assert child_status(target) == "status 0"
    with heaplock(programs[program]) as target:
        watch = forkwindow.ForksUnderFrida(target.pid)
        child = fork_now(target)
        watch.attached(follow_new=False)
        watch.detaching()
        assert watch.settle() == []
        assert (watch.freed, watch.stuck) == ([child], [])
        assert child_status(target) == "status 0"


def test_a_child_spinning_again_on_a_lock_released_once_is_named_not_released(programs):
    with heaplock(programs["heaplock"], "twice") as target:
        watch = forkwindow.ForksUnderFrida(target.pid)
        child = fork_now(target)
        watch.attached(follow_new=True)
        watch.free_stuck()
        assert (watch.freed, watch.stuck) == ([child], [])
        time.sleep(0.05)  # it takes the lock, then spins on it again
        watch.free_stuck()
        watch.free_stuck()
        assert (watch.freed, watch.stuck) == ([child], [child])
        assert forkwindow.stuck_on(child) is not None  # never released: it still spins
        watch.detaching()
        assert watch.settle(grace=0.05) == [child]


def test_a_child_forked_during_the_attach_that_still_runs_is_named_at_risk(programs):
    with heaplock(programs["heaplock"], "plain") as target:
        watch = forkwindow.ForksUnderFrida(target.pid)
        child = fork_now(target)
        watch.attached(follow_new=True)
        watch.detaching()
        assert watch.settle(grace=0.05) == [child]
        assert watch.freed == []


def test_only_a_child_forked_as_frida_unloads_is_named_at_risk(programs):
    # under --follow-fork a child forked during the recording and still running at the
    # detach was named as forked while Frida's agent loaded or unloaded (docs/fork.md
    # section 16)
    with heaplock(programs["heaplock"], "plain") as target:
        watch = forkwindow.ForksUnderFrida(target.pid)
        watch.attached(follow_new=False)
        fork_now(target)  # during the recording: Frida's and ours
        watch.detaching()
        assert watch.settle(timeout=0.3, grace=0.05) == []
    with heaplock(programs["heaplock"], "plain") as target:
        watch = forkwindow.ForksUnderFrida(target.pid)
        watch.attached(follow_new=False)
        watch.detaching()
        child = fork_now(target)
        assert watch.settle(timeout=0.3, grace=0.05) == [child]


@contextlib.contextmanager
def stopped_by(tracer: str, pid: int) -> Iterator[None]:
    """`pid` held in a tracing stop by a thread of this process ("us") or of another one."""
    other = None
    if tracer == "us":
        pt.call(pt.PTRACE_SEIZE, pid)
        pt.call(pt.PTRACE_INTERRUPT, pid)
        os.waitpid(pid, pt.WALL)
    else:
        seize = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None)
libc.ptrace({pt.PTRACE_SEIZE}, {pid}, None, None)
libc.ptrace({pt.PTRACE_INTERRUPT}, {pid}, None, None)
os.waitpid({pid}, {pt.WALL})
print("stopped", flush=True)
sys.stdin.read()
"""
        other = subprocess.Popen(
            ["python3", "-c", seize], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert other.stdout.readline() == "stopped\n"
    try:
        yield
    finally:
        if other is None:
            pt.call(pt.PTRACE_DETACH, pid)
        else:
            other.communicate("")


@pytest.fixture
def forkcounters(programs) -> Iterator[tuple[int, int]]:
    """forkcounters running: its pid and the address of its counters."""
    target = subprocess.Popen([str(programs["forkcounters"])], stdout=subprocess.PIPE, text=True)
    try:
        yield target.pid, int(target.stdout.readline(), 16)
    finally:
        target.kill()
        target.communicate()


def test_a_process_held_stopped_by_a_thread_of_ours_is_found_and_not_one_traced_elsewhere(
    forkcounters,
):
    pid, _ = forkcounters
    assert forkwindow.stopped_by_us(pid) is None
    with stopped_by("us", pid):
        assert forkwindow.stopped_by_us(pid) == pid
    assert forkwindow.stopped_by_us(pid) is None
    with stopped_by("another process", pid):
        assert Path(f"/proc/{pid}/status").read_text().count("\tt (tracing stop)") == 1
        assert forkwindow.stopped_by_us(pid) is None


def counters_at(pid: int, address: int) -> stalker._ForkCounters:
    where = {
        "held": hex(address),
        "inFlight": hex(address + 4),
        "passing": hex(address + 8),
        "gated": hex(address + 12),
    }
    return stalker._ForkCounters(pid, where)


def test_forks_held_by_an_agent_that_does_not_answer_are_let_go_through_memory(forkcounters):
    pid, address = forkcounters
    counters = counters_at(pid, address)
    assert counters.hold(True, wait=False) is True
    mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        os.pwrite(mem, (1).to_bytes(4, "little"), counters.gated)
        at = (counters.held, counters.in_flight, counters.passing, counters.gated)
        assert [int.from_bytes(os.pread(mem, 4, a), "little") for a in at] == [1, 1, 0, 1]

        counters.let_go()

        # the count of forks under way is not the recorder's to change
        assert [int.from_bytes(os.pread(mem, 4, a), "little") for a in at] == [0, 1, 0, 0]
    finally:
        os.close(mem)


def test_a_process_held_stopped_by_frida_with_a_fork_under_way_is_frozen_after_a_while(
    forkcounters, monkeypatch
):
    monkeypatch.setattr(stalker, "FROZEN_AFTER", 0.2)
    pid, address = forkcounters
    counters = counters_at(pid, address)
    assert not counters.frozen()
    with stopped_by("us", pid):
        assert not counters.frozen()  # not yet: Frida's injector stops threads for a moment
        time.sleep(0.25)
        assert counters.frozen()
        started = time.monotonic()
        assert counters.hold(True) is False  # at once, not after AGENT_TIMEOUT s
        assert time.monotonic() - started < 1
    assert not counters.frozen()


def test_a_process_held_stopped_with_no_fork_under_way_is_not_frozen(forkcounters, monkeypatch):
    monkeypatch.setattr(stalker, "FROZEN_AFTER", 0.2)
    pid, address = forkcounters
    counters = counters_at(pid, address + 4)  # in flight and passing read as 0
    with stopped_by("us", pid):
        time.sleep(0.25)
        assert not counters.frozen()
        assert counters.hold(True) is True


class FakeFrida:
    """Frida's device and a session of it, as far as _ForkFollower uses them when it attaches
    to no child."""

    def __init__(self) -> None:
        self.resumed: list[int] = []
        self.callbacks: dict[str, Any] = {}  #: by signal: "child-added", "detached"

    def on(self, signal_name: str, callback: Any) -> None:
        self.callbacks[signal_name] = callback

    def off(self, *_: object) -> None:
        pass

    def resume(self, pid: int) -> None:
        self.resumed.append(pid)

    def enumerate_pending_children(self) -> list[object]:
        return []

    def enable_child_gating(self) -> None:
        pass

    disable_child_gating = enable_child_gating


@pytest.mark.parametrize("found", ["while recording", "at the end"])
def test_a_child_frozen_before_frida_reported_it_is_killed_so_its_parent_goes_on(
    programs, monkeypatch, found
):
    monkeypatch.setattr(stalker, "FROZEN_AFTER", 0.2)
    target = subprocess.Popen(
        [str(programs["faultchild"])], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child = int(target.stdout.readline())
    try:
        # as Frida's injector re-creating its agent thread: it traces the child, which
        # faults, and holds it in that stop
        pt.call(pt.PTRACE_SEIZE, child)
        target.stdin.write("go\n")
        target.stdin.flush()
        _, status = os.waitpid(child, pt.WALL)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSEGV
        frida, errors = FakeFrida(), []
        with ExitWatcher() as watcher:
            follower = stalker._ForkFollower(frida, fake_recording(errors, target.pid), watcher)
            follower.watch(frida, target.pid)
            if found == "while recording":
                for _ in range(2):
                    # not yet: a young child is not looked at, and then Frida's injector
                    # stops a thread for a moment only
                    assert follower.frozen() == []
                    assert follower.killed == {}
                    time.sleep(0.25)
                assert follower.frozen() == []  # a child, not a process with our agent
                assert follower.killed == {child: target.pid}
            processes = follower.close()  # at the end: waits until it counts as frozen
            assert follower.killed == {child: target.pid}
            assert target.communicate(timeout=5)[0] == "signal 9\n"  # it went on
        assert processes == {
            child: {
                "ppid": target.pid,
                "untraced": "frozen before Frida reported it",
                "frozen": True,
                "signal": signal.SIGKILL,
            }
        }
        assert len(errors) == 1
        assert errors[0].startswith(
            f"forked child {child} of pid {target.pid} faulted inside Frida's recovery"
        )
        fate = "branchtrace killed it, so that its parent could go on; it was not traced"
        assert fate in errors[0]
    finally:
        forkwindow.kill_held(child)  # it holds the pipe to the program's output open
        target.kill()
        target.communicate()


def python_program(program: str) -> subprocess.Popen:
    """`program` run by Python in a session of its own, its stdin and stdout piped."""
    return subprocess.Popen(
        [sys.executable, "-c", program],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def fake_recording(errors: list[str], *traced: int) -> SimpleNamespace:
    """What _ForkFollower uses of a _Recording: its warnings go to `errors`; the processes
    `traced` have their main thread traced."""
    return SimpleNamespace(
        _error=errors.append, lock=threading.Lock(), thread_pid={pid: pid for pid in traced}
    )


@contextlib.contextmanager
def program_under_follower(program: str):
    """`program` (python_program), watched by a _ForkFollower of a fake Frida a clock tick
    or more after it starts (its children start after gating began), then sent "go":
    (follower, program, the follower's errors).  Killed, with its children, at the end."""
    frida, errors = FakeFrida(), []
    with ExitWatcher() as watcher:
        target = python_program(program)
        follower = stalker._ForkFollower(frida, fake_recording(errors, target.pid), watcher)
        try:
            time.sleep(0.05)
            follower.watch(frida, target.pid)
            target.stdin.write("go\n")
            target.stdin.flush()
            yield follower, target, errors
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(target.pid, signal.SIGKILL)
            target.communicate()


def test_a_child_forked_during_the_recording_that_frida_never_reported_is_named(monkeypatch):
    # Frida lost such a child (threads starting while others forked): it waited in Frida's
    # code for good, its parent with it, and the recording named it nowhere
    # (docs/fork.md section 16).  A child the program had before the recording is not one.
    monkeypatch.setattr(stalker, "FROZEN_AFTER", 0.2)
    program = (
        "import os, sys, time\n"
        "def child():\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    print(pid, flush=True)\n"
        "child()\n"
        "sys.stdin.readline()\n"
        "child()\n"
        "sys.stdin.readline()\n"
    )
    target = python_program(program)
    try:
        early = int(target.stdout.readline())
        time.sleep(0.05)  # a clock tick (10 ms) or more before the recording
        frida, errors = FakeFrida(), []
        with ExitWatcher() as watcher:
            follower = stalker._ForkFollower(frida, fake_recording(errors, target.pid), watcher)
            follower.watch(frida, target.pid)
            target.stdin.write("go\n")
            target.stdin.flush()
            late = int(target.stdout.readline())
            follower.frozen()  # as while recording: the children not reported yet are listed
            time.sleep(0.3)
            processes = follower.close()
        assert processes == {late: {"ppid": target.pid, "untraced": "never reported by Frida"}}
        assert errors == [
            f"child {late} of pid {target.pid}, forked during the recording, was never "
            "reported by Frida, so not traced: forked past Frida's fork() hook, or lost by "
            "Frida, which leaves such a child waiting in its code for good (a Frida bug; "
            "docs/fork.md section 16)"
        ]
        assert early != late
    finally:
        os.killpg(target.pid, signal.SIGKILL)
        target.communicate()


def test_a_never_reported_child_whose_parent_ended_is_named_under_that_parent(monkeypatch):
    # A spawned program hung on such a child and stopped with Ctrl-C is killed before the
    # recording ends: the child, reparented, was then named nowhere (docs/fork.md section 17)
    monkeypatch.setattr(stalker, "FROZEN_AFTER", 0.2)
    program = (
        "import os, sys, time\n"
        "sys.stdin.readline()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(pid, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    with program_under_follower(program) as (follower, target, errors):
        kid = int(target.stdout.readline())
        follower.frozen()  # as while recording: the children not reported yet are listed
        target.stdin.write("end\n")
        target.stdin.flush()
        target.wait()  # the program ends; its child lives on, reparented
        assert stalker._parent_of(kid) != target.pid
        time.sleep(0.3)
        processes = follower.close()
        assert processes == {kid: {"ppid": target.pid, "untraced": "never reported by Frida"}}
        assert len(errors) == 1 and f"child {kid} of pid {target.pid}" in errors[0]


def test_an_unreported_child_asleep_in_fridas_code_is_killed_and_one_asleep_in_its_own_is_not(
    monkeypatch, tmp_path
):
    # A child forked while another thread of its parent held a lock of Frida's waits on it
    # for good in Frida's recovery, and its parent waits for the child: the recording hung
    # until Ctrl-C (docs/fork.md section 18).  Here the child sleeps in pause() called from
    # code mapped from a file named like Frida's agent; its sibling sleeps in its own code.
    monkeypatch.setattr(stalker, "FROZEN_AFTER", 0.1)
    monkeypatch.setattr(stalker, "STUCK_AFTER", 0.3)
    agent = tmp_path / "frida-agent-64.so"
    agent.write_bytes(bytes([0xB8, 34, 0, 0, 0, 0x0F, 0x05, 0xC3]).ljust(4096, b"\0"))
    program = (
        "import ctypes, os, sys, time\n"
        "sys.stdin.readline()\n"
        "stuck = os.fork()\n"
        "if stuck == 0:\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    libc.mmap.restype = ctypes.c_void_p\n"
        "    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,"
        " ctypes.c_int, ctypes.c_long]\n"
        f"    fd = os.open({str(agent)!r}, os.O_RDONLY)\n"
        "    code = libc.mmap(None, 4096, 5, 2, fd, 0)  # PROT_READ|PROT_EXEC, MAP_PRIVATE\n"
        "    ctypes.CFUNCTYPE(ctypes.c_long)(code)()  # pause()\n"
        "    os._exit(0)\n"
        "sleeping = os.fork()\n"
        "if sleeping == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(stuck, sleeping, flush=True)\n"
        "print(os.waitpid(stuck, 0)[1], flush=True)\n"
        "sys.stdin.readline()\n"
    )
    with program_under_follower(program) as (follower, target, errors):
        stuck, sleeping = (int(x) for x in target.stdout.readline().split())
        deadline = time.monotonic() + 10
        while stuck not in follower.killed and time.monotonic() < deadline:
            follower.frozen()  # as while recording, every FORK_CHECK_INTERVAL
            time.sleep(0.05)
        assert stuck in follower.killed and sleeping not in follower.killed
        assert int(target.stdout.readline()) == signal.SIGKILL  # its parent went on
        processes = follower.close()
        assert processes == {
            stuck: {
                "ppid": target.pid,
                "untraced": "stuck before Frida reported it",
                "stuck": True,
                "signal": signal.SIGKILL.value,
            },
            sleeping: {"ppid": target.pid, "untraced": "never reported by Frida"},
        }
        assert errors[0] == (
            f"forked child {stuck} of pid {target.pid} waited for good inside Frida's "
            "recovery from a fork(), before Frida reported it: on a lock of Frida's that "
            "another thread of its parent held at the fork() (a Frida bug; docs/fork.md "
            "section 18): it could never run again: branchtrace killed it after 0 s, so "
            "that its parent could go on; it was not traced"
        )
        assert len(errors) == 2 and f"child {sleeping} of pid {target.pid}" in errors[1]


def test_children_that_ended_before_frida_reported_them_are_named_with_their_ending():
    # A child of startfork died of SIGSEGV in a thread of Frida's as Frida recovered from its
    # fork(), before Frida reported it: its parent printed the status, the recording named
    # it nowhere (docs/fork.md section 19).  A child that calls exec is Frida's to report; a
    # child forked by a thread not traced is Frida's own (Gum's helper that stops a thread);
    # one forked once Frida dropped its session with the parent was never gated.
    program = (
        "import os, signal, sys, threading\n"
        "sys.stdin.readline()\n"
        "kids = []\n"
        "def child(how):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        if how == 'segv':\n"
        "            os.kill(os.getpid(), signal.SIGSEGV)\n"
        "        if how == 'exec':\n"
        "            os.execv('/bin/true', ['true'])\n"
        "        os._exit(3)\n"
        "    os.waitpid(pid, 0)\n"
        "    kids.append(pid)\n"
        "for how in ('segv', 'exit', 'exec'):\n"
        "    child(how)\n"
        "untraced = threading.Thread(target=child, args=('exit',))\n"
        "untraced.start()\n"
        "untraced.join()\n"
        "print(*kids, flush=True)\n"
        "sys.stdin.readline()\n"
        "child('exit')\n"
        "print(kids[-1], flush=True)\n"
        "sys.stdin.readline()\n"
    )
    frida, errors = FakeFrida(), []
    with ExitWatcher() as watcher:
        if not watcher.available:
            pytest.skip("no process events (needs CAP_NET_ADMIN)")
        target = python_program(program)
        follower = stalker._ForkFollower(frida, fake_recording(errors, target.pid), watcher)
        try:
            follower.watch(frida, target.pid)
            target.stdin.write("go\n")
            target.stdin.flush()
            segv, exits, _, by_untraced = (int(x) for x in target.stdout.readline().split())
            frida.callbacks["detached"]("application-requested", None)
            target.stdin.write("on\n")
            target.stdin.flush()
            ungated = int(target.stdout.readline())
            time.sleep(0.2)  # the process events come in on a thread of the watcher's
            assert {by_untraced, ungated} <= set(watcher.children(target.pid))
            processes = follower.close()
            ended = {
                "ppid": target.pid,
                "untraced": "ended before Frida reported it",
                "ended_unreported": True,
            }
            assert processes == {
                segv: ended | {"exit_code": None, "signal": signal.SIGSEGV.value},
                exits: ended | {"exit_code": 3, "signal": None},
            }
            assert errors == [
                f"2 children of pid {target.pid} ({segv}, {exits}), forked during the "
                f"recording, ended before Frida reported them ({segv}: killed by SIGSEGV; "
                f"{exits}: exit status 3), so not traced: killed by a signal in Frida's "
                "takeover after its fork(), or forked past Frida's fork() hook (docs/fork.md "
                "sections 16 and 19)"
            ]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(target.pid, signal.SIGKILL)
            target.communicate()


def test_a_child_given_the_id_of_one_killed_frozen_is_let_go_untraced_and_that_one_kept():
    # meta.json keeps the ending of a child killed frozen under its pid; a child given an
    # earlier traced child's pid is traced under a key of its own (test_record.py)
    frida, errors = FakeFrida(), []
    with ExitWatcher() as watcher:
        follower = stalker._ForkFollower(frida, SimpleNamespace(_error=errors.append), watcher)
        follower.killed[4242] = 100
        # Frida reports a new child with that id: no attach (FakeFrida has none)
        follower._trace(SimpleNamespace(pid=4242, parent_pid=200, origin="fork"))
        follower._queue.put(None)  # the worker's end
    assert 4242 not in follower.children and follower.killed == {4242: 100}
    assert follower.untraced == {}
    assert frida.resumed == [4242]
    assert errors == [
        "forked child 4242 of pid 200 is not traced: id 4242 was that of a child killed frozen "
        "earlier in this recording (the kernel reuses ids once they reach "
        "/proc/sys/kernel/pid_max)"
    ]


def test_a_child_frida_reports_only_as_the_recording_stops_is_listed_untraced():
    # a fork() of the last moments is a GAP in the parent's trace, but Frida reported its
    # child only once the recording was stopping (or still held it then).  Such a child is
    # let go untraced; it used to be listed nowhere, a fork() without a child in the
    # recording (docs/fork.md section 16).  A late exec of a traced process is no new child.
    class LateFrida(FakeFrida):
        def disable_child_gating(self) -> None:
            for pid, origin in ((424201, "fork"), (parent.pid, "exec")):
                child = SimpleNamespace(pid=pid, parent_pid=parent.pid, origin=origin)
                self.callbacks["child-added"](child)

        def enumerate_pending_children(self) -> list[object]:
            return [SimpleNamespace(pid=424202, parent_pid=parent.pid, origin="fork")]

    parent = subprocess.Popen(["sleep", "60"])
    try:
        frida, errors = LateFrida(), []
        with ExitWatcher() as watcher:
            follower = stalker._ForkFollower(frida, fake_recording(errors, parent.pid), watcher)
            follower.watch(frida, parent.pid)
            processes = follower.close()
    finally:
        parent.kill()
        parent.wait()
    late = {"ppid": parent.pid, "untraced": "forked as the recording stopped"}
    assert processes == {424201: late, 424202: late}
    assert errors == [
        f"2 children of pid {parent.pid} (424201, 424202), forked as the recording stopped, "
        "were let go untraced"
    ]
    # each is resumed (Frida holds it): the late one from a thread of its own
    deadline = time.monotonic() + 10
    while len(frida.resumed) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(frida.resumed) == sorted([parent.pid, 424201, 424202])
