"""The step engine (ptrace single-step, exact) is the oracle for the stalker engine.

For each fixture both engines record the program; the branches that touch the main
executable, from main to the end of the process (exit()'s handlers and destructors
included), must be the same sequence (addresses taken relative to their module, since the
two runs are placed differently), per thread, and so must the calls of the executable's
functions in the call history.  The libraries' branches differ between the runs (Frida's
threads make libc take its multi-threaded paths), so there each engine's trace is checked
against the code itself: every branch, in every module, must be one, and the code between
two must run straight (`discontinuities`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from capstone import CS_ARCH_X86, CS_MODE_64, Cs

import branchtrace
from branchtrace.analysis.kernels import (
    BREAK_SIGRETURN,
    HOW_CALL,
    HOW_SIGNAL,
    HOW_TAIL,
    SIGNAL_DELIVERIES,
)
from branchtrace.store import BranchKind
from branchtrace.store.format import FaultAccess
from branchtrace.x86 import NOT_A_BRANCH, classify, memory_access

BT = [sys.executable, "-m", "branchtrace.cli.main"]

#: fixture -> (arguments, expected stdout)
FIXTURES = {
    "abc": ((), "34"),
    "loop23": ((), str(sum(range(23)))),
    "fib": (("12",), None),
    "fptr": ((), None),
    "switch": ((), "816"),
    "tailcall": ((), "35"),
    "longjmp": ((), "45"),
    "signal": ((), "30"),
    "sighandlers": ((), "31111 pc-in-libc 3 own-handlers"),
    "atonce": (("20",), "20 40"),
    "threads_small": ((), "67"),
    "crash": ((), None),
    "exceptions": ((), "27"),
    "lifecycle": ((), "sum 6"),
    "threadend": ((), "done"),
}


DIRECT = (BranchKind.CALL, BranchKind.JUMP, BranchKind.CONDITIONAL)
#: what code runs through on its way to the next taken branch
STRAIGHT = (NOT_A_BRANCH, BranchKind.CONDITIONAL, BranchKind.SYSCALL)


def record(out: Path, engine: str, program: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *BT,
            "record",
            "--engine",
            engine,
            "--mode",
            "stream",
            "-o",
            str(out),
            "--",
            str(program),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def exe_branches(trace: branchtrace.Trace, tid: int, exe: str) -> list:
    """(from module, offset, to module, offset, kind) of each branch touching `exe`."""
    modules = trace.modules(tid)
    b = trace.branches(tid)
    names = [Path(p).name for p in modules.paths]
    mf, mt = modules.index(b["from"]), modules.index(b["to"])
    rows = [
        (
            names[f],
            int(b["from"][i]) - int(modules.bases[f]),
            names[t],
            int(b["to"][i]) - int(modules.bases[t]),
            BranchKind(int(b["kind"][i])).name,
        )
        for i, f, t in zip(range(b.size), mf.tolist(), mt.tolist(), strict=True)
        if f >= 0 and t >= 0
    ]
    return [r for r in rows if exe in (r[0], r[2])]


def exe_calls(trace: branchtrace.Trace, tid: int, exe: str) -> list[str]:
    """The executable's functions as the call history enters them, in order; a signal
    handler's calls are left out."""
    history = trace.calls(tid)
    seg = history.segments
    names = []
    skip_below = None
    for s in seg:
        depth = int(s["depth"])
        if skip_below is not None:
            if depth >= skip_below:
                continue
            skip_below = None
        if s["how"] == HOW_SIGNAL:
            skip_below = depth
            continue
        fid = int(s["function"])
        if s["how"] in (HOW_CALL, HOW_TAIL) and fid >= 0 and history.modules[fid] == exe:
            names.append(history.names[fid])
    return names


def unique_rows(*columns: np.ndarray) -> list[tuple[int, ...]]:
    """The distinct rows of equal-length columns, in order.  (np.unique on a structured
    array, or with axis=0, compares rows as opaque bytes: 12 s for a trace's 10M branches,
    against 2 s sorted so.)"""
    order = np.lexsort(columns[::-1])
    ordered = [c[order] for c in columns]
    first = np.ones(order.size, dtype=bool)
    if order.size:
        first[1:] = np.logical_or.reduce([c[1:] != c[:-1] for c in ordered])
    return list(zip(*(c[first].tolist() for c in ordered), strict=True))


