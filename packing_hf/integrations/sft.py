"""``packing_hf.SFTTrainer`` / ``packing_hf.SFTConfig``: TRL's SFT with packing_hf's collator and multipack.

Stock TRL 1.x refuses a custom collator in padding-free mode ("Passing a custom data collator is not
supported when using padding-free"): its ``__init__`` raises as soon as ``data_collator`` is given with
``padding_free=True`` or bfd packing. This subclass hands TRL ``data_collator=None`` (so TRL still does its
own set-up: pad token on the model config, dataset preparation, label masks) and installs the collator
afterwards: the one you passed, or a :class:`~packing_hf.PaddingFreeCollator` whenever TRL would have
used padding-free batches or ``max_tokens_per_batch`` is set. Everything of
:class:`~packing_hf.integrations.trainer.PackingTrainerMixin` applies (multipack, exact resume,
pre-flight check, packing metrics).

Streaming: a ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``) with
``max_tokens_per_batch`` and ``max_steps`` is tokenized lazily by TRL (labels with the completion-only /
assistant-only masks) and packed online by a :class:`~packing_hf.streaming.PackedStream`, with exact resume,
as in :class:`packing_hf.Trainer`. Streams of already tokenized samples (``PackedStream``,
``TokenizedStream``, a torch ``IterableDataset``) go to :class:`packing_hf.Trainer` instead: TRL only takes
``datasets`` objects.

A vision dataset (TRL's ``messages`` + ``images``, with a processor) and ``max_tokens_per_batch``: TRL's own
vision-language collation runs on every sample alone and :class:`VisionSFTCollator` packs the results
(pixels, image grids, ``mm_token_type_ids`` kept per sample); the sampler plans by the processed lengths.

What reaches the collator is what TRL prepared: ``input_ids`` and ``labels`` with completion-only /
assistant-only masks already folded in (-100), plus ``seq_lengths`` for rows TRL packed itself
(``packing=True``, bfd), which :class:`~packing_hf.PaddingFreeCollator` turns into one segment per
packed sample in ``cu_seq_lens``.

>>> from packing_hf.integrations.sft import SFTConfig
>>> config = SFTConfig(output_dir="out", packing=True, padding_free=True, max_tokens_per_batch=1024,
...     report_to="none", use_cpu=True)
>>> config.padding_free, config.max_tokens_per_batch
(True, 1024)
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import trl

from .._limits import option
from ..collator import PaddingFreeCollator
from ..multimodal import MultimodalCollator, VisionSFTCollator
from .args import PackingArguments, PrefixTreeArguments, budget_max_length
from .loss_policy import StockLoss
from .stream_data import is_hf_iterable, is_stream
from .trainer import PackingTrainerMixin

__all__ = ["SFTConfig", "SFTTrainer"]


@dataclass
class SFTConfig(PrefixTreeArguments, PackingArguments, trl.SFTConfig):
    """``trl.SFTConfig`` plus the packing fields of :class:`~packing_hf.integrations.args.PackingArguments`,
    ``share_prefixes`` (:class:`~packing_hf.integrations.args.PrefixTreeArguments`) and ``logit_metrics``.

    >>> SFTConfig(output_dir="out", report_to="none", use_cpu=True).packing_preflight
    'switch'
    """

    max_length: int | None = budget_max_length(
        "a longer sample is truncated per truncation_mode and one left with no trained token dropped, or with "
        "packing=True the length of TRL's packed rows; counted: logged once, and max_length_truncated_samples / "
        "_tokens and max_length_dropped_samples in the training logs",
        "None without packing=True (the budget bounds a sample: a longer one follows packing_overflow, an error "
        "by default), the budget with it (TRL packs rows of max_tokens_per_batch tokens)",
    )
    logit_metrics: str = option(
        "labelled",
        "How the loss and TRL's logged `entropy` / `mean_token_accuracy` are computed. labelled "
        "(default): the model's own loss (as packing_hf.Trainer), and the two metrics from its logits at the "
        "labelled tokens only (the same values TRL logs); trl: TRL's fused LM head, which scores every "
        "position over the whole vocabulary each step (about 3x slower on CPU, less memory for the logits).",
    )

    def _max_length_for_budget(self) -> int | None:
        # TRL's own packing (packing=True) needs a row length: rows as long as the budget
        return self.max_tokens_per_batch if self.packing else None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logit_metrics not in ("labelled", "trl"):
            raise ValueError(f"logit_metrics must be 'labelled' or 'trl', got {self.logit_metrics!r}")


@torch.no_grad()
def _labelled_logit_metrics(
    logits: torch.Tensor, labels: torch.Tensor, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(entropy sum, top-1 hits, labelled count)`` of the next-token distributions at the labelled
    positions (label != -100, shifted by one), in fp32, ``chunk`` positions at a time (bounded memory).

    Args:
        logits: ``(batch, seq, vocab)``, any float dtype.
        labels: ``(batch, seq)`` int64, -100 where not trained.

    >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [0.0, 0.0]]])
    >>> entropy, hits, count = _labelled_logit_metrics(logits, torch.tensor([[-100, 1, 0]]))
    >>> round(entropy.item(), 4), hits.item(), count.item()
    (1.0585, 1, 2)
    """
    labels = labels[:, 1:]
    mask = labels != -100
    picked = logits[:, :-1][mask]  # (N, vocab): only the labelled positions
    targets = labels[mask]
    entropy = logits.new_zeros((), dtype=torch.float32)
    hits = torch.zeros((), dtype=torch.int64, device=logits.device)
    for start in range(0, picked.size(0), chunk):
        block = picked[start : start + chunk].float()
        log_p = block.log_softmax(-1)
        entropy += -(log_p.exp() * log_p).sum()
        hits += (block.argmax(-1) == targets[start : start + chunk]).sum()
    return entropy, hits, mask.sum()


