"""``packing_hf.GRPOTrainer`` / ``RLOOTrainer``: TRL's online RL scoring packed rollouts, exactly.

TRL's GRPO and RLOO score every micro-batch of rollouts as a ``(B, P + C)`` tensor: prompts left-padded to
the longest prompt, completions right-padded to the longest completion. Every forward that computes
per-token log-probs (the policy with gradient, the old policy and the reference model without) goes
through one method, ``_get_per_token_logps_and_entropies``. :class:`PackedRolloutsMixin` replaces it: the
rollouts' real tokens become segments of packed rows (:func:`~packing_hf.rollouts.pack_rollouts`:
restarting positions, ``cu_seq_lens``), the model runs with TRL's fused LM head on those rows, and the
per-token log-probs and entropies are scattered back into the ``(B, C)`` layout
(:func:`~packing_hf.rollouts.unpack_rollouts`), zeros where the padded forward writes zeros. TRL's
generation, rewards, advantages, every ``loss_type``, the KL term, importance sampling, entropy masks and
metrics then run unchanged on the same numbers.

- ``max_tokens_per_batch``: most tokens in one packed forward. The rollouts TRL would run in one forward
  (a micro-batch for the training pass; ``per_device_train_batch_size`` rows for the no-grad passes) are
  bin-packed into rows of at most that many tokens, one forward each; a rollout is never split. ``None``
  (default): one packed row per TRL forward. Data-parallel ranks run the same number of forwards.
- ``share_prompt=True``: the rollouts of one forward that share their prompt tokens (a group) store and
  compute the prompt once: a prefix segment, then one branch per completion attending to the prefix and
  itself (:mod:`packing_hf.shared_prefix`, packing_hf's attention). ``G (P + R)`` tokens become
  ``P + G (R + 1)``; the prompt's gradient is the sum over the group, as with ``G`` copies. TRL shuffles a
  generation batch before cutting it into micro-batches, so the training pass shares only what a
  micro-batch holds of a group (all of it with ``steps_per_generation=1``); the no-grad passes score the
  generation batch in order.
- ``share_prefixes=True`` (the general case of ``share_prompt``, which it replaces): every packed row is a
  prefix tree over the rollouts' prompts *and* completions (``min_shared_tokens``: the shortest shared
  node), so completions that share their first turns or tool calls, identical completions and a
  completion that is a strict prefix of another compute every shared token once, at any depth. The fused
  LM head reads the backbone's hidden states gathered at the token that predicts each completion token
  (a branch's first token at its parent's last token); per-token log-probs and entropies equal the
  padded forward's. ``tree_token_ratio`` (tokens of the rollouts alone / tokens the tree rows computed)
  is logged with TRL's metrics. Models whose token mixers cannot start a branch from its parent's state
  are refused by name (:func:`~packing_hf.attention.admission.prefix_tree_refusal`).
- Refused with a ``ValueError`` (they cannot be exact on a packed row, or are not verified): vision-language
  inputs, MoE router auxiliary losses (``output_router_logits`` with ``router_aux_loss_coef != 0``: a
  load-balancing loss over padded rows is not a sum over packed ones), ``use_liger_kernel``, prompt-learning
  PEFT, context/sequence parallelism.

>>> from packing_hf.integrations.rl import GRPOConfig
>>> config = GRPOConfig("out", max_tokens_per_batch=4096, report_to="none", use_cpu=True)
>>> config.max_tokens_per_batch, config.loss_type
(4096, 'dapo')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import trl

from .._limits import check_bool, check_int, option
from ..attention import register_attention
from ..attention.admission import prefix_tree_refusal
from ..errors import PackingRefused
from ..rollouts import pack_rollouts, unpack_rollouts
from .adapters import hidden_states_at
from .args import PREFLIGHT_MODES
from .loss_policy import StockLoss
from .preflight import base_model
from .refusals import Wording
from .skeleton import PackedTrainerSkeleton

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "PackedRolloutsMixin",
    "RLOOConfig",
    "RLOOTrainer",
    "RolloutPackingArguments",
]


@dataclass
class RolloutPackingArguments:
    """Packing fields of the online RL configs (a dataclass mixin, first in the bases)."""

    max_tokens_per_batch: int | None = option(
        None,
        "Most tokens (prompt + completion, summed over rollouts) in one packed forward. The rollouts "
        "TRL scores in one forward are bin-packed into rows of at most this many tokens, one forward each; a "
        "rollout is never split. None (default): one packed row per TRL forward.",
    )
    share_prompt: bool = option(
        False,
        "Compute the prompt of rollouts that share it (a GRPO/RLOO group in one forward) once: the "
        "prompt becomes a prefix segment and every completion a branch attending to it and to itself "
        "(positions continue from the prompt). Exact; the gradient through the prompt is the sum over its "
        "branches. Needs packing_hf's attention (the model is switched to it for the duration). Groups are "
        "never split across packed rows.",
    )
    share_prefixes: bool = option(
        False,
        "Lay every packed row out as a prefix tree over the rollouts' prompts and completions: tokens "
        "several rollouts share (a prompt, earlier turns, tool calls; identical or prefix completions) are "
        "computed once, at any depth. The general case of share_prompt (set only one). Exact; needs "
        "packing_hf's attention (the model is switched to it for the duration); logs tree_token_ratio.",
    )
    min_shared_tokens: int = option(
        1,
        "With share_prefixes: the shortest run of tokens a node shared by several rollouts may hold (a "
        "shorter common run is stored once per rollout group continuing it). 1 shares every common prefix.",
    )
    packing_preflight: Literal["switch", "error", "off"] = option(
        "switch",
        "Before the first packed forward of a model, check that packed samples cannot see each "
        "other: 'switch' (default) switches to packing_hf's varlen attention if they can, 'error' refuses, "
        "'off' skips the check. The model is given back as it was when train/evaluate returns.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  # the TRL config this is mixed into
        # tokens per packed forward; None: one packed row per forward TRL makes
        self.max_tokens_per_batch = check_int(
            self.max_tokens_per_batch, "max_tokens_per_batch", 1, optional=True
        )
        self.share_prompt = check_bool(self.share_prompt, "share_prompt")
        self.share_prefixes = check_bool(self.share_prefixes, "share_prefixes")
        self.min_shared_tokens = check_int(self.min_shared_tokens, "min_shared_tokens", 1)
        if self.share_prompt and self.share_prefixes:
            raise ValueError(
                "share_prompt=True and share_prefixes=True: share_prefixes already shares every prompt (the "
                "depth-1 case of its prefix tree, honouring min_shared_tokens); set share_prompt=False"
            )
        if self.min_shared_tokens != 1 and not self.share_prefixes:
            raise ValueError(
                f"min_shared_tokens={self.min_shared_tokens} is read only with share_prefixes=True; set "
                "share_prefixes=True or leave min_shared_tokens at 1"
            )
        if self.packing_preflight not in PREFLIGHT_MODES:
            raise ValueError(
                f"packing_preflight={self.packing_preflight!r}: it must be one of {list(PREFLIGHT_MODES)}"
            )


@dataclass
class GRPOConfig(RolloutPackingArguments, trl.GRPOConfig):
    """``trl.GRPOConfig`` plus :class:`RolloutPackingArguments` (``max_tokens_per_batch``, ``packing_preflight``).

    >>> GRPOConfig(output_dir="out", report_to="none", use_cpu=True).max_tokens_per_batch is None
    True
    """


@dataclass
class RLOOConfig(RolloutPackingArguments, trl.RLOOConfig):
    """``trl.RLOOConfig`` plus :class:`RolloutPackingArguments` (``max_tokens_per_batch``, ``packing_preflight``).

    >>> RLOOConfig(output_dir="out", max_tokens_per_batch=512, report_to="none", use_cpu=True).max_tokens_per_batch
    512
    """


class PackedRolloutsMixin(PackedTrainerSkeleton):
    """The packed ``_get_per_token_logps_and_entropies`` of :class:`GRPOTrainer` / :class:`RLOOTrainer`.

    Put it first in the bases of a TRL online trainer whose log-prob method has TRL 1.x's signature. After a
    call, :attr:`packing_stats` holds running counts: ``forwards``, ``packed_tokens`` (tokens the packed
    forwards computed), ``padded_tokens`` (``B x (P + C)`` of the padded batches they replaced) and
    ``shared_prompts`` (segments several rollouts continue), ``rollout_tokens`` (tokens of the rollouts
    alone, over ``packed_tokens``: what sharing saved); ``rank_sync_forwards`` counts
    the forwards added (by splitting rows) so that every data-parallel rank runs as many.

    A trainer class declares ``config_class`` (its packing config, to which ``args`` is converted),
    ``algorithm`` and ``stock`` (:class:`~packing_hf.integrations.skeleton.PackedTrainerSkeleton`); the
    arguments are the TRL trainer's.
    """

    packing_refusals = ("liger", "vision_data", "prompt_learning", "sequence_parallelism", "router_aux_loss")
    wording = Wording("rollouts", "rollouts")
    # TRL's own loss over the rollouts: packing_hf packs its forwards only
    packing_loss = StockLoss.PER_EXAMPLE

    def _packing_setup(self) -> None:
        option = "share_prefixes" if self.args.share_prefixes else "share_prompt"
        if getattr(self.args, option):
            # a shared prompt is a depth-1 prefix tree: refused here, before the first forward, on a model whose
            # mixers do not follow the tree (they would start every completion from a zero state)
            for model in (self.model, getattr(self, "ref_model", None)):
                config = None if model is None else getattr(base_model(model), "config", None)
                why = None if config is None else prefix_tree_refusal(config)
                if why is not None:
                    raise PackingRefused(
                        option, f"{option}=True: {why}; set {option}=False (rollouts stay exact)"
                    )
        self.packing_stats = {
            "forwards": 0,
            "packed_tokens": 0,
            "padded_tokens": 0,
            "shared_prompts": 0,
            "rank_sync_forwards": 0,
            "rollout_tokens": 0,
        }

    # ---- models prepared for packed rows -----------------------------------------------------------

    def _packing_attention(self) -> str | None:
        # only packing_hf's attention reads prefix_seq_idx (the guards refuse the others)
        return register_attention() if self.args.share_prompt or self.args.share_prefixes else None

    def _prepare_for_packing(self, model: Any) -> None:
        """The pre-flight check on ``model`` before its first packed forward (once, until given back)."""
        reference = model is not None and model is getattr(self, "ref_model", None)
        self.packing_session.acquire(
            self.accelerator.unwrap_model(model),
            attention=self._packing_attention(),
            role="reference model" if reference else "model",
        )

    def remove_packing_hooks(self) -> None:
        """Give every model prepared for packed rows back as it was (hooks removed, attention restored)."""
        self.packing_session.release()

    def train(self, *args: Any, **kwargs: Any):
        with self.packing_session.open():
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        with self.packing_session.open():
            return super().evaluate(*args, **kwargs)

    # ---- the packed forward ------------------------------------------------------------------------

    def _plan_packs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int
    ):
        """Packed rows for every chunk of ``batch_size`` rows; ranks agree on the number of rows per chunk."""
        budget = self.args.max_tokens_per_batch
        starts = list(range(0, input_ids.size(0), batch_size))
        chunks = [slice(s, min(s + batch_size, input_ids.size(0))) for s in starts]
        share = {
            "share_prompts": self.args.share_prompt,
            "share_prefixes": self.args.share_prefixes,
            "min_shared_tokens": self.args.min_shared_tokens,
        }
        plans = [
            pack_rollouts(input_ids[c], attention_mask[c], logits_to_keep, budget, 1, **share) for c in chunks
        ]
        if self.parallel_plan.world_size > 1:
            # a forward through DDP may communicate (buffer broadcast): every rank runs as many
            counts = torch.tensor([len(p) for p in plans], device=self.accelerator.device)
            torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
            self.packing_stats["rank_sync_forwards"] += int(counts.sum()) - sum(len(p) for p in plans)
            plans = [
                plan
                if len(plan) >= n
                else pack_rollouts(input_ids[c], attention_mask[c], logits_to_keep, budget, n, **share)
                for plan, c, n in zip(plans, chunks, counts.tolist(), strict=True)
            ]
        return list(zip(chunks, plans, strict=True))

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Per-token log-probs ``(B, C)`` (and entropies) of the completions, from packed forwards.

        Same contract as TRL's method: ``input_ids`` / ``attention_mask`` ``(B, P + C)``, ``logits_to_keep = C``;
        ``batch_size`` rows at most share a forward (then ``max_tokens_per_batch`` tokens at most).
        """
        given = sorted(key for key, value in multimodal.items() if value is not None)
        if given:
            raise ValueError(
                f"vision-language inputs ({given}) cannot be packed: image features are tied to padded rows; use "
                "the stock TRL trainer for vision data"
            )
        if compute_aux_loss:
            raise ValueError(
                "the router load-balancing loss cannot be computed on packed rows (refused as 'router_aux_loss')"
            )
        self._prepare_for_packing(model)
        rows, width = input_ids.shape
        logps, entropies = [], []
        packed_tokens = 0
        for chunk, packs in self._plan_packs(input_ids, attention_mask, logits_to_keep, batch_size or rows):
            chunk_logps, chunk_entropies = [], []
            for pack in packs:
                with self.accelerator.autocast(), hidden_states_at(model, pack.predictors):
                    outputs = model(**pack.model_inputs(), fused_lm_head=True)
                chunk_logps.append(outputs.log_probs)
                if compute_entropy:
                    chunk_entropies.append(outputs.entropy)
                self.packing_stats["forwards"] += 1
                packed_tokens += pack.input_ids.numel()
                if pack.prefix_seq_idx is not None:
                    self.packing_stats["shared_prompts"] += len(set(pack.prefix_seq_idx.tolist()) - {-1})
            chunk_rows = chunk.stop - chunk.start
            self.packing_stats["padded_tokens"] += chunk_rows * width
            logps.append(unpack_rollouts(chunk_logps, packs, chunk_rows, logits_to_keep))
            if compute_entropy:
                entropies.append(unpack_rollouts(chunk_entropies, packs, chunk_rows, logits_to_keep))
        rollout_tokens = int(attention_mask.sum())
        self.packing_stats["packed_tokens"] += packed_tokens
        self.packing_stats["rollout_tokens"] += rollout_tokens
        if self.args.share_prefixes:
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["tree_token_ratio"].append(rollout_tokens / packed_tokens)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None


