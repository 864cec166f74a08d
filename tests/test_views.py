"""The views of a recording (show, calls, insns, stats, info) and the Python API, on
fixtures with known answers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import in_process, recorded_burst
from hypothesis import given, settings
from hypothesis import strategies as st

import branchtrace
from branchtrace.analysis.decode import scan
from branchtrace.analysis.kernels import HOW_CALL, SIGNAL_DELIVERIES, call_segments
from branchtrace.analysis.trace import Trace, faults_in
from branchtrace.cli.views import _json_strings
from branchtrace.store.tracedir import TraceDir, thread_label

BT = [sys.executable, "-m", "branchtrace.cli.main"]
FORK_NAMES = {"fork", "__fork", "__libc_fork"}


#: the commands that only read a recording, run in this process: a process of its own
#: spends 1.5 s loading numba and its kernels, which this one loads once
READERS = {"show", "calls", "insns", "stats", "info"}


def bt(*args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    argv = [str(a) for a in args]
    if argv[0] in READERS and columns is None:
        return in_process(argv)
    env = None if columns is None else {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([*BT, *argv], capture_output=True, text=True, timeout=300, env=env)


def recorded(tmp_path: Path, program: Path, *args: str, mode: str = "stream", **kw) -> Path:
    out = tmp_path / program.name
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    res = bt("record", "-o", out, "--mode", mode, *extra, "--", program, *args)
    assert res.returncode in (0, 139), res.stderr
    return out


def jsonl(res: subprocess.CompletedProcess[str]) -> list[dict]:
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


@pytest.fixture(scope="module")
def crash_trace(tmp_path_factory, programs) -> Path:
    return recorded(tmp_path_factory.mktemp("crash"), programs["crash"])


def test_show_gives_the_tail_newest_first_with_symbols_and_lines(crash_trace):
    end, *rows = jsonl(bt("show", crash_trace, "-n", "6", "--json"))
    assert (end["end"], end["signal"]) == ("fault", "SIGSEGV")  # where it ended comes first
    assert [r["index"] for r in rows] == list(range(6))
    newest = rows[0]
    assert {"index", "tid", "from", "to", "kind", "from_sym", "to_sym"} <= newest.keys()
    # the last branch is a's call of boom, at crash.c line 5; before it main called a
    assert (newest["to_sym"], newest["kind"]) == ("boom", "call")
    assert newest["from_sym"].startswith("a+") and newest["from_line"] == "crash.c:5"
    assert newest["to_line"] == "crash.c:4"
    assert any(r["to_sym"] == "a" and r["kind"] == "call" for r in rows)
    assert any(
        r.get("to_sym") == "puts@plt" for r in jsonl(bt("show", crash_trace, "-n", "400", "--json"))
    )
    text = bt("show", crash_trace, "-n", "3")
    assert text.returncode == 0 and "boom crash.c:4" in text.stdout


@pytest.mark.parametrize("engine", ["stalker", "step"])
def test_views_end_a_crash_at_the_faulting_store_in_boom(tmp_path, crash_trace, programs, engine):
    # both engines name the instruction that faulted: Stalker's agent from the fault's pc in
    # its copy of the code, the step engine from its stop
    trace = crash_trace
    if engine == "step":
        trace = recorded(tmp_path, programs["crash"], engine="step")
    *rows, end = jsonl(bt("insns", trace, "-n", "12", "--json"))
    assert len(rows) == 12
    last = rows[-1]
    assert last["sym"].startswith("boom+") and last["line"] == "crash.c:4"
    assert last["insn"] == "mov dword ptr [rax], 0x2a"
    assert not any(r["stopped_within_block"] or r["crash_block"] for r in rows)
    assert end == {
        "tid": last["tid"],
        "thread": last["thread"],
        "end": "fault",
        "status": None,
        "address": last["address"],
        "text": "the program crashed here: SIGSEGV, a write to address 0x0",
        "signal": "SIGSEGV",
        "fault_address": 0,
        "access": "write",
    }
    text = bt("insns", trace, "-n", "12").stdout.splitlines()
    assert text[-1] == "-- the program crashed here: SIGSEGV, a write to address 0x0"
    assert text[-2].split()[1:] == [last["sym"], "mov", "dword", "ptr", "[rax],", "0x2a"]
    assert not [line for line in text if "within this block" in line]
    shown = bt("show", trace, "-n", "1").stdout.splitlines()
    assert f"[the program crashed at {last['sym']}: SIGSEGV, a write to address 0x0]" in shown[2]
    calls = bt("calls", trace).stdout.splitlines()
    assert calls[-1].strip() == "-- the program crashed here: SIGSEGV, a write to address 0x0"
    site = f"the program crashed at {last['sym']} (crash.c:4): SIGSEGV, a write to address 0x0"
    assert bt("info", trace).stdout.splitlines()[1] == site
    assert jsonl(bt("info", trace, "--json"))[0]["crash"] == site


@pytest.mark.parametrize("engine", ["stalker", "step"])
def test_insns_marks_each_fault_a_handler_took(tmp_path, programs, engine):
    # poke faults 3 times, and the handler siglongjmps back to main each time: Stalker
    # runs the handler untraced, and nothing of poke after the store ran
    trace = recorded(tmp_path, programs["faults"], "recover", engine=engine)
    rows = jsonl(bt("insns", trace, "-n", "100000", "--json"))
    marks = [k for k, r in enumerate(rows) if "fault" in r]
    assert len(marks) == 3
    text = "SIGSEGV, a write to address 0x0, here: the program's handler took it"
    for k in marks:
        store, fault, after = rows[k - 1], rows[k], rows[k + 1]
        assert store["sym"].startswith("poke+") and store["insn"] == "mov dword ptr [rax], 0x2a"
        assert (fault["fault"], fault["address"], fault["text"]) == (
            "SIGSEGV",
            store["address"],
            text,
        )
        if engine == "stalker":
            assert after["reason"] == "left_handler" and rows[k + 2]["sym"] == "longjmp"
        else:  # the step engine traces the handler itself
            assert after["sym"] == "on_segv"
    assert rows[-1]["end"] == "exit_group"


@pytest.mark.parametrize("engine", ["stalker", "step"])
def test_views_end_a_thread_at_its_exit_system_call(tmp_path, programs, engine):
    # main calls exit(3) while its worker sleeps in pause(): Stalker records a block as it
    # starts, and _exit's block runs on past its exit_group system call in the code
    trace = tmp_path / "d"
    res = bt("record", "-o", trace, "--engine", engine, "--", programs["threadend"], "exit", "3")
    assert res.returncode == 3, res.stderr
    opened = branchtrace.open(trace)
    main = opened.meta["pid"]
    (worker,) = [t for t in opened.threads if t != main]
    end = opened.end(main)
    assert (end.call, end.status) == ("exit_group", 3) and opened.end(worker) is None
    rows = jsonl(bt("insns", trace, "-n", "200", "--json", "--tid", main))
    *insns, last = rows
    assert last["end"] == "exit_group" and last["status"] == 3
    assert last["text"] == "the process ended here: exit_group(3)"
    assert insns[-1]["insn"] == "syscall" and insns[-1]["address"] == last["address"]
    assert insns[-1]["sym"].startswith("_exit") and "end" not in insns[-2]
    assert not any(r["stopped_within_block"] for r in insns)
    # the worker was ended where it was: somewhere in its last block, which has pause()'s
    # system call; the step engine knows it was inside that call
    rows = jsonl(bt("insns", trace, "-n", "20", "--json", "--tid", worker))
    assert not any("end" in r for r in rows)
    last_block = [r for r in rows if r["block"] == rows[-1]["block"]]
    assert "syscall" in [r["insn"] for r in last_block]
    if engine == "step":
        assert rows[-1]["insn"] == "syscall" and rows[-1]["sym"].startswith("pause")
    assert all(r["stopped_within_block"] == (engine == "stalker") for r in last_block)
    assert not any(r["crash_block"] for r in rows)
    text = bt("insns", trace, "-n", "20", "--tid", worker).stdout.splitlines()
    marker = "-- the process ended while this thread was within this block:"
    assert text.count(marker) == (engine == "stalker")
    text = bt("insns", trace, "-n", "5", "--tid", main).stdout.splitlines()
    assert text[-1] == "-- the process ended here: exit_group(3)"
    assert text[-2].split()[1:] == [insns[-1]["sym"], "syscall"]
    # show (newest first) says it above the newest branch, calls after the last call
    show = bt("show", trace, "-n", "2", "--tid", main).stdout.splitlines()
    assert show[2].strip() == f"[the process ended at {insns[-1]['sym']}: exit_group(3)]"
    assert show[3].split()[0] == "0"
    calls = bt("calls", trace, "--tid", main).stdout.splitlines()
    assert calls[-1].strip() == "-- the process ended here: exit_group(3)"
    assert jsonl(bt("calls", trace, "--json", "--tid", main))[-1]["end"] == "exit_group"
    assert jsonl(bt("show", trace, "-n", "1", "--json", "--tid", main))[0]["status"] == 3


def test_calls_nest_main_a_b_c(tmp_path, programs):
    trace = recorded(tmp_path, programs["abc"])
    *rows, end = jsonl(bt("calls", trace, "--json"))
    assert {"tid", "depth", "function", "module"} <= rows[0].keys()
    assert end["end"] == "exit_group" and "function" not in end  # a row of its own
    exe = [r for r in rows if r["module"] == "abc"]
    main = next(r for r in exe if r["function"] == "main")  # after _init and frame_dummy
    names = [(r["function"], r["depth"] - main["depth"]) for r in exe[exe.index(main) :]]
    assert names[:7] == [("main", 0), ("a", 1), ("b", 2), ("c", 3), ("b", 2), ("a", 1), ("main", 0)]
    assert ("printf@plt", 1) in names
    # -F: only the calls of b and below; -D: not deeper than a's callees
    only_b = jsonl(bt("calls", trace, "--json", "-F", "b"))
    assert [r["function"] for r in only_b] == ["b", "c", "b"]
    shallow = jsonl(bt("calls", trace, "--json", "-D", str(main["depth"] + 1)))
    assert "b" not in {r["function"] for r in shallow} and "a" in {r["function"] for r in shallow}


def test_stats_count_calls_per_function_and_thread(tmp_path, programs):
    fib = jsonl(bt("stats", recorded(tmp_path, programs["fib"], "20"), "--json"))[0]
    assert fib["functions"]["fib"] == 21891
    threads = jsonl(bt("stats", recorded(tmp_path, programs["threads"]), "--json"))[0]
    assert threads["functions"]["g"] == 1009 + 2003 + 3001 + 4001
    assert sorted(t.get("g", 0) for t in threads["threads"].values()) == [0, 1009, 2003, 3001, 4001]
    # stats decodes each thread on its own and keeps none of it: the same counts as the
    # call histories the API keeps
    api = branchtrace.open(tmp_path / "threads")
    assert api.stats() == threads
    assert threads["threads"] == {thread_label(t): api.calls(t).call_counts() for t in api.threads}
    table = bt("stats", tmp_path / "fib", "-n", "3")
    assert table.returncode == 0 and "21,891" in table.stdout and "fib" in table.stdout
    # a terminal too narrow for the table gets longer lines, never a count or a name cut
    narrow = bt("stats", tmp_path / "fib", "-n", "3", columns=8).stdout.splitlines()
    assert narrow[1].split() == ["21,891", "fib"]
    narrow = bt("show", tmp_path / "fib", "-n", "1", columns=8).stdout.splitlines()
    # the last branch, inside _exit() (exit() is traced to its system call), and whole
    assert narrow[2].split()[-2].startswith("_exit") and "…" not in narrow[2], narrow
    # a column per thread only while they fit: the function names are never cut short
    wide = bt("stats", tmp_path / "threads", "-n", "1")
    assert wide.stdout.splitlines()[0].split()[1:-1] == [f"T{t}" for t in threads["threads"]]
    narrow = subprocess.run(
        [*BT, "stats", str(tmp_path / "threads"), "-n", "1"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "24"},
    )
    rows = [line.split() for line in narrow.stdout.splitlines()[:2]]
    assert rows == [["calls", "function"], ["10,014", "g"]], narrow.stdout
    assert "5 threads: too many to list side by side here" in narrow.stdout


def test_a_wrap_trace_starting_mid_stack_has_no_negative_depth(tmp_path, programs):
    trace = recorded(tmp_path, programs["fib"], "27", mode="wrap", buffer_size="512K")
    rows = [r for r in jsonl(bt("calls", trace, "--json")) if "function" in r]
    assert min(r["depth"] for r in rows) == 0
    text = bt("calls", trace, "-D", "0")
    assert "begins inside calls it did not record" in text.stdout
    t = branchtrace.open(trace)
    history = t.calls(t.threads[0])
    assert history.mid_stack
    # every recorded return goes one level up, never below the shallowest level
    assert (history.segments["depth"] >= 0).all()


def test_a_stripped_program_is_shown_as_module_offsets(tmp_path, programs):
    (tmp_path / "bin").mkdir()
    stripped = tmp_path / "bin" / "abc_stripped"
    shutil.copy(programs["abc"], stripped)
    # without its build-id too: symbols are cached per build-id, and the unstripped twin's
    # would be found (as a debugger finds separate debug info)
    subprocess.run(["strip", "-R", ".note.gnu.build-id", str(stripped)], check=True)
    trace = recorded(tmp_path, stripped)
    rows = [r for r in jsonl(bt("show", trace, "-n", "2000", "--json")) if "index" in r]
    exe = [r["from_sym"] for r in rows if r["from_sym"].startswith("abc_stripped+0x")]
    assert exe, "calls from the stripped executable are named module+offset"
    assert any(r["to_sym"] == "printf@plt" for r in rows)  # PLT stubs need no .symtab


def test_python_api(tmp_path, programs):
    t = branchtrace.open(recorded(tmp_path, programs["loop23"]))
    (tid,) = t.threads
    b = t.branches(tid)
    assert b.dtype.names[:3] == ("from", "to", "kind")
    f = t.modules(tid).runtime_address("loop23", "f")
    assert int(((b["to"] == f) & (b["kind"] == branchtrace.BranchKind.CALL)).sum()) == 23
    history = t.calls(tid)
    entered = history.segments[history.segments["how"] == HOW_CALL]
    assert [history.names[i] for i in entered["function"]].count("f") == 23
    assert t.stats()["threads"][str(tid)]["f"] == 23
    assert np.all(np.diff(history.segments["first_block"]) > 0)


def test_views_refuse_an_unknown_thread_in_one_line(crash_trace):
    res = bt("show", crash_trace, "--tid", "1")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "thread 1 is not in" in res.stderr
    missing = bt("calls", crash_trace.parent / "nothing-here")
    assert missing.returncode == 3 and "no such recording" in missing.stderr


def test_views_of_a_follow_fork_recording_keep_each_process_apart(tmp_path, programs):
    out = tmp_path / "forked"
    res = bt("record", "-o", out, "--mode", "stream", "--follow-fork", "--", programs["fork"])
    assert res.returncode == 0, res.stderr
    stats = jsonl(bt("stats", out, "--json"))[0]
    t = branchtrace.open(out)
    parent = t.meta["pid"]
    (child,) = [tid for tid in t.threads if tid != parent]
    assert stats["threads"][str(parent)]["f"] == 3 and stats["threads"][str(child)]["f"] == 5
    assert stats["functions"]["f"] == 8
    # the child's history starts where fork() returned in it, and goes back up into main
    rows = jsonl(bt("calls", out, "--json", "--tid", child))
    assert {r["tid"] for r in rows} == {child}
    assert rows[-1]["end"] == "exit_group"  # the child's own exit
    names = [r["function"] for r in rows[:-1] if r["module"] == "fork"]
    assert names.count("f") == 5 and "main" in names


def test_views_mark_where_fork_ran_untraced(tmp_path, programs):
    # A thread runs fork() outside Stalker (GAP records): the views say so where it
    # happened instead of joining the branch into fork() to the one after it.
    rounds = 3
    out = recorded(tmp_path, programs["forkloop"], str(rounds), "0")
    tid = branchtrace.open(out).meta["pid"]
    end, *rows = jsonl(bt("show", out, "-n", "100000", "--json"))
    assert end["end"] == "exit_group"
    marks = [k for k, r in enumerate(rows) if "break" in r]
    assert len(marks) == rounds
    for k in marks:
        mark, newer, older = rows[k], rows[k - 1], rows[k + 1]
        assert (mark["break"], mark["reason"], mark["lost"]) == ("untraced", "fork", 0)
        assert mark["tid"] == tid
        # newest first: fork() was entered before the mark, and main runs on after it
        assert older["to_sym"] in FORK_NAMES and newer["from_sym"].startswith("main+")
    assert [r["index"] for r in rows if "index" in r] == list(range(len(rows) - rounds))
    assert bt("show", out, "-n", "100000").stdout.count("[fork() ran here, untraced]") == rounds

    calls = jsonl(bt("calls", out, "--json"))[:-1]
    marks = [k for k, r in enumerate(calls) if "break" in r]
    assert len(marks) == rounds
    assert all(calls[k - 1]["function"] in FORK_NAMES for k in marks)
    assert all(calls[k + 1]["function"] == "main" for k in marks)
    assert bt("calls", out).stdout.count("-- fork() ran here, untraced") == rounds

    insns = jsonl(bt("insns", out, "-n", "100000", "--json"))[:-1]
    marks = [k for k, r in enumerate(insns) if "break" in r]
    assert len(marks) == rounds
    assert all(insns[k - 1]["sym"] in FORK_NAMES for k in marks)
    assert all(insns[k + 1]["sym"].startswith("main+") for k in marks)


def test_views_mark_where_records_were_lost_and_how_many(tmp_path, programs):
    # drop mode, a ring nothing drains during a burst: every loss shows where it happened,
    # and the losses shown add up to the count the store keeps
    out = tmp_path / "burst"
    options = ("--mode", "drop", "--buffer-size", "512K")
    res = recorded_burst(out, programs["burst"], 26, *options, drain_held=True)
    assert res.returncode == 0, res.stderr
    t = branchtrace.open(out)
    (tid,) = t.threads
    lost = t.meta["threads"][str(tid)]["lost"]
    assert lost > 0
    rows = jsonl(bt("show", out, "-n", "100000000", "--json"))
    marks = [r for r in rows if "break" in r]
    assert marks and all(r["break"] == "lost" and r["reason"] is None for r in marks)
    assert sum(r["lost"] for r in marks) == lost
    shown = [r for r in rows if "index" in r]
    assert len(shown) == t.branches(tid).size
    # every row is its branch, newest first (the rows are made from columns, not per branch)
    newest_first = t.branches(tid)[::-1]
    assert [r["from"] for r in shown] == newest_first["from"].tolist()
    assert [r["to"] for r in shown] == newest_first["to"].tolist()
    text = bt("show", out, "-n", "100000000").stdout
    assert text.count(" records lost here]") == len(marks)
    assert f"[{marks[0]['lost']:,} records lost here]" in text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(), max_size=20))
def test_json_strings_encode_each_text_as_json_dumps_would(texts):
    # show --json writes its rows from these pieces rather than json.dumps per row
    assert _json_strings(texts) == [json.dumps(text) for text in texts]
    nullable = _json_strings(texts, empty="null")
    assert [json.loads(x) for x in nullable] == [text or None for text in texts]


@pytest.mark.parametrize(
    ("name", "args"),
    [("sighandlers", ()), ("faults", ("recover",)), ("threads", ()), ("atonce", ("100",))],
)
def test_a_trace_decoded_a_piece_at_a_time_reads_as_decoded_whole(tmp_path, programs, name, args):
    """Views read a thread's words a piece at a time (a trace of billions of blocks does
    not fit in memory): cut into pieces of 5 words, between records, its blocks, breaks,
    handler runs, faults, call history and call counts are those of its words decoded in
    one go."""
    path = recorded(tmp_path, programs[name], *args)
    whole = branchtrace.open(path)
    pieces = whole.dir.word_pieces(whole.threads[0], 5)
    assert sum(1 for _ in pieces) > 100
    for piece_words in (None, 5):
        trace = Trace(path, piece_words=piece_words)
        for tid in whole.threads:
            words = whole.words(tid)
            want = scan(words, whole.modules(tid))
            got = trace.blocks(tid)
            for column in ("ids", "break_at", "break_kind", "break_detail", "start", "last"):
                assert np.array_equal(getattr(got, column), getattr(want, column)), column
            for column in ("kind", "size", "handler_at", "handler_times", "head_kind"):
                assert np.array_equal(getattr(got, column), getattr(want, column)), column
            assert trace.faults(tid) == faults_in(words)
            modules = whole.modules(tid)
            func = modules.function_ids(want.start)[0].astype(np.int64)
            first, depth, fid, how = call_segments(
                *want.kernel_args(), func, modules.function_starts
            )
            history = Trace(path, piece_words=piece_words).calls(tid)
            seg = history.segments
            assert np.array_equal(seg["first_block"], first) and np.array_equal(seg["how"], how)
            assert np.array_equal(seg["depth"], depth - depth.min())
            assert np.array_equal(seg["function"], fid)
            assert np.array_equal(
                seg["address"][seg["blocks"] > 0], want.start[want.ids[first]][seg["blocks"] > 0]
            )
            assert np.array_equal(seg["blocks"], np.diff(first, append=want.ids.size))
            assert np.array_equal(history.segments, whole.calls(tid).segments)
            assert np.array_equal(Trace(path, piece_words=piece_words).marks(tid), whole.marks(tid))
        # stats never keeps a thread's blocks: a walk of its own, piece by piece
        per_thread = Trace(path, piece_words=piece_words).stats()["threads"]
        assert per_thread == {
            thread_label(tid): whole.calls(tid).call_counts() for tid in whole.threads
        }
    kinds = np.concatenate([whole.blocks(tid).break_kind for tid in whole.threads])
    if name == "sighandlers":  # signals delivered to traced handlers, nested ones too
        assert np.isin(kinds, SIGNAL_DELIVERIES).sum() >= 3
    if name == "faults":
        assert len(whole.faults(whole.threads[0])) == 3
    if name == "threads":
        assert len(whole.threads) == 5
    if name == "atonce":  # a handler entered at the first instruction of another
        seg = whole.calls(whole.threads[0]).segments
        assert int((seg["blocks"] == 0).sum()) == 100


def test_show_and_insns_decode_only_the_end_of_a_long_trace(tmp_path, programs, monkeypatch):
    """show and insns read the end of a thread, not a stream of billions of blocks: with
    the least they decode cut to 16 words, fib's trace is read a small end at a time
    (grown until it holds the branches asked for) and prints what the whole does."""
    from branchtrace.analysis import trace as trace_module

    path = recorded(tmp_path, programs["fib"], "15")
    want_show = {n: jsonl(bt("show", path, "-n", n, "--json")) for n in ("1", "30", "3000")}
    want_insns = jsonl(bt("insns", path, "-n", "50", "--json"))
    total = Trace(path).blocks(Trace(path).threads[0]).ids.size
    monkeypatch.setattr(trace_module, "_TAIL_WORDS", 16)
    trace = Trace(path)
    tid = trace.threads[0]
    trace.tail(tid, 30)
    assert trace.partial(tid) and 30 <= trace.blocks(tid).ids.size < total // 4
    # too few blocks decoded for the branches asked: more of the end is
    trace.tail(tid, 1)
    assert trace.blocks(tid).ids.size < 100
    branches = trace.branches(tid, last=500)
    assert trace.blocks(tid).ids.size > 500 and trace.partial(tid)
    want = Trace(path).branches(tid, last=500)
    for column in ("from", "to", "kind"):
        assert np.array_equal(branches[column], want[column])
    for n, want in want_show.items():
        assert jsonl(bt("show", path, "-n", n, "--json")) == want
    got_insns = jsonl(bt("insns", path, "-n", "50", "--json"))
    rows = [r for r in want_insns if "insn" in r]
    assert len(rows) == 50 and rows[-1]["sym"].startswith("_exit")
    # the same instructions; block indices count from the first block decoded
    offset = rows[0]["block"] - got_insns[0]["block"]
    assert offset > 0
    for r in got_insns:
        if "block" in r:
            r["block"] += offset
    assert got_insns == want_insns


def test_stats_counts_the_calls_of_functions_without_a_symbol_by_their_entry(tmp_path, programs):
    """A stripped program's (or library's) own functions have no symbol: their calls are
    counted by entry, `module+0xoff`, not dropped (liblzma's were 99.99% of xz's calls)."""
    (tmp_path / "bin").mkdir()
    stripped = tmp_path / "bin" / "loop23_stripped"
    shutil.copy(programs["loop23"], stripped)
    subprocess.run(["strip", "-R", ".note.gnu.build-id", str(stripped)], check=True)
    nm = subprocess.run(["nm", programs["loop23"]], capture_output=True, text=True, check=True)
    symbols = [line.split() for line in nm.stdout.splitlines()]
    (f_offset,) = [int(row[0], 16) for row in symbols if row[-1] == "f" and len(row) == 3]
    trace = recorded(tmp_path, stripped)
    name = f"loop23_stripped+{f_offset:#x}"
    stats = jsonl(bt("stats", trace, "--json"))[0]
    assert stats["functions"][name] == 23 and "f" not in stats["functions"]
    api = branchtrace.open(trace)
    (tid,) = api.threads
    assert api.calls(tid).call_counts()[name] == 23  # the history's counts: the same
    assert api.calls(tid).call_counts() == stats["threads"][str(tid)]


def test_calls_prints_a_history_read_a_piece_at_a_time_as_one_read_whole(
    tmp_path, programs, monkeypatch
):
    """`calls` reads a thread's history twice, a piece at a time, keeping the first
    pass's segments only when they are few: decoded 5 words at a time and read twice, it
    prints what it does from one piece kept (signal handlers nested, a handler left by
    siglongjmp, calls of one function, depths rebased)."""
    from branchtrace.cli import views

    path = recorded(tmp_path, programs["sighandlers"])
    variants = [(), ("--json",), ("-D", "1"), ("-F", "outer"), ("-F", "f", "--json", "-D", "3")]
    want = {v: bt("calls", path, *v).stdout for v in variants}
    assert "[signal handler]" in want[()] and "inner" in want[("-F", "outer")]
    assert want[("-F", "outer")].count("\n") < want[()].count("\n")
    monkeypatch.setattr(views, "_KEPT_SEGMENTS", 0)
    monkeypatch.setattr(views, "Trace", lambda p: Trace(p, piece_words=5))
    for v in variants:
        assert bt("calls", path, *v).stdout == want[v], v


def test_a_view_short_of_memory_says_so_in_one_line(crash_trace, monkeypatch):
    def too_much(self, tid, most=None):
        raise MemoryError

    monkeypatch.setattr(TraceDir, "word_pieces", too_much)
    res = bt("stats", crash_trace)
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "branchtrace: error: not enough memory for this (hint: --tid T reads one thread at a time)"
    ]
