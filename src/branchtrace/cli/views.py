"""The views of a recording: `show` (the tail), `calls`, `insns`, `stats`.

Each reads DIR (default branchtrace.data), takes `--tid` to pick a thread (default: every
thread) and `--json` for JSON Lines.  Decoding and symbolizing are vectorised in
`analysis`; Python here only formats the rows it prints.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from ..analysis import ThreadEnd, Trace, describe_break, signal_name
from ..analysis.kernels import HOW_CALL, HOW_SIGNAL, HOW_START, HOW_TAIL, within_calls_part
from ..analysis.trace import HOW_NAMES
from ..errors import UsageError
from ..store import BranchKind
from ..store.format import GapReason
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


class _Lines:
    """Plain lines written in bulk, styled ones through rich between them: rich prints
    a line in about 50 us, which made `calls` of a 4M-branch trace take 75 s."""

    def __init__(self) -> None:
        self.batch: list[str] = []

    def add(self, text: str) -> None:
        self.batch.append(text + "\n")
        if len(self.batch) >= 50_000:
            self.flush()

    def extend(self, texts: list[str]) -> None:
        self.flush()
        out.file.write("".join(t + "\n" for t in texts))

    def styled(self, text: str, style: str) -> None:
        if not out.is_terminal:  # rich would drop the style too
            self.add(text)
            return
        self.flush()
        out.print(text, style=style, markup=False, highlight=False)

    def flush(self) -> None:
        out.file.write("".join(self.batch))
        self.batch = []


def _print_columns(header: tuple[str, ...], rows: list[tuple[str, ...] | str]) -> None:
    """Rows under `header` in aligned columns (the first right-aligned), nothing cut short;
    a str row is a note (a break of the chain), printed in the second column."""
    cells = [r for r in rows if not isinstance(r, str)]
    widths = [max(len(c) for c in column) for column in zip(header, *cells, strict=True)]
    indent = " " * (widths[0] + 2)

    def line(cols: tuple[str, ...]) -> str:
        first = cols[0].rjust(widths[0])
        rest = (c.ljust(w) for c, w in zip(cols[1:-1], widths[1:-1], strict=True))
        return "  ".join((first, *rest, cols[-1]))

    lines = _Lines()
    lines.styled(line(header), "bold")
    for row in rows:
        if isinstance(row, str):
            lines.styled(indent + row, _BREAK_STYLE)
        else:
            lines.add(line(row))
    lines.flush()


_BREAK_STYLE = "bold yellow"


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


@functools.cache
def _kind_name(kind: int) -> str:
    try:
        return BranchKind(kind).name.lower().replace("_", " ")
    except ValueError:
        return "?"


def _json_strings(texts: list[str], empty: str | None = None) -> list[str]:
    """Each text as a JSON string (`empty` for "", when given), each distinct one encoded
    once: json.dumps per row was a third of `show --json`."""
    encoded = {text: json.dumps(text) for text in set(texts)}
    if empty is not None:
        encoded[""] = empty
    return [encoded[text] for text in texts]


def _where(sym: str, line: str) -> str:
    return f"{sym} {line}" if line else sym


def _heading(trace: Trace, tid: int, what: str) -> None:
    pid = trace.pid_of(tid)
    process = f", process {thread_label(pid)}" if pid != tid else ""
    out.print(f"[bold]thread {thread_label(tid)}{process}[/bold]: {what}")


def _breaks_among(breaks: np.ndarray, row_blocks: np.ndarray, oldest: int) -> dict[int, list]:
    """The breaks of the chain and untraced handler runs (Trace.marks rows) that fall among
    rows ordered by block index, by the row each comes right before (len(rows): after the
    last).  Those before block `oldest` are left out: older than what the rows show."""
    kept = breaks[breaks["block"] >= oldest]
    slots: dict[int, list] = {}
    where = np.searchsorted(row_blocks, kept["block"], side="left").tolist()
    for k, row in zip(where, kept, strict=True):
        slot = slots.setdefault(k, [])
        if slot and _ran_untraced(slot[-1]) and _ran_untraced(row):
            slot[-1] = slot[-1].copy()  # handlers in blocks no row lies between: one line
            slot[-1]["times"] += row["times"]
        else:
            slot.append(row)
    return slots


def _ran_untraced(mark: np.void) -> bool:
    return int(mark["untraced"]) == GapReason.SIGNAL


def _break_json(t: int, row: np.void) -> str:
    thread = {"tid": thread_id(t), "thread": thread_label(t)}
    if _ran_untraced(row):  # the chain holds: not a break
        return json.dumps(
            {
                **thread,
                "untraced": "signal",
                "times": int(row["times"]),
                "text": describe_break(row),
            }
        )
    untraced = int(row["untraced"])
    reason = GapReason(untraced).name.lower() if untraced in set(GapReason) else untraced
    return json.dumps(
        {
            **thread,
            "break": "untraced" if untraced else "lost",
            "reason": reason if untraced else None,
            "lost": int(row["lost"]),
            "text": describe_break(row),
        }
    )


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
        trace.tail(t, max(count, 0))  # not the rest of a stream of billions of blocks
        oldest_first = trace.branches(t, last=max(count, 0))
        # the whole trace is shown: breaks before its first branch belong too
        whole = oldest_first.size < count
        oldest = 0 if whole or oldest_first.size == 0 else int(oldest_first["block"][0])
        slots = _breaks_among(trace.marks(t), oldest_first["block"], oldest) if count > 0 else {}
        # newest first: the breaks go before the row they follow in time
        breaks_above = {oldest_first.size - k: texts for k, texts in slots.items()}
        tail = oldest_first[::-1]
        modules = trace.modules(t)
        src_sym, dst_sym = modules.symbolize(tail["from"]), modules.symbolize(tail["to"])
        src_line, dst_line = modules.source_lines(tail["from"]), modules.source_lines(tail["to"])
        end = trace.end(t) if count > 0 else None
        if as_json:
            lines = _Lines()
            if end is not None:
                lines.add(_end_json(t, end))
            # the row json.dumps would make, from strings each encoded once
            thread = f'"tid": {thread_id(t)}, "thread": {json.dumps(thread_label(t))}'
            kinds = _json_strings([_kind_name(k) for k in tail["kind"].tolist()])
            columns = zip(
                tail["from"].tolist(),
                tail["to"].tolist(),
                kinds,
                _json_strings(src_sym),
                _json_strings(dst_sym),
                _json_strings(src_line, empty="null"),
                _json_strings(dst_line, empty="null"),
                strict=True,
            )
            for i, (src, dst, kind, from_sym, to_sym, from_line, to_line) in enumerate(columns):
                for brk in breaks_above.get(i, ()):
                    lines.add(_break_json(t, brk))
                lines.add(
                    f'{{"index": {i}, {thread}, "from": {src}, "to": {dst}, "kind": {kind}, '
                    f'"from_sym": {from_sym}, "to_sym": {to_sym}, "from_line": {from_line}, '
                    f'"to_line": {to_line}}}'
                )
            for brk in breaks_above.get(tail.size, ()):
                lines.add(_break_json(t, brk))
            lines.flush()
            continue
        _heading(trace, t, f"the last {len(tail)} branches, newest first")
        rows: list[tuple[str, ...] | str] = []
        if end is not None:
            at = modules.symbolize(np.array([end.last], np.uint64))[0]
            rows.append(f"[{end.describe(f'at {at}' if end.last else 'after these')}]")
        kinds = [_kind_name(k) for k in tail["kind"].tolist()]
        for i in range(tail.size + 1):
            rows += [f"[{describe_break(brk)}]" for brk in breaks_above.get(i, ())]
            if i < tail.size:
                src, dst = _where(src_sym[i], src_line[i]), _where(dst_sym[i], dst_line[i])
                rows.append((str(i), src, dst, kinds[i]))
        _print_columns(("#", "from", "to", "kind"), rows)


# -- calls -----------------------------------------------------------------------------------


#: call-history segments `calls` keeps from its first pass over a thread for its second;
#: a longer history is decoded again (40 bytes a segment: 345 million in a 25 s xz run)
_KEPT_SEGMENTS = 4_000_000


class _CallsFilter:
    """Which segments `calls` prints of a history read a piece at a time: those inside
    calls of `function` (a call it is inside of carries over from piece to piece), down
    to `max_depth` below the shallowest level (known after a first pass)."""

    def __init__(self, names: list[str], function: str | None, max_depth: int | None) -> None:
        self.matches = None
        if function is not None:
            # `thrower` finds the C++ `thrower(int)` too
            self.matches = np.array([*(function in (n, n.split("(")[0]) for n in names), False])
        self.max_depth = max_depth
        self.state = np.zeros(2, np.int64)

    def inside(self, seg: np.ndarray) -> np.ndarray:
        """Which of the next segments lie inside calls of the function (all without one)."""
        if self.matches is None:
            return np.ones(seg.size, bool)
        entering = np.isin(seg["how"], (HOW_CALL, HOW_TAIL, HOW_START, HOW_SIGNAL))
        entered = self.matches[seg["function"]] & entering
        return within_calls_part(seg["depth"], entered, self.state)

    def shown(self, seg: np.ndarray, lowest: int) -> np.ndarray:
        keep = self.inside(seg)
        if self.max_depth is not None:
            keep &= seg["depth"] - lowest <= self.max_depth
        return keep


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
        _thread_calls(trace, t, function, max_depth, as_json)


def _thread_calls(
    trace: Trace, t: int, function: str | None, max_depth: int | None, as_json: bool
) -> None:
    """`calls` of one thread, in two passes over its history a piece at a time: the first
    finds the shallowest level and how many segments are shown, the second prints them
    (from the first's segments when they were few enough to keep): a history of hundreds
    of millions of segments is printed in the memory of a piece."""
    modules = trace.modules(t)
    names = modules.function_names
    selection = _CallsFilter(names, function, max_depth)
    total, lowest = 0, 0
    depths: dict[int, int] = {}  # segments inside calls of the function, by depth
    kept: list[np.ndarray] | None = []
    for seg in trace.call_pieces(t):
        inside = seg["depth"][selection.inside(seg)]
        for depth, n in zip(*np.unique(inside, return_counts=True), strict=True):
            depths[int(depth)] = depths.get(int(depth), 0) + int(n)
        lowest = min(lowest, int(seg["depth"].min()))
        total += seg.size
        if kept is not None:
            kept.append(seg)
            if total > _KEPT_SEGMENTS:
                kept = None
    shown = sum(n for d, n in depths.items() if max_depth is None or d - lowest <= max_depth)
    marks = trace.marks(t)
    end = trace.end(t)
    if not as_json:
        note = (
            "; the trace begins inside calls it did not record: depth 0 is the shallowest "
            "level seen, not the thread's outermost"
            if lowest < 0
            else ""
        )
        _heading(trace, t, f"{shown:,} of {total:,} call-history segments{note}")
    selection = _CallsFilter(names, function, max_depth)
    text = _Lines()
    done, last_shown, after = 0, False, -1  # segments so far; the last one shown; its block
    for seg in kept if kept is not None else trace.call_pieces(t):
        rows = np.flatnonzero(selection.shown(seg, lowest))
        # a break shows before the first segment that begins at or after it, when that
        # segment is printed (or at the end, after the last segment)
        first = seg["first_block"]
        breaks = _breaks_among(
            marks[(marks["block"] > after) & (marks["block"] <= first[-1])], first, 0
        )
        chosen = seg[rows]
        chosen["depth"] -= lowest
        labels = _labels(names, modules, chosen)
        if as_json:
            _write_call_json(text, t, rows, chosen, labels, breaks, done, modules)
        else:
            lines = modules.source_lines(chosen["address"]) if shown <= 100_000 else None
            sources = [f"  {line}" if line else "" for line in lines] if lines else None
            write = functools.partial(_write_call_rows, text, rows + done, chosen, labels, sources)
            # the breaks go in before the rows they come before, and the runs of rows
            # between them are written whole (a call per line: `calls` of 5.2M segments
            # took 8.0-8.8 s, 6.0-6.6 s so)
            at = 0
            slots = np.array(sorted(breaks), np.int64)
            for k in np.searchsorted(rows, slots[np.isin(slots, rows)]).tolist():
                write(at, k)
                at = k
                for brk in breaks[int(rows[k])]:
                    text.styled(f"{'':>6}  -- {describe_break(brk)}", _BREAK_STYLE)
            write(at, rows.size)
        last_shown = bool(rows.size) and int(rows[-1]) == seg.size - 1
        after = int(first[-1])
        done += seg.size
    # what came after the last segment's first block, and the end: when that is printed
    if last_shown:
        for brk in _breaks_among(marks[marks["block"] > after], np.zeros(0, np.int64), 0).get(
            0, ()
        ):
            if as_json:
                text.add(_break_json(t, brk))
            else:
                text.styled(f"{'':>6}  -- {describe_break(brk)}", _BREAK_STYLE)
        if end is not None:
            if as_json:
                text.add(_end_json(t, end))
            else:
                text.styled(f"{'':>6}  -- {end.describe()}", "bold")
    text.flush()


def _write_call_json(
    text: _Lines,
    t: int,
    rows: np.ndarray,
    chosen: np.ndarray,
    labels: list[str],
    breaks: dict[int, list],
    done: int,
    modules: Any,
) -> None:
    """`calls --json` lines for segments `rows` of a piece (`chosen`, depths rebased),
    the piece's first being segment `done` of the history, with the breaks before them."""
    thread = {"tid": thread_id(t), "thread": thread_label(t)}
    module_names = modules.function_modules
    for i, s, label in zip(rows.tolist(), chosen, labels, strict=True):
        for brk in breaks.get(i, ()):
            text.add(_break_json(t, brk))
        fid = int(s["function"])
        text.add(
            json.dumps(
                {
                    **thread,
                    "index": done + i,
                    "depth": int(s["depth"]),
                    "function": label,
                    "module": module_names[fid] if fid >= 0 else "??",
                    "how": HOW_NAMES[int(s["how"])],
                    "address": int(s["address"]),
                    "blocks": int(s["blocks"]),
                }
            )
        )


def _write_call_rows(
    text: _Lines,
    rows: np.ndarray,
    chosen: np.ndarray,
    labels: list[str],
    sources: list[str] | None,
    a: int,
    b: int,
) -> None:
    """`calls`' lines for rows a..b-1 of `rows` (segments `chosen`), 50,000 at a time."""
    indents = ["  " * d for d in range(int(chosen["depth"][a:b].max(initial=0)) + 1)]
    for lo in range(a, b, 50_000):
        part = slice(lo, min(b, lo + 50_000))
        where = sources[part] if sources else [""] * (part.stop - lo)
        text.extend(
            [
                f"{i:>6}  {indents[d]}{label}{' [signal handler]' if h else ''}{w}"
                for i, d, label, h, w in zip(
                    rows[part].tolist(),
                    chosen["depth"][part].tolist(),
                    labels[part],
                    (chosen["how"][part] == HOW_SIGNAL).tolist(),
                    where,
                    strict=True,
                )
            ]
        )


def _labels(names: list[str], modules: Any, rows: np.ndarray) -> list[str]:
    """Each segment's function name; `module+0xoff` of its entry where it has none (one
    vectorised lookup for all of those)."""
    labels = [names[f] if f >= 0 else "" for f in rows["function"].tolist()]
    unnamed = np.flatnonzero(rows["function"] < 0)
    for k, label in zip(unnamed.tolist(), modules.symbolize(rows["address"][unnamed]), strict=True):
        labels[k] = label
    return labels


# -- insns -----------------------------------------------------------------------------------


def _newest_instructions(
    trace: Trace, tid: int, count: int, cuts: dict[int, int]
) -> list[tuple[int, str, int]]:
    """(address, text, block index) of the newest `count` executed instructions, oldest
    first, reconstructed by disassembling the recorded blocks (capstone).  `cuts`: blocks
    the thread left before their end, by the last instruction it ran in each (the system
    call that ended it, an instruction that faulted)."""
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
        if start <= cuts.get(b, last) <= last:
            last = cuts.get(b, last)
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
        trace.tail(t, max(count, 0))  # a block is one instruction at least
        end = trace.end(t)
        last_block = trace.blocks(t).ids.size - 1
        handled, cuts = _handled_faults(trace, t, end)
        if end is not None:
            cuts[last_block] = end.last
        rows = _newest_instructions(trace, t, count, cuts)
        modules = trace.modules(t)
        killed = _killed_within_last_block(trace, t) if end is None else None
        by_signal = bool(_process_ending(trace, t).get("signal"))
        addresses = np.array([r[0] for r in rows], dtype=np.uint64)
        syms, lines = modules.symbolize(addresses), modules.source_lines(addresses)
        row_blocks = np.array([r[2] for r in rows], dtype=np.int64)
        oldest = int(row_blocks[0]) if rows else 0
        breaks_before = _breaks_among(trace.marks(t), row_blocks, oldest)
        if as_json:
            json_lines = _Lines()
            for k, ((address, text, block), sym, line) in enumerate(
                zip(rows, syms, lines, strict=True)
            ):
                for brk in breaks_before.get(k, ()):
                    json_lines.add(_break_json(t, brk))
                json_lines.add(
                    json.dumps(
                        {
                            "tid": thread_id(t),
                            "thread": thread_label(t),
                            "address": address,
                            "sym": sym,
                            "line": line or None,
                            "insn": text,
                            "block": block,
                            # the thread stopped somewhere in this block, not at its end
                            "stopped_within_block": killed is not None and block == last_block,
                            "crash_block": killed is not None and block == last_block and by_signal,
                        }
                    )
                )
                if (block, address) in handled:
                    fault, text = handled[(block, address)]
                    json_lines.add(_fault_json(t, fault, text))
            if end is not None and rows:
                json_lines.add(_end_json(t, end))
            json_lines.flush()
            continue
        _heading(trace, t, f"the last {len(rows)} instructions, oldest first")
        previous = None
        printed = _Lines()
        for k, ((address, text, block), sym, line) in enumerate(
            zip(rows, syms, lines, strict=True)
        ):
            for brk in breaks_before.get(k, ()):
                printed.styled(f"-- {describe_break(brk)}", _BREAK_STYLE)
                previous = None
            if killed and block == last_block and (k == 0 or rows[k - 1][2] != block):
                printed.styled(f"-- {killed}:", "bold red")
                previous = None
            if line and line != previous:
                printed.styled(line, "dim")
                previous = line
            printed.add(f"  {address:#014x} {sym:<32} {text}")
            if (block, address) in handled:
                printed.styled(f"-- {handled[(block, address)][1]}", "bold")
        if end is not None and rows:
            printed.styled(f"-- {end.describe()}", "bold")
        printed.flush()


def crash_sites(path: Path, pid: int, keys: list[int]) -> dict[int, str]:
    """Where each of these processes of the recording at `path` faulted (keys as in its
    `processes`; the program's `pid` for any image of it), when one of its threads' trace
    ends at a fault: the instruction, its source line and what it did.  Quietly none for
    a recording that cannot be read: the caller's summary stands without them."""
    from ..errors import BranchtraceError

    if not keys:
        return {}
    sites: dict[int, str] = {}
    try:
        trace = Trace(path)
        for tid in trace.threads:
            key = trace.pid_of(tid)
            key = pid if thread_id(key) == pid and pid in keys else key
            end = trace.end(tid) if key in keys and key not in sites else None
            if end is None or end.call != "fault" or not end.last:
                continue
            modules = trace.modules(tid)
            at = np.array([end.last], np.uint64)
            place, line = modules.symbolize(at)[0], modules.source_lines(at)[0]
            sites[key] = end.describe(f"at {place}" + (f" ({line})" if line else ""))
    except (BranchtraceError, OSError):
        pass
    return sites


def _handled_faults(
    trace: Trace, tid: int, end: ThreadEnd | None
) -> tuple[dict[tuple[int, int], tuple[ThreadEnd, str]], dict[int, int]]:
    """The faults a handler of the program took without the thread ending there, by
    (block, address), with what to say; and the blocks the thread left at such a fault
    (its handler jumped out: nothing after the faulting instruction ran)."""
    breaks = trace.breaks(tid)
    left = set(breaks["block"][breaks["untraced"] == GapReason.LEFT_HANDLER].tolist())
    last_block = trace.blocks(tid).ids.size - 1
    handled: dict[tuple[int, int], tuple[ThreadEnd, str]] = {}
    cuts: dict[int, int] = {}
    for block, fault in trace.faults(tid):
        if end is not None and block == last_block and fault == end:
            continue
        if block + 1 in left:  # the break that follows says how it left
            cuts[block] = fault.address
        text = f"{fault.fault_text()}, here: the program's handler took it"
        handled[(block, fault.address)] = (fault, text)
    return handled, cuts


def _fault_json(t: int, fault: ThreadEnd, text: str) -> str:
    return json.dumps(
        {
            "tid": thread_id(t),
            "thread": thread_label(t),
            "fault": signal_name(fault.signal or 0),
            "address": fault.address,
            "fault_address": fault.fault_address,
            "access": fault.access.name.lower(),
            "text": text,
        }
    )


def _end_json(t: int, end: ThreadEnd) -> str:
    row = {
        "tid": thread_id(t),
        "thread": thread_label(t),
        "end": end.call,
        "status": end.status,
        "address": end.address,
        "text": end.describe(),
    }
    if end.call == "fault":
        row |= {
            "signal": signal_name(end.signal or 0),
            "fault_address": end.fault_address,
            "access": end.access.name.lower(),
        }
    return json.dumps(row)


#: signals a program dies of when it faults (rather than being killed from outside)
_FAULTS = {4, 5, 6, 7, 8, 11, 31}  # SIGILL, SIGTRAP, SIGABRT, SIGBUS, SIGFPE, SIGSEGV, SIGSYS


def _process_ending(trace: Trace, tid: int) -> dict[str, Any]:
    """meta.json's account of how the thread's process ended (exit_code, signal, detached)."""
    meta = trace.meta
    pid = trace.pid_of(tid)
    if pid == int(meta.get("pid") or 0):
        return meta
    return dict((meta.get("processes") or {}).get(thread_label(pid)) or {})


def _killed_within_last_block(trace: Trace, tid: int) -> str | None:
    """What to say before the last block of a thread whose process ended while it ran
    (it did not end itself).  Stalker records a block as it starts, so the thread stopped
    somewhere inside that block, not necessarily at its end (the step engine ends a block
    at the faulting instruction itself, so it needs no such line)."""
    if trace.meta.get("engine") == "step":
        return None
    ending = _process_ending(trace, tid)
    if not ending or ending.get("detached"):
        return None
    if ending.get("exec"):
        return "the process called exec while this thread was within this block"
    signum = ending.get("signal")
    if not signum:
        if ending.get("exit_code") is None:
            return None
        return "the process ended while this thread was within this block"
    name = signal_name(int(signum))
    pid = trace.pid_of(tid)
    alone = sum(trace.pid_of(other) == pid for other in trace.threads) == 1
    if alone and int(signum) in _FAULTS:
        return f"the program crashed ({name}) within this block"
    return f"the process was killed by {name} while this thread was within this block"


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