def discontinuities(trace: branchtrace.Trace, tid: int) -> tuple[list[str], int]:
    """Each way the thread's branches, in every module, disagree with the code on disk, and
    how many branches were checked.  The instruction at a branch's `from` must be a branch
    of its kind, to its `to` if direct; from one branch's `to` the code must run straight
    (past not-taken conditionals and system calls) to the next branch's `from`, unless the
    chain breaks between them.  A missing or an invented branch fails one of these."""
    modules = trace.modules(tid)
    b = trace.branches(tid)
    cs = Cs(CS_ARCH_X86, CS_MODE_64)
    cs.detail = True
    decoded: dict[int, object] = {}

    def insn(address: int):  # type: ignore[no-untyped-def]
        if address not in decoded:
            m = int(modules.index(np.array([address], np.uint64))[0])
            image = modules.image(m) if m >= 0 else None
            code = image.read(modules.file_address(m, address), 16) if image else b""
            decoded[address] = next(cs.disasm(code, address, 1), None)
        return decoded[address]

    problems: list[str] = []
    checked = 0
    for src, dst, kind in unique_rows(b["from"], b["to"], b["kind"]):
        i = insn(src)
        if i is None or kind == BranchKind.INTERRUPT:
            continue  # the vDSO is not on disk
        checked += 1
        if classify(i.bytes, src)[0] != kind:
            problems.append(f"{src:#x} {i.mnemonic} {i.op_str} recorded as {kind}")
        elif kind in DIRECT and i.operands[0].imm != dst:
            problems.append(f"{src:#x} {i.mnemonic} {i.op_str} recorded going to {dst:#x}")
    blocks = trace.blocks(tid)
    signals = np.isin(blocks.break_kind, (*SIGNAL_DELIVERIES, BREAK_SIGRETURN))
    breaks = np.sort(blocks.break_at[~signals])
    crossed = np.searchsorted(breaks, b["block"], side="right")
    joined = np.flatnonzero(crossed[1:] == crossed[:-1])
    for start, end in unique_rows(b["to"][joined], b["from"][joined + 1]):
        pc = start
        while pc != end:
            i = insn(pc)
            if i is None:
                break
            if classify(i.bytes, pc)[0] not in STRAIGHT:
                problems.append(f"from {start:#x} a {i.mnemonic} at {pc:#x} before {end:#x}")
                break
            pc += i.size
            if pc - start > 1 << 16:
                problems.append(f"from {start:#x} the code never reaches {end:#x}")
                break
    return problems, checked


def thread_order(trace: branchtrace.Trace) -> list[int]:
    """Threads by the order they started (the main thread first)."""
    return sorted(trace.threads, key=lambda t: (t != trace.meta["pid"], t))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_stalker_matches_the_step_oracle(tmp_path, programs, name):
    args, expected = FIXTURES[name]
    program = programs[name]
    runs = {}
    for engine in ("step", "stalker"):
        res = record(tmp_path / engine, engine, program, *args)
        if expected is not None:
            assert res.stdout.strip() == expected, (engine, res.stderr)
        runs[engine] = (res, branchtrace.open(tmp_path / engine))
    (step_res, step), (stalker_res, stalker) = runs["step"], runs["stalker"]
    assert step_res.returncode == stalker_res.returncode, (step_res.stderr, stalker_res.stderr)
    assert len(step.threads) == len(stalker.threads)
    exe = program.name
    for t_step, t_stalker in zip(thread_order(step), thread_order(stalker), strict=True):
        for trace, tid in ((step, t_step), (stalker, t_stalker)):
            problems, checked = discontinuities(trace, tid)  # every module, libc's too
            assert checked > 50 and not problems, problems[:10]
            # a system call that returns to the next instruction is no branch, whether a
            # block ends with it (the step engine's always do; Stalker's when its slab ran
            # short) or not
            b = trace.branches(tid)
            to_next = (b["kind"] == BranchKind.SYSCALL) & (b["to"] > b["from"])
            assert not (to_next & (b["to"] - b["from"] <= 2)).any()
        reference = exe_branches(step, t_step, exe)  # handlers run traced by both
        assert len(reference) > 3
        assert exe_branches(stalker, t_stalker, exe) == reference
        step_calls = exe_calls(step, t_step, exe)
        assert exe_calls(stalker, t_stalker, exe) == step_calls


