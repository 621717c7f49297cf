"""Ctrl-C and resume for ``packing-hf train``: a run stopped by Ctrl-C keeps a checkpoint and says how to go on.

- :func:`resume_checkpoint`: the checkpoint a run continues from (``resume: true`` = the latest ``checkpoint-*``
  in ``output_dir``; ``resume_from_checkpoint: PATH`` = that one), found, or refused by name, before anything
  heavy loads;
- :func:`train_until_interrupted`: ``trainer.train()`` where the first Ctrl-C lets the optimizer step in flight
  finish, then saves a full checkpoint (model, optimizer, scheduler, RNG, data position) through the Trainer's
  own ``_save_checkpoint`` and stops; a second Ctrl-C stops at once, without saving. Stopping on a step boundary
  (not where the signal lands) is what makes the checkpoint whole: a step cut in the middle of the optimizer
  update would save half-updated weights;
- :class:`TrainingInterrupted`: what the job raises after writing the summary so far; the command line prints
  its message and the command that resumes.

>>> latest_checkpoint("/nonexistent") is None
True
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TrainRun",
    "TrainingInterrupted",
    "checkpoint_step",
    "interrupted_message",
    "latest_checkpoint",
    "resume_checkpoint",
    "resumed_note",
    "train_until_interrupted",
]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C after a checkpoint was saved (a ``KeyboardInterrupt``: code that stops on
    Ctrl-C keeps doing so). ``checkpoint`` is its folder, ``step`` the steps it holds, ``summary`` the job's
    summary so far (also written to ``packing_summary.json``)."""

    def __init__(self, message: str, *, checkpoint: str | None, step: int, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.step = step
        self.summary = summary

    def __str__(self) -> str:
        return str(self.args[0])


def latest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The ``checkpoint-<step>`` folder of ``output_dir`` with the highest step that holds a trainer state
    (one cut short while being written has none), or None."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = [
        (int(match.group(1)), path)
        for path in folder.iterdir()
        if (match := _CHECKPOINT.match(path.name)) and (path / "trainer_state.json").is_file()
    ]
    return str(max(found)[1]) if found else None


