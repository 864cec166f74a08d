"""Pure functions over recorded records: decoding, call counts.  No engines, no privileges."""

from .decode import BRANCH_DTYPE, decode_blocks, thread_branches
from .timeline import thread_records, with_switches

__all__ = ["BRANCH_DTYPE", "decode_blocks", "thread_branches", "thread_records", "with_switches"]