def test_a_vfork_child_runs_nothing_in_its_parents_trace_and_takes_nothing_from_it(
    tmp_path, programs
):
    # A vfork() child runs in its parent's memory until it execs or exits.  Under Stalker
    # it ran on in the parent thread's compiled code: its calls of f() were recorded in the
    # parent's trace (12 calls, not 8), and the blocks it compiled first had no record, so
    # the parent's `ret` from __vfork was missing every round (the trace took __vfork's
    # `jae` for a jump into main: a discontinuity).  It now runs natively from the system
    # call on (put_vfork in stalker_agent.c), as Gum runs a clone(CLONE_VM) child.  The step
    # engine took the SIGCHLD each child's end sends, which has no handler here, for an
    # INTERRUPT, and the step that delivered it for no step at all.
    traces = {}
    for engine in ("step", "stalker"):
        res = record(tmp_path / engine, engine, programs["vfork"], "4")
        assert (res.returncode, res.stdout) == (0, "4 rounds\n"), (engine, res.stderr)
        if engine == "stalker":  # the children are named, untraced
            assert "forked 4 child processes" in res.stderr, res.stderr
        trace = branchtrace.open(tmp_path / engine)
        (tid,) = trace.threads
        problems, checked = discontinuities(trace, tid)
        assert checked > 50 and not problems, (engine, problems[:10])
        assert not (trace.branches(tid)["kind"] == BranchKind.INTERRUPT).any(), engine
        functions = trace.stats()["functions"]
        assert (functions["f"], functions.get("in_child", 0), functions["__vfork"]) == (8, 0, 4)
        traces[engine] = (trace, tid)
    (step, t_step), (stalker, t_stalker) = traces["step"], traces["stalker"]
    exe = programs["vfork"].name
    assert exe_calls(stalker, t_stalker, exe) == exe_calls(step, t_step, exe)
    # libc's own returns differ (Frida's threads make waitpid() take its multi-threaded way)
    ours = [r for r in exe_branches(stalker, t_stalker, exe) if r[0] == exe]
    assert ours == [r for r in exe_branches(step, t_step, exe) if r[0] == exe]


def test_a_signal_that_comes_as_vfork_returns_to_the_parent_runs_its_handler_traced(
    tmp_path, programs
):
    # The child's exit releases its parent and sends it SIGCHLD, which the kernel delivers
    # as the parent's vfork() returns: in put_vfork's own code, after its system call,
    # where no instruction of the program's copy begins, so the handler ran natively,
    # marked by a GAP (14 of 20 runs).  That place now counts as the program's next
    # instruction (is_vfork_return in stalker_agent.c).
    res = record(tmp_path / "d", "stalker", programs["vforksig"], "40")
    assert res.returncode == 0 and res.stdout.startswith("40 rounds, "), res.stderr
    signals = int(res.stdout.split()[2])
    trace = branchtrace.open(tmp_path / "d")
    (tid,) = trace.threads
    problems, checked = discontinuities(trace, tid)
    assert checked > 50 and not problems, problems[:10]
    untraced = trace.meta["threads"][str(tid)]["gaps"].get("signal", 0)
    history = trace.calls(tid)
    handlers = history.segments[history.segments["how"] == HOW_SIGNAL]
    traced = [history.function_name(int(f)) for f in handlers["function"]].count("on_child")
    assert traced + untraced == signals and untraced <= 10, (traced, untraced, signals)


