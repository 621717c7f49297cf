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
  The model's layers compute real tokens only; the logits take ``S x L x V`` as stock's do.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from trl.experimental.tpo import TPOConfig as _StockTPOConfig
from trl.experimental.tpo import TPOTrainer as _StockTPOTrainer

from ..padding import PackedLayout
from ..preference import PaddingFreePreferenceCollator, _ids_array
from ..varlen import INT32_MAX
from .args import PackingArguments, as_config
from .dpo import (
    PreferenceStatsCollator,
    _check_dataset,
    _check_vocabulary,
    _pad_token_id,
    check_whole_sequence_options,
)
from .preflight import base_model
from .trainer import PackingTrainerMixin

__all__ = ["PackedTripleForward", "PaddingFreeTripleCollator", "TPOConfig", "TPOTrainer"]

logger = logging.getLogger(__name__)

_STOCK = "trl.experimental.tpo.TPOTrainer"
_BRANCHES = ("chosen", "rejected", "reference")
_PACKED_INPUTS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass
class TPOConfig(PackingArguments, _StockTPOConfig):
    """``trl.experimental.tpo.TPOConfig`` plus the packing fields of
    :class:`~packing_hf.integrations.args.PackingArguments`; ``max_tokens_per_batch`` counts every sequence of
    an example (chosen, rejected and, when ``tpo_alpha != 0``, reference).

    >>> TPOConfig(output_dir="out", padding_free=True, report_to="none", use_cpu=True).tpo_alpha
    1.0
    """

    _optional_switches: ClassVar[tuple[str, ...]] = ("padding_free",)
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Packed rows, no padding computed: what this trainer always does (None or True). False is "
            "refused: use TRL's own trainer for padded batches."
        },
    )


