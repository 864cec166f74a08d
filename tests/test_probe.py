"""Probes: specs, every engine's exact hit counts, every displaced-instruction class, return
values through recursion, clean removal from a running process, hits in a trace DIR."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import branchtrace
from branchtrace.engines.base import Target
from branchtrace.probes.base import Hit
from branchtrace.probes.hitstore import read_hits
from branchtrace.probes.spec import ARG_REGISTERS, ProbeSpecError, Resolver, parse
from branchtrace.probes.uprobe import UprobeEngine
from branchtrace.probes.xol import XolEngine
from branchtrace.store.format import (
    MAX_RING_PAYLOAD,
    BranchKind,
    parse_probe_hit,
    probe_hit_payload,
)
from branchtrace.store.tracedir import TraceDir
from branchtrace.symbols.elf import ElfImage

BT = [sys.executable, "-m", "branchtrace.cli.main"]
ENGINES = ["uprobe", "xol"]
#: every way the xol engine can run the displaced instruction, and the kernel's uprobes
MODES = [("xol", "auto"), ("xol", "boost"), ("xol", "step"), ("xol", "inline"), ("uprobe", "")]


def bt(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BT, *args], capture_output=True, text=True, timeout=timeout)


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return bt("probe", *args)


def run_engine(engine: str, program: Path, specs: list[str], *args: str, mode: str = "auto"):
    resolver = Resolver(program)
    points = [resolver.resolve(parse(s)) for s in specs]
    chosen = UprobeEngine() if engine == "uprobe" else XolEngine(mode or "auto")
    hits: list[Hit] = []
    result = chosen.run(
        Target((str(program), *args)), points, hits.append, lambda _: None, threading.Event()
    )
    return result, hits


# -- specs -------------------------------------------------------------------------------------


def test_spec_forms():
    s = parse("parse(arg1, arg2:string, +8(%rsp):u64, %rdi:x64, n=arg8:u32)")
    assert (s.function, s.module, s.offset, s.is_return) == ("parse", None, 0, False)
    f = s.fetches
    assert (f[0].source, f[0].reg, f[0].kind, f[0].bits) == ("reg", "rdi", "s", 64)
    assert (f[1].kind, f[1].cap) == ("string", 128)
    assert (f[2].source, f[2].reg, f[2].offset, f[2].kind) == ("mem", "rsp", 8, "u")
    assert (f[3].reg, f[3].kind) == ("rdi", "x")
    assert (f[4].name, f[4].source, f[4].reg, f[4].offset, f[4].bits) == ("n", "mem", "rsp", 16, 32)
    r = parse("libc.so.6:malloc%return($retval:u64)")
    assert (r.module, r.function, r.is_return, r.fetches[0].source) == (
        "libc.so.6", "malloc", True, "retval"
    )  # fmt: skip
    assert parse("f+0x1a").offset == 0x1A
    line = parse("main.c:42(%rax)")
    assert (line.source_file, line.line, line.function) == ("main.c", 42, None)
    assert parse("f(s=arg1:string[16])").fetches[0].cap == 16


@pytest.mark.parametrize(
    "text, message",
    [
        ("f(arg1", "must end with ')'"),
        ("f(arg0)", "count from arg1"),
        ("f($retval)", "needs a %return probe"),
        ("f%return(arg1)", "not available at a return"),
        ("f(%xyz)", "unknown register"),
        ("f(arg1:u7)", "not argN"),
        ("f(arg1:string[0])", "string cap"),
        ("f+0x4%return", "takes no offset"),
    ],
)
def test_bad_specs_are_one_clear_error(text, message):
    with pytest.raises(ProbeSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(text)


_names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
_types = st.sampled_from(["", ":u8", ":s16", ":u32", ":x64", ":string", ":string[9]"])


@given(
    function=_names,
    offset=st.integers(0, 0xFFFF),
    args=st.lists(st.tuples(st.integers(1, 12), _types), max_size=6),
)
def test_spec_parser_properties(function, offset, args):
    text = f"{function}+{offset:#x}(" + ", ".join(f"arg{n}{t}" for n, t in args) + ")"
    s = parse(text)
    assert (s.function, s.offset, len(s.fetches)) == (function, offset, len(args))
    for (n, t), f in zip(args, s.fetches, strict=True):
        if n <= 6:
            assert (f.source, f.reg) == ("reg", ARG_REGISTERS[n - 1])
        else:  # the stack, above the return address
            assert (f.source, f.reg, f.offset) == ("mem", "rsp", 8 * (n - 6))
        assert f.kind == ("string" if "string" in t else t[1] if t else "s")


def test_resolution_against_the_elf(programs):
    program = programs["probe_classes"]
    image = ElfImage(program)
    r = Resolver(program)
    point = r.resolve(parse("jcc_fn+4"))
    assert point.vaddr == image.functions["jcc_fn"] + 4
    assert point.instruction[:1] == b"\x7c"  # jl rel8
    fib = Resolver(programs["fib"]).resolve(parse("fib.c:5"))
    assert fib.function == "fib"
    libc = r.resolve(parse("libc:malloc"))
    assert libc.path.name.startswith("libc.so") and libc.function == "malloc"


@pytest.mark.parametrize(
    "spec, code, message",
    [
        ("nosuchfunction", 2, "no function 'nosuchfunction' in probe_classes"),
        ("jcc_fn+0x3", 2, "offset 0x3 is not on an instruction boundary"),
        ("probe_classes.c:1", 2, "probe_classes.c:1 has no code"),
        ("nolib:malloc", 2, "no library 'nolib'"),
    ],
)
def test_bad_probe_points_are_one_clear_line(programs, spec, code, message):
    r = probe(spec, "--", str(programs["probe_classes"]))
    assert r.returncode == code
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_missing_binary_and_no_permission(tmp_path, programs):
    r = probe("main", "--", str(tmp_path / "missing"))
    assert r.returncode == 10 and "no such file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    spin = subprocess.Popen([str(programs["spin"])], stdout=subprocess.PIPE, text=True)
    try:
        spin.stdout.readline()  # type: ignore[union-attr]
        caps = "-sys_ptrace,-perfmon,-sys_admin"
        setpriv = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
        r = subprocess.run(
            [*setpriv, *BT, "probe", "f", "-p", str(spin.pid)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 12 and "no permission to probe process" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    finally:
        spin.kill()
        spin.communicate()


def test_list_matching_functions(programs):
    r = probe("-l", "*_fn", "--", str(programs["probe_classes"]))
    assert r.returncode == 0
    assert set(r.stdout.split()) == {
        "riprel_fn", "call_fn", "jcc_fn", "jcc32_fn", "ret_fn", "push_fn", "mov_fn", "icall_fn"
    }  # fmt: skip
    r = probe("-l", "libc:mallo?", "--", str(programs["probe_classes"]))
    assert r.stdout.split() == [n for n in r.stdout.split() if n.startswith("libc.so")]
    assert any(n.endswith(":malloc") for n in r.stdout.split())


# -- exact counts ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_eight_threads_each_hit_exactly_ten_thousand_times(programs, engine):
    native = subprocess.run([str(programs["probe_threads"])], capture_output=True, text=True)
    r = probe("--engine", engine, "--json", "probed(arg1)", "--", str(programs["probe_threads"]))
    assert r.returncode == 0, r.stderr
    hits = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    per_tid = collections.Counter(h["tid"] for h in hits)
    assert len(per_tid) == 8 and set(per_tid.values()) == {10_000}
    # every thread passed each i in 0..9999 exactly once, and the values say so
    seen = collections.defaultdict(list)
    for h in hits:
        seen[h["tid"]].append(h["args"]["arg1"])
    assert all(sorted(v) == list(range(10_000)) for v in seen.values())
    program_output = [line for line in r.stdout.splitlines() if not line.startswith("{")]
    assert program_output == native.stdout.splitlines()
    assert "probed  80,000        8" in r.stderr
    assert " 0 lost" in r.stderr


CLASSES = {
    "rip-relative load": "riprel_fn",
    "call": "call_fn+4",
    "short conditional jump": "jcc_fn+4",
    "near conditional jump": "jcc32_fn+4",
    "ret": "ret_fn+4",
    "push": "push_fn",
    "register move": "mov_fn",
    "indirect call": "icall_fn+4",
}


@pytest.mark.parametrize("name", list(CLASSES))
def test_probed_instruction_class_leaves_the_output_unchanged(programs, name):
    program = programs["probe_classes"]
    native = subprocess.run([str(program)], capture_output=True, text=True).stdout
    for engine, mode in MODES:
        args = ["--engine", engine] + (["--displaced", mode] if mode not in ("", "inline") else [])
        args += ["--inline-step"] if mode == "inline" else []
        r = probe(*args, "--json", CLASSES[name], "--", str(program))
        assert r.returncode == 0, (engine, mode, r.stderr)
        lines = r.stdout.splitlines()
        hits = [line for line in lines if line.startswith("{")]
        assert len(hits) == 10, (engine, mode)
        assert [line for line in lines if not line.startswith("{")] == native.splitlines()


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


@pytest.mark.parametrize("engine", ENGINES)
def test_return_values_through_recursion(programs, engine):
    result, hits = run_engine(engine, programs["fib"], ["fib(arg1:s32)", "fib%return"], "12")
    assert result.exit_code == 0
    calls = 2 * _fib(13) - 1
    assert {p: sum(t.values()) for p, t in result.hits.items()} == {0: calls, 1: calls}
    stack = []
    for h in hits:  # entries and returns nest; each return gives fib(n) of its entry
        if h.probe == 0:
            stack.append(h.values[0])
        else:
            assert h.retval == _fib(stack.pop())
    assert not stack


def test_values_from_registers_stack_and_strings(programs):
    result, hits = run_engine(
        "xol", programs["probe_threads"], ["probed(arg1:u16, who=arg2:string[3], ret=+0(%rsp):x64)"]
    )
    assert result.exit_code == 0 and len(hits) == 80_000
    image = ElfImage(programs["probe_threads"])
    worker = image.functions["worker"]
    for h in hits[:50]:
        i, who, ret = h.values
        assert 0 <= i < 10_000 and who == "wor"
        assert isinstance(ret, int) and ret & 0xFFF != 0  # a return address into worker
    # the return address is inside worker(), wherever the program was loaded
    bases = {h.values[2] - worker for h in hits}
    assert len(bases) == 1


# -- a running process -------------------------------------------------------------------------


def _maps(pid: int) -> list[str]:
    # the kernel's own [uprobes] XOL area stays once a uprobe was hit: not ours to remove
    return [m for m in Path(f"/proc/{pid}/maps").read_text().splitlines() if "[uprobes]" not in m]


@pytest.mark.parametrize("engine", ENGINES)
def test_attach_probe_stop_leaves_original_code_and_the_program_finishes(programs, engine):
    program = programs["spin"]
    spin = subprocess.Popen([str(program)], stdout=subprocess.PIPE, text=True)
    assert spin.stdout is not None
    spin.stdout.readline()
    before = _maps(spin.pid)
    image = ElfImage(program)
    f = image.functions["f"]
    exe_base = int(before[0].split("-")[0], 16)
    r = probe(
        "--engine", engine, "--duration", "0.6", "-q", "f(arg1)", "f%return", "-p", str(spin.pid)
    )
    assert r.returncode == 0, r.stderr
    assert "detached from pid" in r.stderr
    counts = [line.split() for line in r.stderr.splitlines() if line.startswith("f")]
    assert counts[0][0] == "f" and int(counts[0][1]) > 20
    with open(f"/proc/{spin.pid}/mem", "rb") as mem:
        mem.seek(exe_base + f)
        assert mem.read(32) == image.read(f, 32)
    assert _maps(spin.pid) == before
    out, _ = spin.communicate(timeout=30)
    assert spin.returncode == 0 and out.strip() == str(sum(range(1500)))


def test_hits_go_into_a_trace_directory(tmp_path, programs):
    out = tmp_path / "hits"
    specs = ["fib(arg1:s32)", "fib%return($retval)"]
    r = probe("-o", str(out), "--json", *specs, "--", str(programs["fib"]), "7")
    assert r.returncode == 0, r.stderr
    printed = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    trace = TraceDir.open(out)
    meta = trace.meta()
    (tid,) = trace.threads()
    words, _ = trace.words(tid)
    stored = read_hits(words, tid, meta["probes"])
    assert [(h.probe, h.args, h.retval) for h in stored] == [
        (p["probe"], p["args"], p.get("retval")) for p in printed
    ]
    assert len(stored) == 2 * (2 * _fib(8) - 1)
    info = bt("info", str(out))
    assert f"probe fib: {2 * _fib(8) - 1} hits in 1 thread" in info.stdout


def test_hit_lines_are_readable(programs):
    r = probe("--engine", "xol", "fib(arg1:s32)", "fib%return", "--", str(programs["fib"]), "2")
    lines = [line.split() for line in r.stdout.splitlines() if "fib" in line]
    assert [line[2:] for line in lines] == [
        ["fib(arg1=2)"], ["fib(arg1=1)"], ["fib%return", "=", "1"],
        ["fib(arg1=0)"], ["fib%return", "=", "0"], ["fib%return", "=", "1"],
    ]  # fmt: skip
    times = [float(line[0]) for line in lines]
    assert times == sorted(times)


# -- record --trigger ----------------------------------------------------------------------------


def test_trigger_snapshots_end_at_the_triggering_call(tmp_path, programs):
    out = tmp_path / "trace"
    program = programs["loop23"]
    r = bt("record", "-o", str(out), "--trigger", "f", "--snapshots", "3", "--", str(program))
    assert r.returncode == 0, r.stderr
    assert "3 trigger snapshot(s)" in r.stderr
    shots = sorted((out / "snapshots").iterdir(), key=lambda p: int(p.name))
    assert [p.name for p in shots] == ["1", "2", "3"]
    f = ElfImage(program).functions["f"]
    for k, shot in enumerate(shots, start=1):
        trace = branchtrace.open(shot)
        (tid,) = trace.threads
        assert trace.meta["snapshot"]["trigger"] == "f"
        b = trace.branches(tid)
        to_f = b["to"] - b["to"][-1] + f  # file addresses, whatever the load base
        # the k-th snapshot holds the k calls of f so far, and ends with the k-th
        assert int(((to_f == f) & (b["kind"] == BranchKind.CALL)).sum()) == k
        assert b["kind"][-1] == BranchKind.CALL
    info = bt("info", str(shots[0]))
    assert "snapshot taken when thread" in info.stdout and "reached f" in info.stdout


def test_a_trigger_snapshot_holds_the_threads_that_ended_before_it(tmp_path, programs):
    # the recorder has closed an ended thread's ring by then (a quarter of a second later)
    out = tmp_path / "trace"
    program = programs["threadend"]
    r = bt("record", "-o", str(out), "--trigger", "later", "--", str(program), "late")
    assert r.returncode == 0, r.stderr
    trace = branchtrace.open(out / "snapshots" / "1")
    (worker,) = [t for t in trace.threads if t != trace.meta["pid"]]
    for tid, steps in ((worker, 5), (trace.meta["pid"], 0)):  # main: at the call of later()
        b = trace.branches(tid)
        calls = b[b["kind"] == BranchKind.CALL]["to"]
        names = trace.modules(tid).symbolize(calls)
        assert names.count("step") == steps, names


def loop_head(program: Path, function: str) -> int:
    """The offset in `function` of its loop's head: the target of its last backward jump."""
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs

    image = ElfImage(program)
    start = image.functions[function]
    heads = []
    for insn in Cs(CS_ARCH_X86, CS_MODE_64).disasm(image.read(start, 512), start):
        if insn.mnemonic == "ret":  # (its end, at -O0)
            break
        direct = insn.mnemonic.startswith("j") and insn.op_str.startswith("0x")
        if direct and start <= int(insn.op_str, 16) < insn.address:
            heads.append(int(insn.op_str, 16))
    assert heads, f"no loop in {function}"
    return heads[-1] - start


