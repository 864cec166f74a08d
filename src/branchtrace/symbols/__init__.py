"""ELF images and where modules were loaded: code bytes and symbol addresses."""

from .elf import ElfImage, ModuleMap

__all__ = ["ElfImage", "ModuleMap"]
