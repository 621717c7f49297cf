"""Datasets for the ``packing-hf`` command line: checked records (:mod:`packing_hf.app.records`) rendered
(:mod:`packing_hf.app.render`) and tokenized with loss masks into a ``datasets.Dataset`` of ``input_ids``
and ``labels``, ready for :class:`~packing_hf.PaddingFreeCollator`, with the over-long sample policy
(:func:`prepare_dataset`). ``streaming: true`` reads the same records lazily:
:class:`~packing_hf.app.record_stream.RecordStream`.

>>> PreparedDataset(dataset=None, record_format="text", prompt_format="text").num_truncated
0
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..overflow import check_overflow
from .records import Record, RecordSet, _records_dataset, read_records
from .render import PromptFormat, _encode_records, _resolve_prompt_format, has_turn_weights

__all__ = ["DATA_OVERFLOWS", "PreparedDataset", "prepare_dataset", "tokenize_records"]

logger = logging.getLogger(__name__)

# "split" is the sampler's (pieces are served by its dataset view), not the data preparation's
DATA_OVERFLOWS = ("error", "truncate", "drop")


def tokenize_records(
    records,
    tokenizer,
    *,
    prompt_format: PromptFormat = "auto",
    completion_only_loss: bool = True,
    num_proc: int | None = None,
    desc: str | None = "Tokenizing",
):
    """Tokenize checked records into ``input_ids`` / ``labels`` (a batched ``map`` with a progress bar).

    Every record becomes one sample; nothing is truncated here (see :func:`prepare_dataset`).

    Args:
        records: a :class:`RecordSet` or a list of :class:`Record`.
        tokenizer: a fast Hugging Face tokenizer (character offsets locate the trained spans).
        prompt_format: ``"auto"`` (chat template when the tokenizer has one, else Alpaca; plain text
            for ``text`` records), ``"chat"``, ``"alpaca"`` or ``"text"``.
        completion_only_loss: train only on answers (assistant turns); prompts get label ``-100``.
        num_proc: worker processes for ``datasets.map`` (None = in process).
        desc: the progress bar's label (None: no bar).

    Returns:
        A ``datasets.Dataset`` with ``input_ids`` (list of int), ``labels`` (list of int, ``-100``
        where not trained), ``where`` (the record's file and line) and, when an assistant turn of any
        record has a ``weight`` (OpenAI's per-message key), ``loss_weights`` (float per token: the turn's
        weight on its tokens, 1 elsewhere; see ``docs/loss.md``).

    >>> from transformers import PreTrainedTokenizerFast
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2, "</s>": 3}, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.Split("</s>", "isolated")
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    >>> ds = tokenize_records([Record("x", "text", text="hi")], tok, desc=None)
    >>> ds[0]["input_ids"], ds[0]["labels"]
    ([1, 3], [1, 3])
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"{type(tokenizer).__name__} is a slow tokenizer; character offsets need a fast one "
            "(AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    dataset = _records_dataset(records)
    items = records.records if isinstance(records, RecordSet) else records
    formats = {record.format for record in items}
    weighted = has_turn_weights(items)
    resolved = _resolve_prompt_format(prompt_format, formats, tokenizer)

    def tokenize_batch(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        items = [Record.from_json(text) for text in batch["record"]]
        return _encode_records(items, tokenizer, resolved, completion_only_loss, weighted)

    from datasets.utils import disable_progress_bars, enable_progress_bars, is_progress_bar_enabled

    quiet = desc is None and is_progress_bar_enabled()
    if quiet:  # datasets would draw a "Map" bar anyway
        disable_progress_bars()
    try:
        tokenized = dataset.map(
            tokenize_batch, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc=desc
        )
    finally:
        if quiet:
            enable_progress_bars()
    tokenized.info.description = resolved  # read back by prepare_dataset
    return tokenized


@dataclass
class PreparedDataset:
    """A tokenized dataset plus what was done to it (so nothing changes silently).

    >>> PreparedDataset(dataset=None, record_format="text", prompt_format="text").num_truncated
    0
    """

    dataset: Any  # datasets.Dataset with input_ids / labels
    record_format: str
    prompt_format: str
    num_truncated: int = 0
    num_dropped: int = 0
    num_untrained: int = 0  # samples with no trained token left (truncated away): they add no loss
    records: RecordSet | None = None

    @property
    def lengths(self) -> np.ndarray:
        """``(num_samples,)`` int64 token count of every sample."""
        from ..sampler import lengths_from_dataset

        return lengths_from_dataset(self.dataset)


def prepare_dataset(
    source: str | Path | RecordSet,
    tokenizer,
    *,
    max_length: int | None = None,
    overflow: str = "error",
    prompt_format: PromptFormat = "auto",
    completion_only_loss: bool = True,
    split: str = "train",
    config_name: str | None = None,
    limit: int | None = None,
    mixed_formats: bool = False,
    num_proc: int | None = None,
    desc: str | None = "Tokenizing",
) -> PreparedDataset:
    """Read, check, render and tokenize a dataset, then apply the over-long sample policy.

    Args:
        source, split, config_name, limit, mixed_formats: see :func:`read_records`; ``source`` may
            also be a :class:`RecordSet` already read.
        tokenizer, prompt_format, completion_only_loss, num_proc, desc: see :func:`tokenize_records`.
        max_length: the longest sample allowed, in tokens (None = no limit).
        overflow: what to do with longer samples: ``"error"`` (default: raise, naming how many and
            the longest, with its file and line), ``"truncate"`` (keep the first ``max_length``
            tokens) or ``"drop"``; truncations and drops are counted in the result and logged.

    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(str(SHARED_DATA / "smollm2_tokenizer"))
    >>> prepared = prepare_dataset("embedded", tok, limit=8, max_length=2048, desc=None)
    >>> prepared.dataset.column_names, prepared.prompt_format, len(prepared.lengths)
    (['input_ids', 'labels', 'where'], 'chat', 8)
    """
    overflow = check_overflow(overflow, "prepare_dataset(overflow=...)", DATA_OVERFLOWS)
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
    if isinstance(source, RecordSet):
        records = source
    else:
        records = read_records(
            source, split=split, config_name=config_name, limit=limit, mixed_formats=mixed_formats
        )
    dataset = tokenize_records(
        records,
        tokenizer,
        prompt_format=prompt_format,
        completion_only_loss=completion_only_loss,
        num_proc=num_proc,
        desc=desc,
    )
    formats = records.formats.most_common()
    prepared = PreparedDataset(
        dataset=dataset,
        record_format=formats[0][0] if len(formats) == 1 else "mixed",
        prompt_format=dataset.info.description,
        records=records,
    )
    lengths = prepared.lengths
    if max_length is not None:
        _apply_overflow(prepared, lengths, max_length, overflow, desc)
    if len(prepared.dataset) == 0:
        raise ValueError(
            f"no samples left from {records.source} (all {len(lengths)} were longer than max_length)"
        )
    prepared.num_untrained = _count_untrained(prepared.dataset)
    if prepared.num_untrained == len(prepared.dataset):
        raise ValueError(
            f"nothing to train on in {records.source}: no sample has a trained token left"
            + (" after truncation to max_length; raise max_length" if prepared.num_truncated else "")
        )
    if prepared.num_untrained:
        logger.warning(
            "%d of %d samples have no trained token left (truncated away): they add nothing to the loss",
            prepared.num_untrained,
            len(prepared.dataset),
        )
    return prepared


def _apply_overflow(
    prepared: PreparedDataset, lengths: np.ndarray, max_length: int, overflow: str, desc: str | None
) -> None:
    """Samples longer than ``max_length``: raise (``"error"``, naming how many and the longest), or truncate
    or drop them in ``prepared`` (counted there and logged)."""
    dataset = prepared.dataset
    too_long = np.flatnonzero(lengths > max_length)
    if not too_long.size:
        return
    longest = int(too_long[np.argmax(lengths[too_long])])
    where = dataset[longest]["where"]
    if overflow == "error":
        raise ValueError(
            f"{too_long.size} of {len(lengths)} samples of {prepared.records.source} are longer than "
            f"max_length={max_length} tokens (the longest, {where}, has {int(lengths[longest])}); "
            "raise max_length, or set overflow: truncate or overflow: drop"
        )
    if overflow == "truncate":
        prepared.dataset = dataset.map(
            lambda batch: {
                key: [ids[:max_length] for ids in batch[key]]
                for key in ("input_ids", "labels", "loss_weights")
                if key in batch
            },
            batched=True,
            desc=f"Truncating {too_long.size} samples" if desc else None,
        )
        prepared.num_truncated = int(too_long.size)
    else:
        prepared.dataset = dataset.select(np.flatnonzero(lengths <= max_length))
        prepared.num_dropped = int(too_long.size)
    logger.warning(
        "%s %d of %d samples longer than max_length=%d (the longest, %s, had %d tokens)",
        "truncated" if overflow == "truncate" else "dropped",
        too_long.size,
        len(lengths),
        max_length,
        where,
        int(lengths[longest]),
    )


def _count_untrained(dataset) -> int:
    """How many samples have no label other than -100 (they contribute nothing to the loss)."""
    import pyarrow.compute as pc

    labels = dataset.with_format("arrow")[:].column("labels").combine_chunks()
    per_sample_tokens = pc.list_value_length(labels).to_numpy(zero_copy_only=False).astype(np.int64)
    trained = (labels.flatten().to_numpy(zero_copy_only=False) != -100).astype(np.int64)
    cumulative = np.concatenate([[0], np.cumsum(trained)])
    ends = np.cumsum(per_sample_tokens)
    per_sample_trained = cumulative[ends] - cumulative[ends - per_sample_tokens]
    return int(np.count_nonzero(per_sample_trained == 0))


# --------------------------------------------------------------------------------------------------
# Streaming: the same records, checks, prompts and loss masks, read as training consumes them
# --------------------------------------------------------------------------------------------------
