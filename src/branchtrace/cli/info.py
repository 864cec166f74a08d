"""`branchtrace info`: what a store (or a directory of stores) holds."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..errors import StoreError
from ..store import Ring, RingReader, recovered_head
from ..store.format import WriterState
from ..store.tracedir import META, TraceDir, thread_label, thread_of_file


def find_stores(path: Path) -> list[Path]:
    if path.is_dir():
        # not a hidden one: the ring a killed recorder had made ahead for a next thread
        stores = sorted(
            (p for p in path.glob("*.bts") if not p.name.startswith(".")), key=_store_order
        )
        if not stores and (path / META).is_file() and any(path.glob("T*.stream*")):
            return []  # a trigger snapshot: streams only, counted from meta below
        if not stores:
            raise StoreError(
                f"{path}: no trace stores (*.bts) in this directory",
                hint="record a trace first, or name a store file",
            )
        return stores
    if not path.exists():
        raise StoreError(
            f"{path}: no such file or directory",
            hint="record a trace first (default directory: branchtrace.data)",
        )
    return [path]


def summarize(path: Path) -> dict[str, Any]:
    """One store's summary; reads the records (so a corrupt ring is reported)."""
    with Ring.open(path) as ring:
        h = ring.header()
        reader = RingReader(ring)
        records = reader.read()
        state = WriterState(int(h["writer_state"]))
        alive = ring.writer_alive()
        return {
            "path": str(path),
            "tid": int(h["tid"]),
            "thread": _thread_of(path, int(h["tid"])),
            "mode": ring.mode.name.lower(),
            "ring_bytes": ring.data_size,
            "records": int(records.size),
            "lost": ring.lost_records,
            "recovered_bytes": recovered_head(ring) - ring.head,
            "writer_pid": ring.writer_pid,
            "writer": "writing"
            if alive
            else (
                "closed"
                if state == WriterState.CLOSED
                else "died"
                if state == WriterState.ACTIVE
                else "none"
            ),
            "metadata_entries": len(reader.meta()),
            "writer_waits": int(h["writer_waits"]),
        }


def _store_order(store: Path) -> tuple[int, str]:
    """A recording's stores in the order of their threads' keys (T56 before T100)."""
    try:
        return thread_of_file(store.name), ""
    except ValueError:
        return -1, store.name


def _thread_of(store: Path, tid: int) -> str:
    """The thread a store is of, as views name it: in a recording its name says so
    (T<id>.bts, T<id>#2.bts), else the id its header holds."""
    try:
        return thread_label(thread_of_file(store.name))
    except ValueError:
        return str(tid)


def _execd(meta: dict[str, Any], thread: str) -> bool:
    """Whether the process of `thread` (a thread_label) called exec, ending its trace."""
    pid = (meta.get("threads") or {}).get(thread, {}).get("pid")
    if pid is None or pid == meta.get("pid"):
        return bool(meta.get("exec"))
    return bool((meta.get("processes") or {}).get(thread_label(pid), {}).get("exec"))


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.4g} {unit}"
        size /= 1024
    return f"{size:.4g} GiB"


def recording_summary(path: Path) -> dict[str, Any]:
    """What meta.json says of a recording, with per-thread counts from the data itself."""
    trace = TraceDir.open(path)
    meta = trace.meta()
    threads = {}
    for tid in trace.threads():
        threads[thread_label(tid)] = trace.record_count(tid)
    meta["records_per_thread"] = threads
    loads = [m for m in trace.modules(meta.get("pid")) if m.event == "load"]
    meta["modules"] = len(loads)
    meta["module_names"] = [Path(m.path).name for m in loads]
    if meta.get("started_ns") and meta.get("ended_ns"):
        meta["duration_s"] = (int(meta["ended_ns"]) - int(meta["started_ns"])) / 1e9
    return meta


def _exit_or_signal(meta: dict[str, Any]) -> str:
    if meta.get("signal"):
        try:
            return f"killed by {signal.Signals(meta['signal']).name}"
        except ValueError:
            return f"killed by signal {meta['signal']}"
    return f"exited with status {meta['exit_code']}"


def _ending(meta: dict[str, Any]) -> str:
    if meta.get("frozen"):  # a forked child that froze in Frida's recovery from its fork()
        return "frozen in Frida's fork() recovery, killed"
    if meta.get("stuck"):  # a forked child stuck on a lock in Frida's recovery from its fork()
        return "stuck in Frida's fork() recovery, killed"
    if meta.get("no_code_traced"):  # a forked child that faulted while Frida took it over
        return f"killed by {signal.Signals(meta['signal']).name} in Frida's takeover after fork()"
    if meta.get("died_in_frida"):  # a forked child killed at an instruction of Frida's agent
        return f"killed by {signal.Signals(meta['signal']).name} in Frida's code"
    if meta.get("ended_unreported"):  # a forked child that ended before Frida reported it
        return f"{_exit_or_signal(meta)} before Frida reported it, not traced"
    if meta.get("untraced"):  # a forked child Frida could not trace
        return "not traced"
    if meta.get("signal") or meta.get("exit_code") is not None:
        return _exit_or_signal(meta)
    if meta.get("exec_traced"):  # its new image is traced under a key of its own
        return f"called exec, traced on as {meta['exec_traced']}"
    if meta.get("dropped"):  # Frida dropped our session with it
        return "dropped by Frida, left running untraced"
    if meta.get("detached"):
        return "detached, left running"
    if "ppid" in meta:  # a forked child's entry
        return "ended"
    if "snapshot" in meta:
        return "running when this snapshot was taken"
    if "ended_ns" not in meta:
        return (
            "recording did not finish (the recorder was killed, or failed); rings recovered below"
        )
    return "ended"


