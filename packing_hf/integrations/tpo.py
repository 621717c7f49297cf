"""``packing_hf.TPOTrainer`` / ``packing_hf.TPOConfig``: TRL's Triple Preference Optimization on packed rows, exactly.

TRL keeps TPO in ``trl.experimental.tpo``. It tokenizes every example into ``prompt_ids``, ``chosen_ids``,
``rejected_ids`` and ``reference_ids`` (the gold answer); its collator builds ``prompt + answer`` for the three
answers, truncates each to ``max_length`` and right-pads the ``3B`` sequences of ``B`` examples (chosen rows,
then rejected, then reference; no reference rows when ``tpo_alpha=0``) into one ``(3B, L)`` batch with a
``completion_mask``. Its ``_compute_loss`` calls the model once on that batch and computes, from the logits,
the per-sequence log-probs (summed, or averaged for ``ipo`` / ``tpo-l``), every loss type, the NLL on the
reference answers and the metrics (entropy, ``logits/*``, ``mean_token_accuracy``, rewards, log-probs), each
reading only completion tokens.

This subclass keeps TRL's tokenization and ``_compute_loss`` and changes what the model runs:

- :class:`PaddingFreeTripleCollator` packs the ``S`` sequences of a batch, in TRL's row order, as segments of
  one ``[1, T]`` row (restarting ``position_ids``, ``cu_seq_lens_q/k``), next to TRL's padded layout
  (``input_ids``, ``attention_mask``, ``completion_mask``, ``(S, L)`` integers; no model compute runs on them).
- The model TRL's ``_compute_loss`` calls is :class:`PackedTripleForward`: it runs the model on the packed row
  (varlen attention keeps the segments apart) and scatters the logits of every real token to its place in
  the padded layout ``(S, L, V)``. TRL's loss code then runs unchanged on them, so log-probs, every
  ``loss_type`` (``sigmoid``, ``hinge``, ``ipo``, ``tpo-l``), ``label_smoothing``, the NLL term, gradients and
  every logged metric equal stock's up to floating-point reassociation inside the matmuls: every quantity TRL
  reads is at a real position. Only the logits of padding positions (which stock computes on pad tokens and
  never reads) are zeros; they would reach a ``compute_metrics``, which is refused, or ``trainer.predict()``.
  The model's layers compute real tokens only. That path (the logits take ``S x L x V`` as stock's do) is
  taken with ``chunked_loss=False``, where the head cannot be chunked (the log says why once), and by
  ``trainer.predict()`` unless ``prediction_loss_only``: its predictions are these logits. ``evaluate()``
  asks for the loss and metrics alone (``compute_metrics`` is refused, so transformers sets
  ``prediction_loss_only``) and takes the chunked path below.
- By default (``chunked_loss=True``) no logits are built: ``_compute_loss`` takes from the chunked LM head
  (:func:`~packing_hf.integrations.chunked_head.model_token_logprobs`) every quantity stock's reads from the
  logits (per-token log-probs, the reference NLL, entropy, ``logits/*`` means, token accuracy) and applies
  stock's reductions, loss types and metrics to them (TRL 1.16's ``_compute_loss``, restated).

``max_tokens_per_batch`` packs examples with multipack, an example weighing the tokens of all its sequences
after TRL's ``max_length`` (the reference one only when ``tpo_alpha != 0``), so an example is never split.
``padding_free`` (``None`` or ``True``) is what this trainer always does.

Refused with a ``ValueError``: ``padding_free=False``, a ``data_collator`` that is not a
:class:`PaddingFreeTripleCollator`, ``pad_to_multiple_of`` (a packed row has no padding), ``compute_metrics``
(it would read the padding logits), ``loss_normalization`` other than ``"token"`` (the loss is one term per
example plus the NLL mean), encoder-decoder models, a dataset without ``chosen`` / ``rejected`` /
``reference``, a tokenizer larger than the model's vocabulary, vision datasets, prompt-learning PEFT and
context/sequence parallelism. ``output_router_logits`` is accepted: stock passes no labels, so no router loss
enters its loss, and the packed forward routes every token as the padded one does.

>>> from packing_hf.integrations.tpo import TPOConfig
>>> TPOConfig("out", max_tokens_per_batch=2048, loss_type="tpo-l", report_to="none", use_cpu=True).loss_type
'tpo-l'
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from trl.experimental.tpo import TPOConfig as _StockTPOConfig
from trl.experimental.tpo import TPOTrainer as _StockTPOTrainer

from .._limits import option
from ..padding import PackedLayout
from ..pair_rows import TRIPLE_BRANCHES, PaddingFreeTripleCollator
from ..preference import unpack_shifted
from .args import PackingArguments, budget_max_length
from .chunked_head import model_token_logprobs
from .loss_policy import StockLoss
from .preference_kit import MaxLengthCountsMixin, PreferenceStatsCollator, check_preference_call, pad_token_id
from .refusals import WHOLE_ROW_REFUSALS, Wording
from .trainer import PackingTrainerMixin

__all__ = ["PackedTripleForward", "TPOConfig", "TPOTrainer"]

logger = logging.getLogger(__name__)

_STOCK = "trl.experimental.tpo.TPOTrainer"
_PACKED_INPUTS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass
class TPOConfig(PackingArguments, _StockTPOConfig):
    """``trl.experimental.tpo.TPOConfig`` plus the packing fields of
    :class:`~packing_hf.integrations.args.PackingArguments`; ``max_tokens_per_batch`` counts every sequence of
    an example (chosen, rejected and, when ``tpo_alpha != 0``, reference).

    >>> TPOConfig(output_dir="out", padding_free=True, report_to="none", use_cpu=True).tpo_alpha
    1.0
    """

    max_length: int | None = budget_max_length(
        "every sequence truncated per truncation_mode by the collator, counted in its stats and logged"
    )

    _optional_switches: ClassVar[tuple[str, ...]] = ("padding_free",)
    padding_free: bool | None = option(
        None,
        "Packed rows, no padding computed: what this trainer always does (None or True). False is "
        "refused: use TRL's own trainer for padded batches.",
    )


class PackedTripleForward:
    """The model as TRL's ``TPOTrainer._compute_loss`` calls it, running one packed row instead.

    Called with TRL's padded ``input_ids`` / ``attention_mask`` ``(S, L)`` (and ``use_cache``), it runs
    ``model`` on the packed row of the same batch and returns the model's output with ``logits`` ``(S, L, V)``
    in the padded layout: the logits of every real token at its place, zeros on padding.

    Args:
        model: the model (or its DDP / PEFT wrapper) the trainer trains.
        packed: the packed keys of a :class:`PaddingFreeTripleCollator` batch (``packed_input_ids``,
            ``packed_index``, ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``).

    >>> from packing_hf.pair_rows import PaddingFreeTripleCollator
    >>> class Echo(torch.nn.Module):  # logits: the token id, once per "vocabulary" entry
    ...     def forward(self, input_ids, **kwargs):
    ...         return {"logits": input_ids[..., None].float().expand(-1, -1, 2)}
    >>> batch = PaddingFreeTripleCollator(include_reference=False)(
    ...     [{"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4]}])
    >>> out = PackedTripleForward(Echo(), batch)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    >>> out["logits"][..., 0].tolist()
    [[1.0, 2.0, 3.0], [1.0, 4.0, 0.0]]
    """

    def __init__(self, model: Any, packed: Mapping[str, Any]) -> None:
        self.model = model
        self.packed = packed

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        rows, width = input_ids.shape
        packed_ids = self.packed["packed_input_ids"]  # (1, T)
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("use_cache",)}
        if extra:
            raise ValueError(
                f"PackedTripleForward got {sorted(extra)}: a packed row takes no other model inputs; use "
                f"{_STOCK} for them"
            )
        inputs = {k: self.packed[k] for k in _PACKED_INPUTS}
        output = self.model(input_ids=packed_ids, use_cache=False, **inputs)
        logits = output["logits"]  # (1, T, V)
        cu = self.packed["cu_seq_lens_q"]
        if int(cu[-1]) != packed_ids.shape[1] or cu.numel() != rows + 1:
            raise ValueError(
                f"the packed row ({packed_ids.shape[1]} tokens, {cu.numel() - 1} segments) does not match the "
                f"padded layout ({rows} sequences): the batch did not come from one PaddingFreeTripleCollator call"
            )
        # segment s is row s of the padded layout
        layout = PackedLayout.from_cu_seqlens(cu, width, packed_shape=tuple(packed_ids.shape))
        output["logits"] = layout.pad(logits)  # (S, L, V)
        return output


class TPOTrainer(MaxLengthCountsMixin, PackingTrainerMixin, _StockTPOTrainer):
    """``trl.experimental.tpo.TPOTrainer`` on packed rows: same log-probs, loss, gradients and metrics.

    Same arguments as TRL's; ``args`` is converted to :class:`TPOConfig` if it is a plain ``TrainingArguments``
    / TRL ``TPOConfig``. Unless given, the collator is a :class:`PaddingFreeTripleCollator` with the config's
    ``max_length`` / ``truncation_mode`` (TRL's truncation) and ``include_reference=tpo_alpha != 0``. Load the
    model with an attention that keeps packed segments apart (sdpa/eager for llama-like models, or
    ``packing_hf.register_attention()``); the pre-flight check verifies it while training.

    >>> import datasets
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from packing_hf.architectures.tiny import tiny_config
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
    >>> data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="], "chosen": ["2", "5"], "rejected": ["3", "6"],
    ...     "reference": ["2", "5"]})
    >>> args = TPOConfig("/tmp/packing_hf_tpo_doctest", max_tokens_per_batch=64, max_length=32, max_steps=1,
    ...     bf16=False, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    >>> trainer = TPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    >>> type(trainer.data_collator).__name__
    'PaddingFreeTripleCollator'
    >>> trainer.train().global_step  # doctest: +ELLIPSIS
    {...}
    1
    """

    config_class = TPOConfig
    algorithm = "TPO"
    stock = _STOCK
    packing_collator = PaddingFreeTripleCollator
    packing_refusals = (
        "padding_free_false",
        "collator",
        "pad_to_multiple_of",
        "compute_metrics",
        "own_loss",
        "encoder_decoder",
        *WHOLE_ROW_REFUSALS,
    )
    wording = Wording(
        "TPO rows", "preference batches", "a TPO example, whose sequences", "example plus its own NLL mean"
    )
    packing_loss = StockLoss.PER_EXAMPLE

    def _max_length_columns(self, args: Any) -> tuple[str, ...]:
        branches = TRIPLE_BRANCHES if args.tpo_alpha != 0.0 else TRIPLE_BRANCHES[:2]  # the reference rows
        return tuple(f"{branch}_ids" for branch in branches)

    def _before_stock_init(self, call: dict[str, Any]) -> None:
        args, collator, processing_class = call["args"], call["data_collator"], call["processing_class"]
        check_preference_call(call, needs=TRIPLE_BRANCHES)
        if collator is None:
            call["data_collator"] = PaddingFreeTripleCollator(
                max_length=args.max_length,
                overflow="truncate",
                truncation_mode=args.truncation_mode,
                include_reference=args.tpo_alpha != 0.0,
                pad_token_id=pad_token_id(processing_class),
            )
        elif collator.include_reference != (args.tpo_alpha != 0.0):
            raise ValueError(
                f"data_collator.include_reference={collator.include_reference} but tpo_alpha="
                f"{args.tpo_alpha}: TRL reads reference rows exactly when tpo_alpha != 0"
            )

    def _compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
        """Stock's loss and metrics, the model running the packed row (:class:`PackedTripleForward`)."""
        if "packed_index" not in inputs:
            raise ValueError(
                f"{type(self).__name__} got a batch without 'packed_index' (keys {sorted(inputs)}): batches must "
                "come from PaddingFreeTripleCollator"
            )
        padded = {k: inputs[k] for k in ("input_ids", "attention_mask", "completion_mask")}
        packed = {k: inputs[k] for k in ("packed_input_ids", "packed_index", *_PACKED_INPUTS)}
        # return_outputs: trainer.predict(), whose predictions are the logits (evaluate() asks for the loss alone)
        resolved = None if return_outputs else self.loss_policy.chunked_head(self, model)
        if resolved is None:
            return super()._compute_loss(PackedTripleForward(model, packed), padded, return_outputs)
        return self._chunked_compute_loss(model, padded, packed, resolved)

    def _chunked_compute_loss(self, model: Any, padded: dict, packed: dict, resolved: Any) -> torch.Tensor:
        """Stock's ``_compute_loss`` (TRL 1.16) from the chunked LM head: every quantity it reads from the logits
        (per-token log-probs, the NLL, entropy, ``logits/*`` means, token accuracy) per chunk, the same reductions
        and metrics."""
        mode = "train" if self.model.training else "eval"
        n_branches = 3 if self.tpo_alpha != 0.0 else 2
        packed_ids = packed["packed_input_ids"]  # (1, T)
        targets = torch.cat([packed_ids[:, 1:], torch.full_like(packed_ids[:, :1], -100)], dim=1)
        inputs = {"input_ids": packed_ids, "use_cache": False, **{k: packed[k] for k in _PACKED_INPUTS}}
        out, _ = model_token_logprobs(
            model, inputs, targets, resolved, entropy=True, mean_logits=True, top1=True
        )  # (1, T) each
        rows, width = padded["input_ids"].shape
        mask = padded["completion_mask"][:, 1:].to(out.logps.device)  # (S, L - 1): stock's shifted row mask
        per_token_logps, entropy, mean_logits, top1 = (
            unpack_shifted(x[:, :-1], packed["packed_index"], rows, width) * mask for x in out
        )  # (S, L - 1), zero outside the completions as stock's row_mask
        if self.loss_type in ("ipo", "tpo-l"):
            logps = per_token_logps.sum(1) / mask.sum(1).clamp(min=1)
        else:
            logps = per_token_logps.sum(1)
        chosen_logps, rejected_logps = logps.chunk(n_branches)[:2]
        loss = self._per_sequence_loss(chosen_logps - rejected_logps).mean()
        if n_branches == 3:  # stock: cross-entropy over the reference completions' tokens
            reference_mask = mask.chunk(3)[2].bool()
            loss = loss + self.tpo_alpha * -per_token_logps.chunk(3)[2][reference_mask].mean()
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        metrics["entropy"].append(gather(entropy.detach()[mask.bool()].mean()).mean().item())
        if mode == "train":
            tokens = gather(padded["attention_mask"].sum()).sum().item()
            self._total_train_tokens += tokens // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        masks = mask.chunk(n_branches)
        branches = zip(("chosen", "rejected"), mean_logits.chunk(n_branches), masks, strict=False)
        for name, means, branch_mask in branches:
            total, count = gather(means.sum()).sum().item(), gather(branch_mask.sum()).sum().item()
            metrics[f"logits/{name}"].append(total / count if count > 0 else 0.0)
        correct, total = gather(top1.chunk(n_branches)[0].sum()).sum(), gather(masks[0].sum()).sum()
        metrics["mean_token_accuracy"].append((correct / total).item() if total > 0 else 0.0)
        chosen_rewards, rejected_rewards = (
            self.beta * chosen_logps.detach(),
            self.beta * rejected_logps.detach(),
        )
        metrics["rewards/chosen"].append(self.accelerator.gather(chosen_rewards).mean().item())
        metrics["rewards/rejected"].append(self.accelerator.gather(rejected_rewards).mean().item())
        accuracies = (chosen_rewards > rejected_rewards).float()
        metrics["rewards/accuracies"].append(self.accelerator.gather(accuracies).mean().item())
        margins = chosen_rewards - rejected_rewards
        metrics["rewards/margins"].append(self.accelerator.gather(margins).mean().item())
        metrics["logps/chosen"].append(self.accelerator.gather(chosen_logps).mean().item())
        metrics["logps/rejected"].append(self.accelerator.gather(rejected_logps).mean().item())
        return loss

    def _per_sequence_loss(self, delta: torch.Tensor) -> torch.Tensor:
        """Stock's per-example loss of ``delta = chosen_logps - rejected_logps`` ``(B,)`` for its ``loss_type``."""
        if self.loss_type == "hinge":
            return torch.relu(1 - self.beta * delta)
        if self.loss_type == "ipo":
            return (delta - 1 / (2 * self.beta)) ** 2
        if self.loss_type == "tpo-l":
            delta = delta - self.tpo_l_gamma / self.beta
        elif self.loss_type != "sigmoid":
            raise ValueError(
                f"Unknown loss type: {self.loss_type}. Should be one of ['sigmoid', 'hinge', 'ipo', 'tpo-l']"
            )
        smoothing = self.label_smoothing
        return (
            -F.logsigmoid(self.beta * delta) * (1 - smoothing) - F.logsigmoid(-self.beta * delta) * smoothing
        )

    def _multipack_lengths_of(self, dataset: Any) -> np.ndarray:
        """Tokens of every example in a packed row: all its sequences, after the collator's ``max_length``."""
        from .dataloaders import column_lengths

        collator = self.data_collator
        branches = TRIPLE_BRANCHES if collator.include_reference else TRIPLE_BRANCHES[:2]
        columns = ("prompt_ids", *(f"{b}_ids" for b in branches))
        prompt, *answers = column_lengths(dataset, columns, "example", "let TPOTrainer tokenize it")
        limit = collator.max_length if collator.overflow == "truncate" else None
        total = np.zeros_like(prompt)
        for answer in answers:
            total += prompt + answer if limit is None else np.minimum(prompt + answer, limit)
        return total

    def _wrap_train_collator(self, collator: Any) -> Any:
        if self.args.packing_metrics and isinstance(collator, PaddingFreeTripleCollator):
            return PreferenceStatsCollator(collator)
        return collator
