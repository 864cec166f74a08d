"""ELF access with pyelftools: code bytes by virtual address, function symbols."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from ..errors import StoreError


@dataclass(frozen=True)
class Segment:
    vaddr: int
    offset: int
    filesz: int


class ElfImage:
    """One ELF file: its loadable segments and function symbols.

    Addresses here are the file's own virtual addresses; a module loaded at `base` maps
    file address `v` to `base + v - first_load_vaddr` (zero for PIE and libraries).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                elf = ELFFile(f)
                self.segments = [
                    Segment(s["p_vaddr"], s["p_offset"], s["p_filesz"])
                    for s in elf.iter_segments()
                    if s["p_type"] == "PT_LOAD"
                ]
                self.functions = self._functions(elf)
        except (OSError, ELFError) as e:
            raise StoreError(f"{self.path}: cannot read ELF ({e})") from None
        self.first_vaddr = min((s.vaddr for s in self.segments), default=0) & ~0xFFF
        self._data = self.path.read_bytes()

    @staticmethod
    def _functions(elf: ELFFile) -> dict[str, int]:
        found: dict[str, int] = {}
        for name in (".dynsym", ".symtab"):
            table = elf.get_section_by_name(name)
            if not isinstance(table, SymbolTableSection):
                continue
            for sym in table.iter_symbols():
                if sym["st_info"]["type"] == "STT_FUNC" and sym["st_value"] and sym.name:
                    found[sym.name] = sym["st_value"]
        return found

    def read(self, vaddr: int, n: int) -> bytes:
        """Up to `n` bytes of the file image at `vaddr` (empty if not in a segment)."""
        for s in self.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                off = s.offset + vaddr - s.vaddr
                return self._data[off : off + min(n, s.vaddr + s.filesz - vaddr)]
        return b""


@functools.lru_cache(maxsize=256)
def load_image(path: str) -> ElfImage | None:
    try:
        return ElfImage(path)
    except StoreError:
        return None


class ModuleMap:
    """Modules by load address, for vectorised address -> module lookups."""

    def __init__(self, modules: list[tuple[int, int, str]]) -> None:
        mods = sorted(set(modules))
        self.bases = np.array([m[0] for m in mods], dtype=np.uint64)
        self.ends = np.array([m[0] + m[1] for m in mods], dtype=np.uint64)
        self.paths = [m[2] for m in mods]

    def index(self, addresses: np.ndarray) -> np.ndarray:
        """Module index per address, -1 where no module holds it."""
        a = np.asarray(addresses, dtype=np.uint64)
        i = np.searchsorted(self.bases, a, side="right").astype(np.int64) - 1
        ok = (i >= 0) & (a < self.ends[np.maximum(i, 0)])
        return np.where(ok, i, -1)

    def image(self, i: int) -> ElfImage | None:
        return load_image(self.paths[i]) if Path(self.paths[i]).is_file() else None

    def file_address(self, i: int, address: int) -> int:
        image = self.image(i)
        first = image.first_vaddr if image else 0
        return address - int(self.bases[i]) + first

    def _function_table(self, i: int) -> tuple[np.ndarray, list[str]]:
        image = self.image(i)
        if image is None or not image.functions:
            return np.zeros(0, dtype=np.uint64), []
        items = sorted((a, n) for n, a in image.functions.items())
        base = int(self.bases[i]) - image.first_vaddr
        return np.array([a + base for a, _ in items], dtype=np.uint64), [n for _, n in items]

    def symbolize(self, addresses: np.ndarray) -> list[str]:
        """`function+0xoff` for each address (`module+0xoff` without symbols, `0x...` outside
        every module); one searchsorted per module, not a Python lookup per address."""
        a = np.asarray(addresses, dtype=np.uint64)
        mods = self.index(a)
        out = [f"{int(x):#x}" for x in a]
        for m in np.unique(mods[mods >= 0]).tolist():
            sel = np.flatnonzero(mods == m)
            starts, names = self._function_table(m)
            j = np.searchsorted(starts, a[sel], side="right").astype(np.int64) - 1
            module = Path(self.paths[m]).name
            for k, idx in zip(sel.tolist(), j.tolist(), strict=True):
                if idx >= 0:
                    out[k] = f"{names[idx]}+{int(a[k]) - int(starts[idx]):#x}"
                else:
                    out[k] = f"{module}+{int(a[k]) - int(self.bases[m]):#x}"
        return out

    def runtime_address(self, path_suffix: str, function: str) -> int | None:
        """Where `function` of the module whose path ends with `path_suffix` was loaded."""
        for i, path in enumerate(self.paths):
            if path.endswith(path_suffix):
                image = self.image(i)
                if image and function in image.functions:
                    return int(self.bases[i]) + image.functions[function] - image.first_vaddr
        return None
