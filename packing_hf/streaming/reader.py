"""TokenizedStream: samples read lazily from files or datasets, tokenized on the fly, sharded by rank.

What it reads (``data``):

- local files: JSON Lines (``.jsonl``, ``.ndjson``), JSON (``.json``: JSON Lines or a list of records,
  told by content) and Parquet (``.parquet``), one path or a list, read in the order given
  (:mod:`packing_hf.streaming.files`, the readers the ``packing-hf`` app uses too);
- a ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``), sharded across ranks with
  ``datasets.distributed.split_dataset_by_node``;
- anything else that can be iterated again for every pass: a ``datasets.Dataset``, a list of dicts, or a
  function returning a fresh iterator of dicts.

Tokenization (optional): with ``tokenizer`` every record's text (``text_column``, or
``formatting_func(record)``) is tokenized in batches of ``batch_size`` records (one call of the fast
tokenizer per batch); ``tokenize(records) -> {"input_ids": [...], ...}`` replaces both for custom
pipelines (chat templates, label masks). Without either, records must already hold ``input_ids``.

Sharding: rank ``r`` of ``n`` takes records ``r, r + n, r + 2n, ...`` of the concatenated files (or of a
sequence); the others' lines are skipped without being parsed or tokenized. Shards are disjoint and
their sizes differ by at most one record.

Positions: the stream counts the records of its shard it handed out; :meth:`TokenizedStream.iterate`
restarts from any count (skipping without tokenizing: lines are not parsed, Parquet row groups are not
read, sequences are indexed), which is how :class:`~packing_hf.streaming.PackedStream` resumes.
:meth:`TokenizedStream.where` names the record last handed out (``file.jsonl:12``,
``file.parquet: row 7``, ``example 3``) for error messages.

>>> import json, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "data.jsonl")
>>> with open(path, "w") as f:
...     _ = f.write("\\n".join(json.dumps({"input_ids": list(range(1, n + 1))}) for n in (3, 1, 2)))
>>> stream = TokenizedStream(path)
>>> [len(s["input_ids"]) for s in stream.iterate()], stream.where().endswith("data.jsonl:3")
([3, 1, 2], True)
>>> [len(s["input_ids"]) for s in stream.shard(2, 1).iterate()]
[1]
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from .._limits import check_int
from .files import file_format, read_record_file

__all__ = ["TokenizedStream", "read_stream", "streaming_dataset_reader"]

# what a fingerprint reads of the data: the head of every file, the first records of a datasets stream
_FINGERPRINT_BYTES = 1 << 16
_FINGERPRINT_RECORDS = 16


def _digest(chunks: Iterator[bytes]) -> str:
    sha = hashlib.sha1()
    for chunk in chunks:
        sha.update(chunk)
    return sha.hexdigest()[:16]


def _record_bytes(records: Iterator[Any]) -> Iterator[bytes]:
    for record in records:
        yield json.dumps(record, sort_keys=True, default=repr).encode() + b"\n"


def _file_head(path: Path) -> Iterator[bytes]:
    with path.open("rb") as handle:
        yield handle.read(_FINGERPRINT_BYTES)


def _is_file_list(data: Any) -> bool:
    if isinstance(data, str | os.PathLike):
        return True
    return (
        isinstance(data, list | tuple) and bool(data) and all(isinstance(p, str | os.PathLike) for p in data)
    )


class TokenizedStream:
    """Records from files or datasets, tokenized in batches, one rank's shard (see the module docstring).

    Args:
        data: path(s) of JSON Lines / Parquet files, a ``datasets.IterableDataset``, a
            ``datasets.Dataset``, a list of dicts, or a function returning a fresh iterator of dicts.
        tokenizer: a Hugging Face tokenizer; records are tokenized in batches (``tokenizer(texts)``).
        text_column: the record field holding the text (with ``tokenizer``).
        formatting_func: ``record -> text``, instead of ``text_column`` (e.g. a prompt template + EOS).
        tokenize: ``list of records -> dict of lists`` (one list per output field, one element per
            record), instead of ``tokenizer``: for chat templates, label masks, ...
        batch_size: records tokenized per call.
        keep_columns: record fields copied into every sample next to the tokenizer's output
            (e.g. an id, for tracing).
        column: the token-id field of a sample.
        num_replicas, rank: the shard this stream reads (use :meth:`shard` to get another one).

    Samples are dicts: the tokenizer's fields except ``attention_mask`` (packed batches do not use it)
    plus ``keep_columns``; without tokenization, the records themselves.

    Raises (when iterated): ``ValueError`` naming the record (``file:line``) for a malformed JSON line, a
    line that is not a JSON object, a record without the text field, or tokenizer output of the wrong
    shape.
    """

    def __init__(
        self,
        data: Any,
        tokenizer: Any = None,
        *,
        text_column: str = "text",
        formatting_func: Callable[[Mapping[str, Any]], str] | None = None,
        tokenize: Callable[[list[Mapping[str, Any]]], Mapping[str, Sequence[Any]]] | None = None,
        batch_size: int = 1000,
        keep_columns: Sequence[str] = (),
        column: str = "input_ids",
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if tokenizer is not None and tokenize is not None:
            raise ValueError("pass tokenizer (with text_column or formatting_func) or tokenize, not both")
        if formatting_func is not None and tokenizer is None:
            raise ValueError(
                "formatting_func needs a tokenizer to turn its text into tokens; pass tokenizer="
            )
        batch_size = check_int(batch_size, "batch_size", 1)
        num_replicas = check_int(num_replicas, "num_replicas", 1)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be an int in [0, {num_replicas - 1}], got {rank!r}")
        self.data = data
        self.tokenizer = tokenizer
        self.text_column = text_column
        self.formatting_func = formatting_func
        self.tokenize = tokenize
        self.batch_size = batch_size
        self.keep_columns = tuple(keep_columns)
        self.column = column
        self.num_replicas = num_replicas
        self.rank = rank
        self._kind = self._classify(data)
        if self._kind == "files":
            paths = [data] if isinstance(data, str | os.PathLike) else list(data)
            self.paths = [Path(p) for p in paths]
            for path in self.paths:
                file_format(path)
                if not path.is_file():
                    raise ValueError(f"data file {str(path)!r} does not exist")
        self._where: Callable[[], str] = lambda: "before the first record"
        self._fingerprint: str | None = None

    @staticmethod
    def _classify(data: Any) -> str:
        if _is_file_list(data):
            return "files"
        module = type(data).__module__
        if module.startswith("datasets") and type(data).__name__ == "IterableDataset":
            return "hf_iterable"
        if (
            isinstance(data, Sequence)
            and not isinstance(data, str | bytes)
            or (module.startswith("datasets") and hasattr(data, "__getitem__") and hasattr(data, "__len__"))
        ):
            return "sequence"
        if callable(data):
            return "callable"
        if isinstance(data, Iterator) or iter(data) is data:
            raise TypeError(
                f"got a one-shot iterator ({type(data).__name__}): a stream is read again every epoch and on "
                "resume; pass a list, a datasets.IterableDataset, file paths, or a function returning a fresh iterator"
            )
        raise TypeError(
            f"cannot stream from {type(data).__name__}; pass file paths (JSON Lines / Parquet), a "
            "datasets.IterableDataset or Dataset, a list of dicts, or a function returning an iterator of dicts"
        )

    def shard(self, num_replicas: int, rank: int) -> TokenizedStream:
        """The same stream restricted to shard ``rank`` of ``num_replicas`` (of the whole data, not of this shard)."""
        other = TokenizedStream(
            self.data,
            self.tokenizer,
            text_column=self.text_column,
            formatting_func=self.formatting_func,
            tokenize=self.tokenize,
            batch_size=self.batch_size,
            keep_columns=self.keep_columns,
            column=self.column,
            num_replicas=num_replicas,
            rank=rank,
        )
        other._fingerprint = self._fingerprint  # the same data (a datasets stream may be mid-epoch by now)
        return other

    def fingerprint(self) -> str:
        """What the data is, to refuse resuming a stream over other data.

        Files: name, size and a hash of the first 64 KiB of each (so a copy elsewhere still matches);
        a ``datasets`` stream: its dataset name, config, split, shard count and a hash of its first records; a
        list: a hash of every record; a ``datasets.Dataset``: its content fingerprint; a function: its name.
        """
        if self._fingerprint is None:
            self._fingerprint = self._data_fingerprint()
        return self._fingerprint

    def _data_fingerprint(self) -> str:
        data = self.data
        if self._kind == "files":
            return ";".join(f"{p.name}:{p.stat().st_size}:{_digest(_file_head(p))}" for p in self.paths)
        if self._kind == "hf_iterable":
            info = getattr(data, "info", None)
            names = [
                getattr(info, "dataset_name", None),
                getattr(info, "config_name", None),
                getattr(data, "split", None),
            ]
            head = _digest(_record_bytes(islice(iter(data), _FINGERPRINT_RECORDS)))
            return (
                f"datasets.IterableDataset({', '.join(str(n) for n in names if n)}, "
                f"shards={getattr(data, 'num_shards', '?')}, head={head})"
            )
        if self._kind == "sequence":
            content = getattr(data, "_fingerprint", None)  # a datasets.Dataset hashes its own content
            if not isinstance(content, str):
                content = _digest(_record_bytes(iter(data)))
            return f"{type(data).__name__}(len={len(data)}, content={content})"
        return f"callable {getattr(data, '__qualname__', type(data).__name__)}"

    def where(self) -> str:
        """The position of the last record handed out (``file.jsonl:12``, ``file.parquet: row 7``, ...)."""
        return self._where()

    # ---- records ----------------------------------------------------------------------------------

    def _records(self, start: int, epoch: int) -> Iterator[Any]:
        """This shard's records from its ``start``-th on; sets ``self._where`` as they go."""
        if self._kind == "files":
            yield from self._file_records(start)
        elif self._kind == "hf_iterable":
            yield from self._hf_records(start, epoch)
        elif self._kind == "sequence":
            data, n, r = self.data, self.num_replicas, self.rank
            for index in range(r + start * n, len(data), n):
                self._where = lambda index=index: f"sample {index}"
                yield data[index]
        else:
            n, r = self.num_replicas, self.rank
            records = islice(iter(self.data()), r + start * n, None, n)
            for k, record in enumerate(records, start):
                self._where = lambda index=r + k * n: f"record {index}"
                yield record

    def _hf_records(self, start: int, epoch: int) -> Iterator[Any]:
        from datasets.distributed import split_dataset_by_node

        self.fingerprint()  # before set_epoch changes what the stream's first records are
        data = self.data
        if self.num_replicas > 1:
            data = split_dataset_by_node(data, rank=self.rank, world_size=self.num_replicas)
        if hasattr(data, "set_epoch"):
            data.set_epoch(epoch)
        shard = f" of shard {self.rank}/{self.num_replicas}" if self.num_replicas > 1 else ""
        for k, record in enumerate(islice(iter(data), start, None), start):
            self._where = lambda k=k: f"example {k}{shard}"
            yield record

    def _file_records(self, start: int) -> Iterator[Any]:
        n, r = self.num_replicas, self.rank
        first = r + start * n  # global index of the first record to hand out
        base = 0  # global index of the current file's first record
        for path in self.paths:
            records = read_record_file(
                path, first=max(first - base, 0), every=n, phase=(r - base) % n, batch_size=self.batch_size
            )
            while True:
                try:
                    where, record = next(records)
                except StopIteration as stop:
                    base += stop.value  # the file's record count
                    break
                self._where = lambda where=where: where
                yield record

    # ---- samples ----------------------------------------------------------------------------------

    def iterate(self, start: int = 0, epoch: int = 0) -> Iterator[dict[str, Any]]:
        """This shard's samples, from its ``start``-th record on (records before it are skipped untokenized).

        ``epoch`` is passed to ``set_epoch`` of a ``datasets.IterableDataset`` (its own shuffling, if any).
        """
        records = self._records(start, epoch)
        if self.tokenizer is None and self.tokenize is None:
            for record in records:
                if not isinstance(record, Mapping):
                    raise ValueError(
                        f"{self.where()}: expected a dict per record, got {type(record).__name__}"
                    )
                yield record
            return
        while True:
            block, wheres = [], []  # the records of one tokenizer call, and where each came from
            for record in islice(records, self.batch_size):
                block.append(record)
                wheres.append(self._where)
            if not block:
                return
            encoded = self._encode(block, wheres)
            keys = [k for k in encoded if k != "attention_mask"]
            for key in keys:
                if len(encoded[key]) != len(block):
                    raise ValueError(
                        f"tokenization of {len(block)} records ({wheres[0]()} to {wheres[-1]()}) returned "
                        f"{len(encoded[key])} values for {key!r}; it must return one per record"
                    )
            for i, record in enumerate(block):
                self._where = wheres[i]  # errors downstream name this sample's record, not the block's last
                sample = {key: encoded[key][i] for key in keys}
                for name in self.keep_columns:
                    if name not in record:
                        raise ValueError(
                            f"{wheres[i]()}: keep_columns names {name!r}, which the record lacks"
                        )
                    sample[name] = record[name]
                yield sample

    def _encode(self, block: list[Any], wheres: list[Callable[[], str]]) -> Mapping[str, Sequence[Any]]:
        if self.tokenize is not None:
            encoded = self.tokenize(block)
            if not isinstance(encoded, Mapping) or self.column not in encoded:
                keys = f" with keys {sorted(encoded)!r}" if isinstance(encoded, Mapping) else ""
                raise ValueError(
                    f"tokenize() must return a dict of lists holding {self.column!r}, got "
                    f"{type(encoded).__name__}{keys}"
                )
            return encoded
        texts = []
        for record, where in zip(block, wheres, strict=True):
            if not isinstance(record, Mapping):
                raise ValueError(f"{where()}: expected a dict per record, got {type(record).__name__}")
            if self.formatting_func is not None:
                text = self.formatting_func(record)
            elif self.text_column in record:
                text = record[self.text_column]
            else:
                raise ValueError(
                    f"{where()}: no {self.text_column!r} field (keys: {sorted(record)}); set text_column= or "
                    "formatting_func="
                )
            if not isinstance(text, str):
                raise ValueError(
                    f"{where()}: the text to tokenize must be a str, got {type(text).__name__}: {text!r:.60}; "
                    "fix text_column / formatting_func"
                )
            texts.append(text)
        return self.tokenizer(texts)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.iterate()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.fingerprint()}, tokenizer={type(self.tokenizer).__name__ if self.tokenizer else None}, "
            f"shard {self.rank}/{self.num_replicas})"
        )


def read_stream(data: Any, tokenizer: Any = None, **kwargs: Any) -> TokenizedStream:
    """A :class:`TokenizedStream` over ``data`` (files, a ``datasets`` dataset, a list, a function).

    >>> [s["input_ids"] for s in read_stream([{"input_ids": [1, 2]}, {"input_ids": [3]}])]
    [[1, 2], [3]]
    """
    return TokenizedStream(data, tokenizer, **kwargs)


def streaming_dataset_reader(
    data_path: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int = 1000, **kwargs: Any
) -> TokenizedStream:
    """fast_axolotl's name for the reader: :func:`read_stream` over local files, ``batch_size`` records
    tokenized at a time (other keyword arguments as :class:`TokenizedStream`).

    >>> reader = streaming_dataset_reader(SHARED_DATA / "gsm8k_test.jsonl", batch_size=64)
    >>> next(iter(reader))["question"][:22]
    'Janet’s ducks lay 16 e'
    """
    if not _is_file_list(data_path):
        raise TypeError(
            f"data_path must be a path or a list of paths, got {type(data_path).__name__}; use read_stream() "
            "for datasets and iterables"
        )
    return TokenizedStream(data_path, batch_size=batch_size, **kwargs)
