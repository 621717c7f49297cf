"""What a ``packing-hf`` config refers to and combines, checked before anything loads: model types and
attention implementations (with the closest valid names, and the package a missing one needs), training
values transformers would accept and misbehave on, what streaming cannot do, the batching mode.

>>> check_attn_implementation("sdpa")
'sdpa'
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
from typing import Any

from .catalogue import trainer_entry, trainers_where
from .record_stream import STREAM_OVERFLOWS

__all__ = [
    "TRAINER_KEYS",
    "check_attn_implementation",
    "check_model_type",
    "check_reward_funcs",
    "check_sequence_parallel",
    "check_share_prefixes",
    "refuse_parallel_keys",
    "refuse_unread_keys",
    "trl_packs",
    "unused_keys",
]

logger = logging.getLogger("packing_hf.app.config")

# A key of packing_hf's own config groups (model, data, job) that some trainers have no use for:
# key -> (the property of a trainer's catalogue entry that says it uses the key, why another trainer does not,
# with what to use instead; ``{users}``: the trainers that use it).
TRAINER_KEYS: dict[str, tuple[str, str]] = {
    "mixed_formats": (
        "reads_records",
        "trainer: {trainer} reads one TRL format (its columns, renamed by column_mapping), not packing_hf's "
        "record formats",
    ),
    "column_mapping": (
        "reads_trl_format",
        "trainer: {trainer} reads packing_hf's record formats (messages, conversations, question/answer, "
        "...), whose fields are found by name; column_mapping renames the columns of the TRL trainers' data",
    ),
    "eval_dataset": (
        "measures",
        "trainer: {trainer} measures no held-out eval loss (trainer: {users} does, before and after training)",
    ),
    "eval_num_samples": (
        "measures",
        "trainer: {trainer} measures no held-out eval loss (trainer: {users} does, before and after training)",
    ),
    "prompt_format": (
        "app_tokenizes",
        "trainer: {trainer} has TRL render the records (the tokenizer's chat template, or prompt + "
        "completion without one)",
    ),
    "overflow": (
        "app_tokenizes",
        "trainer: {trainer} has TRL truncate a sample to max_length when max_length is set (counted and "
        "reported; unset with multipack, the budget bounds a sample); for a sample longer than "
        "max_tokens_per_batch set packing_overflow",
    ),
    "completion_only_loss": (
        "reads_records",
        "trainer: {trainer} trains on the completions by construction",
    ),
    "max_length": (
        "tokenizes_ahead",
        "a trainer: {trainer} sample is a prompt and its generated completion; set max_completion_length",
    ),
    "dataset_num_proc": (
        "tokenizes_ahead",
        "trainer: {trainer} tokenizes no dataset ahead (the prompts are tokenized as completions are generated)",
    ),
    "streaming": (
        "reads_records",
        "trainer: {trainer} reads its whole dataset in TRL's format; streaming is for {users}",
    ),
    "stream_check_records": (
        "reads_records",
        "trainer: {trainer} reads its whole dataset in TRL's format; streaming is for {users}",
    ),
    "sample_packing": (
        "chooses_batching",
        "trainer: {trainer} always packs (its pairs, examples or rollouts as packed rows); set "
        "max_tokens_per_batch for multipack batches of at most that many tokens",
    ),
    "baseline_batches": (
        "measures",
        "trainer: {trainer} times no padded baseline (trainer: {users} does; benchmarks/ compares the other "
        "trainers with TRL's padded ones)",
    ),
    "baseline_time_share": (
        "measures",
        "trainer: {trainer} times no padded baseline (trainer: {users} does; benchmarks/ compares the other "
        "trainers with TRL's padded ones)",
    ),
    "reward_funcs": (
        "generates",
        "trainer: {trainer} generates no completions to score (reward_funcs are for {users})",
    ),
}


def _users(attribute: str) -> str:
    """The trainers whose entry has ``attribute``, as a message names them (``grpo and rloo``)."""
    names = trainers_where(attribute)
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"


def _is_hub_name(source: str | None) -> bool:
    """Whether ``dataset`` / ``eval_dataset`` names a Hub dataset (the only sources with splits and
    configurations), not the embedded rows or a local file."""
    from pathlib import Path

    from ..streaming.files import RECORD_FILE_SUFFIXES

    if source is None or source.split(":")[0] == "embedded":
        return False
    path = Path(source).expanduser()
    return path.suffix.lower() not in (*RECORD_FILE_SUFFIXES, ".json") and not path.exists()


def unused_keys(cfg: Any) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The keys of packing_hf's own config groups (model, data, job) that this run would not use:
    ``key -> (why, the keys whose values make it so)``. ``load_train_config`` refuses such a key when it is
    given, naming the reason, or drops it with a note when the command line changed what it depended on
    (``trainer=sft`` for a config written for ``trainer: trainer``).

    >>> from packing_hf.app.config import load_train_config
    >>> unused_keys(load_train_config({"trainer": "dpo"}))["reward_funcs"][0]
    'trainer: dpo generates no completions to score (reward_funcs are for grpo and rloo)'
    """
    model, data, job = cfg.model, cfg.data, cfg.job
    entry = trainer_entry(job.trainer)
    unused: dict[str, tuple[str, tuple[str, ...]]] = {}
    for key, (uses, why) in TRAINER_KEYS.items():
        if not getattr(entry, uses):
            unused[key] = (why.format(trainer=job.trainer, users=_users(uses)), ("trainer",))
    if not data.streaming:
        unused.setdefault(
            "stream_check_records",
            ("it checks the first records of a stream (streaming: true)", ("streaming",)),
        )
    if entry.measures and data.eval_dataset is None:
        unused.setdefault(
            "eval_num_samples",
            (
                "there is no eval data (eval_dataset is none; auto means none for a dataset other than "
                "embedded); set eval_dataset",
                ("dataset", "eval_dataset"),
            ),
        )
    if job.baseline_batches == 0:
        unused.setdefault(
            "baseline_time_share", ("baseline_batches: 0 skips the padded baseline", ("baseline_batches",))
        )
    sources = [data.dataset] + (
        [data.eval_dataset] if data.eval_dataset and "eval_dataset" not in unused else []
    )
    if not any(_is_hub_name(source) for source in sources):
        for key in ("dataset_split", "dataset_config"):
            unused[key] = (
                f"it selects a Hub dataset's split or configuration, and {' and '.join(sources)} "
                f"{'is' if len(sources) == 1 else 'are'} not on the Hub",
                ("dataset", "eval_dataset"),
            )
    if model.model_type is not None and model.tokenizer_name_or_path is not None:
        for key in ("gguf_file", "gguf_package"):
            unused[key] = (
                "the model is built from model_type and the tokenizer read from tokenizer_name_or_path",
                ("model_type", "tokenizer_name_or_path"),
            )
    return unused