@dataclass
class PaddingFreeTripleCollator(PaddingFreePreferenceCollator):
    """Collate rows tokenized by TRL's ``TPOTrainer`` into one packed row of ``S`` segments.

    Input: ``B`` feature dicts with ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` and (when
    ``include_reference``) ``reference_ids``, lists / arrays / tensors of ints; other keys are ignored. The
    sequences are ``prompt + answer``, in TRL's order: the ``B`` chosen ones, the ``B`` rejected ones, then the
    ``B`` reference ones (``S = 3B``; ``S = 2B`` without reference). Output (``L`` the longest sequence, ``T``
    the packed tokens): ``packed_input_ids`` ``(1, T)`` int64, ``position_ids`` ``(1, T)`` int64,
    ``cu_seq_lens_q/k`` ``(S + 1,)`` int32, ``max_length_q/k`` int, ``packed_index`` ``(T,)`` int64 (as
    :class:`~packing_hf.preference.PaddingFreePreferenceCollator`'s: flat index into ``(S, L)`` of every token
    that is a prediction target, ``S * L`` for segment starts), and TRL's right-padded ``input_ids``,
    ``attention_mask``, ``completion_mask`` ``(S, L)`` int64.

    Args:
        include_reference: pack the reference sequences (TRL drops them when ``tpo_alpha=0``).
        max_length, overflow, truncation_mode: a sequence longer than ``max_length``: ``"error"`` (default)
            raises; ``"truncate"`` cuts it as TRL's ``DataCollatorForTriplePreference`` does, counted in
            :attr:`stats`. Other arguments as :class:`~packing_hf.preference.PaddingFreePreferenceCollator`;
            ``shared_prompt`` and ``pad_to_multiple_of`` are refused.

    >>> collator = PaddingFreeTripleCollator()
    >>> batch = collator([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3, 4], "reference_ids": [5]}])
    >>> batch["packed_input_ids"].tolist(), batch["cu_seq_lens_q"].tolist()
    ([[1, 2, 1, 3, 4, 1, 5]], [0, 2, 5, 7])
    >>> batch["completion_mask"].tolist()
    [[0, 1, 0], [0, 1, 1], [0, 1, 0]]
    """

    include_reference: bool = True

    input_columns: ClassVar[tuple[str, ...]] = ("prompt_ids", "chosen_ids", "rejected_ids", "reference_ids")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_prompt:
            raise ValueError("PaddingFreeTripleCollator does not share prompts; leave shared_prompt=False")
        if self.pad_to_multiple_of:
            raise ValueError(
                f"pad_to_multiple_of={self.pad_to_multiple_of}: packed TPO rows take no padding; leave it unset"
            )
        if not (self.return_flash_attn_kwargs and self.return_position_ids):
            raise ValueError(
                "PaddingFreeTripleCollator needs return_flash_attn_kwargs=True and return_position_ids=True: "
                "the segment boundaries are what keeps the sequences apart"
            )

    def __call__(
        self, features: Iterable[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, Any]:
        features, return_tensors = self._batch_arguments(features, return_tensors, "one example")
        branches = _BRANCHES if self.include_reference else _BRANCHES[:2]
        keys = ("prompt_ids", *(f"{b}_ids" for b in branches))
        missing = [k for k in keys if any(k not in f for f in features)]
        if missing:
            raise ValueError(
                f"a feature lacks {missing} (keys: {sorted(features[0])}): PaddingFreeTripleCollator takes rows "
                "tokenized by TRL's TPOTrainer"
            )
        n = len(features)
        prompts = [_ids_array(f["prompt_ids"], i, "prompt_ids") for i, f in enumerate(features)]
        sequences, completions = [], []  # TRL's row order: branch by branch
        for branch in branches:
            for i, f in enumerate(features):
                answer = _ids_array(f[f"{branch}_ids"], i, f"{branch}_ids")
                sequences.append(np.concatenate([prompts[i], answer]))
                completions.append(
                    np.repeat(np.array([0, 1], dtype=np.int64), [prompts[i].size, answer.size])
                )
        seq_len = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        if (seq_len == 0).any():
            s = int(np.argmax(seq_len == 0))
            raise ValueError(f"example {s % n}: prompt + {branches[s // n]} is empty; drop empty examples")
        sequences, completions, seq_len = self._truncate(sequences, completions, seq_len, branches, n)
        n_seq, width = seq_len.size, int(seq_len.max())
        cu = np.zeros(n_seq + 1, dtype=np.int64)
        np.cumsum(seq_len, out=cu[1:])
        if cu[-1] > INT32_MAX or n_seq * width > INT32_MAX:
            raise ValueError(
                f"the batch holds {int(cu[-1])} tokens ({n_seq} x {width} padded), more than int32 offsets can "
                f"address ({INT32_MAX}); use fewer examples per batch"
            )
        row = np.repeat(np.arange(n_seq, dtype=np.int64), seq_len)  # (T,) sequence of every packed token
        offsets = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], seq_len)  # (T,) its position
        flat = row * width + offsets  # (T,) its place in the padded layout
        packed_index = flat.copy()
        packed_index[cu[:-1]] = n_seq * width  # segment starts are never prediction targets
        ids = np.concatenate(sequences)
        padded = {
            "input_ids": np.full(n_seq * width, self.pad_token_id, dtype=np.int64),
            "attention_mask": np.zeros(n_seq * width, dtype=np.int64),
            "completion_mask": np.zeros(n_seq * width, dtype=np.int64),
        }
        padded["input_ids"][flat] = ids
        padded["attention_mask"][flat] = 1
        padded["completion_mask"][flat] = np.concatenate(completions)

        self.stats["batches"] += 1
        self.stats["pairs"] += n
        self.stats["samples"] += n_seq
        self.stats["tokens"] += int(cu[-1])
        self.stats["padded_layout_tokens"] += n_seq * width
        batch: dict[str, Any] = {
            "packed_input_ids": ids[None],
            "packed_index": packed_index,
            "position_ids": (offsets + self.position_ids_start)[None],
            "cu_seq_lens_q": cu.astype(np.int32),
            "cu_seq_lens_k": cu.astype(np.int32),
            **{k: v.reshape(n_seq, width) for k, v in padded.items()},
        }
        if return_tensors == "pt":
            batch = {k: torch.from_numpy(v) for k, v in batch.items()}
        batch["max_length_q"] = batch["max_length_k"] = width
        return batch

    def _truncate(
        self, sequences: list, completions: list, seq_len: np.ndarray, branches: tuple, n: int
    ) -> tuple[list, list, np.ndarray]:
        """``max_length`` on every sequence: raise, or cut as TRL's collator does (``truncation_mode``)."""
        m = self.max_length
        if m is None or not (too_long := seq_len > m).any():
            return sequences, completions, seq_len
        if self.overflow == "error":
            s = int(np.argmax(too_long))
            raise ValueError(
                f"example {s % n}: prompt + {branches[s // n]} has {int(seq_len[s])} tokens > max_length={m}; set "
                f"overflow='truncate' (TRL's truncation, truncation_mode={self.truncation_mode!r}), raise "
                "max_length, or filter long examples out of the dataset"
            )
        cut = slice(None, m) if self.truncation_mode == "keep_start" else slice(-m, None)
        dropped = int((seq_len - m)[too_long].sum())
        self.stats["truncated_samples"] += int(too_long.sum())
        self.stats["truncated_tokens"] += dropped
        if not self._warned_overflow:
            self._warned_overflow = True
            logger.warning(
                "PaddingFreeTripleCollator truncated %d sequence(s) to max_length=%d (%s), dropping %d tokens; "
                "further cases are only counted in collator.stats",
                int(too_long.sum()), m, self.truncation_mode, dropped,
            )  # fmt: skip
        return [s[cut] for s in sequences], [c[cut] for c in completions], np.minimum(seq_len, m)


