"""``streaming: true`` for the ``packing-hf`` command line: the records of a source read, checked, rendered
and tokenized as training consumes them (:class:`RecordStream`, a
:class:`~packing_hf.streaming.TokenizedStream` for ``packing_hf.Trainer``), with the per-record checks,
prompts and loss masks of the map-style path (:mod:`packing_hf.app.data`).

>>> STREAM_OVERFLOWS
('error', 'truncate')
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..overflow import check_overflow
from ..streaming.files import RECORD_FILE_SUFFIXES, file_format, read_record_file
from .records import (
    _EMBEDDED_DIR,
    _EMBEDDED_FILES,
    Record,
    _first,
    _hub_dataset,
    normalise_record,
    unread_fields,
)
from .render import (
    _PROMPT_FORMATS,
    PromptFormat,
    _encode_records,
    _resolve_prompt_format,
    _trl_rows,
    has_turn_weights,
)

__all__ = ["STREAM_OVERFLOWS", "RecordStream"]

logger = logging.getLogger(__name__)

# a stream tokenizes each batch of records once and hands every record on: it cannot leave one out
STREAM_OVERFLOWS = ("error", "truncate")


def _stream_source(source: str, split: str, config_name: str | None):
    """``(function returning a fresh iterator of (where, raw record), what the data is)`` of a source read
    lazily; files and Hub datasets are opened (and refused) here, before any model loads."""
    path = _EMBEDDED_DIR / _EMBEDDED_FILES[source] if source in _EMBEDDED_FILES else Path(source).expanduser()
    if path.suffix.lower() in RECORD_FILE_SUFFIXES:
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist; check the `dataset` path")
        if file_format(path) == "json":  # one JSON value: parsed whole, so nothing is gained by streaming
            raise ValueError(
                f"{path} holds a JSON list, which cannot be streamed (it is parsed whole); write one record per "
                "line (JSON Lines), or set streaming: false"
            )
        return (lambda: read_record_file(path)), f"{path.name}:{path.stat().st_size}"
    if path.exists():
        raise ValueError(
            f"{path} is not a .jsonl/.json (JSON Lines) or .parquet file, the files streaming: true reads; "
            "convert it to JSON Lines"
        )
    dataset = _hub_dataset(source, config_name, split, streaming=True)
    return (lambda: ((f"{source} record {i + 1}", row) for i, row in enumerate(dataset))), (
        f"{source}/{config_name}/{split}"
    )


class RecordStream:
    """The records of a source read, checked, rendered and tokenized as training consumes them
    (``streaming: true``), with the map-style path's per-record checks, prompts and loss masks.

    :attr:`stream` is a :class:`~packing_hf.streaming.TokenizedStream` of ``{"input_ids", "labels"}``
    samples for ``packing_hf.Trainer`` (which packs it online): records are read in order, checked one by
    one (:func:`normalise_record`: errors name the file and line), and ``batch_size`` of them rendered
    (:func:`format_records`) and tokenized in one tokenizer call. Nothing is read up front, hence:

    - a source's format is the format of the first record read; a record of another format stops the
      stream with its file and line, unless ``mixed_formats`` (``prompt_format: auto`` is then resolved
      per batch of records, as :func:`tokenize_records` resolves it for the whole set);
    - records with nothing to learn are skipped and counted as they come (:attr:`skipped`);
    - a sample longer than ``max_length`` stops the stream with its file and line (``overflow="error"``)
      or is truncated and counted (``"truncate"``); ``"drop"`` is not offered: every record read is handed
      on as one sample;
    - ``limit`` takes the first ``limit`` records of the source, in every pass;
    - a pass that reads no record, or none with anything to learn, is an error (training would wait
      forever for a batch).

    Counters (:attr:`records_read`, :attr:`formats`, :attr:`skipped`, :attr:`num_truncated`,
    :attr:`num_untrained`) add up over every pass this process reads.

    Args:
        source: ``"embedded"``, a JSON Lines (``.jsonl``, ``.json`` with one object per line) or Parquet
            path, or a Hub dataset name (``datasets.load_dataset(..., streaming=True)``).
        tokenizer, prompt_format, completion_only_loss: see :func:`tokenize_records`.
        split, config_name, limit, mixed_formats: see :func:`read_records`.
        max_length, overflow: the longest sample and what to do with longer ones (see above).
        batch_size: records rendered and tokenized per tokenizer call.

    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(str(SHARED_DATA / "smollm2_tokenizer"))
    >>> records = RecordStream("embedded", tok, limit=3, max_length=2048)
    >>> [len(s["input_ids"]) == len(s["labels"]) for s in records.stream]
    [True, True, True]
    >>> records.describe()
    'embedded (streamed): 3 records read by this process (3 question); the first 3 of the source in every pass (num_samples)'
    """

    def __init__(
        self,
        source: str | Path,
        tokenizer,
        *,
        split: str = "train",
        config_name: str | None = None,
        limit: int | None = None,
        mixed_formats: bool = False,
        max_length: int | None = None,
        overflow: str = "error",
        prompt_format: PromptFormat = "auto",
        completion_only_loss: bool = True,
        batch_size: int = 256,
    ) -> None:
        from ..streaming import TokenizedStream

        self.overflow = check_overflow(overflow, "overflow (with streaming: true)", STREAM_OVERFLOWS)
        if limit is not None and limit < 1:
            raise ValueError(f"num_samples must be >= 1 or unset, got {limit}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"{type(tokenizer).__name__} is a slow tokenizer; character offsets need a fast one "
                "(AutoTokenizer.from_pretrained(..., use_fast=True))"
            )
        if prompt_format not in _PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {_PROMPT_FORMATS}, got {prompt_format!r}")
        self.source = str(source)
        self.tokenizer = tokenizer
        self.limit = limit
        self.mixed_formats = mixed_formats
        self.max_length = max_length
        self.prompt_format = prompt_format
        self.completion_only_loss = completion_only_loss
        self._open, identity = _stream_source(self.source, split, config_name)
        self.records_read = 0
        self.formats: Counter = Counter()
        self.prompt_formats: Counter = Counter()
        self.skipped: dict[str, list[str]] = {}  # reason -> where (every one: the report names the first)
        self.ignored_fields: Counter = Counter()
        self.num_truncated = 0
        self.num_untrained = 0
        self._format: str | None = None
        # the stream's fingerprint (a resumed run must read the same data) names the data, not this object
        self.__qualname__ = f"records({identity}, first {limit})" if limit else f"records({identity})"
        self.stream = TokenizedStream(self, tokenize=self._tokenize, batch_size=batch_size)

    def __call__(self) -> Iterable[dict[str, Record]]:
        """One pass over the source: ``{"record": Record}`` for every checked record with something to learn."""
        read = kept = 0
        skipped_before = {reason: len(where) for reason, where in self.skipped.items()}
        for where, raw in self._open():
            if self.limit is not None and read == self.limit:
                break
            read += 1
            self.records_read += 1
            expected = None if self.mixed_formats else self._format
            record = normalise_record(raw, where, expected)
            self._format = self._format or record.format
            self.formats[record.format] += 1
            self.ignored_fields.update(unread_fields(raw, record.format))
            reason = record.skip_reason
            if reason is not None:
                if reason not in self.skipped:
                    logger.warning(
                        "%s: skipping %s (%s): it would teach nothing; counted and reported at the end",
                        self.source,
                        where,
                        reason,
                    )
                self.skipped.setdefault(reason, []).append(where)
                continue
            kept += 1
            yield {"record": record}
        if read == 0:
            raise ValueError(f"{self.source} holds no records")
        if kept == 0:
            reasons = "; ".join(
                f"{len(where) - skipped_before.get(reason, 0)} with {reason}"
                for reason, where in self.skipped.items()
            )
            raise ValueError(
                f"nothing to train on in {self.source}: every record has nothing to learn ({reasons}); every "
                "record needs a non-empty answer / assistant turn"
            )

    def _tokenize(self, block: list[dict[str, Record]]) -> dict[str, list[Any]]:
        items = [item["record"] for item in block]
        if has_turn_weights(items):
            where = next(r.where for r in items if has_turn_weights([r]))
            raise ValueError(
                f"{where}: an assistant turn has a loss weight, which streaming: true does not read (a stream "
                "cannot know ahead whether later records carry weights); set streaming: false"
            )
        resolved = _resolve_prompt_format(self.prompt_format, {r.format for r in items}, self.tokenizer)
        self.prompt_formats[resolved] += len(items)
        encoded = _encode_records(items, self.tokenizer, resolved, self.completion_only_loss)
        input_ids, labels = encoded["input_ids"], encoded["labels"]
        limit = self.max_length
        for i, (ids, where) in enumerate(zip(input_ids, encoded["where"], strict=True)):
            if limit is None or len(ids) <= limit:
                continue
            if self.overflow == "error":
                raise ValueError(
                    f"{where}: the sample has {len(ids)} tokens, more than max_length={limit}; raise "
                    "max_length, or set overflow: truncate"
                )
            input_ids[i], labels[i] = ids[:limit], labels[i][:limit]
            self.num_truncated += 1
            if all(label == -100 for label in labels[i]):
                self.num_untrained += 1
        return {"input_ids": input_ids, "labels": labels}

    def check_first(self, count: int) -> int:
        """Read, check, render and tokenize the first ``count`` records (of the first ``limit``), as training
        will, and return how many were read: a dry pass that catches a bad record of the start of the source
        before a model loads. This stream's counters are left as they were; a start with nothing to learn
        is not an error here (later records may have some)."""
        from ..streaming import TokenizedStream

        probe = copy.copy(self)
        probe.limit = count if self.limit is None else min(count, self.limit)
        probe.records_read = probe.num_truncated = probe.num_untrained = 0
        probe.formats, probe.prompt_formats, probe.ignored_fields = Counter(), Counter(), Counter()
        probe.skipped = {}
        probe._format = None
        probe.stream = TokenizedStream(probe, tokenize=probe._tokenize, batch_size=self.stream.batch_size)
        try:
            for _ in probe.stream.iterate():
                pass
        except ValueError as error:
            if not str(error).startswith(f"nothing to train on in {self.source}"):
                raise
        return probe.records_read

    def trl_dataset(self):
        """The checked records as a ``datasets.IterableDataset`` of TRL rows (see :func:`trl_records`), for
        ``trainer: sft``: TRL renders and tokenizes them as they are read (``prompt_format``,
        ``max_length`` and ``overflow`` of this stream do not apply: TRL's own settings do)."""
        import datasets

        def rows():
            yield from _trl_rows((item["record"] for item in self()), self.tokenizer)

        return datasets.IterableDataset.from_generator(rows)

    def describe(self) -> str:
        """One line: the records read so far, their formats, what was skipped, truncated or ignored."""
        formats = ", ".join(f"{n:,} {name}" for name, n in self.formats.most_common())
        parts = [f"{self.source} (streamed): {self.records_read:,} records read by this process"]
        if formats:
            parts[0] += f" ({formats})"
        if self.limit is not None:
            parts.append(f"the first {self.limit:,} of the source in every pass (num_samples)")
        for reason, where in self.skipped.items():
            parts.append(f"{len(where)} skipped ({reason}: {_first(where)})")
        if self.num_truncated:
            parts.append(f"{self.num_truncated} truncated to max_length={self.max_length}")
        if self.num_untrained:
            parts.append(f"{self.num_untrained} with no trained token left after truncation")
        if self.ignored_fields:
            parts.append(
                "fields not used: " + ", ".join(f"{k} ({n})" for k, n in self.ignored_fields.most_common())
            )
        return "; ".join(parts)
