"""The packing fields shared by ``packing_hf.TrainingArguments`` and ``packing_hf.SFTConfig``.

``PackingArguments`` is a dataclass mixin: put it first in the bases of a ``transformers.TrainingArguments``
subclass and its fields become ordinary arguments, parsed by ``HfArgumentParser`` / ``TrlParser`` from the
command line or YAML like every other field.

>>> from packing_hf.integrations.args import TrainingArguments
>>> args = TrainingArguments(output_dir="out", max_tokens_per_batch=4096, report_to="none")
>>> args.max_tokens_per_batch, args.packing_preflight
(4096, 'switch')
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import transformers

from .._limits import check_bool, check_int, option
from .._loss import check_loss_normalization
from ..overflow import check_overflow
from ..sampler import MIXINGS
from .parallel import apply_sp_size, check_deepspeed_world

__all__ = [
    "PREFLIGHT_MODES",
    "PackingArguments",
    "PrefixTreeArguments",
    "TrainingArguments",
    "as_config",
    "budget_max_length",
]

PREFLIGHT_MODES = ("switch", "error", "off")


class _TrlDefaultLength(int):
    """TRL's default ``max_length`` (1024), marked so that a packing config can tell it from a value the user
    set: a default must not cut or drop a sample that the token budget has room for."""


_BUDGET_BOUNDS = (
    "None: the budget bounds a sample instead (a longer one follows packing_overflow, an error by default)"
)


def budget_max_length(meaning: str, with_budget: str = _BUDGET_BOUNDS) -> Any:
    """The ``max_length`` field of a packed TRL config: TRL's default 1024, unless ``max_tokens_per_batch`` is
    set and ``max_length`` is not (then ``_max_length_for_budget``, None: no default cuts or drops a sample the
    budget has room for). ``meaning``: what TRL does with a longer sample; ``with_budget``: the value then.

    >>> from packing_hf.integrations.dpo import DPOConfig
    >>> kwargs = dict(output_dir="out", report_to="none", use_cpu=True)
    >>> DPOConfig(**kwargs, max_tokens_per_batch=4096).max_length is None
    True
    >>> DPOConfig(**kwargs).max_length, DPOConfig(**kwargs, max_tokens_per_batch=4096, max_length=512).max_length
    (1024, 512)
    """
    return option(
        _TrlDefaultLength(1024),
        f"Maximum length of a tokenized sequence (TRL's field). Set: TRL's meaning ({meaning}). Unset with "
        f"max_tokens_per_batch: {with_budget}. Unset otherwise: TRL's default, 1024.",
    )


@dataclass
class PackingArguments:
    """Packing fields, mixed into a ``TrainingArguments`` subclass (see the module docstring)."""

    # the ``bool | None`` switches a subclass adds (None: decide for me), checked like the packing booleans
    _optional_switches: ClassVar[tuple[str, ...]] = ()

    max_tokens_per_batch: int | None = option(
        None,
        "Token budget of one micro-batch on one device. When set, training batches come from "
        "packing_hf.MultipackBatchSampler: every micro-batch holds as many whole samples as fit in this "
        "many tokens (bin packing, shuffled every epoch, sharded over data-parallel ranks), and "
        "per_device_train_batch_size is not used for training. None (default): no multipack; each step "
        "flattens per_device_train_batch_size samples (online packing by the collator).",
    )
    packing_preflight: Literal["switch", "error", "off"] = option(
        "switch",
        "Before training on packed batches, check on a tiny copy of the model's config (cached per "
        "architecture and attention implementation) that packed samples cannot see each other. "
        "'switch' (default): if they can, switch the model to packing_hf's varlen attention and check "
        "again, refusing to train if it still leaks. 'error': refuse to train if they can. 'off': no check.",
    )
    packing_overflow: Literal["error", "truncate", "split", "drop"] = option(
        "error",
        "With max_tokens_per_batch: what to do with a sample longer than the budget. 'error' "
        "(default) names it and stops; 'truncate' / 'split' / 'drop' are applied by the sampler and "
        "counted in its stats (never silently).",
    )
    multipack_mixing: Literal["random", "sorted"] = option(
        "random",
        "With max_tokens_per_batch: which samples share a batch. 'random' (default): a new random mix "
        "every epoch, as few batches as sorted packing on real data, trains like shuffled batches. 'sorted': "
        "best-fit decreasing, the last fraction of a percent of fill, but length-grouped batches (trained to a "
        "worse loss in the issue's measurements). See docs/multipack.md.",
    )
    multipack_cost_model: str | None = option(
        "auto",
        "With max_tokens_per_batch and several ranks: balance every step by predicted compute cost "
        "sum(LINEAR * L + QUADRATIC * L**2) instead of tokens. 'flops': counted from the model config; "
        "'fit': measured on the model (a few timed forward + backward passes, cached per model/device/"
        "attention); 'LINEAR,QUADRATIC': given; None: token balance. Default 'auto': 'flops' where the model "
        "config has the sizes it reads, else token balance (said once). See docs/multipack.md.",
    )
    packing_eval: bool = option(
        True,
        "With max_tokens_per_batch: evaluate on multipack batches too (every eval sample once, the "
        "same number of batches on every rank); eval_loss is then the token-mean over the eval set, equal to "
        "the padded eval loss. An eval set too small to give every rank the same number of batches is refused, "
        "unless dataloader_drop_last=True: whole batches are then left out, counted in eval_dropped_samples. "
        "False: stock padded eval batches.",
    )
    loss_normalization: Literal["token", "sample", "sample_sum"] = option(
        "token",
        "How the training loss of an optimizer step is averaged, the same whatever the packing, "
        "gradient accumulation or number of processes. 'token' (default, stock): mean over every predicted "
        "token of the step. 'sample': every sample's own token mean, averaged over the step's samples (each "
        "sample counts equally). 'sample_sum': a sample's summed token loss, averaged over the step's samples. "
        "A per-token 'loss_weights' column, when the data has one, weighs every token under all three. "
        "See docs/loss.md.",
    )
    chunked_loss: bool = option(
        True,
        "Compute the training and evaluation loss (and SFT's entropy / token-accuracy metrics) from the "
        "model's final hidden states in chunks of tokens, so the (tokens x vocabulary) logits never exist whole: "
        "the same loss and gradients, a fraction of the memory (packing_hf.loss_head). A model whose LM head "
        "cannot be chunked exactly keeps the full logits, and the log says why once. False: the model's own "
        "logits and loss.",
    )
    sp_size: int | None = option(
        None,
        "Sequence parallelism: cut every packed row (max_tokens_per_batch tokens) over this many processes, "
        "with the one-process loss and gradients (packing_hf's Ulysses all-to-all around its varlen attention; "
        "Trainer, SFTTrainer, DPOTrainer). The same as parallelism_config=ParallelismConfig(sp_size=N); the "
        "processes are sp_size-groups of data-parallel replicas (DDP, DeepSpeed ZeRO or FSDP2 beside it). See "
        "docs/distributed.md.",
    )
    packing_metrics: bool = option(
        True,
        "Add packing metrics to the training logs: packing_efficiency (real tokens / token "
        "capacity of the micro-batches), real_tokens_per_step and padding_avoided_per_step (tokens a "
        "padded batch of the same samples would have added), summed over data-parallel ranks; and model FLOPs "
        "(attention counted per sample), model TFLOP/s, MFU and p50/p90 step times (packing_hf.flops).",
    )
    peak_tflops: float | None = option(
        None,
        "Peak TFLOP/s of one device, for the mfu in the logs (model FLOP/s / (peak x devices)). None "
        "(default): the dense bf16 peak of a known CUDA GPU (packing_hf.flops.PEAK_BF16_TFLOPS), else no mfu "
        "(on CPU, say). Needs packing_metrics and batches whose samples packing_hf can count (refused otherwise).",
    )

    def _max_length_for_budget(self) -> int | None:
        """``max_length`` when the user left TRL's default and set ``max_tokens_per_batch`` (see
        :func:`budget_max_length`): None, the budget bounds a sample."""
        return None

    def follow_budget(self) -> None:
        """An unset ``max_length`` (TRL's default) follows ``max_tokens_per_batch`` once that is set (see
        :func:`budget_max_length`); called on construction, and by whoever sets the budget afterwards."""
        unset = type(getattr(self, "max_length", None)) is _TrlDefaultLength
        if unset and self.max_tokens_per_batch is not None:
            # the budget bounds a sample; TRL's default 1024 would cut one the budget has room for
            self.max_length = self._max_length_for_budget()

    def __post_init__(self) -> None:
        self.follow_budget()
        apply_sp_size(self)  # the parallel layout's sizes are read in parallel.py
        super().__post_init__()  # type: ignore[misc]  # the TrainingArguments base this is mixed into
        budget = self.max_tokens_per_batch
        # tokens per micro-batch per device; None flattens per_device_train_batch_size samples per step
        self.max_tokens_per_batch = check_int(budget, "max_tokens_per_batch", 1, optional=True)
        if self.packing_preflight not in PREFLIGHT_MODES:
            raise ValueError(
                f"packing_preflight={self.packing_preflight!r}: it must be one of {list(PREFLIGHT_MODES)}"
            )
        self.packing_overflow = check_overflow(self.packing_overflow, "packing_overflow")
        self.loss_normalization = check_loss_normalization(self.loss_normalization)
        if self.multipack_mixing not in MIXINGS:
            raise ValueError(f"multipack_mixing={self.multipack_mixing!r}: it must be one of {MIXINGS}")
        if self.multipack_cost_model not in (None, "auto", "flops", "fit"):
            from ..cost import CostModel

            try:
                CostModel.parse(self.multipack_cost_model)
            except ValueError as error:
                raise ValueError(
                    f"multipack_cost_model: {error}; or 'auto' / 'flops' / 'fit' / None"
                ) from None
        for name in ("packing_eval", "packing_metrics", "chunked_loss"):
            setattr(self, name, check_bool(getattr(self, name), name))
        if self.peak_tflops is not None:
            peak = self.peak_tflops
            if (
                isinstance(peak, bool)
                or not isinstance(peak, int | float)
                or not math.isfinite(peak)
                or peak <= 0
            ):
                raise ValueError(
                    f"peak_tflops must be a number > 0 (one device's peak TFLOP/s), got {peak!r}"
                )
            if not self.packing_metrics:
                raise ValueError(
                    f"peak_tflops={peak} sets the peak of the mfu in the packing metrics, which "
                    "packing_metrics=False turns off; set packing_metrics=True or unset peak_tflops"
                )
            self.peak_tflops = float(peak)
        for name in self._optional_switches:
            setattr(self, name, check_bool(getattr(self, name), name, optional=True))
        if getattr(self, "deepspeed", None):
            # a world accelerate miscounts, refused before a ZeRO-3 model built after these arguments is partitioned
            check_deepspeed_world(self)
            _join_deepspeed_comm()


def _join_deepspeed_comm() -> None:
    """``deepspeed.comm`` over the process group transformers started, where transformers did not start DeepSpeed's.

    With ``use_cpu=True`` (DeepSpeed on CPU: ``DS_ACCELERATOR=cpu``) transformers starts ``torch.distributed`` (gloo)
    but not ``deepspeed.comm``, so a model built after the arguments under ZeRO-3 (``deepspeed.zero.Init``) would
    count one process and fail on the batch sizes ("train_batch_size is not equal to ..."); DeepSpeed adopts an
    existing group. On GPUs transformers starts ``deepspeed.comm`` itself and this does nothing.
    """
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    from deepspeed import comm

    if not comm.is_initialized():
        comm.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)


@dataclass
class PrefixTreeArguments:
    """``share_prefixes``: the prefix-tree fields of the trainers whose loss is a causal-LM loss over the samples
    (``packing_hf.TrainingArguments``, ``packing_hf.SFTConfig``), mixed in before :class:`PackingArguments`.

    >>> args = TrainingArguments(output_dir="out", share_prefixes=True, report_to="none")
    >>> args.share_prefixes, args.min_shared_tokens
    (True, 1)
    >>> TrainingArguments(output_dir="out", min_shared_tokens=4, report_to="none")
    Traceback (most recent call last):
    ...
    ValueError: min_shared_tokens=4 sets how long a prefix shared by samples must be, which only share_prefixes=True uses; set share_prefixes=True or remove min_shared_tokens
    """

    share_prefixes: bool = option(
        False,
        "Merge the samples of every micro-batch that begin with the same tokens (a conversation cut into one "
        "sample per assistant turn, a shared system prompt) into a prefix tree, one packed row that stores and "
        "computes every shared prefix once, with each sample's loss and gradients as if run alone "
        "(packing_hf.PrefixTreeCollator, packing_hf's attention). With max_tokens_per_batch the sampler puts "
        "samples sharing prefixes in the same micro-batch. tree_token_ratio (tokens before / after sharing) is "
        "logged. See docs/prefix_trees.md.",
    )
    min_shared_tokens: int | None = option(
        None,
        "With share_prefixes: the shortest prefix several samples share as one node (>= 1; a shorter common run "
        "is repeated in each sample). Default 1: every common prefix is shared.",
    )

    def __post_init__(self) -> None:
        self.share_prefixes = check_bool(self.share_prefixes, "share_prefixes")
        if self.min_shared_tokens is not None and not self.share_prefixes:
            raise ValueError(
                f"min_shared_tokens={self.min_shared_tokens} sets how long a prefix shared by samples must be, which "
                "only share_prefixes=True uses; set share_prefixes=True or remove min_shared_tokens"
            )
        if self.share_prefixes:
            self.min_shared_tokens = check_int(
                1 if self.min_shared_tokens is None else self.min_shared_tokens, "min_shared_tokens", 1
            )
        super().__post_init__()  # type: ignore[misc]  # PackingArguments, then the TrainingArguments base


@dataclass
class TrainingArguments(PrefixTreeArguments, PackingArguments, transformers.TrainingArguments):
    """``transformers.TrainingArguments`` plus the packing fields of :class:`PackingArguments` and
    :class:`PrefixTreeArguments`.

    >>> TrainingArguments(output_dir="out", report_to="none").max_tokens_per_batch is None
    True
    """


def as_config(args: Any, model: Any, config_class: type, suffix: str) -> Any:
    """``args`` as ``config_class`` (a packing_hf config; a plain ``TrainingArguments`` or TRL config is
    converted, ``None`` becomes TRL's default ``<model name>-<suffix>`` output folder); shared by the TRL
    trainers' subclasses.

    >>> as_config(None, "org/tiny-llama", TrainingArguments, "DPO").output_dir
    'tiny-llama-DPO'
    """
    if isinstance(args, config_class):
        return args
    if args is None:
        name = (
            model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
        )
        return config_class(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-{suffix}")
    values = args.to_dict()
    values["hub_token"] = args.hub_token  # to_dict hides it
    names = {f.name for f in dataclasses.fields(config_class) if f.init}
    return config_class(**{k: v for k, v in values.items() if k in names})