class PackedTripleForward:
    """The model as TRL's ``TPOTrainer._compute_loss`` calls it, running one packed row instead.

    Called with TRL's padded ``input_ids`` / ``attention_mask`` ``(S, L)`` (and ``use_cache``), it runs
    ``model`` on the packed row of the same batch and returns the model's output with ``logits`` ``(S, L, V)``
    in the padded layout: the logits of every real token at its place, zeros on padding.

    Args:
        model: the model (or its DDP / PEFT wrapper) the trainer trains.
        packed: the packed keys of a :class:`PaddingFreeTripleCollator` batch (``packed_input_ids``,
            ``packed_index``, ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``).

    >>> from packing_hf.integrations.tpo import PaddingFreeTripleCollator
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


def _check_model(model: Any) -> None:
    if isinstance(model, str) or model is None:
        return
    config = getattr(base_model(model), "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(base_model(model)).__name__} is an encoder-decoder model: TPO scores causal language models, "
            f"and packing_hf packs only those; use a causal LM (or {_STOCK})"
        )


class TPOTrainer(PackingTrainerMixin, _StockTPOTrainer):
    """``trl.experimental.tpo.TPOTrainer`` on packed rows: same log-probs, loss, gradients and metrics.

    Same arguments as TRL's; ``args`` is converted to :class:`TPOConfig` if it is a plain ``TrainingArguments``
    / TRL ``TPOConfig``. Unless given, the collator is a :class:`PaddingFreeTripleCollator` with the config's
    ``max_length`` / ``truncation_mode`` (TRL's truncation) and ``include_reference=tpo_alpha != 0``. Load the
    model with an attention that keeps packed segments apart (sdpa/eager for llama-like models, or
    ``packing_hf.register_attention()``); the pre-flight check verifies it while training.

    >>> import datasets
    >>> from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")
    >>> config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = AutoModelForCausalLM.from_config(config)
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

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        args = as_config(args, model, TPOConfig, "TPO")
        data_collator = self._packed_init(
            model, args, data_collator, train_dataset, eval_dataset, processing_class, kwargs
        )
        super().__init__(
            model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        if isinstance(model, str):
            _check_model(self.model)
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        for name in ("cp_size", "sp_size"):
            if parallelism is not None and (getattr(parallelism, name, 1) or 1) > 1:
                raise ValueError(
                    f"{name}={getattr(parallelism, name)}: context/sequence parallelism shards sequences, which "
                    f"a packed row does not support; unset it or use {_STOCK}"
                )
        self._packing_setup()

    @staticmethod
    def _packed_init(model: Any, args: Any, data_collator: Any, train_dataset: Any, eval_dataset: Any,
                     processing_class: Any, kwargs: dict) -> PaddingFreeTripleCollator:  # fmt: skip
        """Every refusal before TRL tokenizes anything; returns the collator to use."""
        if args.padding_free is False:
            raise ValueError(
                f"padding_free=False asks for padded batches, which packing_hf's trainer never runs; use {_STOCK}"
            )
        if data_collator is not None and not isinstance(data_collator, PaddingFreeTripleCollator):
            raise ValueError(
                f"data_collator={type(data_collator).__name__} does not pack TPO rows; leave it unset (a "
                "PaddingFreeTripleCollator is built) or pass a PaddingFreeTripleCollator"
            )
        if args.pad_to_multiple_of:
            raise ValueError(
                f"pad_to_multiple_of={args.pad_to_multiple_of} pads TRL's padded batches; a packed row has no "
                "padding. Leave it unset"
            )
        if kwargs.get("compute_metrics") is not None:
            raise ValueError(
                "compute_metrics reads the logits of every position, padding included, which a packed row does "
                f"not compute. Unset it (TRL's TPO metrics are logged anyway) or use {_STOCK}"
            )
        if args.loss_normalization != "token":
            raise ValueError(
                f"loss_normalization={args.loss_normalization!r}: the loss of {_STOCK} is one term per example "
                "plus its own NLL mean; leave loss_normalization='token'"
            )
        _check_model(model)
        check_whole_sequence_options(
            args,
            model,
            train_dataset,
            kwargs,
            unit="a TPO example, whose sequences",
            what="preference",
            stock=_STOCK,
        )
        _check_dataset(train_dataset, "train_dataset", needs=_BRANCHES)
        _check_dataset(eval_dataset, "eval_dataset", needs=_BRANCHES)
        _check_vocabulary(processing_class, model)
        if data_collator is None:
            data_collator = PaddingFreeTripleCollator(
                max_length=args.max_length,
                overflow="truncate",
                truncation_mode=args.truncation_mode,
                include_reference=args.tpo_alpha != 0.0,
                pad_token_id=_pad_token_id(processing_class),
            )
        elif data_collator.include_reference != (args.tpo_alpha != 0.0):
            raise ValueError(
                f"data_collator.include_reference={data_collator.include_reference} but tpo_alpha="
                f"{args.tpo_alpha}: TRL reads reference rows exactly when tpo_alpha != 0"
            )
        return data_collator

    def _compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
        """Stock's loss and metrics, the model running the packed row (:class:`PackedTripleForward`)."""
        if "packed_index" not in inputs:
            raise ValueError(
                f"{type(self).__name__} got a batch without 'packed_index' (keys {sorted(inputs)}): batches must "
                "come from PaddingFreeTripleCollator"
            )
        padded = {k: inputs[k] for k in ("input_ids", "attention_mask", "completion_mask")}
        packed = {k: inputs[k] for k in ("packed_input_ids", "packed_index", *_PACKED_INPUTS)}
        return super()._compute_loss(PackedTripleForward(model, packed), padded, return_outputs)

    def _multipack_lengths_of(self, dataset: Any) -> np.ndarray:
        """Tokens of every example in a packed row: all its sequences, after the collator's ``max_length``."""
        from .dataloaders import column_lengths

        collator = self.data_collator
        branches = _BRANCHES if collator.include_reference else _BRANCHES[:2]
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
