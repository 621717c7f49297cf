"""Limits of the varlen kernels, shared by the numpy-only bin packing and the torch code.

>>> INT32_MAX
2147483647
"""

from __future__ import annotations

__all__ = ["INT32_MAX"]

# cu_seqlens are int32 in every varlen kernel: a packed row (or a batch budget) past this cannot be addressed
INT32_MAX = 2**31 - 1
