"""The views of a recording: `show` (the tail), `calls`, `insns`, `stats`.

Each reads DIR (default branchtrace.data), takes `--tid` to pick a thread (default: every
thread) and `--json` for JSON Lines.  Decoding and symbolizing are vectorised in
`analysis`; Python here only formats the rows it prints.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from ..analysis import CallHistory, Trace
from ..analysis.kernels import HOW_CALL, HOW_SIGNAL, HOW_START, HOW_TAIL, within_calls
from ..analysis.trace import HOW_NAMES
from ..errors import UsageError
from ..store import BranchKind
from ..store.tracedir import parse_thread_label, thread_id, thread_label

out = Console(highlight=False, soft_wrap=True)


def _print_whole(table: Table) -> None:
    """Print `table` with no cell cut short: a name or a count is evidence, so a table wider
    than the terminal (C++ names) makes longer lines rather than "2,5…" or a cropped name."""
    natural = Measurement.get(out, out.options.update(max_width=1 << 20), table).maximum
    width = out.width
    out.width = max(width, natural)
    try:
        out.print(table)
    finally:
        out.width = width


path_argument = click.argument(
    "path", type=click.Path(path_type=Path), default="branchtrace.data", required=False
)


class _ThreadLabel(click.ParamType):
    """A thread as views name it: its id, or "id#2" for the second thread of the recording
    with that id (the kernel reuses ids; tracedir.thread_label)."""

    name = "TID"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_thread_label(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a thread id (N, or N#2 for the second thread with id N)")


tid_option = click.option(
    "--tid",
    type=_ThreadLabel(),
    help="only this thread (default: every thread); N#2: the second thread with id N",
)
json_option = click.option("--json", "as_json", is_flag=True, help="JSON Lines, for scripts")


def _threads(trace: Trace, tid: int | None) -> list[int]:
    if tid is None:
        return trace.threads
    if tid not in trace.threads:
        labels = [thread_label(t) for t in trace.threads]
        known = ", ".join(labels[:20]) or "none"
        if len(labels) > 20:
            known += f", ... ({len(labels)} in all: branchtrace info {trace.path} lists them)"
        raise UsageError(
            f"thread {thread_label(tid)} is not in {trace.path}", hint=f"threads recorded: {known}"
        )
    return [tid]


def _kind_name(kind: int) -> str:
    try:
        return BranchKind(kind).name.lower().replace("_", " ")
    except ValueError:
        return "?"


def _where(sym: str, line: str) -> str:
    return f"{sym} {line}" if line else sym


def _heading(trace: Trace, tid: int, what: str) -> None:
    pid = trace.pid_of(tid)
    process = f", process {pid}" if pid != tid else ""
    out.print(f"[bold]thread {thread_label(tid)}{process}[/bold]: {what}")


# -- show ------------------------------------------------------------------------------------


@click.command()
@path_argument
@click.option("-n", "count", default=20, show_default=True, help="how many branches")
@tid_option
@json_option
def show(path: Path, count: int, tid: int | None, as_json: bool) -> None:
    """The tail of the trace: the newest branches first (0 = newest), like the seed's GET."""
    trace = Trace(path)
    for t in _threads(trace, tid):
        tail = trace.branches(t, last=max(count, 0))[::-1]
        modules = trace.modules(t)
        src_sym, dst_sym = modules.symbolize(tail["from"]), modules.symbolize(tail["to"])
        src_line, dst_line = modules.source_lines(tail["from"]), modules.source_lines(tail["to"])
        if as_json:
            for i, b in enumerate(tail):
                row = {
                    "index": i,
                    "tid": thread_id(t),
                    "thread": thread_label(t),
                    "from": int(b["from"]),
                    "to": int(b["to"]),
                    "kind": _kind_name(int(b["kind"])),
                    "from_sym": src_sym[i],
                    "to_sym": dst_sym[i],
                    "from_line": src_line[i] or None,
                    "to_line": dst_line[i] or None,
                }
                click.echo(json.dumps(row))
            continue
        _heading(trace, t, f"the last {len(tail)} branches, newest first")
        table = Table(box=None, header_style="bold", pad_edge=False)
        for col in ("#", "from", "to", "kind"):
            table.add_column(col, justify="right" if col == "#" else "left")
        for i, b in enumerate(tail):
            table.add_row(
                str(i),
                _where(src_sym[i], src_line[i]),
                _where(dst_sym[i], dst_line[i]),
                _kind_name(int(b["kind"])),
            )
        _print_whole(table)