def test_a_trigger_inside_a_leaf_function_leaves_its_locals_as_they_were(tmp_path, programs):
    # `mix()` keeps its loop counter under the stack pointer (a leaf function at -O0): an
    # Interceptor probe at the trigger pushed over it, and the program never ended; the call
    # listener before it also took the word at the stack pointer for a return address
    program = programs["vectors"]
    native = subprocess.run([str(program), "50"], capture_output=True, text=True, check=True)
    trigger = f"mix+{loop_head(program, 'mix'):#x}"
    out = tmp_path / "trace"
    r = bt(
        "record", "-o", str(out), "--trigger", trigger, "--snapshots", "2", "--", str(program), "50"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == native.stdout
    assert "2 trigger snapshot(s)" in r.stderr


def test_a_trigger_inside_a_vector_loop_leaves_the_avx512_registers_as_they_were(
    tmp_path, programs
):
    # glibc's AVX routines in the script's part of a snapshot changed them: 2 of these 2,000
    # rounds, one per snapshot, through an Interceptor probe
    program = programs["avx512"]
    trigger = f"rounds_changed+{loop_head(program, 'rounds_changed'):#x}"
    out = tmp_path / "trace"
    args = ["--trigger", trigger, "--snapshots", "2", "--", str(program), "regs", "2000", "0"]
    r = bt("record", "-o", str(out), *args)
    assert r.returncode == 0, r.stderr
    if r.stdout == "no AVX-512\n":
        pytest.skip("this CPU has no AVX-512")
    assert r.stdout == "parent: 0 of 2000 rounds saw them changed\nchildren: 0 saw them changed\n"
    assert "2 trigger snapshot(s)" in r.stderr


def test_trigger_needs_wrap_mode_and_a_known_function(programs):
    r = bt("record", "--mode", "stream", "--trigger", "f", "--", str(programs["loop23"]))
    assert r.returncode == 2 and "--trigger snapshots the wrap buffer" in r.stderr
    r = bt("record", "--trigger", "nosuch", "--", str(programs["loop23"]))
    assert r.returncode == 2 and "no function 'nosuch'" in r.stderr


_value = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=40))


