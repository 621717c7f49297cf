"""Sequence parallelism over packed rows, Ulysses style: cut a packed row over the ranks of a group, train on
the shards, get the loss and gradients of the whole row.

Every rank of a sequence-parallel (SP) group holds the same packed ``[1, T]`` row (the multipack sampler's
rank is the data-parallel rank). :func:`shard_packed_batch` checks the row whole, shifts its labels whole
(the target of a shard's last token is the next shard's first token), and keeps this rank's contiguous
shard of ``input_ids`` / ``position_ids`` / ``shift_labels``, with a
:class:`~packing_hf.attention.ulysses.SequenceShard` carrying the row's boundaries. The model runs on the
shard; its attention layers (``attn_implementation=packing_hf.ATTENTION_NAME``) see the whole row for
``H / sp`` heads (:mod:`packing_hf.attention.ulysses`). The loss of the shards is loss arithmetic, beside the
rest of it: :mod:`packing_hf.shard_loss` gives each rank its targets' share of the row's loss under any
``loss_normalization`` / ``loss_weights`` (the shares add up to the one-process loss, and the gradients summed
over the group are the one-process gradients). :func:`gather_shard_tokens` sums per-token values of the
group's shards back into the whole row (a loss every rank computes from the whole row: DPO's).

A prefix-tree row (``prefix_seq_idx``, :mod:`packing_hf.prefix_tree`) is cut like any row, wherever the cuts
fall (a parent on one rank, its children on another): ``prefix_seq_idx`` names segments of the whole row and
rides in every shard; the attention, which holds the whole row for its heads, gathers every segment's
ancestor keys from the whole row's ``cu_seq_lens`` exactly as one process does; the positions are the row's
(continuing each parent's); and the row's labels are ``-100`` at every segment start (checked whole), so the
whole-row label shift gives every token the target it has inside its own segment. What a row's shifted labels
cannot hold, a branch point predicting the first token of each of several children, is no part of such a row
(read it from the logits of the branch point, :meth:`packing_hf.prefix_tree.PrefixTree.token_logprobs`).

What cannot be exact is refused by name (:func:`check_sequence_parallel_model`): token mixers (SSM,
DeltaNet, convolutions) need whole samples; models whose attention is not packing_hf's would attend within
the shard only.

>>> shard_lengths(5, 2)
[3, 2]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._loss import LOSS_WEIGHTS_KEY
from ..registry import router_loss_coefficient, support
from ..varlen import IGNORE_INDEX, PADDING_KEY, position_ids_to_cu_seqlens
from .admission import needs_preparation, preparation_of
from .guards import validate_packed_batch
from .interface import ATTENTION_NAME
from .prefix import PREFIX_KEY
from .ulysses import SHARD_KEY, SequenceShard, shard_lengths

__all__ = [
    "SHARD_KEY",
    "SequenceShard",
    "check_sequence_parallel_model",
    "check_sequence_parallel_router_loss",
    "gather_shard_tokens",
    "sequence_parallel_groups",
    "sequence_parallel_mesh",
    "shard_lengths",
    "shard_packed_batch",
]

# the per-token keys a shard keeps (cut), the keys consumed into the shard, and what else it may carry
_CONSUMED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "labels", LOSS_WEIGHTS_KEY)


def check_sequence_parallel_router_loss(config: Any, sp_size: int, model: Any = None) -> None:
    """Refuse, by name, a model whose own loss adds a router load-balancing loss (MoE, ``output_router_logits``
    with ``router_aux_loss_coef != 0``) to a loss that sequence parallelism computes from each shard's logits.

    The shards' losses add up to the row's cross-entropy, but not the router loss: it multiplies, per expert, the
    fraction of the row's tokens routed to it by their mean router probability, two means over the whole row
    that no rank holds. Computed per shard it would differ; left out (the shard's loss is its logits' alone) the
    step would silently train without it.

    >>> from types import SimpleNamespace
    >>> check_sequence_parallel_router_loss(SimpleNamespace(output_router_logits=False), 2)
    """
    coefficient = router_loss_coefficient(config, model)
    if coefficient == 0.0:
        return
    model_type = getattr(config, "model_type", type(config).__name__)
    raise ValueError(
        f"{model_type}: sequence parallelism (sp_size={sp_size}) computes the loss from each shard's logits, and "
        f"this model adds a router load-balancing loss to its own (output_router_logits=True, router_aux_loss_coef="
        f"{coefficient}), which is not a sum over shards (per expert: the row's share of tokens routed to it times "
        "their mean router probability): it would be left out of the step. Set output_router_logits=False (or "
        "router_aux_loss_coef=0), or train with sp_size=1"
    )


def check_sequence_parallel_model(model: torch.nn.Module, sp_size: int) -> None:
    """Refuse, by name and with the fix, a model whose packed rows cannot be split over ``sp_size`` ranks exactly.

    A model qualifies when it runs packing_hf's varlen attention (the layers the shard's all-to-alls live in),
    has no token mixer (a state-space / DeltaNet / convolution layer carries state along the whole sample,
    which a shard does not hold) and splits its heads over ``sp_size`` (query heads divisible by ``sp_size``;
    key/value heads divisible by it, or dividing it: they are then repeated).

    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    >>> check_sequence_parallel_model(model, 2)
    Traceback (most recent call last):
    ...
    ValueError: sequence parallelism (sp_size=2) runs inside packing_hf's varlen attention, but the model uses attn_implementation='sdpa', which would attend within each rank's shard only; load it with attn_implementation=packing_hf.register_attention()
    """
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != ATTENTION_NAME:
        raise ValueError(
            f"sequence parallelism (sp_size={sp_size}) runs inside packing_hf's varlen attention, but the model "
            f"uses attn_implementation={implementation!r}, which would attend within each rank's shard only; "
            "load it with attn_implementation=packing_hf.register_attention()"
        )
    entry = support(str(getattr(text, "model_type", "")))
    if entry.status == "mixers" or entry.split_stack:
        raise ValueError(
            f"{entry.model_type}: sequence parallelism cannot split its packed rows: its token mixers ({entry.reason}) "
            "run along whole samples, which a rank's shard does not hold; train it with data parallelism only "
            "(sp_size=1)"
        )
    reason = needs_preparation(config, varlen=True, preparation=preparation_of(model))
    if reason is not None or entry.own_attention or entry.status == "refused":
        raise ValueError(
            f"{entry.model_type}: sequence parallelism needs a model whose attention layers all dispatch to "
            f"packing_hf's varlen attention ({reason or entry.reason}); train it with sp_size=1"
        )
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % sp_size or (kv_heads % sp_size and sp_size % kv_heads):
        raise ValueError(
            f"sequence parallelism splits the attention heads over the ranks: sp_size={sp_size} must divide the "
            f"{heads} query heads and divide (or be a multiple of) the {kv_heads} key/value heads; choose another "
            "sp_size"
        )


def sequence_parallel_groups(sp_size: int) -> tuple[Any, int, int, int]:
    """The sequence-parallel group of this process: ``(group, sp_rank, dp_rank, dp_size)``.

    The world is cut into ``world / sp_size`` groups of consecutive ranks (``0..sp-1``, ``sp..2sp-1``, ...): the
    ranks of a group hold one row together, the groups are the data-parallel replicas: the ``"sp"`` and
    ``"dp"`` dimensions of :func:`sequence_parallel_mesh`, which builds them. Every process must call it
    (collective). Needs ``torch.distributed`` initialised: on 4 processes, ``sequence_parallel_groups(2)`` on
    rank 3 returns ``(the group of ranks 2 and 3, 1, 1, 2)`` (``tests/distributed/_sp_worker.py`` runs it).
    """
    mesh = sequence_parallel_mesh(sp_size)
    return mesh.get_group("sp"), mesh.get_local_rank("sp"), mesh.get_local_rank("dp"), mesh.size(0)


def sequence_parallel_mesh(sp_size: int, device_type: str | None = None) -> Any:
    """The world as a ``(dp, sp)`` :class:`~torch.distributed.device_mesh.DeviceMesh`: the sequence-parallel
    groups along ``"sp"`` (consecutive ranks), the data-parallel replicas along ``"dp"``. The one builder of this
    layout: :func:`sequence_parallel_groups` and the trainers'
    :class:`~packing_hf.integrations.parallel.ParallelPlan` take their groups from it.

    ``mesh.get_group("sp")`` is the group to pass to :func:`shard_packed_batch`; ``mesh.get_local_rank("dp")`` and
    ``mesh.size(0)`` are the multipack sampler's ``rank`` / ``num_replicas``. FSDP2 shards over it either way:
    ``fully_shard(model, mesh=mesh._flatten())`` (every process: parameters, gradients and optimizer states
    ``1 / world`` per process) or ``fully_shard(model, mesh=mesh)`` (HSDP: sharded over each SP group, replicated
    over ``"dp"``); the gradients are summed over every process in both, which is what the shards' losses need.
    Every process must call it (collective). ``device_type``: ``"cuda"`` under NCCL, else ``"cpu"`` (default: from
    the default group's backend). ``tests/distributed/_fsdp_worker.py`` runs it under ``fully_shard``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if sp_size < 1 or world % sp_size:
        raise ValueError(
            f"sp_size={sp_size} must divide the number of processes ({world}): every data-parallel replica is "
            "a group of sp_size processes"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))