# -- calls -----------------------------------------------------------------------------------


def _selected(history: CallHistory, function: str | None, max_depth: int | None) -> np.ndarray:
    """Indices of the segments to print: inside calls of `function`, above `max_depth`."""
    seg = history.segments
    keep = np.ones(seg.size, dtype=bool)
    if max_depth is not None:
        keep &= seg["depth"] <= max_depth
    if function is not None:
        # `thrower` finds the C++ `thrower(int)` too
        named = [function in (n, n.split("(")[0]) for n in history.names]
        matches = np.array([*named, False])[seg["function"]]
        entering = np.isin(seg["how"], (HOW_CALL, HOW_TAIL, HOW_START, HOW_SIGNAL))
        keep &= within_calls(seg["depth"], matches & entering)
    return np.flatnonzero(keep)


@click.command()
@path_argument
@click.option("-F", "--function", help="only calls of FUNCTION and what they call")
@click.option("-D", "--depth", "max_depth", type=int, help="only down to this nesting depth")
@tid_option
@json_option
def calls(
    path: Path, function: str | None, max_depth: int | None, tid: int | None, as_json: bool
) -> None:
    """The function-call history, oldest first, indented by nesting (GDB's /ilc)."""
    trace = Trace(path)
    for t in _threads(trace, tid):
        history = trace.calls(t)
        rows = _selected(history, function, max_depth)
        seg = history.segments
        labels = _labels(history, trace.modules(t), seg[rows])
        if as_json:
            for i, label in zip(rows.tolist(), labels, strict=True):
                s = seg[i]
                fid = int(s["function"])
                click.echo(
                    json.dumps(
                        {
                            "tid": thread_id(t),
                            "thread": thread_label(t),
                            "index": i,
                            "depth": int(s["depth"]),
                            "function": label,
                            "module": history.module_name(fid),
                            "how": HOW_NAMES[int(s["how"])],
                            "address": int(s["address"]),
                            "blocks": int(s["blocks"]),
                        }
                    )
                )
            continue
        note = (
            "; the trace begins inside calls it did not record: depth 0 is the shallowest "
            "level seen, not the thread's outermost"
            if history.mid_stack
            else ""
        )
        _heading(trace, t, f"{len(rows):,} of {seg.size:,} call-history segments{note}")
        modules = trace.modules(t)
        lines = modules.source_lines(seg["address"][rows]) if rows.size <= 100_000 else None
        for k, (i, label) in enumerate(zip(rows.tolist(), labels, strict=True)):
            s = seg[i]
            how = int(s["how"])
            mark = " [signal handler]" if how == HOW_SIGNAL else ""
            src = f"  {lines[k]}" if lines and lines[k] else ""
            out.print(f"{i:>6}  {'  ' * int(s['depth'])}{label}{mark}{src}", markup=False)


def _labels(history: CallHistory, modules: Any, rows: np.ndarray) -> list[str]:
    """Each segment's function name; `module+0xoff` of its entry where it has none (one
    vectorised lookup for all of those)."""
    labels = [history.names[f] if f >= 0 else "" for f in rows["function"].tolist()]
    unnamed = np.flatnonzero(rows["function"] < 0)
    for k, label in zip(unnamed.tolist(), modules.symbolize(rows["address"][unnamed]), strict=True):
        labels[k] = label
    return labels


# -- insns -----------------------------------------------------------------------------------


def _newest_instructions(trace: Trace, tid: int, count: int) -> list[tuple[int, str, int]]:
    """(address, text, block index) of the newest `count` executed instructions, oldest
    first, reconstructed by disassembling the recorded blocks (capstone)."""
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs

    cs = Cs(CS_ARCH_X86, CS_MODE_64)
    blocks = trace.blocks(tid)
    modules = trace.modules(tid)
    found: list[list[tuple[int, str, int]]] = []
    total = 0
    for b in range(blocks.ids.size - 1, -1, -1):
        if total >= count:
            break
        u = int(blocks.ids[b])
        start, last = int(blocks.start[u]), int(blocks.last[u])
        m = int(modules.index(np.array([start], dtype=np.uint64))[0])
        image = modules.image(m) if m >= 0 else None
        code = image.read(modules.file_address(m, start), last - start + 16) if image else b""
        insns = []
        for insn in cs.disasm(code, start):
            if insn.address > last:
                break
            insns.append((insn.address, f"{insn.mnemonic} {insn.op_str}".strip(), b))
        if not insns:
            insns = [(start, "(code not readable)", b)]
        found.append(insns)
        total += len(insns)
    flat = [i for group in reversed(found) for i in group]
    return flat[-count:] if count > 0 else []