@given(time_ns=st.integers(0, 2**62), ip=st.integers(0, 2**47), values=st.lists(_value, max_size=8))
def test_probe_hit_payload_round_trip(time_ns, ip, values):
    payload = probe_hit_payload(time_ns, ip, values)
    assert len(payload) <= MAX_RING_PAYLOAD and all(w >> 63 == 0 for w in payload)
    t, i, back = parse_probe_hit(payload)
    assert (t, i, len(back)) == (time_ns, ip, len(values))
    for v, b in zip(values, back, strict=True):
        if isinstance(v, str):  # long strings are cut to fit, never changed otherwise
            assert isinstance(b, str) and v.startswith(b)
        else:
            assert b == v


def test_ctrl_c_on_an_attached_process_removes_the_probes(programs):
    program = programs["spin"]
    spin = subprocess.Popen([str(program)], stdout=subprocess.PIPE, text=True)
    assert spin.stdout is not None
    spin.stdout.readline()
    before = _maps(spin.pid)
    tool = subprocess.Popen(
        [*BT, "probe", "--engine", "xol", "f(arg1)", "f%return", "-p", str(spin.pid)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert tool.stdout is not None
    first = tool.stdout.readline()  # hits flow: the probes are in (spin runs for 3 s)
    assert " f(arg1=" in first or " f%return" in first
    tool.send_signal(signal.SIGINT)
    _, err = tool.communicate(timeout=60)
    assert tool.returncode == 0, err
    assert "detached from pid" in err
    image = ElfImage(program)
    base = int(before[0].split("-")[0], 16)
    with open(f"/proc/{spin.pid}/mem", "rb") as mem:
        mem.seek(base + image.functions["f"])
        assert mem.read(32) == image.read(image.functions["f"], 32)
    assert _maps(spin.pid) == before
    out, _ = spin.communicate(timeout=30)
    assert spin.returncode == 0 and out.strip() == str(sum(range(1500)))
