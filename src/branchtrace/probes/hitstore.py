"""Probe hits as PROBE_HIT records in a trace directory, one stream per thread, and back."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..store import Flags, Mode, Ring, RingReader, RingWriter
from ..store.format import (
    ESCAPE_BIT,
    LEN_MASK,
    LEN_SHIFT,
    TYPE_MASK,
    TYPE_SHIFT,
    RecordType,
    parse_probe_hit,
    probe_hit_payload,
    unpayload,
)
from ..store.tracedir import TraceDir, drain_to_file
from .base import Hit
from .spec import ProbePoint

RING_SIZE = 1 << 20


class HitWriter:
    """Writes every hit into DIR: a stream-mode ring per thread, drained to its file as it
    fills, so nothing is dropped."""

    def __init__(self, output: Path, points: list[ProbePoint]) -> None:
        self.tracedir = TraceDir.create(output)
        self.points = points
        self.threads: dict[int, tuple[Ring, RingWriter, RingReader, int]] = {}
        self.written = 0

    def __call__(self, hit: Hit) -> None:
        t = self.threads.get(hit.tid)
        if t is None:
            ring = Ring.create(
                self.tracedir.ring_path(hit.tid), RING_SIZE, Mode.STREAM,
                Flags.TRACE | Flags.SIGNAL, tid=hit.tid,
            )  # fmt: skip
            fd = os.open(self.tracedir.stream_path(hit.tid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            t = self.threads[hit.tid] = (ring, RingWriter(ring), RingReader(ring, consume=True), fd)
        ring, writer, reader, fd = t
        values = list(hit.values) if hit.retval is None else [*hit.values, hit.retval]
        payload = probe_hit_payload(hit.time_ns, self.points[hit.probe].vaddr, values)
        if ring.head - ring.tail > RING_SIZE // 2:
            drain_to_file(reader, fd)
        writer.write(RecordType.PROBE_HIT, hit.probe, *payload)
        self.written += 1

    def close(self, meta: dict[str, Any]) -> None:
        for ring, writer, reader, fd in self.threads.values():
            writer.close()
            drain_to_file(reader, fd, final=True)
            reader.close()
            os.close(fd)
            ring.close()
        meta["probes"] = [probe_meta(p) for p in self.points]
        self.tracedir.write_meta(meta)


def probe_meta(point: ProbePoint) -> dict[str, Any]:
    return {
        "label": point.label,
        "spec": point.spec.text,
        "path": str(point.path),
        "function": point.function,
        "vaddr": point.vaddr,
        "return": point.is_return,
        "values": [{"name": f.name, "kind": f.kind, "bits": f.bits} for f in point.spec.fetches],
    }


@dataclass(frozen=True)
class RecordedHit:
    time_ns: int
    tid: int
    probe: str  #: the probe's label
    ip: int
    args: dict[str, int | str | None]
    retval: int | None


def read_hits(words: np.ndarray, tid: int, probes: list[dict[str, Any]]) -> list[RecordedHit]:
    """The PROBE_HIT records among a thread's words, decoded with the probes' meta."""
    w = np.asarray(words, dtype=np.uint64)
    headers = np.flatnonzero(
        (w & ESCAPE_BIT != 0)
        & (((w >> np.uint64(TYPE_SHIFT)) & np.uint64(TYPE_MASK)) == RecordType.PROBE_HIT)
    )
    out = []
    for i in headers.tolist():
        head = int(w[i])
        n = (head >> LEN_SHIFT) & LEN_MASK
        probe = probes[head & 0xFFFFFFFFFF]
        payload = unpayload(w[i + 1 : i + 1 + n]).tolist()
        time_ns, ip, values = parse_probe_hit(payload)
        last = values.pop() if probe["return"] else None
        retval = last if isinstance(last, int) else None
        args: dict[str, int | str | None] = {}
        for v, f in zip(values, probe["values"], strict=False):
            if isinstance(v, int) and f["kind"] in ("u", "x"):
                v &= (1 << f["bits"]) - 1
            args[f["name"]] = v
        out.append(RecordedHit(time_ns, tid, probe["label"], ip, args, retval))
    return out
