"""ELF access with pyelftools: code bytes by address, function symbols, PLT stubs, lines.

Every table is a set of sorted numpy arrays so that a million addresses are looked up with
one `searchsorted` per module, never a Python loop per address.  Tables are cached in
memory per path and on disk per build-id (`~/.cache/branchtrace/symbols`), because DWARF
line programs are slow to parse.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from capstone import CS_ARCH_X86, CS_MODE_64, Cs
from capstone import x86 as cx86
from elftools.common.exceptions import DWARFError, ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection
from elftools.elf.sections import NoteSection, SymbolTableSection

from ..errors import StoreError

_TABLE_VERSION = 4  #: bump when the cached tables change shape
_BINDING_RANK = {"STB_GLOBAL": 0, "STB_WEAK": 1, "STB_LOCAL": 2}


@dataclass(frozen=True)
class Segment:
    vaddr: int
    offset: int
    filesz: int


@dataclass
class SymbolTable:
    """Functions of one ELF file, sorted by address (file addresses)."""

    starts: np.ndarray  #: uint64
    sizes: np.ndarray  #: uint64; 0 when the symbol has no size (then it reaches the next)
    names: list[str]


@dataclass
class LineTable:
    """DWARF line rows sorted by address; line 0 ends a sequence (no source there)."""

    addresses: np.ndarray  #: uint64
    lines: np.ndarray  #: uint32
    files: np.ndarray  #: uint32 index into `paths`
    paths: list[str]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "branchtrace" / "symbols"


class ElfImage:
    """One ELF file: its loadable segments, functions, PLT stubs and line table.

    Addresses here are the file's own virtual addresses; a module loaded at `base` maps
    file address `v` to `base + v - first_vaddr` (`first_vaddr` is 0 for PIE and libraries).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._data = self.path.read_bytes()
            with open(self.path, "rb") as f:
                elf = ELFFile(f)
                self.segments = [
                    Segment(s["p_vaddr"], s["p_offset"], s["p_filesz"])
                    for s in elf.iter_segments()
                    if s["p_type"] == "PT_LOAD"
                ]
                self.build_id = _build_id(elf)
        except (OSError, ELFError) as e:
            raise StoreError(f"{self.path}: cannot read ELF ({e})") from None
        self.first_vaddr = min((s.vaddr for s in self.segments), default=0) & ~0xFFF
        self._symbols: SymbolTable | None = None
        self._lines: LineTable | None = None

    @functools.cached_property
    def functions(self) -> dict[str, int]:
        """name -> file address (PLT stubs included, as `name@plt`)."""
        t = self.symbols
        return {n: int(a) for a, n in zip(t.starts.tolist(), t.names, strict=True)}

    @property
    def symbols(self) -> SymbolTable:
        if self._symbols is None:
            self._load_tables()
        assert self._symbols is not None
        return self._symbols

    @property
    def lines(self) -> LineTable:
        if self._lines is None:
            self._load_tables()
        assert self._lines is not None
        return self._lines

    def read(self, vaddr: int, n: int) -> bytes:
        """Up to `n` bytes of the file image at `vaddr` (empty if not in a segment)."""
        for s in self.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                off = s.offset + vaddr - s.vaddr
                return self._data[off : off + min(n, s.vaddr + s.filesz - vaddr)]
        return b""

    # -- tables ------------------------------------------------------------------------------

    def _cache_key(self) -> str:
        ident = self.build_id or hashlib.sha1(self._data).hexdigest()
        return f"{ident}-v{_TABLE_VERSION}"

    def _load_tables(self) -> None:
        cached = cache_dir() / f"{self._cache_key()}.npz"
        try:
            with np.load(cached, allow_pickle=False) as z:
                self._symbols = SymbolTable(
                    z["sym_starts"], z["sym_sizes"], z["sym_names"].tolist()
                )
                self._lines = LineTable(
                    z["line_addresses"], z["line_lines"], z["line_files"], z["line_paths"].tolist()
                )
                return
        except (OSError, KeyError, ValueError):
            pass
        with open(self.path, "rb") as f:
            elf = ELFFile(f)
            self._symbols = _symbol_table(elf)
            self._lines = _line_table(elf)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(
                tmp,
                sym_starts=self._symbols.starts,
                sym_sizes=self._symbols.sizes,
                sym_names=np.array(self._symbols.names, dtype=str),
                line_addresses=self._lines.addresses,
                line_lines=self._lines.lines,
                line_files=self._lines.files,
                line_paths=np.array(self._lines.paths, dtype=str),
            )
            tmp.replace(cached)
        except OSError:
            pass  # a read-only home: no cache, same answers


