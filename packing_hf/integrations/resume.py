"""Exact resume of the packing trainers: the multipack sampler's epoch and position, and every rank's stream
position and buffer, saved in each checkpoint and checked on resume (see :mod:`packing_hf.integrations.trainer`).

>>> SAMPLER_STATE_NAME, STREAM_STATE_NAME.format(rank=0)
('packing_hf_sampler.json', 'packing_hf_stream_rank0.json')
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import numpy as np
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..streaming import PackedStream
from .args import PackingArguments

__all__ = ["SAMPLER_STATE_NAME", "STREAM_STATE_NAME", "PackingResumeMixin"]


# Written next to trainer_state.json in every checkpoint of a multipack run.
SAMPLER_STATE_NAME = "packing_hf_sampler.json"
# Written by every rank in every checkpoint of a streaming run (``.format(rank=r)``).
STREAM_STATE_NAME = "packing_hf_stream_rank{rank}.json"
_STATE_FORMAT = 1


def _lengths_fingerprint(lengths: np.ndarray) -> str:
    """A short hash of the per-sample lengths: the sampler's plan depends on them."""
    return hashlib.sha1(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


def _checkpoint_state(checkpoint: str, name: str, missing: str) -> dict[str, Any]:
    """The JSON state ``name`` saved in ``checkpoint``; ``missing`` is the error when the file is not there."""
    path = os.path.join(checkpoint, name)
    if not os.path.isfile(path):
        raise ValueError(missing)
    with open(path) as f:
        return json.load(f)


class PackingResumeMixin:
    """Checkpoint and resume of the packing trainers' data order; part of
    :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`."""

    args: PackingArguments

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        epochs_trained, steps_trained_in_current_epoch = super()._init_training_state(*args, **kwargs)
        if self.packing_stream is not None:
            # The stream resumes from its own saved state; stock's skip_first_batches would then skip (and
            # read) that many batches of the already resumed stream.
            steps_trained_in_current_epoch = 0
        return epochs_trained, steps_trained_in_current_epoch

    def _save_stream_state(self, output_dir: str) -> None:
        """Every data-parallel replica's stream position and buffer (``STREAM_STATE_NAME``) into ``output_dir``, written
        by each rank (under sequence parallelism by the first rank of each group)."""
        if not self.parallel_plan.counts_rows:
            return  # sequence parallelism: the group shares one stream replica, its first rank writes it
        stream = self.packing_stream
        consumed = self._stream_batches_consumed
        state = {
            "format": _STATE_FORMAT,
            "global_step": self.state.global_step,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "batches_consumed": consumed,
            "stream": stream.state_dict(batches_consumed=consumed),
        }
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, STREAM_STATE_NAME.format(rank=stream.rank)), "w") as f:
            json.dump(state, f)

    def _restore_stream(self, stream: PackedStream) -> None:
        """On resume: put ``stream`` where the checkpoint's run left this rank's stream."""
        checkpoint = self._packing_resume_dir
        if checkpoint is None or self.args.ignore_data_skip:
            return  # ignore_data_skip: the user asked for the data to restart from the stream's beginning
        name = STREAM_STATE_NAME.format(rank=stream.rank)
        fix = (
            "resume with the data, world size, max_tokens_per_batch, seed and packing_overflow of that run, or pass "
            "ignore_data_skip=True to restart the stream from its beginning"
        )
        state = _checkpoint_state(
            checkpoint,
            name,
            f"resuming from {checkpoint} with a streaming train_dataset, but the checkpoint has no {name} (it "
            f"was not saved by a streaming run on {stream.num_replicas} process(es)), so the stream's position "
            f"is unknown; {fix}",
        )
        try:
            stream.load_state_dict(state["stream"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot resume the stream of {checkpoint} ({name}): {exc}; {fix}") from None

    # ---- checkpoints and resume ------------------------------------------------------------------

    def _sampler_position(self, global_step: int) -> tuple[int, int]:
        """``(epoch, batches consumed in it)`` after ``global_step`` optimizer steps, computed the way the
        Trainer computes where to resume (``skip_first_batches`` count included)."""
        gas = self.args.gradient_accumulation_steps
        steps_per_epoch = max(1, math.ceil(len(self._multipack_sampler) / gas))
        return global_step // steps_per_epoch, (global_step % steps_per_epoch) * gas

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.packing_stream is not None:
            self._save_stream_state(os.path.join(self._get_output_dir(trial=trial), folder))
        if self._multipack_sampler is not None and self.args.should_save:
            # The sampler's own counter runs ahead of training (the DataLoader prefetches): the position
            # saved is the Trainer's, from its step count.
            epoch, consumed = self._sampler_position(self.state.global_step)
            sampler_state = {
                **self._multipack_sampler.state_dict(),
                "epoch": epoch,
                "batches_consumed": consumed,
            }
            state = {
                "format": _STATE_FORMAT,
                "global_step": self.state.global_step,
                "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                "batches_per_epoch": len(self._multipack_sampler),
                "lengths_sha1": _lengths_fingerprint(self._multipack_sampler.lengths),
                "sampler": sampler_state,
            }
            output_dir = os.path.join(self._get_output_dir(trial=trial), folder)
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, SAMPLER_STATE_NAME), "w") as f:
                json.dump(state, f, indent=2, sort_keys=True)
        super()._save_checkpoint(model, trial)

    def _restore_sampler_epoch(self, sampler: Any) -> None:
        """On resume: check that the checkpoint's data order is reproducible, and put the sampler in its epoch.

        The Trainer skips the consumed batches itself (``skip_first_batches``, which only walks the sampler's
        index lists), so the sampler restarts the epoch from its first batch: loading its position as well
        would skip them twice. Under several processes that skipping wrapper also hides the sampler from the
        Trainer's ``set_epoch`` call, hence the epoch is set here.
        """
        checkpoint = self._packing_resume_dir
        if checkpoint is None or self.args.ignore_data_skip:
            return  # ignore_data_skip: the user asked for the data order to restart
        fix = (
            "resume with the dataset, world size, max_tokens_per_batch, seed and gradient_accumulation_steps of "
            "that run, or pass ignore_data_skip=True to restart the data order from the checkpoint's epoch"
        )
        state = _checkpoint_state(
            checkpoint,
            SAMPLER_STATE_NAME,
            f"resuming from {checkpoint} with max_tokens_per_batch={self.args.max_tokens_per_batch}, but the "
            f"checkpoint has no {SAMPLER_STATE_NAME} (it was not saved by a multipack run), so the batches "
            f"it consumed cannot be skipped exactly; {fix}",
        )
        saved = state["sampler"]
        now = {
            "batches_per_epoch": len(sampler),
            "lengths_sha1": _lengths_fingerprint(sampler.lengths),
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
        }
        different = [
            f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in now.items() if state.get(k) != v
        ]
        # where the Trainer will resume, with the current arguments, must be where the checkpoint stopped
        position = self._sampler_position(int(state["global_step"]))
        if not different and position != (saved["epoch"], saved["batches_consumed"]):
            different.append(
                f"position: checkpoint {(saved['epoch'], saved['batches_consumed'])}, now {position}"
            )
        if different:
            raise ValueError(
                f"cannot resume the multipack data order of {checkpoint}: it changed ({'; '.join(different)}); {fix}"
            )
        try:
            # validates seed, budget, number of ranks, ... and sets the epoch; position 0: the Trainer skips
            sampler.load_state_dict({**saved, "batches_consumed": 0})
        except ValueError as exc:
            raise ValueError(
                f"cannot resume the multipack data order of {checkpoint}: {exc}; {fix}"
            ) from None
