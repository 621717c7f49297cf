"""The ``packing-hf`` command line.

Sub-commands:

- ``packing-hf train CONFIG.yaml [overrides]``: fine-tune with packing (see :mod:`packing_hf.train`);
  overrides are ``--key value``, ``--key=value`` or ``key=value`` for any config key.
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

_USAGE = """usage: packing-hf {train,stats,verify} ...

  train CONFIG.yaml [--key value | key=value ...]   fine-tune with packing (configs/*.yaml)
  stats DATA --max-tokens-per-batch N [--plot out.png]   efficiency of batching strategies on DATA
  verify [--model-type llama | --model PATH] ...     check that packed samples do not see each other

Run `packing-hf <command> --help` for the options of a command."""


def _train_help() -> str:
    import dataclasses

    from .config import DataArguments, JobArguments, ModelArguments

    lines = [
        "usage: packing-hf train CONFIG.yaml [--key value | --key=value | key=value ...]",
        "",
        "Fine-tune with packing. CONFIG.yaml is a flat mapping of keys; command-line overrides win.",
        "Keys (besides every field of packing_hf.TrainingArguments, or packing_hf.SFTConfig with trainer: sft,",
        "e.g. max_tokens_per_batch, learning_rate, max_steps, output_dir, bf16):",
    ]
    for cls in (ModelArguments, DataArguments, JobArguments):
        lines.append(f"\n  {cls.__name__}:")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            lines.append(f"    {f.name} (default {default!r}): {f.metadata.get('help', '')}")
    return "\n".join(lines)


def _train(argv: Sequence[str]) -> int:
    if not argv or "-h" in argv or "--help" in argv:
        print(_train_help())
        return 0 if argv else 2
    config, overrides = argv[0], list(argv[1:])
    if config.startswith("-") or "=" in config:
        print(
            "packing-hf train: error: the first argument must be the config file, e.g. configs/tiny_cpu.yaml",
            file=sys.stderr,
        )
        return 2
    from .config import load_train_config

    try:
        cfg = load_train_config(config, overrides)
    except (ValueError, FileNotFoundError) as error:
        print(f"packing-hf train: error: {error}", file=sys.stderr)
        return 2
    from .train import run_training

    try:
        run_training(cfg)
    except (ValueError, FileNotFoundError) as error:
        if os.environ.get("PACKING_HF_TRACEBACK"):
            raise
        print(
            f"packing-hf train: error: {error}\n(set PACKING_HF_TRACEBACK=1 for the full traceback)",
            file=sys.stderr,
        )
        return 1
    return 0


def _stats(argv: Sequence[str]) -> int:
    from .stats import stats_main

    return stats_main(argv)


def _verify(argv: Sequence[str]) -> int:
    from .verify import verify_main

    return verify_main(list(argv))


_COMMANDS = {"train": _train, "stats": _stats, "verify": _verify}


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
