"""`branchtrace info`: what a store (or a directory of stores) holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..errors import StoreError
from ..store import Ring, RingReader, recovered_head
from ..store.format import WriterState


def find_stores(path: Path) -> list[Path]:
    if path.is_dir():
        stores = sorted(path.glob("*.bts"))
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


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.4g} {unit}"
        size /= 1024
    return f"{size:.4g} GiB"


@click.command()
@click.argument("path", type=click.Path(path_type=Path), default="branchtrace.data")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per store")
def info(path: Path, as_json: bool) -> None:
    """What PATH (a trace directory or one store file) holds."""
    rows = [summarize(p) for p in find_stores(path)]
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    table = Table(box=None, header_style="bold")
    for col in ("store", "tid", "mode", "ring", "records", "lost", "writer"):
        table.add_column(col, justify="right" if col in ("records", "lost", "tid") else "left")
    for r in rows:
        writer = f"{r['writer']} (pid {r['writer_pid']})" if r["writer_pid"] else str(r["writer"])
        if r["recovered_bytes"]:
            writer += f", {r['recovered_bytes']} bytes recovered past its head"
        table.add_row(
            Path(str(r["path"])).name,
            str(r["tid"] or "-"),
            str(r["mode"]),
            _human(int(r["ring_bytes"])),
            f"{r['records']:,}",
            f"{r['lost']:,}",
            writer,
        )
    Console(highlight=False).print(table)
