"""Model adapters: forward hooks that let a model take a trainer's packed batch while the trainer's own code
keeps working in the padded layout it was written for.

This is the one integrations module that hooks the user's model (``docs/architecture.md``; the layout test
checks it). Each adapter is installed once per model by the trainer's
:class:`~packing_hf.integrations.session.PackingSession` (``session.adapter(model, Adapter)``), acts only on
calls that carry its packed keys (every other call passes untouched) and is removed by ``remove()``:

- :class:`PackedPreferenceForward` (DPO, KTO): packed preference rows in, per-token outputs of TRL's fused LM
  head scattered back to the padded ``(2B, L - 1)`` layout; a call carrying :data:`SEQUENCE_PARALLEL_KEY`
  (DPO with ``sp_size``) runs this rank's shard of the row and gathers the per-token outputs of the group;
- :class:`PackedRewardForward` (reward): packed pairs in, the score head's output read at each sequence's
  pooled token, as stock's ``(2B, num_labels)`` scores.

:func:`head_inputs` (the chunked loss: the LM head's input kept, no logits projected, for one forward) and
:func:`hidden_states_at` (GRPO/RLOO prefix-tree rows: the backbone's hidden states gathered at the tokens that
predict the completions, for one forward). The
trainer's accelerate objects are adapted in :mod:`packing_hf.integrations.accelerator`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..attention import ATTENTION_NAME
from ..attention.sequence_parallel import (
    SHARD_KEY,
    check_sequence_parallel_model,
    gather_shard_tokens,
    shard_packed_batch,
)
from ..preference import TREE_INDEX_KEY, TreeTargets, pack_padded_labels, unpack_shifted
from ..shared_prefix import PREFIX_KEY
from .preflight import base_model

__all__ = [
    "SEQUENCE_PARALLEL_KEY",
    "PackedPreferenceForward",
    "PackedRewardForward",
    "head_inputs",
    "hidden_states_at",
]

#: the call keyword asking :class:`PackedPreferenceForward` to cut the packed row over a sequence-parallel group
#: (its value: the group); the trainer adds it to the batch, so the group travels with the call
SEQUENCE_PARALLEL_KEY = "packing_hf_sequence_parallel_group"

# the keys of a packed row that shard_packed_batch takes (and cuts, or carries in the shard)
_ROW_KEYS = ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # fmt: skip


def _around(model: torch.nn.Module, before: Any, after: Any) -> list[Any]:
    """A keyword pre-hook and a keyword post-hook around ``model``'s forward; their handles."""
    # prepend: the rewrite must come before packing_hf's own guards, which check the packed inputs
    return [
        model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]


def _remove(handles: list[Any]) -> None:
    while handles:
        handles.pop().remove()


@contextlib.contextmanager
def hidden_states_at(model: torch.nn.Module, predictors: torch.Tensor | None) -> Iterator[None]:
    """For one forward of a prefix-tree rollout pack: the backbone's ``last_hidden_state`` ``(1, T, H)``
    gathered to ``(1, N, H)`` at ``predictors`` ``(N,)`` int64, so that TRL's fused LM head scores each of the
    pack's ``shift_labels`` (a branch point's row once per child, see :mod:`packing_hf.rollouts`). The
    gather's backward sums a branch point's gradient over its children. ``None``: nothing is changed.

    A forward hook on the backbone, removed on exit: TRL's fused forward calls the backbone and the head in
    one closure, and no argument reaches the hidden states between them. The hook holds this call's
    ``predictors``, so two threads running one model on tree packs at once would see each other's.

    >>> from transformers import AutoModelForCausalLM
    >>> from packing_hf.architectures import tiny_config
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    >>> with hidden_states_at(model, torch.tensor([2, 2, 0])):
    ...     hidden = model.model(input_ids=torch.tensor([[5, 6, 7]])).last_hidden_state
    >>> tuple(hidden.shape), len(model.model._forward_hooks)
    ((1, 3, 64), 0)
    """
    if predictors is None:
        yield
        return
    # TRL's fused forward reads ``self.base_model`` of the causal LM under the PEFT / DDP wrappers
    handle = _gather_hidden_states(base_model(model).base_model, predictors)
    try:
        yield
    finally:
        handle.remove()


