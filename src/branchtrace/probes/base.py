"""What every probe engine shares: hits, results, and fetching a probe's values."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..engines.base import Target
from .spec import Fetch, ProbePoint

Value = int | str | None  #: None: the memory could not be read


@dataclass(frozen=True)
class Hit:
    time_ns: int  #: CLOCK_MONOTONIC
    tid: int
    probe: int  #: index into the probe list
    values: tuple[Value, ...] = ()
    retval: int | None = None  #: for %return probes (rax, signed)


@dataclass
class ProbeResult:
    pid: int
    hits: dict[int, dict[int, int]] = field(default_factory=dict)  #: probe -> tid -> count
    lost: int = 0  #: hits the engine knows it dropped (kernel ring overflow)
    exit_code: int | None = None
    signal: int | None = None
    detached: bool = False  #: the process was left running (Ctrl-C, --duration)
    warnings: list[str] = field(default_factory=list)

    def count(self, hit: Hit) -> None:
        per_tid = self.hits.setdefault(hit.probe, {})
        per_tid[hit.tid] = per_tid.get(hit.tid, 0) + 1


class ProbeEngine(Protocol):
    name: str

    def run(
        self,
        target: Target,
        points: list[ProbePoint],
        on_hit: Callable[[Hit], None],
        started: Callable[[str], None],
        stop: threading.Event,
    ) -> ProbeResult: ...


class Registers(Protocol):
    def __getitem__(self, name: str, /) -> int: ...


def fetch_value(f: Fetch, regs: Registers, read: Callable[[int, int], bytes | None]) -> Value:
    """One value at a hit: `regs` are the thread's registers there, `read(addr, n)` reads
    its memory (None if unreadable)."""
    if f.source == "mem":
        addr = (regs[f.reg] + f.offset) & (2**64 - 1)
        if f.kind == "string":
            ptr = read(addr, 8)
            return None if ptr is None else read_string(int.from_bytes(ptr, "little"), f.cap, read)
        raw = read(addr, f.bits // 8)
        if raw is None:
            return None
        return as_int(int.from_bytes(raw, "little"), f)
    value = regs[f.reg]
    if f.kind == "string":
        return read_string(value, f.cap, read)
    return as_int(value, f)


def as_int(value: int, f: Fetch) -> int:
    value &= (1 << f.bits) - 1
    if f.kind == "s" and value >> (f.bits - 1):
        value -= 1 << f.bits
    return value


def read_string(addr: int, cap: int, read: Callable[[int, int], bytes | None]) -> str | None:
    if addr == 0:
        return None
    out = b""
    while len(out) < cap:
        # never read across a page boundary in one go: the next page may be unmapped
        n = min(cap - len(out), 4096 - ((addr + len(out)) & 4095))
        chunk = read(addr + len(out), n)
        if not chunk:
            break
        end = chunk.find(b"\0")
        if end >= 0:
            return (out + chunk[:end]).decode("utf-8", "backslashreplace")
        out += chunk
    return out[:cap].decode("utf-8", "backslashreplace") if out else None


def format_value(value: Value, f: Fetch) -> str:
    if value is None:
        return "?"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if f.kind == "x":
        return f"{value:#x}"
    return str(value)