def _as_packing_config(args: Any, model: Any) -> SFTConfig:
    """``args`` as a packing_hf ``SFTConfig`` (TRL would convert a plain TrainingArguments to *its* SFTConfig)."""
    if isinstance(args, SFTConfig):
        return args
    if args is None:
        name = (
            model
            if isinstance(model, str)
            else getattr(getattr(model, "config", None), "_name_or_path", "model")
        )
        return SFTConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-SFT")
    values = args.to_dict()
    values["hub_token"] = args.hub_token  # to_dict hides it
    names = {f.name for f in dataclasses.fields(SFTConfig) if f.init}
    return SFTConfig(**{k: v for k, v in values.items() if k in names})


class SFTTrainer(PackingTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` that accepts packing_hf's collator in padding-free mode and packs with multipack.

    Same arguments as ``trl.SFTTrainer``; ``args`` is converted to :class:`SFTConfig` if it is a plain
    ``TrainingArguments`` / ``trl.SFTConfig``.

    >>> import datasets, torch
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from packing_hf.architectures.tiny import tiny_config
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")  # any tokenizer folder
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
    >>> data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="], "completion": ["2", "5"]})
    >>> args = SFTConfig("/tmp/packing_hf_sft_doctest", packing=True, padding_free=True, max_length=64,
    ...     max_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    >>> trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
    ...     data_collator=PaddingFreeCollator())
    >>> type(trainer.data_collator).__name__
    'PaddingFreeCollator'
    >>> result = trainer.train()  # the Trainer prints its final metrics  # doctest: +ELLIPSIS
    {...'train_loss'...}
    >>> result.global_step
    1
    """

    config_class = SFTConfig
    algorithm = "SFT"
    stock = "trl.SFTTrainer"
    packing_collator = (PaddingFreeCollator, MultimodalCollator)
    # TRL's SFT loss: the model's token mean, plus TRL's metrics (the plain route computes both)
    packing_loss = StockLoss.SFT
    # sp_size cuts packed rows over processes (integrations/sequence_parallel.py)
    packing_sequence_parallel = True

    def _packing_config(self, args: Any, model: Any) -> SFTConfig:
        return _as_packing_config(args, model)

    def _before_stock_init(self, call: dict[str, Any]) -> None:
        train_dataset = call.get("train_dataset")
        if is_stream(train_dataset) and not is_hf_iterable(train_dataset):
            # TRL accepts datasets.Dataset / IterableDataset only (it tokenizes them itself)
            raise TypeError(
                f"SFTTrainer tokenizes its dataset itself and takes a datasets.IterableDataset for streaming "
                f"(load_dataset(..., streaming=True)), got {type(train_dataset).__name__}; for a stream of "
                "already tokenized samples (PackedStream, TokenizedStream, a torch IterableDataset) use "
                "packing_hf.Trainer with max_tokens_per_batch"
            )
        args = call["args"]
        padding_free = args.padding_free or (args.packing and args.packing_strategy in ("bfd", "bfd_split"))
        # TRL raises on any collator in padding-free mode; it gets None and the collator comes after.
        self._collator_after = padding_free or args.max_tokens_per_batch is not None or args.share_prefixes
        if self._collator_after:
            self._user_collator, call["data_collator"] = call.get("data_collator"), None

    def _after_stock_init(self, call: dict[str, Any]) -> None:
        if not self._collator_after:
            return
        data_collator = self._user_collator
        if call["args"].share_prefixes and not getattr(self, "_is_vision_dataset", False):
            # vision data is refused with share_prefixes when the trainer is set up (_check_share_prefixes)
            data_collator = self._prefix_tree_collator(call["args"], data_collator)
        elif data_collator is None and getattr(self, "_is_vision_dataset", False):
            # TRL's own vision-language collation (chat template, images, labels), sample by sample, packed
            data_collator = VisionSFTCollator(self.data_collator)
        elif data_collator is None:
            data_collator = PaddingFreeCollator.for_tokenizer(
                self._tokenizer, pad_to_multiple_of=call["args"].pad_to_multiple_of
            )
        self.data_collator = data_collator

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL's preparation, with what ``max_length`` cuts counted (never silent).

        TRL truncates every sample to ``max_length`` (and drops one left with no trained token), or cuts it
        to one packed row (``packing=True``), inside its ``_prepare_dataset``, without a count. Here TRL
        tokenizes and builds the labels with ``max_length=None``, the lengths are read, and TRL's last steps
        run as TRL runs them (its truncation and filter, or its ``pack_dataset``), with the samples and
        tokens cut counted in ``self.max_length_stats[dataset_name]``, logged once with the fix and added to
        the training logs. A streamed dataset (read lazily) or ``skip_prepare_dataset`` goes to TRL as is.
        """
        import datasets

        if args.max_length is None or not isinstance(dataset, datasets.Dataset):
            return super()._prepare_dataset(
                dataset, processing_class, args, packing, formatting_func, dataset_name
            )
        whole_args = copy.copy(args)  # a shallow copy: TRL reads it, nothing re-runs __post_init__
        whole_args.max_length, whole_args.shuffle_dataset = None, False
        dataset = super()._prepare_dataset(
            dataset, processing_class, whole_args, False, formatting_func, dataset_name
        )
        import pyarrow.compute as pc

        lengths = pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_numpy()
        max_length = args.max_length
        over = lengths > max_length
        stats = {
            "truncated_samples": int(over.sum()),
            "truncated_tokens": int((lengths[over] - max_length).sum()),
            "dropped_samples": 0,
        }
        map_kwargs = {"num_proc": args.dataset_num_proc}
        if packing:
            # TRL's own packing tail (trl.SFTTrainer._prepare_dataset): rows of max_length tokens; "bfd" cuts a
            # longer sample to one row, "bfd_split" and "wrapped" carry the rest over to other rows
            dataset = dataset.select_columns(["input_ids", "labels"])
            if args.shuffle_dataset:
                dataset = dataset.shuffle(seed=args.seed)
            dataset = trl.pack_dataset(dataset, max_length, args.packing_strategy, map_kwargs)
            if args.packing_strategy != "bfd":
                stats["truncated_samples"] = stats["truncated_tokens"] = 0
        else:
            # TRL's truncation (truncation_mode), then its drop of every sample with no trained token
            if stats["truncated_samples"]:
                cut = (
                    slice(None, max_length)
                    if args.truncation_mode == "keep_start"
                    else slice(-max_length, None)
                )
                dataset = dataset.map(
                    lambda example: {
                        "input_ids": example["input_ids"][cut],
                        "labels": example["labels"][cut],
                    },
                    **map_kwargs,
                )
            kept = dataset.filter(
                lambda example: any(label != -100 for label in example["labels"]), **map_kwargs
            )
            stats["dropped_samples"] = len(dataset) - len(kept)
            dataset = kept
        if args.shuffle_dataset:
            dataset = dataset.shuffle(seed=args.seed)
        how = "cut to one packed row" if packing else f"truncated ({args.truncation_mode})"
        said = (
            f"max_length={max_length} {how} {stats['truncated_samples']} of {lengths.size} samples "
            f"({stats['truncated_tokens']} tokens cut, the longest had {int(lengths.max())} tokens)"
        )
        if stats["dropped_samples"]:
            said += f", and dropped {stats['dropped_samples']} left with no trained token"
        self._record_max_length_cut(dataset_name, stats, said)
        return dataset

    def _multipack_lengths_of(self, dataset: Any) -> Any:
        """Sample lengths for the multipack sampler; a vision dataset's are its processed lengths (image
        placeholders expanded), from TRL's collation of every sample once."""
        collator = self.data_collator
        if not isinstance(collator, VisionSFTCollator):
            return super()._multipack_lengths_of(dataset)
        import numpy as np

        return np.array([collator.process(dataset[i])["input_ids"].shape[-1] for i in range(len(dataset))])

    def _sft_plain_loss(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any, head: Any) -> Any:
        """SFT's plain route (:class:`~packing_hf.integrations.loss_policy.LossRoute`): TRL's SFT loss and its
        logged metrics, without scoring every position over the whole vocabulary.

        TRL's ``compute_loss`` runs a fused LM head that computes log-probabilities, entropy and top-1 for every
        position of the row (prompt tokens too, on CPU) on every step: about 3x the cost of the step itself
        for a small model on CPU. With ``logit_metrics="labelled"`` the loss is the model's own (the same
        value: the summed negative log-likelihood of the labelled tokens over ``num_items_in_batch``), and
        ``entropy`` / ``mean_token_accuracy`` are computed from its logits, detached, at the labelled
        positions only, where TRL's values are non-zero anyway: the logged numbers mean what TRL's mean. With
        ``chunked_loss`` (default: ``head``, the resolved chunked LM head) the loss and both metrics come from the
        chunked LM head, no logits kept. The loss policy sends other losses (packing_hf's ``loss_normalization`` /
        ``loss_weights``, DFT, label smoothing, ``compute_loss_func``, MoE aux loss, sequence parallelism) down
        their own routes, TRL's ``compute_loss`` among them.
        """
        mode = "train" if self.model.training else "eval"
        inputs["use_cache"] = False
        loss, stats, outputs = self._model_loss(model, inputs, num_items_in_batch, head, metrics=True)
        if stats is not None:  # the metrics from the chunked head's chunks, at the labelled tokens
            entropy_sum, num_correct, num_valid = stats.entropy, stats.hits, stats.count
        else:
            entropy_sum, num_correct, num_valid = _labelled_logit_metrics(outputs.logits, inputs["labels"])
        gather = self.accelerator.gather_for_metrics
        num_valid, entropy_sum, num_correct = (gather(x).sum() for x in (num_valid, entropy_sum, num_correct))
        metrics = self._metrics[mode]
        metrics["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        metrics["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train":
            # TRL's token count: the attention mask's ones, or the packed row's length
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            else:
                local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
            self._total_train_tokens += gather(local).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        return loss

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        if not self.completion_only_loss and "completion_mask" in self._signature_columns:
            # completion_only_loss=False means train on the prompt too: keep TRL's meaning, drop the mask
            self._signature_columns.remove("completion_mask")
