"""MultipackBatchSampler: batches of dataset indices that fill a token budget, for one rank or many.

The sampler decides which samples share a batch (bin packing, see ``_binpack.py``), shards the
batches across data-parallel ranks and visits them in a random order. It yields lists of dataset
indices, for ``DataLoader(dataset, batch_sampler=sampler, collate_fn=PaddingFreeCollator())``.

Two plans decide which samples share a batch (``mixing``):

- ``"random"`` (default): every epoch the samples are visited in a fresh random order drawn from
  ``(seed, epoch)`` (the ones longer than half the budget first) and each goes into the batch it fills
  most tightly; then the least-filled batches are emptied into the others where possible. Batches are
  a random mix of lengths, as in plain shuffled batches, and a sample's batch-mates change every epoch.
  It needs 0-0.3% more batches than ``"sorted"`` (none on the shared GSM8K / GPTeacher / Alpaca data).
- ``"sorted"``: best-fit decreasing over the lengths sorted longest first, the same bins every epoch
  (only equal-length samples trade places). The fewest batches, but every batch holds samples of
  nearly the same length; on GSM8K this trained to a measurably worse loss (see docs/multipack.md).

How an epoch is planned (identical on every rank, no communication):

1. *The batch count, once*: ``"sorted"``: the bins of best-fit decreasing + repair. ``"random"``: the
   most bins among a few epochs' draws plus 0.1% (at most 1% + 1 over the Martello-Toth lower bound),
   so that every epoch's draw fits in it. With ``drop_last=False`` the count is then rounded up to a
   multiple of ``num_replicas``. ``len()`` is exact and the same in every epoch.
2. *Per epoch*, from ``(seed, epoch)`` (through ``numpy.random.SeedSequence``, the same on every
   machine): the bins (``"random"``: a new draw; one that needs more bins than the count is drawn
   again, and after 8 tries the epoch reuses epoch 0's bins, counted in
   :meth:`~MultipackBatchSampler.stats`; ``"sorted"``: which of several equal-length samples takes
   which place); bins are split in two (those holding the most samples)
   until there are exactly the fixed number; which bins are dropped (``drop_last=True`` only); the
   order in which steps are visited (uniformly random); which rank takes which bin of a step.
3. *Steps*: with several ranks, bins are grouped ``num_replicas`` at a time into steps of similar cost
   (the predicted compute cost ``sum(linear * L + quadratic * L**2)`` when a ``cost_model`` is given,
   else tokens, or the sum of squared lengths with ``balance="attention"``), so ranks wait on each
   other as little as possible; rank ``r`` yields the bin it was given in every step. Where a step's
   costliest bin is still over 1% above the step's mean (few steps, as on a dataset of a few hundred
   samples on 8 ranks, where no bins of similar cost are left to group; split bins; the epoch's
   tail), samples move between the bins of that step (one given whole, or traded for one or two
   shorter ones) until it is within 1% or no move helps; the budget stays a hard cap and the bin
   count does not change. Every step is balanced on its own, so under gradient accumulation every
   micro-batch is too.

>>> sampler = MultipackBatchSampler([3, 5, 2, 6, 4], max_tokens_per_batch=10, seed=0)
>>> len(sampler), sorted(i for batch in sampler for i in batch)
(2, [0, 1, 2, 3, 4])
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from . import _binpack
from ._epoch_plan import _EpochPlan, _mean_length_spread, _ranges
from ._limits import check_int, check_world
from .cost import CostModel, rank_cost_spread
from .overflow import OVERFLOW_POLICIES, OverflowPolicy, check_overflow
from .prefix_plan import PrefixGroups, check_prefix_groups

__all__ = ["MIXINGS", "OVERFLOW_POLICIES", "MultipackBatchSampler", "OverflowView", "lengths_from_dataset"]

logger = logging.getLogger(__name__)

Balance = Literal["tokens", "attention", "cost"]
Mixing = Literal["random", "sorted"]
#: what ``mixing=`` accepts
MIXINGS: tuple[str, ...] = ("random", "sorted")
_BALANCES = ("tokens", "attention", "cost")
_STATE_KEYS = ("epoch", "batches_consumed")
# configuration that fixes the plan: a state saved under one cannot resume under another
_PLAN_KEYS = (
    "seed",
    "shuffle",
    "num_replicas",
    "max_tokens_per_batch",
    "num_samples",
    "drop_last",
    "overflow",
    "mixing",
    "lengths_sha1",
    "balance",
    "cost_model",
    "prefix_groups_sha1",
)


def lengths_from_dataset(dataset: Any, column: str = "input_ids") -> np.ndarray:
    """Token count of every row of a ``datasets.Dataset``, read from the Arrow list offsets.

    No Python list of token ids is built: the lengths come from the column's offsets buffer (or the
    column itself when it already holds integer lengths), and an indices mapping left by
    ``select``/``shuffle``/``filter`` is applied on top.

    Args:
        dataset: a ``datasets.Dataset`` (map-style; an ``IterableDataset`` has no lengths up front).
        column: a list column (``"input_ids"``) or an integer column of precomputed lengths.

    Returns:
        ``(len(dataset),)`` int64.

    Raises:
        TypeError: not a ``datasets.Dataset``, or the column is neither a list nor an integer column.
        ValueError: the column does not exist, or holds nulls.

    >>> import datasets
    >>> ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4], [5, 6]]})
    >>> lengths_from_dataset(ds).tolist(), lengths_from_dataset(ds.select([2, 0])).tolist()
    ([3, 1, 2], [2, 3])
    """
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc

    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"expected a datasets.Dataset, got {type(dataset).__name__}; for other datasets pass the lengths "
            "directly, e.g. [len(row['input_ids']) for row in dataset]"
        )
    if column not in dataset.column_names:
        raise ValueError(
            f"column {column!r} is not in the dataset (columns: {dataset.column_names}); tokenize first"
        )
    chunked = dataset.data.column(column)  # pa.ChunkedArray over the whole table, before any indices mapping
    kind = chunked.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        parts = [pc.list_value_length(chunk) for chunk in chunked.chunks]
    elif pa.types.is_integer(kind):
        parts = list(chunked.chunks)
    else:
        raise TypeError(
            f"column {column!r} has Arrow type {kind}; expected a list column (token ids) or an integer "
            "column of lengths"
        )
    if any(part.null_count for part in parts):
        raise ValueError(f"column {column!r} holds null rows; drop or fill them before building the sampler")
    lengths = (
        np.concatenate([part.to_numpy(zero_copy_only=False) for part in parts]).astype(np.int64)
        if parts
        else np.zeros(0, np.int64)
    )
    indices = getattr(dataset, "_indices", None)  # set by select/shuffle/filter until flatten_indices()
    if indices is not None:
        lengths = lengths[indices.column(0).to_numpy().astype(np.int64)]
    return lengths


class MultipackBatchSampler(_EpochPlan, Sampler[list[int]]):
    """Batch sampler that packs samples into batches of at most ``max_tokens_per_batch`` tokens.

    Every batch is a list of dataset indices whose lengths sum to at most ``max_tokens_per_batch``;
    batches are nearly full (within a fraction of a percent of the Martello-Toth lower bound on real
    data), a random mix of lengths by default, visited in a random order, and sharded across
    data-parallel ranks.

    Args:
        lengths: the token count of every sample: a sequence / numpy array / tensor of ints ``(n,)``,
            or a ``datasets.Dataset`` (then ``column`` is read from its Arrow offsets, see
            :func:`lengths_from_dataset`).
        max_tokens_per_batch: the token budget of one batch (per rank).
        column: the column of a ``datasets.Dataset`` to measure (ignored for plain lengths).
        shuffle: draw the plan anew each epoch from ``(seed, epoch)``: which samples share a batch,
            the step order and the bins' rank. ``False``: the same plan every epoch, bins filled in
            dataset order (``mixing="random"``) and steps visited in dataset order (by their smallest
            index).
        seed: seed of the plan; every rank must use the same.
        num_replicas: number of data-parallel ranks (default: ``torch.distributed`` world size when
            initialized, else 1).
        rank: this rank (default: ``torch.distributed`` rank when initialized, else 0).
        drop_last: ``False`` (default): bins are split until every rank gets the same number of
            batches and every sample appears exactly once per epoch; if the dataset is too small for
            that (fewer samples than ``num_replicas x batches per rank``) a ``ValueError`` says so.
            ``True``: the ``bins % num_replicas`` left-over bins are dropped each epoch (different
            ones every epoch, counted in :meth:`stats` as ``dropped_samples`` / ``dropped_tokens``).
        overflow: a sample longer than ``max_tokens_per_batch`` (one of :data:`OVERFLOW_POLICIES`):
            ``"error"`` (default) raises a ``ValueError`` naming its index and length.
            ``"truncate"`` packs it as ``max_tokens_per_batch`` tokens, ``"split"`` as
            ``ceil(L / budget)`` pieces yielded as indices ``>= len(dataset)``; with either, the DataLoader
            must get ``sampler.wrap_dataset(dataset)`` (the :class:`OverflowView` that cuts them and serves
            the pieces), and iterating before ``wrap_dataset`` was called raises, since the batches would
            exceed the budget or index past the dataset. ``"drop"`` leaves it out. All of them are counted in :meth:`stats` and logged once.
        balance: how steps are formed from bins when ``num_replicas > 1``: ``"cost"`` (the default when
            ``cost_model`` is given) puts bins of similar predicted cost in the same step; ``"tokens"``
            (the default without one) bins of similar token counts; ``"attention"`` uses the sum of
            squared sample lengths (the cost of attention alone). Costs matter on long-tail data, where a
            bin holding one long sample costs far more than one holding many short ones.
        cost_model: a :class:`~packing_hf.CostModel` (``cost(L) = linear * L + quadratic * L**2``,
            given, from :meth:`~packing_hf.CostModel.from_config` or measured by
            :func:`~packing_hf.fit_cost_model`): predicts every batch's cost for ``balance="cost"`` and
            for :meth:`stats` (``rank_cost_max_over_mean``). ``len()`` and the fill do not depend on it;
            which samples share a batch does (within a step).
        shard: ``True`` (default): yield this rank's batches only. ``False``: yield the batches of
            every rank, interleaved step by step (batch ``i`` belongs to rank ``i % num_replicas``), for
            a wrapper that shards batches itself the same way, such as accelerate's
            ``BatchSamplerShard``; ``len()`` is then ``num_replicas`` times larger.
        mixing: which samples share a batch (one of :data:`MIXINGS`). ``"random"`` (default): a fresh
            random mix every epoch (random-order best fit, long samples first, see
            :func:`~packing_hf._binpack.pack_best_fit_random_order`); the spread of batch mean lengths
            is that of shuffled batches, and on GSM8K it trains to the loss of padded random batches.
            ``"sorted"``: best-fit decreasing, the same bins every epoch; the fewest batches (0-0.3%
            fewer, none on the shared real data) and a cheaper plan, but each batch holds samples of
            nearly the same length, which trained to a worse loss. See docs/multipack.md for the
            measured costs.
        prefix_groups: a :class:`~packing_hf.prefix_plan.PrefixGroups` from
            :func:`~packing_hf.prefix_plan.find_prefix_groups` of the same samples and budget: batches are
            planned by computed tokens. Groups, not samples, are packed (by their trees' ``unique_tokens``,
            steps balanced by ``balance`` over the trees' tokens, attention terms or cost), and every batch
            yields the indices of its groups' samples, each group's together. Every sample must be in
            exactly one group (checked against ``lengths``); a group over the budget is a single sample,
            left to ``overflow``. ``len()``, resume and the ranks work as without.

    Attributes:
        max_tokens_per_batch, num_replicas, rank, epoch, seed, shuffle, drop_last, overflow, balance,
        shard, mixing, prefix_groups: as given (``epoch`` changes with :meth:`set_epoch`).
        lengths: ``(n,)`` int64, the token count of every sample.
        batch_size: ``None`` (batches hold a varying number of samples; what ``DataLoader`` and
            accelerate expect from a batch sampler without a fixed size).

    Using it with accelerate / the HF Trainer: the sampler is already rank-aware. ``accelerator.prepare``
    wraps a ``DataLoader``'s batch sampler in ``BatchSamplerShard`` when there are several processes,
    which would shard a second time (each rank would keep ``1 / num_replicas`` of its own batches): iterating
    the sampler so raises a ``ValueError`` naming the two fixes. Either build the sampler with ``shard=False`` (accelerate then deals batch ``i`` to rank
    ``i % num_replicas``, which is exactly this sampler's assignment, and ``len()`` stays a multiple of
    ``num_replicas`` so ``BatchSamplerShard`` never pads), or keep ``shard=True`` and make the wrapper a
    pass-through after ``prepare`` (``num_processes = 1``, ``process_index = 0``, as transformers
    does for ``BatchRebalanceSampler``). Call ``set_epoch`` on the sampler itself each epoch:
    accelerate's ``DataLoaderShard.set_epoch`` does not reach a batch sampler inside
    ``BatchSamplerShard`` (the Trainer reaches it through ``dataloader.batch_sampler.batch_sampler``).

    Resuming: :meth:`state_dict` holds the epoch and the number of batches this sampler yielded in it.
    A ``DataLoader`` with workers draws batches ahead of the training loop, so when saving from a
    training loop set ``state["batches_consumed"]`` to the number of batches the loop actually
    consumed. Do not combine :meth:`load_state_dict` with another skipping mechanism
    (``accelerate.skip_first_batches``, the Trainer's data skip): batches would be skipped twice.

    >>> sampler = MultipackBatchSampler([5, 5, 4, 3, 2, 1], 10, num_replicas=2, rank=0)
    >>> other = MultipackBatchSampler([5, 5, 4, 3, 2, 1], 10, num_replicas=2, rank=1)
    >>> len(sampler) == len(other), sorted(i for b in [*sampler, *other] for i in b)
    (True, [0, 1, 2, 3, 4, 5])
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | torch.Tensor | Any,
        max_tokens_per_batch: int,
        *,
        column: str = "input_ids",
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        overflow: OverflowPolicy = "error",
        balance: Balance | None = None,
        shard: bool = True,
        mixing: Mixing = "random",
        cost_model: CostModel | None = None,
        prefix_groups: PrefixGroups | None = None,
    ) -> None:
        super().__init__()
        self.max_tokens_per_batch = check_int(max_tokens_per_batch, "max_tokens_per_batch", 1)
        _binpack.check_budget(self.max_tokens_per_batch, "max_tokens_per_batch")  # the int32 limit
        overflow = check_overflow(overflow, "MultipackBatchSampler(overflow=...)")
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(
                f"cost_model must be a packing_hf.CostModel, got {type(cost_model).__name__}; build one with "
                "CostModel(linear, quadratic), CostModel.from_config(model.config) or fit_cost_model(model, budget)"
            )
        if balance is None:
            balance = "tokens" if cost_model is None else "cost"
        if balance not in _BALANCES:
            raise ValueError(f"balance must be one of {_BALANCES}, got {balance!r}")
        if balance == "cost" and cost_model is None:
            raise ValueError(
                "balance='cost' needs a cost_model (CostModel(linear, quadratic), CostModel.from_config(config) "
                "or fit_cost_model(model, budget)); or use balance='tokens'"
            )
        if mixing not in MIXINGS:
            raise ValueError(
                f"mixing must be one of {MIXINGS}, got {mixing!r}: 'random' (default) mixes lengths in "
                "every batch, 'sorted' packs the fewest batches of similar lengths"
            )
        self.num_replicas, self.rank = check_world(num_replicas, rank)
        self.seed = check_int(seed, "seed", 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.overflow: OverflowPolicy = overflow
        self.balance: Balance = balance
        self.shard = bool(shard)
        self.mixing: Mixing = mixing
        self.cost_model = cost_model
        self.column = column
        self.batch_size = None
        self.epoch = 0

        if type(lengths).__module__.startswith("datasets"):
            lengths = lengths_from_dataset(lengths, column)
        self.lengths = _binpack.as_lengths(lengths)
        if self.lengths.size == 0:
            raise ValueError("the dataset is empty (no lengths): there is nothing to sample")
        if prefix_groups is not None:
            check_prefix_groups(prefix_groups, self.lengths, self.max_tokens_per_batch)
        self.prefix_groups = prefix_groups
        self._build_items()

        self._start = 0  # batches to skip at the next __iter__ (set by load_state_dict)
        self._wrapped = False  # wrap_dataset was called: indices of pieces / truncations are served
        self._consumed = 0  # batches yielded in the current epoch (what state_dict saves)
        self._template: dict[str, Any] | None = None
        self._plan_cache: tuple[int, dict[str, Any]] | None = None

    # ------------------------------------------------------------------------------------------
    # Sampler protocol

    @property
    def num_steps(self) -> int:
        """Batches per rank in one epoch (the same in every epoch)."""
        return self._get_template()["n_bins"] // self.num_replicas

    def __len__(self) -> int:
        return self.num_steps * (1 if self.shard else self.num_replicas)

    def __iter__(self) -> Iterator[list[int]]:
        if not self._wrapped and (self.pieces.size or self._counts["truncated_samples"]):
            n_long = self._counts["split_samples"] + self._counts["truncated_samples"]
            raise ValueError(
                f"overflow={self.overflow!r} packed {n_long} over-long sample(s) as "
                f"{'pieces' if self.pieces.size else 'max_tokens_per_batch tokens'}, which only the sampler's "
                "dataset view serves: build the DataLoader on sampler.wrap_dataset(dataset) (packing_hf.Trainer "
                "does), else the batches would exceed max_tokens_per_batch or index past the dataset"
            )
        self._refuse_double_sharding()
        plan = self._plan()
        steps = plan["steps"]
        # shard=False: step-major, so batch i belongs to rank i % num_replicas
        bins = steps[:, self.rank] if self.shard else steps.reshape(-1)
        start, self._start = self._start, 0
        self._consumed = start
        for i, batch in enumerate(self._batches(plan, bins[start:]), start):
            self._consumed = i + 1
            yield batch

    def _refuse_double_sharding(self) -> None:
        """Raise when accelerate's ``BatchSamplerShard`` deals this rank's batches out again.

        ``accelerator.prepare(DataLoader(batch_sampler=sampler))`` wraps a batch sampler in ``BatchSamplerShard``
        with several processes; around a sampler that already yields this rank's batches (``shard=True``) it
        keeps every ``num_processes``-th of them, and each epoch silently loses ``1 - 1 / num_processes`` of
        the data. accelerate offers no hook to tell a batch sampler who wraps it, so the wrapper is found as
        the caller of this generator (the frames of ``BatchSamplerShard.__iter__``), only when accelerate is
        imported."""
        shard_module = sys.modules.get("accelerate.data_loader")
        if not self.shard or self.num_replicas == 1 or shard_module is None:
            return
        frame = sys._getframe(2)  # past this method and the generator body: who called next()
        for _ in range(3):  # _iter_with_no_split / _iter_with_split <- __iter__ <- the DataLoader
            if frame is None:
                return
            owner = frame.f_locals.get("self")
            if isinstance(owner, shard_module.BatchSamplerShard) and owner.batch_sampler is self:
                if owner.num_processes > 1:
                    raise ValueError(
                        f"MultipackBatchSampler(shard=True) already yields the batches of rank {self.rank} of "
                        f"{self.num_replicas}, and accelerate's BatchSamplerShard (accelerator.prepare of its "
                        f"DataLoader) shards them again over {owner.num_processes} processes: each rank would "
                        f"see 1/{owner.num_processes} of its batches and the rest of the data would be lost. "
                        "Build the sampler with shard=False (accelerate then deals batch i to rank "
                        "i % num_replicas, the sampler's own assignment), or after accelerator.prepare call "
                        "packing_hf.integrations.accelerator.pass_through_batch_shard(prepared_dataloader, "
                        "sampler) (what packing_hf.Trainer does)"
                    )
                return
            frame = frame.f_back

    def set_epoch(self, epoch: int) -> None:
        """Use the plan of ``epoch`` from the next iteration on (call it before every epoch, on every rank).

        A pending resume position (from :meth:`load_state_dict`) is kept when ``epoch`` is the resumed
        epoch and discarded otherwise.
        """
        epoch = check_int(epoch, "epoch", 0)
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = 0
            self._consumed = 0

    # ------------------------------------------------------------------------------------------
    # resume

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches_consumed"}`` plus the configuration the plan depends on (checked on load)."""
        return {
            "epoch": self.epoch,
            "batches_consumed": self._consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "max_tokens_per_batch": self.max_tokens_per_batch,
            "num_samples": int(self.lengths.size),
            "drop_last": self.drop_last,
            "overflow": self.overflow,
            "mixing": self.mixing,
            # the plan depends on every length, not only on their count
            "lengths_sha1": hashlib.sha1(np.ascontiguousarray(self.lengths).tobytes()).hexdigest(),
            # which bins share a step (a state saved before these existed is checked without them)
            "balance": self.balance,
            "cost_model": None
            if self.cost_model is None
            else [self.cost_model.linear, self.cost_model.quadratic],
            # which samples are packed together as one tree
            "prefix_groups_sha1": None if self._members is None else self._groups_sha1(),
        }

    def _groups_sha1(self) -> str:
        digest = hashlib.sha1()
        for array in (*self._members, self._item_lengths):
            digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
        return digest.hexdigest()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration yields exactly the batches of ``state["epoch"]`` not yet consumed.

        A state saved before ``mixing`` existed comes from the ``"sorted"`` plan.

        Raises:
            ValueError: a key is missing, the state was saved under a configuration that gives a
                different plan, or ``batches_consumed`` is out of range.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; pass the dict returned by state_dict()")
        saved = {"mixing": "sorted", **state}
        mine = self.state_dict()
        differ = [
            f"{k}: saved {saved[k]!r}, now {mine[k]!r}"
            for k in _PLAN_KEYS
            if k in saved and saved[k] != mine[k]
        ]
        if differ:
            raise ValueError(
                "the saved sampler state comes from a different plan (" + "; ".join(differ) + "); resume "
                "with the same data, seed, budget, mixing and number of ranks"
            )
        epoch = check_int(state["epoch"], "state['epoch']", 0)
        consumed = check_int(state["batches_consumed"], "state['batches_consumed']", 0)
        if consumed > len(self):
            raise ValueError(f"state['batches_consumed'] = {consumed} > {len(self)} batches in an epoch")
        self.epoch = epoch
        self._start = consumed
        self._consumed = consumed

    # ------------------------------------------------------------------------------------------
    # datasets for split / truncate

    def wrap_dataset(self, dataset: Any) -> Any:
        """The dataset to give the ``DataLoader``: ``dataset`` itself, or an :class:`OverflowView` of it.

        Needed with ``overflow="split"`` (the sampler yields indices ``>= len(dataset)`` for the pieces
        of split samples, which only the view serves); with ``overflow="truncate"`` it cuts long samples
        itself, so the collator needs no ``max_length``. With ``"error"`` and ``"drop"``, or when no
        sample is too long, the dataset is returned unchanged.
        """
        self._wrapped = True
        if self.overflow in ("split", "truncate") and (self.pieces.size or self._counts["truncated_samples"]):
            return OverflowView(dataset, self)
        return dataset

    # ------------------------------------------------------------------------------------------
    # reporting

    def lower_bound(self) -> int:
        """Martello-Toth L2 lower bound on the number of batches any packing of these items needs."""
        return int(self._get_template()["lower_bound"])

    def efficiency(self, epoch: int | None = None) -> float:
        """Real tokens / (batches x ``max_tokens_per_batch``) over all ranks in ``epoch`` (default: current)."""
        plan = self._plan(epoch)
        kept = plan["steps"].reshape(-1)
        return _binpack.packing_efficiency(
            int(plan["bin_tokens"][kept].sum()), kept.size, self.max_tokens_per_batch
        )

    def stats(self, epoch: int | None = None) -> dict[str, int | float]:
        """Numbers for logging (flat dict of ints and floats) about the plan of ``epoch`` (default: current).

        Keys: ``epoch``, ``num_samples``, ``num_items`` (what was packed: samples, truncated samples,
        pieces), ``num_replicas``, ``max_tokens_per_batch``, ``batches`` (all ranks),
        ``batches_per_rank``, ``tokens`` (real tokens yielded), ``efficiency``, ``lower_bound``,
        ``packed_batches`` (the bins this epoch's packing needed, before splitting),
        ``batches_over_lower_bound`` and ``..._pct`` (of ``packed_batches``), ``split_batches`` (bins
        split in two to reach the fixed count: the ranks' multiple and, with ``mixing="random"``, the
        slack), ``redraws`` / ``fallback`` (``mixing="random"``: extra draws this epoch, and 1 when it
        reused epoch 0's bins), ``long_above`` (items longer than this were placed first; 0 for
        ``"sorted"``), ``batch_mean_length_std`` (std across batches of their mean sample length: the
        length grouping a plan adds; shuffled batches show it too, by chance),
        ``truncated_samples`` / ``truncated_tokens``, ``split_samples`` / ``split_pieces``,
        ``overflow_dropped_samples`` / ``overflow_dropped_tokens`` (``overflow="drop"``),
        ``dropped_samples`` / ``dropped_tokens`` (``drop_last``), ``step_token_spread`` and
        ``step_attention_spread`` (mean over steps of ``(max - min) / max`` across ranks: 0 is perfectly
        balanced); with a ``cost_model``, ``rank_cost_max_over_mean``: ``sum over steps of the slowest
        rank's predicted cost / sum of the mean`` (1.0: no rank ever waits; see
        :func:`~packing_hf.cost.rank_cost_spread`). With ``prefix_groups``: ``prefix_groups`` (the groups
        packed), ``sample_tokens`` (the epoch's samples run alone; ``tokens`` counts the trees') and
        ``tree_token_ratio`` (the two's ratio).
        """
        plan = self._plan(epoch)
        template = self._get_template()
        steps = plan["steps"]
        offsets = plan["offsets"]
        n_bins = offsets.size - 1
        bin_sizes = np.diff(offsets)
        dropped = plan["dropped"]
        tokens = plan["bin_tokens"][steps]  # (num_steps, num_replicas)
        squares = plan["bin_squares"][steps]
        kept = steps.reshape(-1)

        def spread(values: np.ndarray) -> float:
            top = values.max(axis=1)
            return float(np.mean((top - values.min(axis=1)) / np.maximum(top, 1))) if values.size else 0.0

        bound = int(template["lower_bound"])
        packed = int(plan["packed_bins"])
        return {
            "epoch": self.epoch if epoch is None else epoch,
            "num_samples": int(self.lengths.size),
            "num_items": int(self._item_lengths.size),
            "num_replicas": self.num_replicas,
            "max_tokens_per_batch": self.max_tokens_per_batch,
            "batches": int(steps.size),
            "batches_per_rank": int(steps.shape[0]),
            "tokens": int(tokens.sum()),
            "efficiency": self.efficiency(epoch),
            "lower_bound": bound,
            "packed_batches": packed,
            "batches_over_lower_bound": packed - bound,
            "batches_over_lower_bound_pct": 100.0 * (packed - bound) / max(bound, 1),
            "split_batches": n_bins - packed,
            "redraws": int(plan["redraws"]),
            "fallback": int(plan["fallback"]),
            "long_above": int(template["long_above"]),
            "batch_mean_length_std": _mean_length_spread(plan["bin_tokens"][kept], bin_sizes[kept]),
            **self._counts,
            "dropped_samples": int(bin_sizes[dropped].sum()),
            "dropped_tokens": int(plan["bin_tokens"][dropped].sum()),
            "step_token_spread": spread(tokens),
            "step_attention_spread": spread(squares),
            **({} if self._members is None else self._tree_stats(plan, kept)),
            **(
                {}
                if self.cost_model is None
                else {"rank_cost_max_over_mean": rank_cost_spread(self.cost_model.bin_costs(tokens, squares))}
            ),
        }

    def _tree_stats(self, plan: dict[str, Any], kept: np.ndarray) -> dict[str, int | float]:
        """``prefix_groups`` (groups packed: trees and pieces), ``sample_tokens`` (the tokens of the epoch's
        samples run alone) and ``tree_token_ratio`` (those over the trees' tokens yielded: ``tokens``)."""
        positions, _ = _ranges(plan["offsets"], kept)
        kept_items = plan["items"][positions]
        sample_tokens = int(self._item_sample_tokens[kept_items].sum())
        tree_tokens = int(self._item_lengths[kept_items].sum())
        return {
            "prefix_groups": int(self._item_lengths.size),
            "sample_tokens": sample_tokens,
            "tree_token_ratio": sample_tokens / max(tree_tokens, 1),
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_samples={self.lengths.size}, max_tokens_per_batch={self.max_tokens_per_batch}, "
            f"num_replicas={self.num_replicas}, rank={self.rank}, epoch={self.epoch}, seed={self.seed}, "
            f"shuffle={self.shuffle}, drop_last={self.drop_last}, overflow={self.overflow!r}, "
            f"balance={self.balance!r}, shard={self.shard}, mixing={self.mixing!r}, cost_model={self.cost_model!r}"
            + ("" if self._members is None else f", prefix_groups={self._item_lengths.size}")
            + ")"
        )


class OverflowView(Dataset):
    """A dataset view that serves the indices a sampler with ``overflow="split"``/``"truncate"`` yields.

    Index ``i < len(dataset)`` is ``dataset[i]`` (cut to ``max_tokens_per_batch`` tokens when the
    sampler truncates); index ``len(dataset) + j`` is piece ``j`` of a split sample:
    ``sampler.pieces[j] = (sample, start, stop)``, i.e. ``dataset[sample]`` with every field aligned
    with ``column`` (same length: ``input_ids``, ``labels``, loss masks, ...) sliced to
    ``[start:stop]``. Other fields are passed through unchanged. Each piece is trained as its own
    sequence (it cannot attend to the previous piece).

    Build it with ``sampler.wrap_dataset(dataset)``.

    >>> sampler = MultipackBatchSampler([2, 5], max_tokens_per_batch=4, overflow="split", shuffle=False)
    >>> view = sampler.wrap_dataset([{"input_ids": [7, 8]}, {"input_ids": [1, 2, 3, 4, 5]}])
    >>> sorted(sorted(b) for b in sampler), view[2], view[3]
    ([[0, 3], [2]], {'input_ids': [1, 2, 3, 4]}, {'input_ids': [5]})
    """

    def __init__(self, dataset: Any, sampler: MultipackBatchSampler) -> None:
        if len(dataset) != sampler.lengths.size:
            raise ValueError(
                f"the dataset has {len(dataset)} rows but the sampler was built from {sampler.lengths.size} lengths"
            )
        self.dataset = dataset
        self.column = sampler.column
        self.max_length = sampler.max_tokens_per_batch if sampler.overflow == "truncate" else None
        self.pieces = sampler.pieces
        self._n = len(dataset)

    def __len__(self) -> int:
        return self._n + len(self.pieces)

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        if index < 0 or index >= len(self):
            raise IndexError(f"index {index} out of range for an OverflowView of {len(self)} items")
        if index < self._n:
            row = self.dataset[index]
            if self.max_length is None or len(row[self.column]) <= self.max_length:
                return row
            return self._slice(row, 0, self.max_length)
        sample, start, stop = (int(v) for v in self.pieces[index - self._n])
        return self._slice(self.dataset[sample], start, stop)

    def _slice(self, row: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
        full = len(row[self.column])
        return {
            key: value[start:stop]
            if hasattr(value, "__len__") and not isinstance(value, str) and len(value) == full
            else value
            for key, value in row.items()
        }
