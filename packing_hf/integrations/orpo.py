"""``packing_hf.ORPOTrainer`` / ``packing_hf.CPOTrainer``: TRL's ORPO and CPO on packed pairs, exactly.

TRL keeps ORPO and CPO in ``trl.experimental`` in the older DPO style: each row is tokenized into
``chosen_input_ids`` / ``chosen_labels`` and ``rejected_input_ids`` / ``rejected_labels`` (``prompt + answer``,
``-100`` on the prompt), a collator pads them, and ``concatenated_forward`` runs the ``2B`` sequences of ``B``
pairs as one right-padded ``(2B, L)`` batch and returns the per-sequence log-probs of the answers, the logits and
an NLL term. These subclasses keep TRL's tokenization, loss and metrics, and replace only the collator and
``concatenated_forward``:

- :class:`PaddingFreePairCollator` packs the ``2B`` sequences (chosen ones first, TRL's row order) as segments of
  one ``[1, T]`` row with restarting ``position_ids`` and ``cu_seq_lens_q/k``
  (:class:`~packing_hf.preference.PaddingFreePreferenceCollator` on prompt-less pairs), next to TRL's padded
  layout (``input_ids``, ``attention_mask``, ``concatenated_labels``, ``(2B, L)`` integers; no model compute runs
  on them).
- ``concatenated_forward`` runs the model once on the packed row (varlen attention keeps the segments apart),
  takes the log-prob of every next token, scatters them to the padded layout
  (:func:`~packing_hf.preference.unpack_shifted`) and reduces them as stock does: summed (CPO ``sigmoid`` /
  ``hinge``) or averaged (ORPO, CPO ``ipo`` / ``simpo`` / ``alphapo``) over each answer's labels. ORPO's NLL is
  the mean over every chosen token after the first (prompt included), CPO's over the chosen answer's tokens
  (``cpo_alpha * nll``; none when ``cpo_alpha=0``), as stock. Log-probs, losses, gradients and every metric
  equal stock's up to floating-point reassociation inside the matmuls, except:
- ``logits/chosen`` / ``logits/rejected``: stock averages the logits of every position of the padded batch,
  padding included, so its value depends on how much padding the batch has. Here they are the mean over the real
  positions stock reads (ORPO: every token but each sequence's last; CPO: every token); they equal stock's on a
  batch without padding.

``share_prefixes=True`` (:class:`~packing_hf.integrations.preference_kit.PairTreeArguments`, opt-in): the
``2B`` sequences of a micro-batch become one prefix tree (``PaddingFreePairCollator(share_prefixes=True)``), so a
system prompt, the earlier turns of a conversation cut into pairs and each pair's prompt are computed once;
each token's log-prob is read at the row of the token before it in its sequence (a node's first token at its
parent's last row, the branch point), through the logits or the chunked LM head, and everything above holds.
Refused on models whose token mixers cannot follow a tree (hybrids), by name.

``max_tokens_per_batch`` packs pairs with multipack, a pair weighing ``len(chosen_input_ids) +
len(rejected_input_ids)``. ``padding_free`` (``None`` or ``True``) is what these trainers always do.

``max_length``: TRL tokenizes every pair in its ``__init__`` and cuts the end of an answer whose sequence
(prompt + answer) is longer than ``max_length`` (``None`` becomes 512 there), without a count. Here what it cut is
counted against an untruncated tokenization of the same rows (only those that reach ``max_length``) and kept in
``max_length_stats[dataset]``, with a warning and the fix, as ``max_length_truncated_samples`` /
``_tokens`` in the training logs (``eval_max_length_*`` in the evaluation metrics) and in ``packing-hf train``'s
summary. Unset with ``max_tokens_per_batch``, nothing is cut: the budget bounds a pair (a longer one follows
``packing_overflow``, an error by default), and the loss of an untruncated pair is stock's.

Refused with a ``ValueError``: ``padding_free=False``, a ``data_collator`` that does not pack pairs,
encoder-decoder models (their labels go through the decoder, not a packed row), MoE models with
``output_router_logits`` (the router's auxiliary loss would be computed over the packed tokens, not stock's
padded ones), ``generate_during_eval`` (it needs padded prompts), ``loss_normalization`` other than ``"token"``
(the loss is one term per pair), vision datasets, prompt-learning PEFT and context/sequence parallelism.

>>> from packing_hf.integrations.orpo import CPOConfig
>>> CPOConfig("out", max_tokens_per_batch=2048, loss_type="alphapo", report_to="none", use_cpu=True).loss_type
'simpo'
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from trl.experimental.cpo import CPOConfig as _StockCPOConfig
from trl.experimental.cpo import CPOTrainer as _StockCPOTrainer
from trl.experimental.orpo import ORPOConfig as _StockORPOConfig
from trl.experimental.orpo import ORPOTrainer as _StockORPOTrainer
from trl.trainer.utils import selective_log_softmax

from .._limits import option
from ..attention import register_attention
from ..pair_rows import LABELS_KEY, PaddingFreePairCollator
from ..preference import TREE_INDEX_KEY, TreeTargets, preference_pair_lengths, unpack_shifted
from ..prefix_tree import picked_log_probs
from ..shared_prefix import PREFIX_KEY
from ..varlen import IGNORE_INDEX
from .args import PackingArguments, budget_max_length
from .chunked_head import model_token_logprobs
from .loss_policy import StockLoss
from .preference_kit import (
    PairTreeArguments,
    PreferenceStatsCollator,
    check_preference_call,
    check_tree_collator,
    pad_token_id,
    refuse_shared_prompt_where_inexact,
    tree_token_ratio,
)
from .refusals import WHOLE_ROW_REFUSALS, Wording
from .trainer import PackingTrainerMixin

__all__ = ["CPOConfig", "CPOTrainer", "ORPOConfig", "ORPOTrainer"]

_PADDING_FREE_HELP = (
    "Packed pairs, no padding computed: what this trainer always does (None or True). False is refused: use "
    "TRL's own trainer for padded batches."
)
_MAX_LENGTH_MEANING = (
    "TRL keeps the prompt and cuts the end of a longer answer when it tokenizes, 512 when None without "
    "max_tokens_per_batch; what it cut counted in max_length_stats, logged once with the fix and in the logs"
)
_UNBOUNDED = sys.maxsize  # TRL's max_length while the budget bounds a pair: no sequence is cut


@dataclass
class ORPOConfig(PairTreeArguments, PackingArguments, _StockORPOConfig):
    """``trl.experimental.orpo.ORPOConfig`` plus the packing fields of
    :class:`~packing_hf.integrations.args.PackingArguments`; ``max_tokens_per_batch`` counts both sequences of
    every pair.

    >>> ORPOConfig(output_dir="out", padding_free=True, report_to="none", use_cpu=True).packing_preflight
    'switch'
    """

    max_length: int | None = budget_max_length(_MAX_LENGTH_MEANING)
    _optional_switches: ClassVar[tuple[str, ...]] = ("padding_free",)
    padding_free: bool | None = option(None, _PADDING_FREE_HELP)


@dataclass
class CPOConfig(PairTreeArguments, PackingArguments, _StockCPOConfig):
    """``trl.experimental.cpo.CPOConfig`` plus the packing fields of
    :class:`~packing_hf.integrations.args.PackingArguments`; ``max_tokens_per_batch`` counts both sequences of
    every pair.

    >>> CPOConfig(output_dir="out", report_to="none", use_cpu=True).loss_type
    'sigmoid'
    """

    max_length: int | None = budget_max_length(_MAX_LENGTH_MEANING)
    _optional_switches: ClassVar[tuple[str, ...]] = ("padding_free",)
    padding_free: bool | None = option(None, _PADDING_FREE_HELP)


class PackedPairsMixin:
    """The packed ``concatenated_forward`` shared by :class:`ORPOTrainer` and :class:`CPOTrainer`.

    Subclasses say how the per-sequence log-probs are reduced (:meth:`_average_log_prob`), which tokens the NLL
    term averages over (:meth:`_nll_mask`) and which positions the ``logits/*`` metrics read
    (``_logits_drop_last``).

    >>> ORPOTrainer._logits_drop_last, CPOTrainer._logits_drop_last  # stock reads logits[:, :-1] / logits
    (True, False)
    """

    packing_collator = PaddingFreePairCollator
    packing_refusals = (
        "padding_free_false",
        "collator",
        "own_loss",
        "generate_during_eval",
        "encoder_decoder",
        "router_loss",
        *WHOLE_ROW_REFUSALS,
    )
    wording = Wording(
        "pairs", "preference batches", "a preference pair, whose two sequences", "pair plus its own NLL mean"
    )
    packing_loss = StockLoss.PER_EXAMPLE
    _logits_drop_last: ClassVar[bool]

    def _before_stock_init(self, call: dict[str, Any]) -> None:
        check_preference_call(call)
        args, collator = call["args"], call["data_collator"]
        if collator is None:
            call["data_collator"] = PaddingFreePairCollator(
                pad_token_id=pad_token_id(call["processing_class"]),
                share_prefixes=args.share_prefixes,
                min_shared_tokens=args.min_shared_tokens,
            )
        else:
            check_tree_collator(args, collator)
        call[
            "args"
        ].remove_unused_columns = False  # as stock sets it for its own collator: it reads TRL's columns

    @contextlib.contextmanager
    def _during_stock_init(self, call: dict[str, Any]) -> Iterator[None]:
        args = call["args"]
        unbounded = args.max_length is None and args.max_tokens_per_batch is not None
        if unbounded:  # TRL would cut at 512; the budget bounds a pair instead (packing_overflow decides)
            args.max_length = _UNBOUNDED
        try:
            yield
        finally:
            if unbounded:
                args.max_length = None

    def _after_stock_init(self, call: dict[str, Any]) -> None:
        import datasets

        # stock's prediction_step warns on any collator but its own: this one is exact
        self.use_dpo_data_collator = True
        if self._shares_prefixes():
            refuse_shared_prompt_where_inexact([self.model], "share_prefixes")
        for name, dataset in (("train", self.train_dataset), ("eval", self.eval_dataset)):
            if isinstance(dataset, datasets.Dataset):  # TRL tokenized it already: what it cut is counted
                self._count_max_length_cut(name, dataset)
        if self.max_length == _UNBOUNDED:
            self.max_length = None  # nothing was cut; TRL reads it only to tokenize

    def _count_max_length_cut(self, name: str, dataset: Any) -> None:
        """What TRL's tokenization cut from ``dataset`` at ``self.max_length``: its sequences that reach
        ``max_length`` are tokenized again by TRL's ``tokenize_row`` without a limit and compared (the answer's
        end is what TRL cuts), kept in ``max_length_stats[name]`` with a warning (see the module docstring)."""
        from .dataloaders import column_lengths

        limit = self.max_length
        kept = column_lengths(dataset, ("chosen_input_ids", "rejected_input_ids"), "pair", "")
        suspects = np.flatnonzero((kept[0] >= limit) | (kept[1] >= limit))
        cut, emptied, longest = [], 0, 0
        self.max_length = _UNBOUNDED
        try:
            for i in suspects.tolist():
                row = dataset[i]
                whole = self.tokenize_row(row)
                for side, kept_length in zip(("chosen", "rejected"), kept, strict=True):
                    length = len(whole[f"{side}_input_ids"])
                    longest = max(longest, length)
                    if length > kept_length[i]:
                        cut.append(length - int(kept_length[i]))
                        emptied += all(label == IGNORE_INDEX for label in row[f"{side}_labels"])
        finally:
            self.max_length = limit
        stats = {"truncated_samples": len(cut), "truncated_tokens": sum(cut)}
        said = (
            f"TRL's max_length={limit} cut the answer of {len(cut)} of {2 * len(dataset)} sequences "
            f"({sum(cut)} tokens cut, the longest had {longest} tokens)"
        )
        if emptied:
            said += f", {emptied} of them left with no answer token (the prompt alone fills max_length)"
        self._record_max_length_cut(name, stats, said)

    def get_batch_loss_metrics(self, model: Any, batch: dict[str, Any], train_eval: str = "train") -> tuple:
        loss, metrics = super().get_batch_loss_metrics(model, batch, train_eval)  # type: ignore[misc]
        if TREE_INDEX_KEY in batch:
            prefix = "eval_" if train_eval == "eval" else ""
            metrics[f"{prefix}tree_token_ratio"] = tree_token_ratio(batch)
        return loss, metrics

    def _shares_prefixes(self) -> bool:
        return bool(getattr(self.data_collator, "share_prefixes", False))

    def _packing_attention(self) -> str | None:
        """packing_hf's attention while the collator builds prefix trees (the only attention reading
        ``prefix_seq_idx``); the model's own otherwise."""
        return register_attention() if self._shares_prefixes() else None

    def _average_log_prob(self) -> bool:
        raise NotImplementedError

    def _nll_mask(self, batch: dict[str, Any], n_pairs: int) -> torch.Tensor | None:
        """``(B, L - 1)`` bool: the chosen targets the NLL term averages over, or ``None`` for no NLL term."""
        raise NotImplementedError

    def concatenated_forward(self, model: Any, batch: dict[str, Any]) -> tuple:
        """Stock's ``concatenated_forward`` on a packed row: ``(chosen_logps (B,), rejected_logps (B,),
        chosen_logits (N_c, V), rejected_logits (N_r, V), nll_loss ())``; the logits are those of the real
        positions the ``logits/*`` metrics average (see the module docstring)."""
        if TREE_INDEX_KEY in batch:
            return self._tree_forward(model, batch)
        if "packed_index" not in batch:
            raise ValueError(
                f"{type(self).__name__} got a batch without 'packed_index' (keys {sorted(batch)}): batches must "
                "come from PaddingFreePairCollator"
            )
        packed_ids = batch["packed_input_ids"]  # (1, T)
        index = batch["packed_index"]  # (T,)
        labels = batch[LABELS_KEY]  # (S, L)
        rows, width = labels.shape
        n_pairs = rows // 2
        inputs = {
            k: batch[k]
            for k in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
        }
        resolved = self.loss_policy.chunked_head(self, model)
        if resolved is not None:
            # the chunked LM head: no (T, V) logits; the logits/* metrics average each position's mean logit
            targets = torch.cat([packed_ids[:, 1:], torch.full_like(packed_ids[:, :1], IGNORE_INDEX)], dim=1)
            (token_logps, _, logits, _), _ = model_token_logprobs(
                model,
                {"input_ids": packed_ids, "use_cache": False, **inputs},
                targets,
                resolved,
                mean_logits=True,
            )  # (1, T) each
            token_logps = token_logps[:, :-1]
            logits = logits[..., None]  # (1, T, 1): a position's mean logit averages like its V logits
        else:
            logits = model(input_ids=packed_ids, use_cache=False, **inputs).logits  # (1, T, V)
            # log-prob of every packed next token; those crossing into the next segment are dropped by the scatter
            token_logps = selective_log_softmax(
                logits[:, :-1], packed_ids[:, 1:].to(logits.device)
            )  # (1, T - 1)
        per_token = unpack_shifted(token_logps, index, rows, width)  # (S, L - 1), stock's positions
        logps, nll_loss = self._reduce(per_token, batch)

        cu = batch["cu_seq_lens_q"].tolist()
        positions = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
        if self._logits_drop_last:  # stock reads logits[:, :-1]: every position that predicts a token
            positions[torch.tensor(cu[1:], device=logits.device) - 1] = False
        chosen_logits = logits[0, : cu[n_pairs]][positions[: cu[n_pairs]]]
        rejected_logits = logits[0, cu[n_pairs] : cu[rows]][positions[cu[n_pairs] : cu[rows]]]
        return logps[:n_pairs], logps[n_pairs:], chosen_logits, rejected_logits, nll_loss

    def _reduce(self, per_token: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stock's reductions of the per-token log-probs ``(S, L - 1)``: the per-sequence log-probs ``(S,)``
        (summed or averaged over each answer's labels, as ``get_batch_logps``) and the NLL term ``()``."""
        labels = batch[LABELS_KEY]
        n_pairs = labels.shape[0] // 2
        loss_mask = labels[:, 1:].to(per_token.device) != IGNORE_INDEX
        logps = (per_token * loss_mask).sum(-1)  # the same reduction as stock's get_batch_logps
        if self._average_log_prob():
            logps = logps / loss_mask.sum(-1)
        nll_mask = self._nll_mask(batch, n_pairs)
        if nll_mask is None:
            return logps, torch.tensor(0.0).to(self.accelerator.device)
        nll_mask = nll_mask.to(per_token.device)
        return logps, -(per_token[:n_pairs] * nll_mask).sum() / nll_mask.sum()

    def _tree_forward(self, model: Any, batch: dict[str, Any]) -> tuple:
        """``concatenated_forward`` on a prefix-tree row (``share_prefixes``): each token's log-prob is read at
        the row of the token before it in its sequence (a node's first token at its parent's last row, the
        branch point), then copied to every padded position that reads it (:class:`TreeTargets`)."""
        packed_ids = batch["packed_input_ids"]  # (1, T)
        padded_ids, attention = batch["input_ids"], batch["attention_mask"]  # (S, L)
        n_pairs = padded_ids.shape[0] // 2
        keys = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", PREFIX_KEY)
        inputs = {k: batch[k] for k in keys}
        # every real token after a sequence's first is a target here: ORPO's NLL reads the prompt's too
        every = padded_ids.masked_fill(attention == 0, IGNORE_INDEX)
        targets = TreeTargets.from_index(batch[TREE_INDEX_KEY], every, packed_ids.shape[-1])
        predictor, row_labels = targets.predictor, targets.row_labels[0]  # (T,)
        scored = row_labels != IGNORE_INDEX
        resolved = self.loss_policy.chunked_head(self, model)
        if resolved is not None:
            # the chunked LM head at the predicting rows; the rows predicting nothing (each sequence's last
            # token) are added, unscored, for the mean logits of the logits/* metrics
            read = torch.zeros_like(scored)
            read[torch.where(scored, predictor, torch.arange(scored.numel()))] = True
            rows = torch.cat([predictor, torch.nonzero(~read)[:, 0]])  # (T + leaves,)
            scores = torch.cat([row_labels, torch.full((rows.numel() - scored.numel(),), IGNORE_INDEX)])
            (token_logps, _, means, _), _ = model_token_logprobs(
                model,
                {"input_ids": packed_ids, "use_cache": False, **inputs},
                scores[None].to(packed_ids.device),
                resolved,
                mean_logits=True,
                rows=rows,
            )  # (1, T + leaves) each
            token_logps = token_logps[:, : scored.numel()]
            # every row's mean logit (a row read by several targets holds the same value in each)
            means = means.new_zeros(scored.numel()).index_put_((rows.to(means.device),), means[0])
            logits = means[None, :, None]  # (1, T, 1): a position's mean logit averages like its V logits
        else:
            logits = model(input_ids=packed_ids, use_cache=False, **inputs).logits  # (1, T, V)
            # (T,): the normaliser once per row, however many children read it
            picked = picked_log_probs(logits[0], predictor, row_labels.clamp(min=0))
            token_logps = torch.where(scored.to(logits.device), picked, 0.0).to(logits.dtype)[None]  # (1, T)
        device = logits.device
        logps, nll_loss = self._reduce(targets.unpack(token_logps), batch)

        # the logits/* metrics: every real position of each side (ORPO: but each sequence's last), as stock reads
        keep = attention.bool()
        if self._logits_drop_last:
            keep = keep & torch.cat([attention[:, 1:].bool(), torch.zeros_like(keep[:, :1])], dim=1)
        at = batch[TREE_INDEX_KEY].to(device)  # (S, L): the row of every position
        chosen_logits = logits[0, at[:n_pairs][keep[:n_pairs].to(device)]]
        rejected_logits = logits[0, at[n_pairs:][keep[n_pairs:].to(device)]]
        return logps[:n_pairs], logps[n_pairs:], chosen_logits, rejected_logits, nll_loss

    def _multipack_lengths_of(self, dataset: Any) -> np.ndarray:
        """Tokens of every pair in a packed row: both sequences, as TRL tokenized (and truncated) them."""
        from .dataloaders import column_lengths

        chosen, rejected = column_lengths(
            dataset,
            ("chosen_input_ids", "rejected_input_ids"),
            "pair",
            f"let {type(self).__name__} tokenize it",
        )
        return preference_pair_lengths(np.zeros_like(chosen), chosen, rejected)

    def _wrap_train_collator(self, collator: Any) -> Any:
        if self.args.packing_metrics and isinstance(collator, PaddingFreePairCollator):
            return PreferenceStatsCollator(collator)
        return collator


class ORPOTrainer(PackedPairsMixin, PackingTrainerMixin, _StockORPOTrainer):
    """``trl.experimental.orpo.ORPOTrainer`` on packed pairs: same log-probs, loss, gradients and metrics.

    Same arguments as TRL's; ``args`` is converted to :class:`ORPOConfig` if it is a plain
    ``TrainingArguments`` / TRL ``ORPOConfig``. Unless given, the collator is a :class:`PaddingFreePairCollator`.
    Load the model with an attention that keeps packed segments apart (sdpa/eager for llama-like models, or
    ``packing_hf.register_attention()``); the pre-flight check verifies it while training. ``logits/chosen`` and
    ``logits/rejected`` are means over real positions (see the module docstring).

    >>> import datasets
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from packing_hf.architectures.tiny import tiny_config
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
    >>> data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="], "chosen": ["2", "5"], "rejected": ["3", "6"]})
    >>> args = ORPOConfig("/tmp/packing_hf_orpo_doctest", max_tokens_per_batch=64, max_length=32, max_steps=1,
    ...     report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    >>> trainer = ORPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    >>> trainer.train().global_step  # doctest: +ELLIPSIS
    {...}
    1
    """

    stock = "trl.experimental.orpo.ORPOTrainer"
    algorithm = "ORPO"
    config_class = ORPOConfig
    _logits_drop_last = True

    def _average_log_prob(self) -> bool:
        return True  # ORPO's odds ratio is over mean per-token log-probs

    def _nll_mask(self, batch: dict[str, Any], n_pairs: int) -> torch.Tensor:
        # stock: cross-entropy over every real chosen token after the first, prompt included
        return batch["attention_mask"][:n_pairs, 1:] == 1


class CPOTrainer(PackedPairsMixin, PackingTrainerMixin, _StockCPOTrainer):
    """``trl.experimental.cpo.CPOTrainer`` on packed pairs: same log-probs, loss, gradients and metrics.

    Every ``loss_type`` (``sigmoid``, ``hinge``, ``ipo``, ``simpo``, ``alphapo``), ``alpha`` and ``cpo_alpha``
    as stock. Same arguments as TRL's; ``args`` is converted to :class:`CPOConfig` if it is a plain
    ``TrainingArguments`` / TRL ``CPOConfig``. Unless given, the collator is a :class:`PaddingFreePairCollator`.
    ``logits/chosen`` and ``logits/rejected`` are means over real positions (see the module docstring).

    >>> import datasets
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from packing_hf.architectures.tiny import tiny_config
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
    >>> data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="], "chosen": ["2", "5"], "rejected": ["3", "6"]})
    >>> args = CPOConfig("/tmp/packing_hf_cpo_doctest", loss_type="simpo", max_length=32, max_steps=1,
    ...     per_device_train_batch_size=2, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    >>> trainer = CPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    >>> type(trainer.data_collator).__name__
    'PaddingFreePairCollator'
    >>> trainer.train().global_step  # doctest: +ELLIPSIS
    {...}
    1
    """

    stock = "trl.experimental.cpo.CPOTrainer"
    algorithm = "CPO"
    config_class = CPOConfig
    _logits_drop_last = False

    def _average_log_prob(self) -> bool:
        return self.loss_type in ("ipo", "simpo")  # as stock (alphapo became simpo in the config)

    def _nll_mask(self, batch: dict[str, Any], n_pairs: int) -> torch.Tensor | None:
        if self.cpo_alpha == 0:
            return None
        return batch[LABELS_KEY][:n_pairs, 1:] != IGNORE_INDEX  # stock: the chosen answer's tokens
