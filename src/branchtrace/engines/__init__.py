"""Where records come from: each engine writes per-thread stores into a trace directory."""

from .base import Engine, Events, RecordOptions, RecordResult, Target, ThreadStats

__all__ = ["Engine", "Events", "RecordOptions", "RecordResult", "Target", "ThreadStats"]