def _row_boundaries(batch: dict, total: int) -> torch.Tensor:
    cu = batch.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        return cu.to(torch.int32).cpu()
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor):
        return position_ids_to_cu_seqlens(positions.cpu())
    return torch.tensor([0, total], dtype=torch.int32)


def _collective_device(group: Any) -> torch.device:
    """Where a small tensor for a collective over ``group`` must live: NCCL takes only CUDA tensors (the
    process's current device), gloo CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_same_row(batch: dict, cu: torch.Tensor, group: Any) -> None:
    """Every rank of the group must hold the same row (the sampler's rank must be the data-parallel rank)."""
    ids = batch["input_ids"].reshape(-1).long().cpu()
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64)
    summary = [ids.numel(), cu.numel(), int((ids * weights).sum()), int(cu.long().sum())]
    parents = batch.get(PREFIX_KEY)
    if isinstance(parents, torch.Tensor):  # a tree row: the same parents too
        summary.append(int((parents.long().cpu() * torch.arange(1, parents.numel() + 1)).sum()))
    mine = torch.tensor(summary, device=_collective_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if any(not torch.equal(other, mine) for other in everyone):
        raise ValueError(
            "the ranks of a sequence-parallel group hold different packed rows, so their shards do not form one "
            "row; give every rank of the group the same batch (a multipack sampler whose num_replicas / rank are "
            "the data-parallel world size / rank, not the process's)"
        )


def shard_packed_batch(batch: dict, group: Any = None, *, local_only: bool = False) -> dict:
    """This rank's shard of a packed ``[1, T]`` row, ready for ``model(**shard)``.

    Args:
        batch: the whole row, as :class:`packing_hf.PaddingFreeCollator` builds it: ``input_ids`` ``(1, T)``,
            ``position_ids`` ``(1, T)`` restarting per sample, optionally ``cu_seq_lens_q/k``, ``max_length_q/k``,
            ``labels`` ``(1, T)`` and ``loss_weights`` ``(1, T)``; a prefix-tree row's ``prefix_seq_idx``
            ``(n,)`` (carried into every shard, see the module docstring). Checked whole (``validate_packed_batch``).
        group: the sequence-parallel process group (``None``: the default group), whose ranks all pass the same
            row (checked: one small all-gather).
        local_only: negative control: each shard attends within its own tokens only (not exact).

    Returns:
        ``input_ids`` / ``position_ids`` ``(1, T_rank)`` (the row's own positions, so rotary embeddings are those
        of the row), ``shift_labels`` ``(1, T_rank)`` (``shift_labels[t] = labels[t + 1]`` of the whole row; the
        row's last target is ``-100``), ``use_cache=False``, the :class:`SequenceShard` under :data:`SHARD_KEY`
        (the row's boundaries, labels and loss weights), and any non-token entries of ``batch``.

    Raises:
        ValueError: a row that is not one packed ``[1, T]`` row, with other per-token entries it cannot cut, or
            different across the group's ranks. A row shorter than the group (a stream's one-token padding batch)
            is lengthened with one-token samples that have no target, so that every rank holds a token.

    >>> from packing_hf import PaddingFreeCollator
    >>> row = PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    >>> shard = shard_packed_batch(row)  # one process (no process group): the whole row
    >>> shard["input_ids"].tolist(), shard["shift_labels"].tolist()
    ([[5, 6, 7, 8, 9]], [[6, 7, -100, 9, -100]])
    """
    if dist.is_available() and dist.is_initialized():
        size, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        size, rank = 1, 0
    checked = _checked_row(batch)
    total = int(checked["input_ids"].shape[1])
    padding = checked.get(PADDING_KEY)
    first_padding = total - int(padding) if padding is not None else total
    if total < size:  # a stream's one-token padding batch, or a tiny row: no rank may be left without a token
        checked = _lengthen_row(checked, size)
        total = size
    lengths = shard_lengths(total, size)
    cu = _row_boundaries(checked, total)
    positions = checked.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        positions = torch.arange(total).unsqueeze(0)
    if size > 1:
        _check_same_row(checked, cu, group)
    labels = checked.get("labels")
    weights = checked.get(LOSS_WEIGHTS_KEY)
    shard = SequenceShard(group, rank, lengths, cu, positions.reshape(1, -1), local_only=local_only)
    shard.labels, shard.loss_weights = labels, weights
    begin, end = shard.offset, shard.offset + shard.length
    out: dict[str, Any] = {}
    for key, value in checked.items():
        if key in _CONSUMED:
            continue
        if key in ("input_ids", "position_ids"):
            out[key] = value[:, begin:end]
        elif key == PADDING_KEY:
            # this shard's part of the padding closing the row (one-token samples added by _lengthen_row follow it)
            out[key] = torch.tensor(max(0, end - max(begin, first_padding)))
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (1, total):
            raise ValueError(
                f"the batch's {key!r} {tuple(value.shape)} is per token, and sequence parallelism does not know how "
                "to cut it over the ranks; drop it from the batch (or train with sp_size=1)"
            )
        else:
            out[key] = value
    if "position_ids" not in out:
        out["position_ids"] = positions.reshape(1, -1)[:, begin:end]
    if isinstance(labels, torch.Tensor):
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (1, T): the target of every token
        out["shift_labels"] = shifted[:, begin:end]
    out["use_cache"] = False
    out[SHARD_KEY] = shard
    return out


def _checked_row(batch: dict) -> dict:
    """``batch`` as one checked packed ``[1, T]`` row (``validate_packed_batch``) that has none of the keys
    sequence parallelism derives itself."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
        raise ValueError(
            f"sequence parallelism cuts one packed row of input_ids (1, T), got {shape}; collate with "
            "packing_hf.PaddingFreeCollator (inputs_embeds and several rows are not supported)"
        )
    checked = validate_packed_batch(batch)
    for key in ("shift_labels", "seq_idx"):
        if checked.get(key) is not None:
            raise ValueError(
                f"the batch already has {key!r}; sequence parallelism computes what it needs from the whole row "
                "(labels, position_ids): pass the row as the collator built it"
            )
    return checked


def _lengthen_row(batch: dict, size: int) -> dict:
    """A row of ``T < size`` tokens as ``size`` tokens: ``size - T`` one-token samples appended (the row's last
    id, position 0, no target, weight 0), which attend to nothing but themselves and add nothing to the loss
    or its counts; every rank then holds a token."""
    ids = batch["input_ids"]
    total, extra = int(ids.shape[1]), size - int(ids.shape[1])
    out = dict(batch)
    for key, value in batch.items():
        if key in ("input_ids", "position_ids", "labels", LOSS_WEIGHTS_KEY):
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (1, total):
            raise ValueError(
                f"the batch's {key!r} {tuple(value.shape)} is per token, and a row of {total} token(s) shorter "
                f"than the sequence-parallel group ({size}) is lengthened with samples of one token, which "
                f"{key!r} would not cover; drop it from the batch (or raise max_tokens_per_batch)"
            )
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        positions = torch.arange(total, device=ids.device).unsqueeze(0)
    out["input_ids"] = torch.cat([ids, ids[:, -1:].expand(1, extra)], dim=1)
    out["position_ids"] = torch.cat([positions, positions.new_zeros(1, extra)], dim=1)
    cu = _row_boundaries(batch, total)
    cu = torch.cat([cu, cu[-1] + torch.arange(1, extra + 1, dtype=cu.dtype)])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        out[key] = cu.to(ids.device)
    for key in ("max_length_q", "max_length_k"):
        out[key] = max(int(batch.get(key) or 1), 1)
    for key, fill in (("labels", IGNORE_INDEX), (LOSS_WEIGHTS_KEY, 0)):
        if isinstance(batch.get(key), torch.Tensor):
            out[key] = torch.cat([batch[key], batch[key].new_full((1, extra), fill)], dim=1)
    if isinstance(batch.get(PREFIX_KEY), torch.Tensor):  # the added samples are roots of their own
        parents = batch[PREFIX_KEY]
        out[PREFIX_KEY] = torch.cat([parents, parents.new_full((extra,), -1)])
    return out


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group``, forward and backward: every rank of the group computes the same loss
    from the sum, so each rank's gradient of its own addend is the group's summed gradient of the sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def gather_shard_tokens(values: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """The whole row's per-token ``values`` from every rank's shard: ``(1, T_rank, ...)`` -> ``(1, T, ...)``.

    Each rank places its tokens at their offset in a row of zeros and the group all-reduces the rows (``x + 0``
    is exact, so every rank gets the row one process computes). Autograd-correct for a loss every rank of the
    group computes alike from the whole row (a preference loss over per-sample sums): the backward sums the
    group's gradients, so this rank's tokens get ``sp`` times their share, which DDP's average over the
    ``dp x sp`` processes turns back into the data-parallel gradient. Non-float values are gathered without
    gradient.

    Args:
        values: ``(1, T_rank, ...)`` this rank's per-token values (``shard.length`` tokens).
        shard: this rank's :class:`SequenceShard`.

    Returns:
        ``(1, T, ...)`` with ``T = sum(shard.lengths)``; ``values`` itself on a group of one.

    >>> shard = SequenceShard(None, 0, [3], torch.tensor([0, 3], dtype=torch.int32), torch.tensor([[0, 1, 2]]))
    >>> gather_shard_tokens(torch.tensor([[1.0, 2.0, 3.0]]), shard).tolist()  # one process: the row itself
    [[1.0, 2.0, 3.0]]
    """
    if values.dim() < 2 or tuple(values.shape[:2]) != (1, shard.length):
        raise ValueError(
            f"{shard!r}: per-token values of shape {tuple(values.shape)} are not (1, {shard.length}, ...), one value "
            "per token of this rank's shard"
        )
    if shard.size == 1:
        return values
    rest = tuple(values.shape[2:])
    before = values.new_zeros((1, shard.offset, *rest))
    after = values.new_zeros((1, sum(shard.lengths) - shard.offset - shard.length, *rest))
    row = torch.cat([before, values, after], dim=1)  # (1, T, ...): this rank's tokens, zeros elsewhere
    if row.is_floating_point():
        return _SumOverGroup.apply(row, shard.group)
    counts = row.detach().long()
    dist.all_reduce(counts, group=shard.group)
    return counts.to(values.dtype)
