"""Children forked while Frida's agent loads, stuck on its heap lock: found and freed
(engines/forkwindow.py), on a fixture that builds the same stuck state without Frida
(tests/programs/heaplock.c); test_record.py has the real attach."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from branchtrace.engines import forkwindow
from branchtrace.engines import ptrace as pt


@contextlib.contextmanager
def heaplock(program, how: str = "frida") -> Iterator[subprocess.Popen]:
    """heaplock started, then made to fork: the program and its child, the child spinning."""
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


def child_status(target: subprocess.Popen) -> str:
    try:
        return target.communicate(timeout=5)[0].strip()
    except subprocess.TimeoutExpired:
        return "still waiting for its child"


def test_a_child_spinning_on_a_lock_no_thread_of_it_holds_is_freed_and_exits_0(programs):
    with heaplock(programs["heaplock"]) as target:
        child = fork_now(target)
        assert forkwindow.free_if_stuck(child)
        assert child_status(target) == "status 0"


@pytest.mark.parametrize("how", ["plain", "threads"])
def test_other_children_are_left_alone(programs, how):
    # a plain busy loop is no Frida lock; with a second thread the lock may yet be released
    with heaplock(programs["heaplock"], how) as target:
        child = fork_now(target)
        assert not forkwindow.free_if_stuck(child)
        time.sleep(0.2)
        assert forkwindow._stat(child)[0] == "R"  # still spinning, and not left stopped
        os.kill(child, signal.SIGKILL)
        assert child_status(target) == f"status {signal.SIGKILL}"


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


def test_only_children_forked_since_the_watch_began_are_watched(programs):
    with heaplock(programs["heaplock"]) as target:
        child = fork_now(target)
        late = forkwindow.ForksUnderFrida(target.pid)
        late.attached(follow_new=True)
        late.free_stuck()
        assert late.freed == []
        assert forkwindow.free_if_stuck(child)
        assert child_status(target) == "status 0"
    with heaplock(programs["heaplock"]) as target:
        watch = forkwindow.ForksUnderFrida(target.pid)
        child = fork_now(target)
        watch.attached(follow_new=False)
        watch.detaching()
        assert watch.settle() == []
        assert watch.freed == [child]
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