@click.command()
@click.argument("path", type=click.Path(path_type=Path), default="branchtrace.data")
@click.option(
    "--json", "as_json", is_flag=True, help="JSON: the recording, then one object per store"
)
def info(path: Path, as_json: bool) -> None:
    """What PATH (a recording directory or one store file) holds."""
    meta = recording_summary(path) if (path / META).is_file() else None
    rows = [summarize(p) for p in find_stores(path)]
    crash = None
    if meta is not None and meta.get("signal") and meta.get("pid"):
        from .views import crash_sites  # numba: only for a crash

        crash = crash_sites(path, int(meta["pid"]), [int(meta["pid"])]).get(int(meta["pid"]))
    if as_json:
        if meta is not None:
            click.echo(json.dumps(meta | ({"crash": crash} if crash else {})))
        for row in rows:
            click.echo(json.dumps(row))
        return
    out = Console(highlight=False, soft_wrap=True)
    if meta is not None:
        what = " ".join(meta.get("argv") or []) or f"pid {meta.get('pid')}"
        out.print(f"{what}  (pid {meta.get('pid')}): {_ending(meta)}", markup=False)
        if crash:
            out.print(crash, markup=False)
        shot = meta.get("snapshot")
        if shot:
            out.print(
                f"snapshot taken when thread {thread_label(int(shot['tid']))} reached "
                f"{shot['trigger']}",
                markup=False,
            )
        total = sum(meta["records_per_thread"].values())
        threads = len(meta["records_per_thread"])
        for i, probe in enumerate(meta.get("probes") or []):
            per_tid = (meta.get("hits") or {}).get(str(i), {})
            out.print(
                f"probe {probe['label']}: {sum(per_tid.values()):,} hits in "
                f"{len(per_tid)} thread{'s' if len(per_tid) != 1 else ''}",
                markup=False,
            )
        out.print(
            f"engine {meta.get('engine')}, {meta.get('mode')} mode, "
            f"{_human(int(meta.get('buffer_size', 0)))} per thread; "
            f"{threads} thread{'s' if threads != 1 else ''}, {total:,} records, "
            f"{meta['modules']} modules"
            + (f", {meta['duration_s']:.3g} s" if "duration_s" in meta else ""),
            markup=False,
        )
        names = meta["module_names"]
        if names:
            shown = ", ".join(names[:6]) + (
                f", ... ({len(names) - 6} more)" if len(names) > 6 else ""
            )
            out.print(f"modules: {shown}", markup=False)
        processes = meta.get("processes") or {}
        children = [e for e in processes.values() if "execd_by" not in e]
        if children:
            endings: dict[str, int] = {}
            for ending in children:
                key = _ending(ending).split(",")[0]
                endings[key] = endings.get(key, 0) + 1
            out.print(
                f"followed {len(children)} forked child process(es): "
                + ", ".join(f"{n} {e}" for e, n in sorted(endings.items())),
                markup=False,
            )
        images = [e for e in processes.values() if "execd_by" in e]
        if images:
            names = sorted({Path(e.get("executable") or "?").name for e in images})
            out.print(
                f"followed {len(images)} exec'ed program image(s): {', '.join(names)}",
                markup=False,
            )
        gaps: dict[str, int] = {}
        for thread in (meta.get("threads") or {}).values():
            for reason, n in (thread.get("gaps") or {}).items():
                gaps[reason] = gaps.get(reason, 0) + n
        if gaps:
            out.print(
                "untraced stretches (GAP records): "
                + ", ".join(f"{reason} {n}" for reason, n in sorted(gaps.items())),
                markup=False,
            )
        signals: dict[str, int] = {}
        for thread in (meta.get("threads") or {}).values():
            for how, n in (thread.get("signals") or {}).items():
                signals[how] = signals.get(how, 0) + n
        if signals.get("held"):
            merged = signals.get("merged", 0)
            out.print(
                f"signals held to the next block's start or system call: {signals['held']:,} "
                "(they came in Stalker's code for a branch, inside its copy of an "
                "instruction, or on top of another signal at its handler's entry, where a "
                "handler cannot be entered)"
                + (
                    f"; {merged:,} more of the same came meanwhile, delivered with them once, "
                    "as the kernel does a standard signal already pending"
                    if merged
                    else ""
                ),
                markup=False,
            )
        for w in meta.get("warnings") or []:
            out.print(f"warning: {w}", markup=False)
    per_thread = meta["records_per_thread"] if meta else {}
    switches = {t: s.get("switches", 0) for t, s in (meta or {}).get("threads", {}).items()}
    show_switches = bool(meta and meta.get("sched"))
    table = Table(box=None, header_style="bold")
    columns = ["store", "tid", "mode", "ring", "records", "lost"]
    columns += ["switches"] if show_switches else []
    for col in (*columns, "writer"):
        table.add_column(
            col, justify="right" if col in ("records", "lost", "tid", "switches") else "left"
        )
    for r in rows:
        if r["writer"] == "died" and meta and _execd(meta, str(r["thread"])):
            r["writer"] = "ended at exec"  # the exec ended the image, its threads with it
        writer = f"{r['writer']} (pid {r['writer_pid']})" if r["writer_pid"] else str(r["writer"])
        if r["recovered_bytes"]:
            writer += f", {r['recovered_bytes']} bytes recovered past its head"
        table.add_row(
            Path(str(r["path"])).name,
            str(r["thread"] if r["tid"] else "-"),
            str(r["mode"]),
            _human(int(r["ring_bytes"])),
            f"{per_thread.get(str(r['thread']), r['records']):,}",
            f"{r['lost']:,}",
            *([f"{switches.get(str(r['thread']), 0):,}"] if show_switches else []),
            writer,
        )
    out.print(table)