def resume_checkpoint(resume: bool, resume_from_checkpoint: str | None, output_dir: str) -> str | None:
    """The checkpoint folder a run continues from, or None for a fresh start.

    ``resume`` (``resume=true``) takes the latest checkpoint in ``output_dir``; ``resume_from_checkpoint`` is a
    folder, or ``true`` / ``last`` for the latest (transformers' spelling). Checked before anything loads.

    Raises:
        ValueError: both are set, there is no checkpoint to resume from, or the named folder is not one.
    """
    given = None if resume_from_checkpoint in (None, "", "false", "False") else str(resume_from_checkpoint)
    if resume and given is not None:
        raise ValueError(
            f"resume=true and resume_from_checkpoint={given} both say where to resume from; keep one of the two "
            "(resume=true takes the latest checkpoint in output_dir)"
        )
    if not resume and given is None:
        return None
    if resume or given.lower() in ("true", "last"):
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is None:
            raise ValueError(
                f"resume: no checkpoint-* folder with a trainer_state.json in output_dir {output_dir}, so there is "
                "nothing to resume; run without resume=true to start from the beginning (or point "
                "resume_from_checkpoint at a checkpoint folder)"
            )
        return checkpoint
    if not (Path(given) / "trainer_state.json").is_file():
        raise ValueError(
            f"resume_from_checkpoint={given} is not a checkpoint folder (no trainer_state.json in it); give a "
            "checkpoint-<step> folder, or resume=true for the latest one in output_dir"
        )
    return given


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer steps a checkpoint holds (its ``trainer_state.json``'s ``global_step``)."""
    import json

    return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"])


def resumed_note(checkpoint: str | None) -> str:
    """`` (resuming after step N of <checkpoint>)`` for the training announcement, or nothing."""
    return f" (resuming after step {checkpoint_step(checkpoint)} of {checkpoint})" if checkpoint else ""


@dataclass
class TrainRun:
    """What one ``trainer.train()`` call did: ``result`` (its ``TrainOutput``), the step it started at (> 0 when
    resumed), and whether Ctrl-C stopped it (``checkpoint``: the folder saved on the way out)."""

    result: Any
    started_at: int = 0
    resumed_from: str | None = None
    interrupted: bool = False
    checkpoint: str | None = None
    requested_at: list[int] = field(default_factory=list)

    def summary(self, global_step: int) -> dict[str, Any]:
        """The step counts for the job's summary: all steps, this run's, and the checkpoint it resumed."""
        return {
            "global_step": int(global_step),
            "steps_this_run": int(global_step) - self.started_at,
            "resumed_from": (
                {"checkpoint": self.resumed_from, "global_step": self.started_at}
                if self.resumed_from
                else None
            ),
        }


def _callback(run: TrainRun):
    from transformers import TrainerCallback

    class _StopOnRequest(TrainerCallback):
        """Save and stop at the end of the step during which Ctrl-C came (after the optimizer update)."""

        def on_train_begin(self, args, state, control, **kwargs):
            run.started_at = int(state.global_step)  # the resumed step: the state is loaded by now

        def on_step_end(self, args, state, control, **kwargs):
            if run.requested_at:
                control.should_save = True
                control.should_training_stop = True
            return control

    return _StopOnRequest()


@contextlib.contextmanager
def _first_ctrl_c_stops_gracefully(trainer, run: TrainRun, say):
    """SIGINT handled as a request to stop at the next step end while the block runs (the main thread of a
    single process only: there the handler can be set, and no other rank is left waiting in a collective); the
    previous handler comes back for a second Ctrl-C and after the block."""
    previous = signal.getsignal(signal.SIGINT)
    usable = (
        threading.current_thread() is threading.main_thread()
        and getattr(trainer.args, "world_size", 1) == 1
        and previous not in (signal.SIG_IGN, None)
    )
    if not usable:
        yield
        return

    def request_stop(signum, frame):
        run.requested_at.append(int(trainer.state.global_step))
        signal.signal(signal.SIGINT, previous)  # the next Ctrl-C stops at once
        say(
            f"Ctrl-C: finishing step {trainer.state.global_step + 1}, then saving a checkpoint to "
            f"{trainer.args.output_dir} and stopping (Ctrl-C again stops at once, without saving)"
        )

    signal.signal(signal.SIGINT, request_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def train_until_interrupted(trainer, resume_from: str | None, say) -> TrainRun:
    """``trainer.train(resume_from_checkpoint=resume_from)``; the first Ctrl-C ends it after the current
    optimizer step with a checkpoint saved (see the module doc). Returns what the call did."""
    run = TrainRun(result=None, resumed_from=resume_from)
    callback = _callback(run)
    trainer.add_callback(callback)
    try:
        with _first_ctrl_c_stops_gracefully(trainer, run, say):
            run.result = trainer.train(resume_from_checkpoint=resume_from)
    finally:
        trainer.remove_callback(callback)
    if run.requested_at:
        run.interrupted = True
        folder = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
        if not folder.is_dir():
            # Ctrl-C after the last step's end (training was finishing): train() has returned, a step boundary
            # still, with the optimizer state in place
            trainer._save_checkpoint(trainer.model, trial=None)
        run.checkpoint = str(folder) if folder.is_dir() else None
    return run


def interrupted_message(run: TrainRun, global_step: int, max_steps: int, summary_path: str | None) -> str:
    """What the job says when Ctrl-C stopped training: where the checkpoint and the summary are, how to resume."""
    total = f" of {max_steps}" if max_steps > 0 else ""
    saved = (
        f"checkpoint saved to {run.checkpoint} (model, optimizer, scheduler, data position)"
        if run.checkpoint
        else "no checkpoint was saved"
    )
    return (
        f"stopped by Ctrl-C after step {global_step}{total}: {saved}"
        + (f"; the summary so far is in {summary_path}" if summary_path else "")
        + (
            ". To continue, run the same command with resume=true (it resumes the latest checkpoint in "
            "output_dir and trains the remaining steps)"
            if run.checkpoint
            else ""
        )
    )
