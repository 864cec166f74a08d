"""Probe specifications: parsing `SPEC` strings and resolving them to code addresses.

    func   func+0xOFF   lib.so:func   file.c:LINE   func%return
    'parse(arg1, arg2:string)'   'parse%return($retval)'   'f(+8(%rsp):u64, %rdi:x64)'

A probe point is resolved against the ELF files themselves (file addresses and file
offsets), so the same point serves an engine that patches a running process (it adds the
module's load bias) and the kernel's uprobes (which take a file offset).
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from capstone import CS_ARCH_X86, CS_MODE_64, Cs

from ..errors import UsageError
from ..symbols.elf import ElfImage

#: SysV AMD64 integer argument registers, in order
ARG_REGISTERS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
REGISTERS = frozenset(
    [
        "rax",
        "rbx",
        "rcx",
        "rdx",
        "rsi",
        "rdi",
        "rbp",
        "rsp",
        "r8",
        "r9",
        "r10",
        "r11",
        "r12",
        "r13",
        "r14",
        "r15",
        "rip",
    ]
)
INT_TYPES = {f"{k}{bits}": (k, bits) for k in "usx" for bits in (8, 16, 32, 64)}
DEFAULT_STRING_CAP = 128
MAX_STRING_CAP = 4096


class ProbeSpecError(UsageError, ValueError):
    """A SPEC that does not parse or does not resolve."""


@dataclass(frozen=True)
class Fetch:
    """One value a probe hit fetches.

    `source` is 'reg' (register `reg`), 'mem' (memory at `reg` + `offset`) or 'retval'.
    `kind` is 'u', 's', 'x' (integers of `bits`) or 'string' (a C string of at most `cap`
    bytes at the address the source yields).
    """

    name: str
    source: str
    reg: str = ""
    offset: int = 0
    kind: str = "s"
    bits: int = 64
    cap: int = 0


@dataclass(frozen=True)
class ProbeSpec:
    text: str
    module: str | None  #: library name or path given as `lib:func`, None: the program
    function: str | None
    offset: int = 0
    source_file: str | None = None
    line: int = 0
    is_return: bool = False
    fetches: tuple[Fetch, ...] = ()

    @property
    def label(self) -> str:
        """How hits of this probe are named: the spec without its fetch list."""
        return self.text.split("(", 1)[0].strip()


@dataclass
class ProbePoint:
    """A resolved probe: where in which file, and what to fetch."""

    spec: ProbeSpec
    path: Path  #: the ELF file holding the code
    function: str
    vaddr: int  #: file (link-time) address of the probed instruction
    file_offset: int
    instruction: bytes = field(repr=False, default=b"")  #: the bytes there, from the file
    first_vaddr: int = 0  #: the file's lowest mapped address (its load bias base)

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def is_return(self) -> bool:
        return self.spec.is_return


_FUNC = re.compile(
    r"^(?:(?P<module>[^:()]+):)?(?P<func>[^:+%()\s][^+%()\s]*?)"
    r"(?:\+(?P<off>0[xX][0-9a-fA-F]+|\d+))?(?P<ret>%return)?$"
)
_LINE = re.compile(r"^(?P<file>[^:()]+):(?P<line>\d+)$")
_MEM = re.compile(r"^(?P<off>[+-]?(?:0[xX][0-9a-fA-F]+|\d+))?\(%(?P<reg>\w+)\)$")


def parse(text: str) -> ProbeSpec:
    """Parse one SPEC; raises ProbeSpecError naming what is wrong."""
    text = text.strip()
    head, fetch_text = text, None
    if "(" in text:
        cut = text.index("(")
        if not text.endswith(")"):
            raise ProbeSpecError(f"probe {text!r}: the value list must end with ')'")
        head, fetch_text = text[:cut].strip(), text[cut + 1 : -1]
    if not head:
        raise ProbeSpecError(f"probe {text!r}: no function or file:line")
    line_match = _LINE.match(head)
    if line_match:
        spec = ProbeSpec(
            text, None, None, source_file=line_match["file"], line=int(line_match["line"])
        )
    else:
        m = _FUNC.match(head)
        if not m:
            raise ProbeSpecError(
                f"probe {head!r} is not func, func+0xOFF, lib:func, file.c:LINE or func%return"
            )
        offset = int(m["off"], 0) if m["off"] else 0
        if m["ret"] and offset:
            raise ProbeSpecError(f"probe {head!r}: a %return probe takes no offset")
        spec = ProbeSpec(text, m["module"], m["func"], offset=offset, is_return=bool(m["ret"]))
    fetches = tuple(_parse_fetches(fetch_text, spec)) if fetch_text is not None else ()
    return ProbeSpec(
        spec.text,
        spec.module,
        spec.function,
        spec.offset,
        spec.source_file,
        spec.line,
        spec.is_return,
        fetches,
    )


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        cur += ch
    parts.append(cur)
    return [p.strip() for p in parts]


def _parse_fetches(text: str, spec: ProbeSpec) -> list[Fetch]:
    if not text.strip():
        return []
    out = []
    for item in _split_top(text):
        if not item:
            raise ProbeSpecError(f"probe {spec.text!r}: empty value in the list")
        name = None
        if "=" in item:
            name, item = (s.strip() for s in item.split("=", 1))
        expr, _, type_text = item.rpartition(":") if _type_suffix(item) else (item, "", "")
        out.append(_parse_fetch(expr.strip(), type_text.strip(), name, spec))
    return out


def _type_suffix(item: str) -> bool:
    tail = item.rsplit(":", 1)[-1] if ":" in item else ""
    return bool(tail) and (tail in INT_TYPES or tail.startswith("string"))


def _parse_fetch(expr: str, type_text: str, name: str | None, spec: ProbeSpec) -> Fetch:
    where = f"probe {spec.text!r}: value {expr!r}"
    kind, bits, cap = "s", 64, 0
    if type_text:
        if type_text in INT_TYPES:
            kind, bits = INT_TYPES[type_text]
        else:
            m = re.fullmatch(r"string(?:\[(\d+)\])?", type_text)
            if not m:
                raise ProbeSpecError(
                    f"{where}: unknown type {type_text!r} (u8..u64, s8..s64, "
                    "x8..x64, string, string[N])"
                )
            kind, cap = "string", int(m[1]) if m[1] else DEFAULT_STRING_CAP
            if not 0 < cap <= MAX_STRING_CAP:
                raise ProbeSpecError(f"{where}: string cap must be 1..{MAX_STRING_CAP}")
    label = name or expr
    arg = re.fullmatch(r"\$?arg(\d+)", expr)
    if arg:
        n = int(arg[1])
        if n < 1:
            raise ProbeSpecError(f"{where}: arguments count from arg1")
        if spec.is_return:
            raise ProbeSpecError(
                f"{where}: arguments are not available at a return; probe the entry too"
            )
        if n <= len(ARG_REGISTERS):
            return Fetch(label, "reg", ARG_REGISTERS[n - 1], 0, kind, bits, cap)
        # past the sixth, integer arguments are on the stack above the return address
        return Fetch(label, "mem", "rsp", 8 * (n - len(ARG_REGISTERS)), kind, bits, cap)
    if expr in ("$retval", "retval"):
        if not spec.is_return:
            raise ProbeSpecError(f"{where}: $retval needs a %return probe")
        return Fetch(label, "retval", "rax", 0, kind, bits, cap)
    if expr.startswith("%"):
        reg = expr[1:]
        if reg not in REGISTERS:
            raise ProbeSpecError(
                f"{where}: unknown register (one of {', '.join(sorted(REGISTERS))})"
            )
        return Fetch(label, "reg", reg, 0, kind, bits, cap)
    m = _MEM.match(expr)
    if m:
        if m["reg"] not in REGISTERS:
            raise ProbeSpecError(f"{where}: unknown register %{m['reg']}")
        off = int(m["off"], 0) if m["off"] else 0
        return Fetch(label, "mem", m["reg"], off, kind, bits, cap)
    raise ProbeSpecError(
        f"{where} is not argN, $retval, %reg or OFF(%reg)", hint="e.g. 'f(arg1, +8(%rsp):u64)'"
    )


# -- resolving ---------------------------------------------------------------------------------


def shared_libraries(program: Path, pid: int | None = None) -> list[Path]:
    """The libraries `program` loads: from the process's mappings when it runs, else what
    the dynamic loader would load (`ldd`)."""
    found: list[Path] = []
    if pid is not None:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            maps = ""
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
                p = Path(parts[5])
                if p not in found:
                    found.append(p)
        return found
    try:
        out = subprocess.run(
            ["ldd", str(program)], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return found
    for line in out.splitlines():
        m = re.search(r"(/\S+) \(0x", line)
        if m:
            found.append(Path(m[1]))
    return found


class Resolver:
    """Resolves specs against one program and its libraries (ELF files read once)."""

    def __init__(self, program: Path, pid: int | None = None) -> None:
        self.program = program.resolve()
        self.pid = pid
        self._images: dict[Path, ElfImage] = {}
        self._libraries: list[Path] | None = None

    def image(self, path: Path) -> ElfImage:
        if path not in self._images:
            self._images[path] = ElfImage(path)
        return self._images[path]

    @property
    def libraries(self) -> list[Path]:
        if self._libraries is None:
            self._libraries = shared_libraries(self.program, self.pid)
        return self._libraries

    def module(self, name: str | None) -> Path:
        if name is None:
            return self.program
        if "/" in name:
            path = Path(name)
            if not path.is_file():
                raise ProbeSpecError(f"{name}: no such file")
            return path.resolve()
        if name in (self.program.name, "exe"):
            return self.program
        for lib in self.libraries:
            base = lib.name
            if base == name or base.startswith((name + ".", name + "-")):
                return lib
        known = ", ".join(sorted({p.name for p in self.libraries})) or "none"
        raise ProbeSpecError(
            f"no library {name!r} in {self.program.name} (it loads: {known})",
            hint="give the library's path, e.g. /usr/lib/x86_64-linux-gnu/libc.so.6:malloc",
        )

    def resolve(self, spec: ProbeSpec) -> ProbePoint:
        if spec.source_file is not None:
            return self._resolve_line(spec)
        assert spec.function is not None
        path = self.module(spec.module)
        image = self.image(path)
        table = image.symbols
        names = table.names
        try:
            k = names.index(spec.function)
        except ValueError:
            close = difflib.get_close_matches(spec.function, names, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else None
            raise ProbeSpecError(
                f"no function {spec.function!r} in {path.name}",
                hint=hint or f"list them: branchtrace probe -l '*' -- {self.program}",
            ) from None
        start, size = int(table.starts[k]), int(table.sizes[k])
        if spec.offset:
            if size and spec.offset >= size:
                raise ProbeSpecError(
                    f"{spec.label}: offset {spec.offset:#x} is past the end of "
                    f"{spec.function} ({size:#x} bytes)"
                )
            boundaries = instruction_starts(image, start, size or spec.offset + 16)
            if spec.offset not in boundaries:
                near = [b for b in boundaries if abs(b - spec.offset) < 16]
                raise ProbeSpecError(
                    f"{spec.label}: offset {spec.offset:#x} is not on an instruction boundary",
                    hint="instructions start at " + ", ".join(f"+{b:#x}" for b in near),
                )
        return self._point(spec, path, image, spec.function, start + spec.offset)

    def _resolve_line(self, spec: ProbeSpec) -> ProbePoint:
        assert spec.source_file is not None
        path = self.module(spec.module)
        image = self.image(path)
        t = image.lines
        if not t.paths:
            raise ProbeSpecError(f"{path.name} has no line information", hint="compile it with -g")
        want = spec.source_file
        files = [
            i
            for i, p in enumerate(t.paths)
            if p == want or p.endswith("/" + want) or os.path.basename(p) == want
        ]
        if not files:
            raise ProbeSpecError(f"{path.name} has no source file {want!r} in its line table")
        in_file = np.isin(t.files, files)
        rows = np.flatnonzero(in_file & (t.lines == spec.line))
        if rows.size == 0:
            have = np.unique(t.lines[in_file & (t.lines > 0)])
            after = have[have > spec.line]
            hint = f"the next line with code is {want}:{int(after[0])}" if after.size else None
            raise ProbeSpecError(f"{want}:{spec.line} has no code", hint=hint)
        vaddr = int(t.addresses[rows].min())
        table = image.symbols
        k = int(np.searchsorted(table.starts, vaddr, side="right")) - 1
        function = table.names[k] if k >= 0 else "?"
        return self._point(spec, path, image, function, vaddr)

    def _point(
        self, spec: ProbeSpec, path: Path, image: ElfImage, function: str, vaddr: int
    ) -> ProbePoint:
        if spec.is_return and spec.source_file is None and spec.offset:
            raise ProbeSpecError(f"{spec.label}: a %return probe is at the function's entry")
        for s in image.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                offset = s.offset + vaddr - s.vaddr
                break
        else:
            raise ProbeSpecError(f"{spec.label}: {vaddr:#x} is not in a loaded segment of {path}")
        return ProbePoint(
            spec, path, function, vaddr, offset, image.read(vaddr, 16), image.first_vaddr
        )

    def matching(self, pattern: str) -> list[tuple[str, str, int]]:
        """(module, function, file address) of functions matching a glob, for `-l`.
        `lib:pattern` searches a library, `*:pattern` the program and every library."""
        module, _, func_pattern = pattern.rpartition(":")
        if not module:
            paths = [self.program]
        elif module == "*":
            paths = [self.program, *self.libraries]
        else:
            paths = [self.module(module)]
        out = []
        for path in paths:
            t = self.image(path).symbols
            for name, start in zip(t.names, t.starts.tolist(), strict=True):
                if fnmatch.fnmatchcase(name, func_pattern):
                    out.append((path.name, name, int(start)))
        return out


def instruction_starts(image: ElfImage, start: int, size: int) -> list[int]:
    """Offsets of the instructions of the code at `start` (linear disassembly)."""
    code = image.read(start, size)
    cs = Cs(CS_ARCH_X86, CS_MODE_64)
    return [insn.address - start for insn in cs.disasm(code, start)]


def resolve_all(texts: list[str], program: Path, pid: int | None = None) -> list[ProbePoint]:
    if not texts:
        raise UsageError("no probe given", hint="e.g. branchtrace probe main -- ./prog")
    resolver = Resolver(program, pid)
    return [resolver.resolve(parse(t)) for t in texts]