def _gather_hidden_states(backbone: torch.nn.Module, rows: torch.Tensor) -> Any:
    """Hook ``backbone`` so that its ``last_hidden_state`` ``(1, T, H)`` becomes ``(1, N, H)``, the rows ``rows``
    ``(N,)`` int64 (the tokens predicting a prefix-tree row's targets); return the hook's handle."""

    def gather(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        hidden = output.last_hidden_state
        output.last_hidden_state = hidden.index_select(1, rows.to(hidden.device))
        return output

    return backbone.register_forward_hook(gather)


class PackedPreferenceForward:
    """Forward hooks letting ``model`` take a packed preference batch while its caller works in the padded layout.

    A call is rewritten only when its keyword arguments hold ``packed_index`` (the batches of
    :class:`~packing_hf.preference.PaddingFreePreferenceCollator`); every other call passes untouched.
    Before the forward: ``input_ids`` (padded ``(S, L)``) and ``attention_mask`` are dropped,
    ``packed_input_ids`` ``(1, T)`` becomes ``input_ids`` and the padded ``labels`` ``(S, L)`` are moved to
    the packed row (:func:`~packing_hf.preference.pack_padded_labels`). After it: every per-token output of
    shape ``(1, T - 1, ...)`` is scattered to ``(S, L - 1, ...)``
    (:func:`~packing_hf.preference.unpack_shifted`). Only TRL's fused LM head (``fused_lm_head=True``) is
    accepted: plain logits of padding positions do not exist in a packed batch.

    Args:
        model: the ``nn.Module`` the trainer calls (a ``PreTrainedModel`` or a PEFT model; not a DDP wrapper,
            whose inner module is called with the same arguments).

    >>> import torch
    >>> from packing_hf.preference import PaddingFreePreferenceCollator
    >>> class Scorer(torch.nn.Module):  # stands for a model with TRL's fused LM head
    ...     def forward(self, input_ids, labels, fused_lm_head=False, **kwargs):
    ...         return {"log_probs": (labels[:, 1:] != -100).float() * input_ids[:, 1:]}
    >>> model = Scorer()
    >>> hooks = PackedPreferenceForward(model)
    >>> batch = PaddingFreePreferenceCollator()([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3, 4]}])
    >>> labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    >>> model(**batch, labels=labels, fused_lm_head=True)["log_probs"].tolist()  # padded (2, 2)
    [[2.0, 0.0], [3.0, 4.0]]
    >>> hooks.remove()
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._layout: tuple[torch.Tensor, int, int, Any] | None = None
        self._tree: TreeTargets | None = None
        self._reorder: list[Any] = []  # the one-call hook on the backbone of a prefix-tree call
        self._handles = _around(model, self._before, self._after)

    def remove(self) -> None:
        """Remove both hooks (the model is as before)."""
        _remove(self._reorder)
        _remove(self._handles)

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # a forward that raised must not leave its layout (or its backbone hook) to the next call
        self._layout, self._tree = None, None
        _remove(self._reorder)
        if TREE_INDEX_KEY in kwargs:
            return self._before_tree(module, args, kwargs)
        if "packed_index" not in kwargs:
            return None
        kwargs = dict(kwargs)
        sequence_parallel = SEQUENCE_PARALLEL_KEY in kwargs
        group = kwargs.pop(SEQUENCE_PARALLEL_KEY, None)
        index = kwargs.pop("packed_index")
        packed_ids = kwargs.pop("packed_input_ids", None)
        _check_packed_call(args, kwargs, packed_ids)
        labels, padded_ids, mask = _padded_inputs(kwargs)
        _refuse_router_loss_over_other_tokens(kwargs, packed_ids, mask)
        if kwargs.get(PREFIX_KEY) is not None:
            _check_prefix_attention(module, "shared-prompt", "shared_prompt")
        kwargs["input_ids"] = packed_ids
        kwargs["labels"] = pack_padded_labels(labels, index)
        shard = self._shard(module, kwargs, group) if sequence_parallel else None
        self._layout = (index, padded_ids.shape[0], padded_ids.shape[1], shard)
        return args, kwargs

    def _before_tree(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A prefix-tree call (``share_prefixes``): the row runs whole; a one-call hook on the backbone puts each
        target row's predictor in its place, and TRL's fused head scores them against pre-shifted labels."""
        kwargs = dict(kwargs)
        if SEQUENCE_PARALLEL_KEY in kwargs:
            raise ValueError(
                "sequence parallelism cuts a packed preference row into plain shards: a prefix-tree row "
                "(share_prefixes) cannot be cut exactly; set share_prefixes=False or train with sp_size=1"
            )
        index = kwargs.pop(TREE_INDEX_KEY)
        packed_ids = kwargs.pop("packed_input_ids", None)
        _check_packed_call(args, kwargs, packed_ids)
        labels, _, mask = _padded_inputs(kwargs)
        _refuse_router_loss_over_other_tokens(kwargs, packed_ids, mask)
        if kwargs.get(PREFIX_KEY) is None:
            raise ValueError(
                "a prefix-tree preference batch (tree_index) without prefix_seq_idx: every node would attend only "
                "to itself; pass the batch of PaddingFreePreferenceCollator(share_prefixes=True) whole"
            )
        _check_prefix_attention(module, "prefix-tree", "share_prefixes")
        model = base_model(module)
        backbone = getattr(model, "base_model", None)
        if not isinstance(backbone, torch.nn.Module) or backbone is model:
            raise ValueError(
                f"{type(model).__name__} has no separate backbone (base_model) whose hidden states TRL's fused LM "
                "head reads: a prefix-tree row's branch points cannot be scored; set share_prefixes=False"
            )
        targets = TreeTargets.from_index(index, labels, packed_ids.shape[-1])
        kwargs["input_ids"] = packed_ids
        kwargs.pop("labels")
        kwargs["shift_labels"] = targets.row_labels.to(labels.device)
        # (1, T, H) -> (1, T, H): row t holds the hidden state that predicts row t's token
        self._reorder.append(_gather_hidden_states(backbone, targets.predictor))
        self._tree = targets
        return args, kwargs

    def _after_tree(self, targets: TreeTargets, output: Any) -> Any:
        _remove(self._reorder)
        row = (1, targets.predictor.numel())
        for key, value in list(output.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == row:
                output[key] = targets.unpack(value)
        log_probs = output.get("log_probs")
        if isinstance(output.get("loss"), torch.Tensor) and isinstance(log_probs, torch.Tensor):
            # the fused head's mean over the padded layout's targets (a shared token counts once per sequence)
            scored = int((targets.gather < targets.predictor.numel()).sum())
            output["loss"] = -log_probs.sum() / max(scored, 1)
        return output

    @staticmethod
    def _shard(module: torch.nn.Module, kwargs: dict, group: Any) -> Any:
        """Replace the packed row in ``kwargs`` by this rank's shard of it (its targets as ``shift_labels``, the
        label shift across shard edges done on the whole row, as in SFT); return the shard."""
        if kwargs.get(PREFIX_KEY) is not None or kwargs.get("output_router_logits"):
            raise ValueError(
                "sequence parallelism cuts a packed preference row into shards: a router load-balancing loss "
                "(output_router_logits) is not a sum over shards, and a shared-prompt row (prefix_seq_idx) is not "
                "carried into the shards by this adapter (shard_packed_batch cuts a tree row exactly; the "
                "preference path over it is not verified yet); set shared_prompt=False and router_aux_loss_coef=0, "
                "or train with sp_size=1"
            )
        row = {key: kwargs.pop(key) for key in _ROW_KEYS if key in kwargs}
        shard = shard_packed_batch(row, group)
        check_sequence_parallel_model(base_model(module), shard[SHARD_KEY].size)
        kwargs.update(shard)  # input_ids, position_ids, shift_labels (1, T_rank), use_cache, the shard
        return shard[SHARD_KEY]

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        layout, self._layout = self._layout, None
        tree, self._tree = self._tree, None
        if tree is not None:
            return self._after_tree(tree, output)
        if layout is None:
            return None
        index, rows, width, shard = layout
        if shard is not None:
            _gather_row(output, shard)
        shifted = (1, index.numel() - 1)
        for key, value in list(output.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == shifted:
                output[key] = unpack_shifted(value, index, rows, width)
        return output


def _check_packed_call(args: tuple, kwargs: dict, packed_ids: Any) -> None:
    """A packed preference call: keyword arguments with the packed row, through TRL's fused LM head."""
    if args or packed_ids is None:
        raise ValueError(
            "a packed preference batch must be passed as keyword arguments with 'packed_input_ids' "
            f"(got {len(args)} positional argument(s), keys {sorted(kwargs)})"
        )
    if not kwargs.get("fused_lm_head"):
        raise ValueError(
            "a packed preference batch was passed to the model without fused_lm_head=True: only TRL's fused "
            "LM head (per-token log-probs) can be mapped back to the padded layout; logits of padding "
            "positions do not exist in a packed row. Call it the way trl.DPOTrainer does, or collate with "
            "trl's DataCollatorForPreference for padded logits"
        )
    if kwargs.get("shift_labels") is not None or kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "shift_labels / inputs_embeds cannot be combined with a packed preference batch (context "
            "parallelism and embedding inputs are not supported); use trl.DPOTrainer for them"
        )


def _padded_inputs(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Pop the padded ``input_ids`` and ``attention_mask`` of a packed call; return them with its ``labels``."""
    labels = kwargs.get("labels")
    padded_ids = kwargs.pop("input_ids", None)
    if not isinstance(labels, torch.Tensor) or not isinstance(padded_ids, torch.Tensor):
        raise ValueError(
            "a packed preference batch needs the padded 'input_ids' and 'labels' of shape (2B, L) next to "
            "'packed_input_ids' (TRL's DPOTrainer derives labels from input_ids and completion_mask)"
        )
    mask = kwargs.pop("attention_mask", None)  # it describes the padded layout; a packed row needs none
    return labels, padded_ids, mask


def _check_prefix_attention(module: torch.nn.Module, layout: str, option: str) -> None:
    """A row with ``prefix_seq_idx`` reaching a model whose attention ignores it (the branches would see each other)."""
    implementation = getattr(getattr(base_model(module), "config", None), "_attn_implementation", None)
    if implementation != ATTENTION_NAME:
        raise ValueError(
            f"a {layout} preference batch (prefix_seq_idx) reached a model running attn_implementation="
            f"{implementation!r}, which ignores the layout (chosen and rejected would see each other). Run "
            "it inside trainer.train()/evaluate() (which switch the attention), load the model with "
            f"attn_implementation=packing_hf.register_attention(), or set {option}=False"
        )


def _refuse_router_loss_over_other_tokens(kwargs: dict, packed_ids: torch.Tensor, mask: Any) -> None:
    """Refuse a router load-balancing loss (MoE: ``output_router_logits``, TRL's ``aux_loss`` of DPO/KTO) over a
    packed row that holds other tokens than the padded batch's real ones.

    Stock computes that loss over the tokens its ``attention_mask`` keeps; the packed row (no mask: every token
    routed) holds the same tokens unless it ends with padding (``pad_to_multiple_of`` / ``length_buckets``) or
    holds each pair's prompt once (``shared_prompt``), and the loss would then count other tokens.
    """
    # TRL asks for the router loss it adds to the DPO/KTO loss by this keyword (router_aux_loss_coef != 0)
    if not kwargs.get("output_router_logits") or not isinstance(mask, torch.Tensor):
        return
    real, packed = int(mask.sum()), int(packed_ids.shape[-1])
    if packed != real:
        raise ValueError(
            f"a packed preference row of {packed} tokens stands for a padded batch of {real} real tokens (padding "
            "from pad_to_multiple_of / length_buckets, or prompts held once by shared_prompt), and the model "
            "returns a router load-balancing loss (output_router_logits, TRL's aux_loss), which counts every "
            "token of the row: it would differ from stock's. Collate without pad_to_multiple_of / length_buckets "
            "and with shared_prompt=False, or set router_aux_loss_coef=0"
        )


def _gather_row(output: Any, shard: Any) -> None:
    """A sharded call's per-token outputs ``(1, T_rank, ...)`` as the whole row's ``(1, T - 1, ...)`` (the
    row's last token has no target), and the fused head's ``loss`` as the whole row's mean log-prob loss."""
    for key, value in list(output.items()):
        if (
            isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and tuple(value.shape[:2]) == (1, shard.length)
        ):
            output[key] = gather_shard_tokens(value, shard)[:, :-1]
    log_probs = output.get("log_probs")
    if isinstance(output.get("loss"), torch.Tensor) and isinstance(log_probs, torch.Tensor):
        targets = (shard.labels[:, 1:] != -100).sum().clamp(min=1).to(log_probs.device)
        output["loss"] = -log_probs.sum() / targets


class PackedRewardForward:
    """Hooks letting a sequence-classification ``model`` take a packed pair batch and return per-sequence scores.

    Acts only on calls holding ``packed_index`` (batches of
    :class:`~packing_hf.preference.PaddingFreeRewardCollator`). Before the forward the padded ``input_ids``
    ``(S, L)`` give the token every sequence is scored at (stock's rule: the last token that is neither
    padding nor ``config.pad_token_id``) and are swapped for the packed row; a hook on the ``score`` head
    keeps its per-token output ``(1, T, num_labels)``; after the forward ``logits`` become that output at
    those tokens, ``(S, num_labels)``.

    Args:
        model: the ``nn.Module`` the trainer calls (a ``PreTrainedModel`` or PEFT model with a ``score`` head).

    >>> import torch
    >>> class Scorer(torch.nn.Module):  # stands for a sequence-classification model
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.config = type("C", (), {"pad_token_id": 0})()
    ...         self.score = torch.nn.Identity()
    ...     def forward(self, input_ids, **kwargs):
    ...         return {"logits": self.score(input_ids[..., None].float())[:, -1]}
    >>> from packing_hf.preference import PaddingFreeRewardCollator
    >>> model = Scorer()
    >>> hooks = PackedRewardForward(model)
    >>> batch = PaddingFreeRewardCollator()([{"chosen_ids": [5, 6], "rejected_ids": [7, 8, 9]}])
    >>> model(**batch)["logits"].tolist()  # each sequence's last token
    [[6.0], [9.0]]
    >>> hooks.remove()
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        head = getattr(base_model(model), "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ValueError(
                f"{type(base_model(model)).__name__} has no `score` head: packed reward scores are read from the "
                "score head's per-token output before pooling. Use an AutoModelForSequenceClassification whose "
                "head is `score` (llama, qwen2, mistral, ...) or trl.RewardTrainer"
            )
        self._ends: torch.Tensor | None = None
        self._scores: torch.Tensor | None = None
        self._handles = [
            *_around(model, self._before, self._after),
            head.register_forward_hook(self._capture),
        ]

    def remove(self) -> None:
        """Remove the hooks (the model is as before)."""
        _remove(self._handles)

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self._ends, self._scores = None, None
        if "packed_index" not in kwargs:
            return None
        kwargs = dict(kwargs)
        kwargs.pop("packed_index")
        kwargs.pop("completion_mask", None)
        packed_ids = kwargs.pop("packed_input_ids", None)
        padded_ids = kwargs.pop("input_ids", None)
        mask = kwargs.pop("attention_mask", None)
        if args or packed_ids is None or padded_ids is None or kwargs.get("cu_seq_lens_q") is None:
            raise ValueError(
                "a packed reward batch must be passed as keyword arguments with packed_input_ids, input_ids and "
                "cu_seq_lens_q (build it with PaddingFreeRewardCollator)"
            )
        pad = getattr(base_model(module).config, "pad_token_id", None)
        if pad is None:
            raise ValueError(
                "config.pad_token_id is None: stock cannot score a padded batch without it (it pools at the last "
                "non-padding token); set model.config.pad_token_id = tokenizer.pad_token_id"
            )
        rows, width = padded_ids.shape
        real = padded_ids != pad
        if mask is not None:
            real &= mask.bool()
        # stock's pooling: the rightmost token that is not the pad id (0 if there is none)
        last = (torch.arange(width, device=real.device) * real).argmax(-1)  # (S,)
        starts = kwargs["cu_seq_lens_q"][:rows].to(last.device).long()  # sequences are segments, in order
        self._ends = starts + last
        kwargs["input_ids"] = packed_ids
        return args, kwargs

    def _capture(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if self._ends is not None:
            self._scores = output

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        ends, scores = self._ends, self._scores
        self._ends, self._scores = None, None
        if ends is None:
            return None
        if scores is None or scores.dim() != 3 or scores.shape[0] != 1:
            raise ValueError(
                "the score head did not run on the packed row (expected its (1, T, num_labels) output)"
            )
        output["logits"] = scores[0].index_select(0, ends.to(scores.device))  # (S, num_labels)
        return output


@contextlib.contextmanager
def head_inputs(head: torch.nn.Module):
    """For the duration, calls of ``head`` project nothing: the list it yields receives each call's input
    ``(B, T, H)`` and the head gets an empty ``(B, 0, H)`` slice of it (the model returns ``(B, 0, V)`` logits)."""
    captured: list[torch.Tensor] = []

    def keep(module: Any, args: tuple) -> tuple:
        captured.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()