def test_a_thread_cancelled_in_a_system_call_is_traced_through_its_unwinding(tmp_path, programs):
    # pthread_cancel() sends SIGCANCEL, whose handler glibc sets with the system call itself
    # (its sigaction() refuses the signal to anyone else): the handler went unhooked, and
    # ran natively with the unwinding and the cleanup handler, unmarked: the thread's trace
    # went from its read() to its end (__call_tls_dtors, where it is followed again) as if
    # called, no GAP, and no cleanup() call (set_glibcs_own in stalker_agent.c; a thread
    # cancelled in sleep() had 132 distinct branches where the step engine had 315).
    runs = {}
    for engine in ("step", "stalker"):
        res = record(tmp_path / engine, engine, programs["cancel"])
        assert (res.returncode, res.stdout) == (0, "1\n"), (engine, res.stderr)
        trace = branchtrace.open(tmp_path / engine)
        main, cancelled = thread_order(trace)
        assert trace.meta["threads"][str(cancelled)]["gaps"] == {}, engine
        functions = trace.stats([cancelled])["functions"]
        assert (functions["f"], functions["cleanup"]) == (2, 1), (engine, functions)
        assert functions["_Unwind_ForcedUnwind"] >= 1 and functions["__pthread_unwind_next"] == 1
        runs[engine] = (trace, main, cancelled)
    (step, *step_threads), (stalker, *stalker_threads) = runs["step"], runs["stalker"]
    exe = programs["cancel"].name
    for t_step, t_stalker in zip(step_threads, stalker_threads, strict=True):
        assert exe_calls(stalker, t_stalker, exe) == exe_calls(step, t_step, exe)


def test_setuid_in_a_threaded_program_runs_glibcs_handler_traced_in_its_threads(tmp_path, programs):
    # SIGSETXID goes to every thread glibc knows: the program's run its handler traced
    # (set_glibcs_own in stalker_agent.c; before, natively and unmarked), and its runs on
    # Frida's threads, which have credentials to change too, are no handler of the
    # program's run off the trace: not counted as such (30 for 5 calls).
    res = record(tmp_path / "d", "stalker", programs["setxid"], "5")
    assert (res.returncode, res.stdout) == (0, "ok\n"), res.stderr
    assert "outside the trace" not in res.stderr, res.stderr
    trace = branchtrace.open(tmp_path / "d")
    assert trace.meta["handlers_off_trace"] == 0
    runs, handlers = 0, set()
    for tid in trace.threads:
        problems, checked = discontinuities(trace, tid)
        assert checked > 20 and not problems, (tid, problems[:10])
        b = trace.branches(tid)
        entered = set(b["to"][b["kind"] == BranchKind.INTERRUPT].tolist())
        handlers.update(entered)
        runs += int((b["kind"] == BranchKind.INTERRUPT).sum())
        runs += trace.meta["threads"][str(tid)]["gaps"].get("signal", 0)
    assert runs == 2 * 5 and len(handlers) == 1  # each of the two threads, once per call


def test_a_jump_in_the_relocated_head_of_a_hooked_handler_is_decoded(tmp_path, programs):
    # The agent hooks each handler's entry; Frida's trampoline runs the instructions the
    # hook replaced relocated, recording nothing, so the `je` at the start of this -O2
    # handler was lost whenever taken (SIGUSR1): the next block began at its target, with
    # no branch there (a discontinuity per SIGUSR1 run).  The decoder now finds the jump in
    # the file (decode.hook_heads).
    from elftools.elf.elffile import ELFFile

    program = programs["handlerhead"]
    with program.open("rb") as f:  # the handler's first bytes, in the file
        elf = ELFFile(f)
        (symbol,) = elf.get_section_by_name(".symtab").get_symbol_by_name("handler")
        text = elf.get_section_by_name(".text")
        handler = symbol["st_value"]  # its offset in the module too: the file is PIE
        at = handler - text["sh_addr"]
        code = text.data()[at : at + 8]
    first = next(Cs(CS_ARCH_X86, CS_MODE_64).disasm(code, 0, 1))
    assert classify(code[first.size :], first.size)[0] == BranchKind.CONDITIONAL
    assert first.size + 2 <= 5  # within the five bytes the hook's jump takes
    traces = {}
    for engine in ("step", "stalker"):
        res = record(tmp_path / engine, engine, program, "6")
        assert (res.returncode, res.stdout) == (0, "3 3\n"), (engine, res.stderr)
        trace = branchtrace.open(tmp_path / engine)
        (tid,) = trace.threads
        problems, checked = discontinuities(trace, tid)
        assert checked > 50 and not problems, (engine, problems[:10])
        traces[engine] = (trace, tid)
    (step, t_step), (stalker, t_stalker) = traces["step"], traces["stalker"]
    exe = program.name
    ours = exe_branches(stalker, t_stalker, exe)
    assert ours == exe_branches(step, t_step, exe)
    je = [r for r in ours if r[:2] == (exe, handler + first.size)]
    assert len(je) == 3 and {r[4] for r in je} == {"CONDITIONAL"}  # the 3 runs for SIGUSR1


