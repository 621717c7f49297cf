"""``share_prefixes=True`` on ``packing_hf.Trainer`` / ``SFTTrainer``: training micro-batches as prefix trees.

Every training micro-batch becomes one prefix-tree row (:class:`~packing_hf.tree_collator.PrefixTreeCollator`):
the samples' shared prefixes (a conversation's earlier turns, a system prompt) are stored and computed once, and
the loss is the row's (row, target, weight) pairs' (``LossRoute.PREFIX_TREE`` of the trainer's
:class:`~packing_hf.integrations.loss_policy.LossPolicy`), equal to the same samples run alone under every
``loss_normalization`` and ``loss_weights``. What this module owns:

- the collator: built from ``min_shared_tokens`` when none is given; a given one must be a ``PrefixTreeCollator``
  with the same ``min_shared_tokens``;
- the refusals, each by name: accelerate's own sequence / context parallelism (packing_hf's ``sp_size`` cuts a
  tree row exactly: :meth:`~packing_hf.integrations.loss.PackingLossMixin._tree_loss`), models whose token
  mixers cannot start a child from its parent's state (:func:`~packing_hf.attention.admission.prefix_tree_refusal`),
  streamed training data (packed online by length, as it arrives), TRL's own packed rows;
- the models run packing_hf's attention while they train (the only attention reading ``prefix_seq_idx``), given
  back after, as for DPO's shared prompts;
- evaluation and prediction batches are flat packed rows (their ``eval_loss`` and logits per sample as before);
- with ``max_tokens_per_batch``, the sampler's plan: samples sharing prefixes are grouped
  (:func:`~packing_hf.prefix_plan.find_prefix_groups`, with the run's budget and ``min_shared_tokens``) and the
  sampler packs the groups by the tokens their trees compute, so that they meet in one micro-batch
  (:meth:`PrefixTreeMixin._multipack_prefix_groups`).

>>> PrefixTreeMixin.__name__
'PrefixTreeMixin'
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..attention import register_attention
from ..attention.admission import prefix_tree_refusal
from ..collator import PaddingFreeCollator
from ..errors import PackingRefused
from ..tree_collator import PrefixTreeCollator
from .dataloaders import _is_hf_dataset
from .loss_policy import StockLoss
from .preflight import base_model
from .stream_data import is_stream

__all__ = ["PrefixTreeMixin", "flat_collator"]

logger = logging.getLogger(__name__)


def flat_collator(collator: PrefixTreeCollator) -> PaddingFreeCollator:
    """The flat packed layout of ``collator``'s samples (its ``max_length``, ``overflow``, positions, dropped keys):
    the evaluation batches of a ``share_prefixes`` run.

    >>> flat_collator(PrefixTreeCollator(max_length=8, overflow="split")).overflow
    'split'
    """
    return PaddingFreeCollator(
        max_length=collator.max_length,
        overflow=collator.overflow,
        position_ids_start=collator.position_ids_start,
        drop_keys=collator.drop_keys,
    )


class PrefixTreeMixin:
    """``share_prefixes`` of the packing trainers (see the module docstring); part of
    :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`. Configs without the field never share."""

    def _trains_prefix_trees(self) -> bool:
        """Whether this trainer lays its training rows out as prefix trees and computes their loss itself
        (``share_prefixes`` of a causal-LM trainer). The pair and RL trainers take ``share_prefixes`` too, but
        lay their own trees out under their stock loss (``preference.py``, ``rollouts.py``)."""
        return bool(getattr(self.args, "share_prefixes", False)) and self.packing_loss is not StockLoss.PER_EXAMPLE

    @staticmethod
    def _prefix_tree_collator(args: Any, given: Any) -> Any:
        """The training collator of a ``share_prefixes`` run (``args``: its training arguments): ``given`` when it
        is a :class:`PrefixTreeCollator` with the config's ``min_shared_tokens``, a new one when ``None``; anything
        else refused by name."""
        wanted = args.min_shared_tokens
        if given is None:
            return PrefixTreeCollator(min_shared_tokens=wanted)
        if not isinstance(given, PrefixTreeCollator):
            raise ValueError(
                f"share_prefixes=True builds prefix-tree rows, but data_collator={type(given).__name__} lays samples "
                "out flat; leave data_collator unset or pass a packing_hf.PrefixTreeCollator"
            )
        if given.min_shared_tokens != wanted:
            raise ValueError(
                f"min_shared_tokens={wanted} in the config contradicts the data_collator's "
                f"min_shared_tokens={given.min_shared_tokens}; set it in one place"
            )
        return given

    def _check_share_prefixes(self) -> None:
        """The refusals of ``share_prefixes=True`` on the built trainer (each by name, with the fix)."""
        if not self._trains_prefix_trees():
            if isinstance(self.data_collator, PrefixTreeCollator):
                raise ValueError(
                    "data_collator=PrefixTreeCollator builds prefix-tree rows, whose loss needs share_prefixes=True "
                    "(the sampler and the loss follow it); set share_prefixes=True in the training arguments"
                )
            return
        plan = self.parallel_plan
        if plan.shards_sequences:
            # packing_hf's own sp_size cuts a tree row exactly (the loss's pairs follow their rows, _tree_loss);
            # accelerate's context / sequence parallelism would cut it without the tree's ancestors
            raise PackingRefused(
                "share_prefixes",
                f"share_prefixes=True with accelerate's sequence/context parallelism ({plan.shards_sequences}): a "
                "prefix-tree row cut by accelerate loses its ancestors' keys at the cut; use packing_hf's "
                "(parallelism_config=ParallelismConfig(sp_size=N) on packing_hf.Trainer / SFTTrainer) or unset "
                "share_prefixes",
            )
        refusal = prefix_tree_refusal(getattr(base_model(self.model), "config", None))
        if refusal is not None:
            raise PackingRefused("prefix_seq_idx", f"share_prefixes=True: {refusal}")
        if is_stream(self.train_dataset):
            raise ValueError(
                "share_prefixes=True with a streaming train_dataset: a stream is packed by sample length as it "
                "arrives, so samples sharing prefixes rarely meet in a micro-batch; materialise the dataset "
                "(datasets.Dataset) or unset share_prefixes"
            )
        if getattr(self, "_is_vision_dataset", False):
            raise ValueError(
                "share_prefixes=True with a vision-language dataset: image features are not shared along a prefix "
                "tree; unset share_prefixes for vision data"
            )
        if getattr(self.args, "logit_metrics", "labelled") != "labelled":
            raise ValueError(
                f"share_prefixes=True with logit_metrics={self.args.logit_metrics!r}: TRL's fused LM head scores a "
                "flat row; a tree row's loss comes from its target pairs (TRL's entropy / token accuracy are not "
                "logged there). Set logit_metrics='labelled' or unset share_prefixes"
            )
        if getattr(self.args, "pad_to_multiple_of", None) is not None:
            raise ValueError(
                f"share_prefixes=True with pad_to_multiple_of={self.args.pad_to_multiple_of}: a prefix-tree row is "
                "not padded (its length is what its tree computes); unset pad_to_multiple_of"
            )
        if getattr(self.args, "packing", False):
            raise ValueError(
                "share_prefixes=True with TRL's packing=True: TRL packs samples into rows of its own before the "
                "collator sees them; set packing=False (the tree row is the packing)"
            )

    def _multipack_prefix_groups(self, dataset: Any, lengths: Any) -> Any:
        """``share_prefixes``: the training samples grouped by shared prefixes, each group priced by its tree's
        tokens (:func:`~packing_hf.prefix_plan.find_prefix_groups`), for ``MultipackBatchSampler(prefix_groups=)``:
        the samples of a group land in one micro-batch, whose row computes their shared prefix once."""
        if not self._trains_prefix_trees():
            return super()._multipack_prefix_groups(dataset, lengths)
        from ..prefix_plan import find_prefix_groups

        if not _is_hf_dataset(dataset):
            dataset = [dataset[i]["input_ids"] for i in range(len(dataset))]
        return find_prefix_groups(
            dataset,
            max_tokens_per_batch=self.args.max_tokens_per_batch,
            min_shared_tokens=self.args.min_shared_tokens,
        )

    def _packing_attention(self) -> str | None:
        """packing_hf's attention while training on prefix-tree rows (the only attention reading
        ``prefix_seq_idx``), given back after; the stock choice otherwise."""
        if self._trains_prefix_trees():
            return register_attention()
        return super()._packing_attention()

    # ---- evaluation on flat rows -------------------------------------------------------------------

    def get_eval_dataloader(self, eval_dataset: Any = None):
        with self._flat_collator():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any):
        with self._flat_collator():
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _flat_collator(self) -> Iterator[None]:
        """Evaluation and prediction on flat packed rows: their loss and logits stay per sample, as
        without ``share_prefixes`` (the data collator is swapped while the loader is built)."""
        original = self.data_collator
        if isinstance(original, PrefixTreeCollator):
            self.data_collator = flat_collator(original)
        try:
            yield
        finally:
            self.data_collator = original