class GRPOTrainer(PackedRolloutsMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` scoring packed rollouts: same log-probs, losses, gradients and metrics, no padding.

    Same arguments as ``trl.GRPOTrainer``; ``args`` is converted to :class:`GRPOConfig` if it is a plain
    ``TrainingArguments`` / ``trl.GRPOConfig``. Generation, rewards and the loss are TRL's; only the log-prob
    forwards run on packed rows (see the module docstring).

    >>> import datasets
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from packing_hf.architectures.tiny import tiny_config
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
    >>> data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="]})
    >>> args = GRPOConfig("/tmp/packing_hf_grpo_doctest", num_generations=2, per_device_train_batch_size=2,
    ...     max_completion_length=4, max_steps=1, report_to="none", save_strategy="no", use_cpu=True,
    ...     disable_tqdm=True, bf16=False, max_tokens_per_batch=64)
    >>> trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
    ...     args=args, train_dataset=data, processing_class=tokenizer)
    >>> result = trainer.train()  # doctest: +ELLIPSIS
    {...'train_loss'...}
    >>> result.global_step, trainer.packing_stats["forwards"] > 0
    (1, True)
    """

    algorithm = "GRPO"
    config_class = GRPOConfig
    stock = "trl.GRPOTrainer"


class RLOOTrainer(PackedRolloutsMixin, trl.RLOOTrainer):
    """``trl.RLOOTrainer`` scoring packed rollouts: same log-probs, losses, gradients and metrics, no padding.

    Same arguments as ``trl.RLOOTrainer``; ``args`` is converted to :class:`RLOOConfig` if it is a plain
    ``TrainingArguments`` / ``trl.RLOOConfig``.

    >>> RLOOTrainer.__mro__[1].__name__, RLOOTrainer.stock
    ('PackedRolloutsMixin', 'trl.RLOOTrainer')
    """

    algorithm = "RLOO"
    config_class = RLOOConfig
    stock = "trl.RLOOTrainer"