@functools.cache
def _cxa_demangle() -> Any:
    try:
        lib = ctypes.CDLL("libstdc++.so.6")
    except OSError:
        return None
    fn = lib.__cxa_demangle
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    return fn


def demangle(name: str) -> str:
    """`thrower(int)` for `_Z7throweri` (the C++ runtime's own demangler); other names as
    they are."""
    fn = _cxa_demangle() if name.startswith("_Z") else None
    if fn is None:
        return name
    status = ctypes.c_int()
    out = fn(name.encode(), None, None, ctypes.byref(status))
    if status.value != 0 or not out:
        return name
    try:
        return ctypes.string_at(out).decode(errors="replace")
    finally:
        _libc_free(out)


_libc_free = ctypes.CDLL(None).free
_libc_free.argtypes = [ctypes.c_void_p]


def _build_id(elf: ELFFile) -> str | None:
    for section in elf.iter_sections():
        if isinstance(section, NoteSection):
            for note in section.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    return str(note["n_desc"])
    return None


def _symbol_table(elf: ELFFile) -> SymbolTable:
    best: dict[int, tuple[tuple[int, int, int], str, int]] = {}

    def offer(address: int, name: str, size: int, rank: tuple[int, int, int]) -> None:
        if address and name and (address not in best or rank < best[address][0]):
            best[address] = (rank, name, size)

    for section_name in (".symtab", ".dynsym"):
        table = elf.get_section_by_name(section_name)
        if not isinstance(table, SymbolTableSection):
            continue
        for sym in table.iter_symbols():
            info = sym["st_info"]
            if info["type"] not in ("STT_FUNC", "STT_GNU_IFUNC") or sym["st_shndx"] == "SHN_UNDEF":
                continue
            name = demangle(sym.name.split("@")[0])
            # among aliases prefer a global, public-looking, short name (memcpy over __GI_memcpy)
            rank = (_BINDING_RANK.get(info["bind"], 3), name.startswith("_"), len(name))
            offer(sym["st_value"], name, sym["st_size"], rank)
    for address, name, size in _plt_stubs(elf):
        offer(address, name, size, (0, 0, 0) if name.endswith("@plt") else (9, 0, 0))
    items = sorted(best.items())
    return SymbolTable(
        np.array([a for a, _ in items], dtype=np.uint64),
        np.array([v[2] for _, v in items], dtype=np.uint64),
        [v[1] for _, v in items],
    )


def _plt_stubs(elf: ELFFile) -> list[tuple[int, str, int]]:
    """(address, `name@plt`, size) of each PLT stub: the stub's indirect jump names the GOT
    slot, and the slot's relocation names the function (robust to .plt/.plt.sec/.plt.got)."""
    slots: dict[int, str] = {}
    for rel_name in (".rela.plt", ".rela.dyn"):
        rel = elf.get_section_by_name(rel_name)
        if not isinstance(rel, RelocationSection):
            continue
        symtab = elf.get_section(rel["sh_link"])
        if not isinstance(symtab, SymbolTableSection):
            continue
        for r in rel.iter_relocations():
            if r["r_info_sym"]:
                name = symtab.get_symbol(r["r_info_sym"]).name
                if name:
                    slots[r["r_offset"]] = demangle(name)
    stubs = []
    cs = Cs(CS_ARCH_X86, CS_MODE_64)
    cs.detail = True
    for section_name in (".plt", ".plt.sec", ".plt.got"):
        sec = elf.get_section_by_name(section_name)
        if sec is None or not sec["sh_size"]:
            continue
        base = sec["sh_addr"]
        entry = sec["sh_entsize"] if sec["sh_entsize"] in (8, 16) else 16
        # the section's head (PLT0, the lazy binder's entry) belongs to no function
        stubs.append((base, section_name, entry))
        for insn in cs.disasm(sec.data(), base):
            if insn.id != cx86.X86_INS_JMP or not insn.operands:
                continue
            op = insn.operands[0]
            if op.type != cx86.X86_OP_MEM or op.mem.base != cx86.X86_REG_RIP:
                continue
            slot = insn.address + insn.size + op.mem.disp
            if slot in slots:
                start = base + (insn.address - base) // entry * entry
                stubs.append((start, f"{slots[slot]}@plt", entry))
    return stubs