@click.command()
@path_argument
@click.option("-n", "count", default=40, show_default=True, help="how many instructions")
@tid_option
@json_option
def insns(path: Path, count: int, tid: int | None, as_json: bool) -> None:
    """Instruction history: the newest executed instructions, oldest first, with source
    lines (GDB's `record instruction-history`)."""
    trace = Trace(path)
    for t in _threads(trace, tid):
        rows = _newest_instructions(trace, t, count)
        modules = trace.modules(t)
        # Stalker records a block as it starts: when the program died of a signal, the
        # fault is somewhere inside the thread's last block, not necessarily at its end
        # (the step engine ends the block at the faulting instruction itself).
        last_block = trace.blocks(t).ids.size - 1
        crashed = trace.meta.get("signal") if trace.meta.get("engine") != "step" else None
        addresses = np.array([r[0] for r in rows], dtype=np.uint64)
        syms, lines = modules.symbolize(addresses), modules.source_lines(addresses)
        if as_json:
            for (address, text, block), sym, line in zip(rows, syms, lines, strict=True):
                click.echo(
                    json.dumps(
                        {
                            "tid": thread_id(t),
                            "thread": thread_label(t),
                            "address": address,
                            "sym": sym,
                            "line": line or None,
                            "insn": text,
                            "block": block,
                            "crash_block": bool(crashed) and block == last_block,
                        }
                    )
                )
            continue
        _heading(trace, t, f"the last {len(rows)} instructions, oldest first")
        previous = None
        for (address, text, block), sym, line in zip(rows, syms, lines, strict=True):
            if crashed and block == last_block and previous != "crash":
                name = _signal_name(int(crashed))
                out.print(f"[bold red]-- the program crashed ({name}) within this block:[/]")
                previous = "crash"
            if line and line != previous:
                out.print(f"[dim]{line}[/dim]")
                previous = line
            out.print(f"  {address:#014x} {sym:<32} {text}", markup=False)


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- stats -----------------------------------------------------------------------------------


@click.command()
@path_argument
@click.option("-n", "top", default=25, show_default=True, help="functions to list (0: all)")
@tid_option
@json_option
def stats(path: Path, top: int, tid: int | None, as_json: bool) -> None:
    """Calls per function, per thread and overall, most called first."""
    trace = Trace(path)
    threads = _threads(trace, tid)
    counts = trace.stats(threads)
    functions, per_thread = counts["functions"], counts["threads"]
    if as_json:
        click.echo(json.dumps(counts))
        return
    rows = list(_top(functions, top))
    # a column per thread while they fit beside the names, which are never cut short
    columns = threads if len(threads) > 1 else []
    widest = max((len(f"{n:,}") + 1 + len(name) for name, n in rows), default=0)
    if widest + sum(len(f" T{thread_label(t)}") for t in columns) > out.width:
        columns = []
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("calls", justify="right", no_wrap=True)
    for t in columns:
        table.add_column(f"T{thread_label(t)}", justify="right", no_wrap=True)
    table.add_column("function", no_wrap=True, overflow="ignore")
    for name, n in rows:
        per = (per_thread[thread_label(t)].get(name, 0) for t in columns)
        table.add_row(f"{n:,}", *(f"{k:,}" for k in per), name)
    _print_whole(table)
    if top and len(functions) > top:
        out.print(f"[dim]... {len(functions) - top} more functions (-n 0 lists all)[/dim]")
    if len(threads) > 1 and not columns:
        out.print(
            f"[dim]{len(threads)} threads: too many to list side by side here; --tid T "
            "for one, --json for all[/dim]"
        )


def _top(items: dict[str, int], top: int) -> Iterator[tuple[str, int]]:
    for i, kv in enumerate(items.items()):
        if top and i >= top:
            return
        yield kv


__all__ = ["calls", "insns", "show", "stats"]
