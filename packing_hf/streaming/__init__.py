"""Streaming packing: token-budget batches from data read as it arrives, in bounded memory.

For corpora streamed from disk or the Hub (``load_dataset(..., streaming=True)``, JSON Lines / Parquet
shards), where lengths are only known as samples arrive and the map-style
:class:`~packing_hf.MultipackBatchSampler` cannot plan an epoch:

- :class:`TokenizedStream` / :func:`read_stream` / :func:`streaming_dataset_reader` (``reader.py``): read
  records and tokenize them in batches, one disjoint shard per rank, with positions for error messages.
- :func:`~packing_hf.streaming.files.read_record_file` (``files.py``): one reader per file format (JSON
  Lines, JSON, Parquet), shared with the ``packing-hf`` app.
- :class:`StreamPacker` (``packer.py``): bounded shuffle buffer + best fit over open batches.
- :class:`PackedStream` (``stream.py``): the ``IterableDataset`` of batches for ``PaddingFreeCollator``,
  equal batch counts on every rank, exact resume (:meth:`PackedStream.state_dict`).
- :func:`fixed_length_rows`: the batches as ``[1, max_length]`` rows, ``pack_sequences`` style.

See ``docs/streaming.md``.

>>> from packing_hf.streaming import PackedStream
>>> [len(b) for b in PackedStream([{"input_ids": [1] * n} for n in (4, 4, 4)], max_tokens_per_batch=8)]
[2, 1]
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> submodule. Resolved on first access, so ``packing_hf.streaming.files`` (the record readers the
# ``packing-hf`` app checks a dataset with before anything heavy loads) is imported without torch.
_LAZY = {
    "PackedStream": "stream",
    "StreamPacker": "packer",
    "TokenizedStream": "reader",
    "fixed_length_rows": "stream",
    "read_stream": "reader",
    "streaming_dataset_reader": "reader",
}

__all__ = [
    "PackedStream",
    "StreamPacker",
    "TokenizedStream",
    "fixed_length_rows",
    "read_stream",
    "streaming_dataset_reader",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'packing_hf.streaming' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module_name}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from .packer import StreamPacker
    from .reader import TokenizedStream, read_stream, streaming_dataset_reader
    from .stream import PackedStream, fixed_length_rows