def _line_table(elf: ELFFile) -> LineTable:
    rows: list[tuple[int, int, int]] = []
    paths: list[str] = []
    index: dict[str, int] = {}
    if elf.has_dwarf_info():
        try:
            dwarf = elf.get_dwarf_info()
            for cu in dwarf.iter_CUs():
                program = dwarf.line_program_for_CU(cu)
                if program is None:
                    continue
                version = program.header["version"]
                files = program.header["file_entry"]
                dirs = program.header["include_directory"]
                comp_dir = cu.get_top_DIE().attributes.get("DW_AT_comp_dir")
                names = []
                for f in files:
                    name = f.name.decode(errors="replace")
                    d = f.dir_index
                    if version < 5:
                        d -= 1  # DWARF 4 numbers directories from 1; 0 is the CU's
                    if not name.startswith("/"):
                        if 0 <= d < len(dirs):
                            name = f"{dirs[d].decode(errors='replace')}/{name}"
                        elif comp_dir is not None:
                            name = f"{comp_dir.value.decode(errors='replace')}/{name}"
                    names.append(name)
                for e in program.get_entries():
                    state = e.state
                    if state is None:
                        continue
                    if state.end_sequence:
                        rows.append((state.address, 0, 0))
                        continue
                    i = state.file if version >= 5 else state.file - 1
                    path = names[i] if 0 <= i < len(names) else "??"
                    if path not in index:
                        index[path] = len(paths)
                        paths.append(path)
                    rows.append((state.address, state.line, index[path]))
        except (DWARFError, ELFError, KeyError, IndexError, AttributeError, ValueError):
            rows, paths = [], []  # unreadable DWARF: no lines, never a crash
    rows.sort(key=lambda r: (r[0], r[1] == 0))  # a row starting code wins over an end
    return LineTable(
        np.array([r[0] for r in rows], dtype=np.uint64),
        np.array([r[1] for r in rows], dtype=np.uint32),
        np.array([r[2] for r in rows], dtype=np.uint32),
        paths,
    )


@functools.lru_cache(maxsize=256)
def load_image(path: str) -> ElfImage | None:
    try:
        return ElfImage(path)
    except StoreError:
        return None


