"""The data of a ``packing-hf train`` run, read and checked before anything heavy is imported.

Parsing the whole config needs the training-arguments classes (transformers, TRL: 10-40 s of imports on a
busy machine), but reading the data needs only the config's data keys. :func:`read_data_first` takes those
from the YAML and the command line (typed here as the full parse types them), reads and checks every record as
the job would (:func:`read_job_data`), and hands the result to the job, which uses it when its own parse gives
the same data settings (:meth:`DataFirst.matches`): a bad line fails in about a second, and the data is read
once. A config this light reading cannot type is left to the full parse, which reports it with its source.

>>> first = read_data_first({"dataset": "embedded", "num_samples": 4}, ["eval_dataset=null"], say=lambda m: None)
>>> len(first.records.records), first.eval_records
(4, None)
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import missing_extra
from .catalogue import CATALOGUE, trainer_entry
from .config import DataArguments, parse_overrides, read_yaml
from .records import RecordSet, read_records

__all__ = ["DataFirst", "check_installed", "read_data_first", "read_job_data", "read_trl_data"]

_TRUE, _FALSE = ("true", "yes", "1", "t", "y"), ("false", "no", "0", "f", "n")


@dataclass
class DataFirst:
    """What :func:`read_data_first` read: for ``trainer`` and ``data``, the records (``trainer`` / ``sft``) or
    TRL's rows and their description (the TRL trainers)."""

    trainer: str
    data: DataArguments
    records: RecordSet | None = None
    eval_records: RecordSet | None = None
    trl_rows: Any = None
    trl_description: str | None = None

    def matches(self, cfg) -> bool:
        """Whether this is the data ``cfg`` (the fully parsed config) reads."""
        return cfg.job.trainer == self.trainer and cfg.data == self.data


def read_job_data(data: DataArguments, trainer: str, say) -> tuple[RecordSet | None, RecordSet | None]:
    """The checked training and eval records of a ``trainer`` / ``sft`` job (no training records with
    ``streaming``: they are read as training consumes them)."""
    records = None
    if not data.streaming:
        say(f"reading and checking the records of {data.dataset}")
        records = read_records(data.dataset, limit=data.num_samples, **data.read_options())
        say(records.describe())
    eval_records = None
    if data.eval_dataset is not None and trainer_entry(trainer).measures:  # the config refuses it for the others
        say(f"reading and checking the held-out eval records of {data.eval_dataset}")
        eval_records = read_records(data.eval_dataset, limit=data.eval_num_samples, **data.read_options())
        eval_records.limit_key = "eval_num_samples"
        say(eval_records.describe())
    return records, eval_records


def read_trl_data(data: DataArguments, trainer: str, say) -> tuple[Any, str]:
    """The training rows of a TRL trainer's job in TRL's format (:mod:`packing_hf.app.trl_data`), checked,
    and their description."""
    from .trl_data import load_trl_dataset, trl_format

    kind = trl_format(trainer).name
    say(f"reading {data.dataset} as TRL's {kind} format for trainer: {trainer}")
    rows = load_trl_dataset(
        trainer,
        data.dataset,
        split=data.dataset_split,
        config_name=data.dataset_config,
        limit=data.num_samples,
        column_mapping=data.column_mapping,
    )
    description = f"{data.dataset}: {len(rows):,} records, columns {rows.column_names}"
    if data.dataset == "embedded":
        description += " (GSM8K; rejected / label-false answers are other questions' reference answers)"
    say(description)
    return rows, description


def _typed(field: dataclasses.Field, key: str, tokens: list[str]) -> Any:
    """A command-line value typed as ``HfArgumentParser`` types it for this field (ValueError otherwise)."""
    kind = str(field.type)
    if key != field.name:  # no_<flag>
        if tokens or not kind.startswith("bool"):
            raise ValueError(key)
        return False
    if not tokens:
        if not kind.startswith("bool"):
            raise ValueError(key)
        return True
    if len(tokens) != 1:
        raise ValueError(key)
    text = tokens[0]
    if text in ("null", "None"):
        return None
    if kind.startswith("bool"):
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(key)
        return text.lower() in _TRUE
    if kind.startswith("int"):
        return int(text)
    return text


def _data_settings(values: Mapping[str, Any], cli: Mapping[str, list[str]]) -> tuple[str, DataArguments]:
    """The trainer and the data arguments of a config, without the training-arguments classes."""
    settings: dict[str, Any] = {}
    for field in dataclasses.fields(DataArguments):
        given = [key for key in (field.name, f"no_{field.name}") if key in cli]
        if given:
            settings[field.name] = _typed(field, given[-1], cli[given[-1]])
        elif field.name in values:
            settings[field.name] = values[field.name]
    trainer = cli["trainer"][0] if cli.get("trainer") else values.get("trainer", "trainer")
    data = DataArguments(**settings)
    measures = trainer in CATALOGUE and CATALOGUE[trainer].measures
    if not measures and "eval_dataset" not in {**values, **cli}:
        data.eval_dataset = None  # as load_train_config: only trainer: trainer measures a held-out loss
    return str(trainer), data


def check_installed(trainer: str, peft: bool) -> None:
    """The optional packages a run needs (TRL for ``trainer: sft`` and the TRL trainers, PEFT for ``peft:``),
    looked up without importing them.

    Raises:
        ImportError: one is missing; the message says how to install it (``make setup``, the pip extra).
    """
    needs = [("trl", f"trainer: {trainer}")] if trainer_entry(trainer).package == "trl" else []
    if peft:
        needs.append(("peft", "the config's peft: adapter"))
    for module, what in needs:
        if importlib.util.find_spec(module) is None:
            raise missing_extra(what, module, ModuleNotFoundError(f"No module named {module!r}", name=module))


def read_data_first(
    config: str | Path | Mapping[str, Any], overrides: Sequence[str], say
) -> DataFirst | None:
    """Read and check the data of ``config`` + ``overrides`` before the training-arguments classes are
    imported; None when the config cannot be typed without them (the full parse then reports it). The
    optional packages the run needs are checked first (:func:`check_installed`).

    Raises:
        ImportError: TRL or PEFT is needed and missing.
        ValueError, TypeError, FileNotFoundError: a record or the data source is wrong (file and line named).
    """
    try:
        values = dict(config) if isinstance(config, Mapping) else read_yaml(config)
        cli = parse_overrides(overrides)
        trainer, data = _data_settings(values, cli)
    except (ValueError, TypeError, FileNotFoundError):
        return None
    if trainer not in CATALOGUE:
        return None
    peft = cli["peft"] not in ([], ["null"], ["None"]) if "peft" in cli else values.get("peft") is not None
    check_installed(trainer, peft)
    first = DataFirst(trainer=trainer, data=data)
    if trainer_entry(trainer).reads_trl_format:
        first.trl_rows, first.trl_description = read_trl_data(data, trainer, say)
    elif data.streaming:
        return None  # streamed records are checked once the tokenizer is loaded (stream_check_records)
    else:
        first.records, first.eval_records = read_job_data(data, trainer, say)
    return first