def check_model_type(model_type: str) -> None:
    """Refuse a ``model_type`` transformers does not know, naming the closest ones.

    >>> check_model_type("lama")
    Traceback (most recent call last):
    ...
    ValueError: unknown model_type 'lama'; did you mean 'llama' or 'mllama' or 'llama4'? (any model type of transformers' AutoConfig)
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return
    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3, cutoff=0.6)
    hint = (
        f"; did you mean {' or '.join(map(repr, close))}?" if close else "; e.g. 'llama', 'qwen2', 'mistral'"
    )
    raise ValueError(f"unknown model_type {model_type!r}{hint} (any model type of transformers' AutoConfig)")


# attention implementation -> (the module it needs, the pip package that provides it)
_ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3 (built from flash-attention's hopper/)"),
    "flash_attention_4": ("flash_attn.cute", "flash-attn-4"),
}


def check_attn_implementation(name: str) -> str:
    """The name transformers gets for ``name`` (``packing_hf`` / ``packing_hf_varlen`` → packing_hf's
    registered attention); refuse an implementation whose package is missing, before any model loads.

    >>> check_attn_implementation("packing_hf"), check_attn_implementation("sdpa")
    ('packing_hf_varlen', 'sdpa')
    """

    from ..attention import resolve_attn_implementation

    resolved = resolve_attn_implementation(name)
    base = resolved.split("|")[-1]  # "paged|sdpa" -> "sdpa"
    needed = _ATTENTION_PACKAGES.get(base)
    if needed is not None:
        module, package = needed
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError(
                f"attn_implementation: {name} needs the {module} package, which is not installed "
                f"(pip install {package}, on a CUDA machine); or use sdpa or packing_hf"
            )
    elif "/" in base:  # a Hub kernel, e.g. kernels-community/flash-attn
        if importlib.util.find_spec("kernels") is None:
            raise ValueError(f"attn_implementation: {name} is a Hub kernel and needs `pip install kernels`")
    else:
        from transformers import AttentionInterface

        known = {"eager", *AttentionInterface._global_mapping}
        if base not in known:
            close = difflib.get_close_matches(base, sorted(known | {"packing_hf"}), n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"unknown attn_implementation {name!r}{hint} (choose from eager, sdpa, packing_hf, "
                "flash_attention_2, flex_attention)"
            )
    return resolved


def check_reward_funcs(cfg: Any, origin) -> None:
    """``trainer: grpo | rloo``: the reward functions imported when the config is parsed, so a wrong import path
    (or none for a dataset other than the embedded one) fails before the data and the model, not after them."""
    from .rewards import resolve_reward_funcs, reward_spec

    if not trainer_entry(cfg.job.trainer).generates:
        return
    try:
        resolve_reward_funcs(reward_spec(cfg.job.trainer, cfg.job.reward_funcs, cfg.data.dataset))
    except ValueError as error:
        raise ValueError(f"{origin('reward_funcs')}: {error}") from None


def _check_training(training: Any, origin=lambda key: "<config>") -> None:
    """Values transformers would accept silently and then misbehave on (run zero steps, loop forever).
    ``origin(key)`` names where a value came from (the YAML file or the command line) for the message."""
    if training.max_steps == 0 or training.max_steps < -1:
        raise ValueError(
            f"{origin('max_steps')}: max_steps must be >= 1 (or -1 to train num_train_epochs epochs), got "
            f"{training.max_steps}"
        )
    if training.max_steps == -1 and not training.num_train_epochs > 0:
        raise ValueError(
            f"{origin('num_train_epochs')}: num_train_epochs must be > 0 when max_steps is unset, got "
            f"{training.num_train_epochs}"
        )
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(training, name) < 1:
            raise ValueError(f"{origin(name)}: {name} must be >= 1, got {getattr(training, name)}")
    if training.learning_rate < 0:
        raise ValueError(
            f"{origin('learning_rate')}: learning_rate must be >= 0, got {training.learning_rate}"
        )
    if training.logging_steps <= 0:
        raise ValueError(
            f"{origin('logging_steps')}: logging_steps must be > 0, got {training.logging_steps}"
        )
    budget = getattr(training, "max_tokens_per_batch", None)
    if budget is not None and budget < 1:
        raise ValueError(f"{origin('max_tokens_per_batch')}: max_tokens_per_batch must be >= 1, got {budget}")


# training arguments transformers' Trainer does not read (they are for your own scripts), or that packing-hf train's
# Trainer cannot honour: it gets no eval set (trainer: trainer measures the held-out loss itself, before and after
# training). key -> (whether the run does what the value says, given it and the config; why not).
_SCRIPT_KEY = (
    "transformers' Trainer does not read it (it is for your own scripts), and packing-hf train {what}"
)
_NO_EVAL_SET = (
    "packing-hf train gives the Trainer no eval set, so there is no evaluation during training to {what} "
    "(trainer: trainer measures the held-out loss on eval_dataset before and after training)"
)


def _evaluates(cfg: Any) -> bool:
    return trainer_entry(cfg.job.trainer).measures and cfg.data.eval_dataset is not None


UNREAD_TRAINING_KEYS: dict[str, tuple[Any, str]] = {
    "do_train": (lambda value, cfg: value is True, _SCRIPT_KEY.format(what="always trains")),
    "do_eval": (
        lambda value, cfg: value is _evaluates(cfg),
        _SCRIPT_KEY.format(what="evaluates when trainer: trainer has an eval_dataset, and only then"),
    ),
    "do_predict": (lambda value, cfg: value is False, _SCRIPT_KEY.format(what="predicts nothing")),
    **{
        key: (lambda value, cfg: False, _NO_EVAL_SET.format(what=what))
        for key, what in (
            ("eval_strategy", "schedule"),
            ("eval_steps", "schedule"),
            ("eval_delay", "delay"),
            ("eval_on_start", "start with"),
            ("per_device_eval_batch_size", "size"),
            ("eval_accumulation_steps", "accumulate"),
            ("metric_for_best_model", "pick the best checkpoint by"),
        )
    },
}


def refuse_unread_keys(cfg: Any, given: set[str], origin) -> None:
    """Once the arguments are built: a training argument of :data:`UNREAD_TRAINING_KEYS` given (``given``: the
    config's and the command line's keys) with a value the run would not honour (an eval key: other than its
    default) is refused by name, never ignored; and the engine's settings
    (:func:`~packing_hf.app.blocks.check_engine`)."""
    import dataclasses

    from .blocks import check_engine

    training = cfg.training
    check_engine(training, origin)
    defaults = {f.name: f.default for f in dataclasses.fields(training) if f.init}
    for key, (honoured, why) in UNREAD_TRAINING_KEYS.items():
        if not ({key, f"no_{key}"} & given) or key not in defaults:
            continue
        value = getattr(training, key)
        value = getattr(value, "value", value)  # an enum (eval_strategy) as its text
        if str(value) != str(defaults[key]) or key.startswith("do_"):
            if not honoured(value, cfg):
                raise ValueError(f"{origin(key)}: {key}: {value!r} is not used: {why}; remove {key}")


def refuse_parallel_keys(given: dict[str, Any], trainer: str, origin) -> None:
    """Before the arguments are built: ``parallelism_config`` in a ``packing-hf`` config (its sizes come from
    ``sp_size``, or from the launcher), and ``sp_size`` for a trainer that does not cut packed rows, refused by
    name. ``given``: the config's and the command line's keys and values."""
    if "parallelism_config" in given:
        raise ValueError(
            f"{origin('parallelism_config')}: parallelism_config is not taken by packing-hf train: set sp_size: N for "
            "packing_hf's sequence parallelism (the same as ParallelismConfig(sp_size=N)), and deepspeed: or "
            "fsdp: / fsdp_config: for the engine; accelerate's other sizes come from its launcher (see "
            "docs/distributed.md). Remove parallelism_config"
        )
    size = given.get("sp_size")
    if size is not None and not trainer_entry(trainer).sequence_parallel:
        raise ValueError(
            f"{origin('sp_size')}: sp_size: {size} is not used: trainer: {trainer} does not cut packed rows over "
            f"processes (sp_size serves trainer: {', '.join(trainers_where('sequence_parallel'))}); remove sp_size"
        )


def check_sequence_parallel(cfg: Any, origin) -> None:
    """``sp_size > 1`` (for a trainer that cuts packed rows, :func:`refuse_parallel_keys`): multipack rows to cut,
    and packing_hf's attention (chosen for the model when the config names none, with a note); anything else
    refused by name."""
    size = getattr(cfg.training, "sp_size", None) or 1
    if size == 1:
        return
    if cfg.batching != "multipack":
        raise ValueError(
            f"{origin('sp_size')}: sp_size: {size} cuts packed rows of max_tokens_per_batch tokens over processes, "
            f"but batching is {cfg.batching!r}; set max_tokens_per_batch"
        )
    wanted = check_attn_implementation("packing_hf")
    given = cfg.model.attn_implementation
    if given is None:
        cfg.model.attn_implementation = "packing_hf"
        cfg.notes.append(
            f"attn_implementation: packing_hf (sp_size: {size} runs inside packing_hf's attention, which sees the "
            "whole row)"
        )
    elif check_attn_implementation(given) != wanted:
        raise ValueError(
            f"{origin('attn_implementation')}: attn_implementation: {given} with sp_size: {size} would attend within "
            "each process's shard of the row only; sequence parallelism runs inside packing_hf's attention: set "
            "attn_implementation: packing_hf (or leave it out)"
        )


def _known_model_config(model: Any) -> Any:
    """The transformers config of the model the run will build, where it is known before any weight is read: a
    model built from ``model_type`` (with its ``model_config``), or a local folder's ``config.json`` (not a Hub id,
    a GGUF file or a model whose code is trusted remote code); ``None`` otherwise, or for an unknown ``model_type``
    (:func:`check_model_type` names it)."""
    from pathlib import Path

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model.model_type is not None:
        if model.model_type not in CONFIG_MAPPING_NAMES:
            return None
        return AutoConfig.for_model(model.model_type, **(model.model_config or {}))
    path = model.model_name_or_path
    local = path is not None and (Path(path) / "config.json").is_file()
    if local and model.gguf_file is None and not model.trust_remote_code:
        return AutoConfig.from_pretrained(path)
    return None


def check_share_prefixes(cfg: Any, origin) -> None:
    """``share_prefixes: true`` (``trainer: trainer`` / ``sft``, whose training arguments have the key): packed rows
    to merge, read with packing_hf's attention (chosen for the model when the config names none, with a note); a
    padded, streamed or TRL-packed run (``sp_size`` cuts a tree row exactly), another attention, or a model whose
    prefix-tree rows cannot be exact (:func:`~packing_hf.attention.admission.prefix_tree_refusal`, where the
    model's config is known before it is built) refused by name."""
    training = cfg.training
    if not getattr(training, "share_prefixes", False):
        return
    where = origin("share_prefixes")
    from ..attention.admission import prefix_tree_refusal

    config = _known_model_config(cfg.model)
    refusal = prefix_tree_refusal(config) if config is not None else None
    if refusal is not None:
        raise ValueError(f"{where}: share_prefixes: true: {refusal} (here: remove share_prefixes)")
    if cfg.batching == "padded":
        raise ValueError(
            f"{where}: share_prefixes: true merges the samples of a packed row into a prefix tree, but batching is "
            "'padded'; set max_tokens_per_batch (multipack) or batching: padding_free"
        )
    if cfg.data.streaming:
        raise ValueError(
            f"{where}: share_prefixes: true with streaming: true: a stream is packed by sample length as it "
            "arrives, so samples sharing prefixes rarely meet in a micro-batch; remove streaming or share_prefixes"
        )
    if getattr(training, "packing", False):
        raise ValueError(
            f"{where}: share_prefixes: true with packing: true: TRL packs samples into rows of its own before "
            "the collator sees them; remove packing (the tree row is the packing)"
        )
    wanted = check_attn_implementation("packing_hf")
    given = cfg.model.attn_implementation
    if given is None:
        cfg.model.attn_implementation = "packing_hf"
        cfg.notes.append(
            "attn_implementation: packing_hf (share_prefixes: true reads prefix_seq_idx, which only packing_hf's "
            "attention reads)"
        )
    elif check_attn_implementation(given) != wanted:
        raise ValueError(
            f"{origin('attn_implementation')}: attn_implementation: {given} with share_prefixes: true would let a "
            "prefix tree's segments miss their ancestors (only packing_hf's attention reads prefix_seq_idx): set "
            "attn_implementation: packing_hf (or leave it out)"
        )


def _check_streaming(cfg: Any) -> None:
    """Refuse what ``streaming: true`` cannot do: whatever needs the whole dataset up front (its length for
    the number of steps, a plan of all its lengths), or a setting the stream would ignore."""
    data, training = cfg.data, cfg.training
    budget = getattr(training, "max_tokens_per_batch", None)
    if budget is None:
        raise ValueError(
            "streaming: true needs max_tokens_per_batch (records are packed into batches of that many tokens "
            "as they arrive); set max_tokens_per_batch, e.g. max_tokens_per_batch=4096"
        )
    if training.max_steps <= 0:
        raise ValueError(
            f"streaming: true needs max_steps > 0, got {training.max_steps}: a stream has no length, so "
            "num_train_epochs cannot give the number of steps; set max_steps"
        )
    if data.overflow not in STREAM_OVERFLOWS:
        raise ValueError(
            f"overflow: {data.overflow} is not offered with streaming: true (every record read is handed on "
            "as one sample); set overflow: truncate or error, or filter the long records out of the file"
        )
    if data.dataset_num_proc is not None:
        raise ValueError(
            f"dataset_num_proc={data.dataset_num_proc} does not apply with streaming: true (records are "
            "tokenized in batches in the training process); remove dataset_num_proc"
        )
    if training.dataloader_num_workers > 0:
        raise ValueError(
            f"dataloader_num_workers={training.dataloader_num_workers} with streaming: true: the stream's "
            "position and buffer live in the main process (a checkpoint saves them); set dataloader_num_workers=0"
        )
    if not getattr(training, "average_tokens_across_devices", True):
        raise ValueError(
            "average_tokens_across_devices: false with streaming: true: a process whose shard runs out trains "
            "on empty padding batches, exact only when the loss is divided by every process's token count; "
            "set average_tokens_across_devices: true"
        )


def trl_packs(training: Any) -> bool:
    """Whether TRL flattens batches itself: ``padding_free`` or ``packing`` (bfd rows) in an ``SFTConfig``."""
    return bool(getattr(training, "padding_free", False) or getattr(training, "packing", False))


def _resolve_batching(cfg: Any) -> str:
    """Turn ``batching`` / ``sample_packing`` / ``max_tokens_per_batch`` into one batching mode."""
    job, training = cfg.job, cfg.training
    budget = getattr(training, "max_tokens_per_batch", None)
    batching = job.batching
    if trainer_entry(job.trainer).always_packs:  # TRL's preference / RL trainers
        if batching not in ("auto", "multipack" if budget is not None else "padding_free"):
            raise ValueError(
                f"trainer: {job.trainer} always packs (its pairs, examples or rollouts as packed rows, of at most "
                f"max_tokens_per_batch tokens when set); remove batching: {batching}"
            )
        return "multipack" if budget is not None else "padding_free"
    if job.sample_packing is not None:
        implied = "multipack" if job.sample_packing else "padded"
        if batching not in ("auto", implied):
            raise ValueError(
                f"sample_packing: {str(job.sample_packing).lower()} means batching {implied!r}, but batching is "
                f"{batching!r}; keep one of the two keys"
            )
        batching = implied
    if batching == "auto":
        if budget is not None:
            batching = "multipack"
        elif job.trainer == "sft":
            # TRL decides: its padding_free / packing (bfd rows) flatten batches, otherwise it pads
            # (share_prefixes: packing_hf's tree collator, which flattens every batch)
            flat = trl_packs(training) or getattr(training, "share_prefixes", False)
            batching = "padding_free" if flat else "padded"
        else:
            batching = "padding_free"
    if batching == "multipack" and budget is None:
        budget = cfg.data.max_length * training.per_device_train_batch_size
        training.max_tokens_per_batch = budget
        training.follow_budget()  # trainer: sft, an unset max_length: the budget bounds a sample, not TRL's 1024
        logger.info(
            "multipack: max_tokens_per_batch = max_length x per_device_train_batch_size = %d x %d = %d",
            cfg.data.max_length,
            training.per_device_train_batch_size,
            budget,
        )
    if batching != "multipack" and budget is not None:
        raise ValueError(
            f"max_tokens_per_batch={budget} needs multipack batching, but batching is {batching!r}"
            + (" (sample_packing: false)" if job.sample_packing is False else "")
            + "; remove max_tokens_per_batch or set batching: multipack"
        )
    if budget is not None and budget < cfg.data.max_length:
        raise ValueError(
            f"max_tokens_per_batch={budget} is smaller than max_length={cfg.data.max_length}: a sample of "
            "max_length tokens could never be placed; raise max_tokens_per_batch or lower max_length"
        )
    shares = getattr(training, "share_prefixes", False)  # packing_hf's tree collator flattens the batches
    if job.trainer == "sft" and batching == "padding_free" and not (trl_packs(training) or shares):
        raise ValueError(
            "trainer: sft with batching: padding_free needs TRL's padding_free: true (or packing: true)"
        )
    if job.trainer == "sft" and batching == "padded" and trl_packs(training):
        raise ValueError("batching: padded contradicts padding_free / packing: true in the SFT config")
    return batching