class ModuleMap:
    """Modules by load address, for vectorised address -> module / symbol / line lookups."""

    def __init__(self, modules: list[tuple[int, int, str]]) -> None:
        mods = sorted(set(modules))
        self.bases = np.array([m[0] for m in mods], dtype=np.uint64)
        self.ends = np.array([m[0] + m[1] for m in mods], dtype=np.uint64)
        self.paths = [m[2] for m in mods]
        self._global: tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[str]] | None = None
        #: each module's image, looked up once: the decoder asks per distinct block (a node
        #: thread: 100,000 of them, 3.5 s of a 22 s `stats` in stat() and pathlib)
        self._images: dict[int, ElfImage | None] = {}

    def index(self, addresses: np.ndarray) -> np.ndarray:
        """Module index per address, -1 where no module holds it."""
        a = np.asarray(addresses, dtype=np.uint64)
        if not self.paths:
            return np.full(a.shape, -1, dtype=np.int64)
        i = np.searchsorted(self.bases, a, side="right").astype(np.int64) - 1
        ok = (i >= 0) & (a < self.ends[np.maximum(i, 0)])
        return np.where(ok, i, -1)

    def image(self, i: int) -> ElfImage | None:
        if i not in self._images:
            path = self.paths[i]
            self._images[i] = load_image(path) if Path(path).is_file() else None
        return self._images[i]

    def load_bias(self, i: int) -> int:
        """runtime address - file address, for module `i`."""
        image = self.image(i)
        return int(self.bases[i]) - (image.first_vaddr if image else 0)

    def file_address(self, i: int, address: int) -> int:
        return address - self.load_bias(i)

    # -- symbols -----------------------------------------------------------------------------

    def _symbols(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[str]]:
        """All modules' functions at runtime addresses: starts, ends (0: open), module index,
        names, and the module names."""
        if self._global is None:
            starts, ends, mods, names = [], [], [], []
            for i in range(len(self.paths)):
                image = self.image(i)
                if image is None:
                    continue
                t = image.symbols
                if not t.names:
                    continue
                bias = np.uint64(self.load_bias(i) & (2**64 - 1))
                s = t.starts + bias
                starts.append(s)
                ends.append(np.where(t.sizes > 0, s + t.sizes, np.uint64(0)))
                mods.append(np.full(s.size, i, dtype=np.int32))
                names += t.names
            if starts:
                s, e, m = np.concatenate(starts), np.concatenate(ends), np.concatenate(mods)
                order = np.argsort(s, kind="stable")
                self._global = (s[order], e[order], m[order], [names[k] for k in order], [])
            else:
                z = np.zeros(0, dtype=np.uint64)
                self._global = (z, z, np.zeros(0, np.int32), [], [])
        return self._global

    @property
    def function_names(self) -> list[str]:
        """Names of the ids `function_ids` returns."""
        return self._symbols()[3]

    def function_ids(self, addresses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(function id, offset) per address: id -1 where no symbol covers it (outside its
        module, past a sized symbol's end).  One searchsorted, however many addresses."""
        a = np.asarray(addresses, dtype=np.uint64)
        starts, ends, mods, _names, _ = self._symbols()
        if starts.size == 0:
            return np.full(a.shape, -1, dtype=np.int64), a.copy()
        j = np.searchsorted(starts, a, side="right").astype(np.int64) - 1
        jj = np.maximum(j, 0)
        ok = (j >= 0) & ((ends[jj] == 0) | (a < ends[jj])) & (self.index(a) == mods[jj])
        return np.where(ok, j, -1), np.where(ok, a - starts[jj], a)

    @property
    def function_starts(self) -> np.ndarray:
        """Entry address of each function id."""
        return self._symbols()[0]

    @property
    def function_modules(self) -> list[str]:
        """Module file name of each function id."""
        names = [Path(p).name for p in self.paths]
        return [names[m] for m in self._symbols()[2].tolist()]

    def symbolize(self, addresses: np.ndarray) -> list[str]:
        """`function+0xoff` for each address (`module+0xoff` without a symbol, `0x...`
        outside every module).  Each distinct address is formatted once: a trace repeats a
        few thousand blocks millions of times."""
        distinct, inverse = np.unique(np.asarray(addresses, dtype=np.uint64), return_inverse=True)
        ids, offsets = self.function_ids(distinct)
        mods = self.index(distinct)
        names = self.function_names
        module_names = [Path(p).name for p in self.paths]
        texts = []
        for addr, fid, off, m in zip(
            distinct.tolist(), ids.tolist(), offsets.tolist(), mods.tolist(), strict=True
        ):
            if fid >= 0:
                texts.append(f"{names[fid]}+{off:#x}" if off else names[fid])
            elif m >= 0:
                texts.append(f"{module_names[m]}+{addr - int(self.bases[m]):#x}")
            else:
                texts.append(f"{addr:#x}")
        return [texts[k] for k in inverse.ravel().tolist()]

    def source_lines(self, addresses: np.ndarray) -> list[str]:
        """`file:line` for each address ('' without line information), each distinct
        address looked up once."""
        distinct, inverse = np.unique(np.asarray(addresses, dtype=np.uint64), return_inverse=True)
        texts = [""] * distinct.size
        mods = self.index(distinct)
        for m in np.unique(mods[mods >= 0]).tolist():
            image = self.image(m)
            if image is None or not image.lines.paths:
                continue
            t = image.lines
            file_names = [Path(path).name for path in t.paths]
            sel = np.flatnonzero(mods == m)
            fa = distinct[sel] - np.uint64(self.load_bias(m) & (2**64 - 1))
            row = np.searchsorted(t.addresses, fa, side="right").astype(np.int64) - 1
            for k, r in zip(sel.tolist(), row.tolist(), strict=True):
                if r >= 0 and t.lines[r]:
                    texts[k] = f"{file_names[t.files[r]]}:{int(t.lines[r])}"
        return [texts[k] for k in inverse.ravel().tolist()]

    def runtime_address(self, path_suffix: str, function: str) -> int | None:
        """Where `function` of the module whose path ends with `path_suffix` was loaded."""
        for i, path in enumerate(self.paths):
            if path.endswith(path_suffix):
                image = self.image(i)
                if image and function in image.functions:
                    return self.load_bias(i) + image.functions[function]
        return None
