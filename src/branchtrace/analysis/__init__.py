"""Pure functions over recorded records: decoding, call counts.  No engines, no privileges."""

from .decode import BRANCH_DTYPE, decode_blocks, thread_branches

__all__ = ["BRANCH_DTYPE", "decode_blocks", "thread_branches"]