def test_step_engine_traces_signal_handlers_and_longjmp_keeps_depth_bounded(tmp_path, programs):
    res = record(tmp_path / "sig", "step", programs["signal"])
    assert res.returncode == 0, res.stderr
    trace = branchtrace.open(tmp_path / "sig")
    (tid,) = trace.threads
    history = trace.calls(tid)
    names = [history.function_name(int(f)) for f in history.segments["function"]]
    handlers = history.segments[history.segments["how"] == HOW_SIGNAL]
    assert [history.function_name(int(f)) for f in handlers["function"]] == ["handler"] * 3
    assert trace.stats()["functions"]["f"] == 3 and "handler" in names
    # after each handler the thread is back at the depth it was interrupted at
    main_depths = {
        int(s["depth"])
        for s in history.segments
        if history.function_name(int(s["function"])) == "main"
    }
    assert len(main_depths) == 1

    res = record(tmp_path / "lj", "step", programs["longjmp"])
    assert res.returncode == 0, res.stderr
    trace = branchtrace.open(tmp_path / "lj")
    history = trace.calls(trace.threads[0])
    seg = history.segments
    main_depths = {
        int(s["depth"]) for s in seg if history.function_name(int(s["function"])) == "main"
    }
    assert len(main_depths) == 1  # three longjmps back into main: no runaway depth
    assert trace.stats()["functions"]["down"] == 15


def test_call_history_through_cxx_exceptions_has_no_runaway_depth(tmp_path, programs):
    res = record(tmp_path / "ex", "stalker", programs["exceptions"])
    assert res.returncode == 0 and res.stdout.strip() == "27", res.stderr
    trace = branchtrace.open(tmp_path / "ex")
    history = trace.calls(trace.threads[0])
    seg = history.segments
    named = [(history.function_name(int(s["function"])), int(s["depth"])) for s in seg]
    main_depths = {d for name, d in named if name == "main"}
    assert len(main_depths) == 1, named  # the unwinder lands back in main's frame each time
    thrower = [d for name, d in named if name == "thrower(int)"]  # demangled
    assert trace.stats()["functions"]["thrower(int)"] == 9
    assert min(thrower) == min(main_depths) + 1 and max(thrower) == min(main_depths) + 3


@pytest.mark.parametrize(
    "code,access",
    [
        ("c7002a000000", FaultAccess.WRITE),  # mov dword ptr [rax], 42
        ("8b00", FaultAccess.READ),  # mov eax, dword ptr [rax]
        ("830001", FaultAccess.WRITE),  # add dword ptr [rax], 1
        ("55", FaultAccess.WRITE),  # push rbp: a stack overflow's fault
        ("e800000000", FaultAccess.WRITE),  # call: its return address
        ("c3", FaultAccess.READ),  # ret
        ("ff30", FaultAccess.UNKNOWN),  # push qword ptr [rax]: reads one place, writes another
        ("0f0b", FaultAccess.UNKNOWN),  # ud2
    ],
)
def test_the_step_engine_tells_what_a_faulting_instruction_does_to_memory(code, access):
    # the stalker engine has the page fault's error code; the step engine, the instruction
    assert memory_access(bytes.fromhex(code), 0x1000) == access
