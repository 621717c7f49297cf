"""Prefix trees from tokenized samples: a trie whose shared prefixes one packed row stores and computes once.

Samples that begin with the same tokens (a system prompt, a conversation's earlier turns, a prompt and
its sampled completions) are merged into a tree of segments, laid out as one packed row with the
prefix-tree layout of :mod:`packing_hf.shared_prefix` (``prefix_seq_idx`` names every segment's parent;
packing_hf's attention lets each segment see its ancestors and itself, never its siblings). Every sample is
the tokens of a path from a root to the node where it ends, and every token of the row is computed once,
however many samples pass through it.

Branch-point semantics (the choices, tested in ``tests/unit/test_prefix_tree.py``):

- A node holds the longest run of tokens that all its samples share; its children start at the first
  token where they differ. No token is repeated: the last token of a parent is the *branch point*.
- Each token's logits belong to the node holding the token. The prediction of a sample's token ``j``
  (its label, in Hugging Face's shifted convention) is read from the logits of the sample's token
  ``j - 1``: the first token of a child is predicted at its parent's last token, whose one logits row
  serves every child, each child reading the log-probability of its own first token there
  (:meth:`PrefixTree.token_logprobs`). A sample's per-token logits and log-probabilities are therefore
  those of the sample alone, and a loss summed over samples counts a shared token once per sample.
- A sample that is a strict prefix of another ends at the end of a node that the other continues; two
  identical samples end at the same node (both read it); samples are given in any order, and the row
  orders siblings by the first sample reaching them, so shuffling changes the row, never a sample's values.
- ``min_shared_tokens``: a node shared by several samples is never shorter; a shorter common run is
  repeated in each of the groups that continue it (as if those samples shared nothing there). ``1``
  merges every common prefix.

Hybrid models (SSM, linear attention, short convolutions), once prepared, run every segment's mixer after
its ancestors' tokens; those where that is not proven exact are refused on a prefix-tree row by name
(:func:`packing_hf.attention.admission.prefix_tree_refusal`).

>>> tree = build_prefix_tree([[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8, 1]])
>>> tree.input_ids.tolist(), tree.cu_seqlens.tolist(), tree.prefix_seq_idx.tolist()
([5, 6, 7, 8, 1, 9], [0, 2, 4, 5, 6], [-1, 0, 1, 0])
>>> tree.position_ids.tolist()  # every segment continues its parent
[0, 1, 2, 3, 4, 2]
>>> [rows.tolist() for rows in tree.sample_rows()]  # the row tokens of every sample, in order
[[0, 1, 2, 3], [0, 1, 5], [0, 1, 2, 3, 4]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .loss_head import default_chunk_size
from .shared_prefix import PREFIX_KEY, shared_prefix_position_ids
from .varlen import check_int32_tokens

__all__ = ["PrefixTree", "build_prefix_tree", "picked_log_probs"]


@dataclass(frozen=True)
class PrefixTree:
    """One packed row holding samples as root-to-node paths of a prefix tree.

    Attributes:
        input_ids: ``(T,)`` int64 the row's tokens, every node's once (parents before children).
        cu_seqlens: ``(n + 1,)`` int32 the node (segment) boundaries.
        prefix_seq_idx: ``(n,)`` int32 every node's parent segment, ``-1`` for a root.
        position_ids: ``(T,)`` int64 positions, continuing from the parent's end in every node.
        sample_index: ``(sum of sample lengths,)`` int64 the row token of every token of every sample,
            samples concatenated in the order they were given.
        sample_cu: ``(S + 1,)`` int64 where each sample's tokens start in ``sample_index``.
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    prefix_seq_idx: torch.Tensor
    position_ids: torch.Tensor
    sample_index: torch.Tensor
    sample_cu: torch.Tensor

    @property
    def num_samples(self) -> int:
        return self.sample_cu.numel() - 1

    @property
    def token_ratio(self) -> float:
        """Tokens of the samples run alone over tokens of the row (``>= 1``; ``2.0``: half as many computed)."""
        return self.sample_index.numel() / max(self.input_ids.numel(), 1)

    def model_inputs(self) -> dict[str, torch.Tensor | int]:
        """The row as keyword arguments of a model loaded with ``attn_implementation=
        packing_hf.register_attention()``: ``input_ids`` and ``position_ids`` ``(1, T)``, ``cu_seq_lens_q/k``,
        ``max_length_q/k``, ``prefix_seq_idx``.

        >>> sorted(build_prefix_tree([[1, 2], [1, 3]]).model_inputs())
        ['cu_seq_lens_k', 'cu_seq_lens_q', 'input_ids', 'max_length_k', 'max_length_q', 'position_ids', 'prefix_seq_idx']
        """
        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return {
            "input_ids": self.input_ids[None],
            "position_ids": self.position_ids[None],
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": longest,
            "max_length_k": longest,
            PREFIX_KEY: self.prefix_seq_idx,
        }

    def sample_rows(self) -> list[torch.Tensor]:
        """Per sample, ``(L_s,)`` int64: the row token holding each of its tokens."""
        return list(torch.split(self.sample_index, torch.diff(self.sample_cu).tolist()))

    def sample_values(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per sample, ``(L_s, ...)``: the rows of ``values`` (logits, hidden states) that are its tokens'.

        Args:
            values: ``(T, ...)`` or ``(1, T, ...)`` per row token (a model's ``logits``).

        Returns:
            One tensor per sample, in the order given; equal to what the sample alone computes.
        """
        values = self._row(values, "values")
        return list(torch.split(values.index_select(0, self.sample_index.to(values.device)), self._lengths()))

    def token_logprobs(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Per sample, ``(L_s - 1,)``: the log-probability of each of its tokens after the first, given the
        tokens before it, as the sample alone computes it (the branch point's row serves every child).

        The log-softmax normaliser is computed once per row token, never once per sample passing through it, and
        the ``(T, V)`` log-softmax never exists: each log-probability is its target's logit minus its row's
        log-sum-exp, taken in chunks of rows (fp32, from logits of any dtype). The backward keeps the logits and
        the ``(T,)`` normalisers and writes the logits' gradient, ``(T, V)`` in their dtype, chunk by chunk.

        Args:
            logits: ``(T, V)`` or ``(1, T, V)`` the model's logits on :meth:`model_inputs`.

        Returns:
            One ``(L_s - 1,)`` float32 tensor per sample, in the order given.

        >>> tree = build_prefix_tree([[0, 1], [0, 2]])
        >>> logits = torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        >>> [round(float(lp.exp()), 3) for lp in tree.token_logprobs(logits)]  # both read row 0
        [0.107, 0.787]
        """
        rows, targets = self._predictions()
        picked = picked_log_probs(self._row(logits, "logits"), rows, targets)  # (sum of L_s - 1,)
        return list(torch.split(picked, [n - 1 for n in self._lengths()]))

    def _lengths(self) -> list[int]:
        return torch.diff(self.sample_cu).tolist()

    def _predictions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, targets)``: for every token after a sample's first, the row that predicts it and its id."""
        keep = torch.ones(self.sample_index.numel(), dtype=torch.bool)
        keep[self.sample_cu[:-1]] = False  # a sample's first token is predicted by nothing
        before = torch.roll(self.sample_index, 1)  # the row of each sample's previous token
        return before[keep], self.input_ids[self.sample_index[keep]]

    def _row(self, values: torch.Tensor, name: str) -> torch.Tensor:
        total = self.input_ids.numel()
        if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == total:
            values = values[0]
        if values.shape[0] != total:
            raise ValueError(
                f"{name} of shape {tuple(values.shape)} does not match the tree's row of {total} tokens; pass "
                "the model's output on PrefixTree.model_inputs(), (T, ...) or (1, T, ...)"
            )
        return values


def picked_log_probs(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits.float())[rows, targets]`` ``(P,)`` float32, without the ``(T, V)`` log-softmax: a
    target's logit minus its row's log-sum-exp, computed once per row in chunks (see
    :meth:`PrefixTree.token_logprobs`). Differentiable in ``logits`` ``(T, V)``; ``rows``, ``targets`` ``(P,)`` int64.

    >>> logits = torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    >>> [round(float(p), 3) for p in picked_log_probs(logits, torch.tensor([0, 0]), torch.tensor([1, 2])).exp()]
    [0.107, 0.787]
    """
    device = logits.device
    chunk = default_chunk_size(logits.shape[-1], device)
    return _PickedLogProbs.apply(logits, rows.to(device), targets.to(device), chunk)


class _PickedLogProbs(torch.autograd.Function):
    """``log_softmax(logits)[rows, targets]`` without the ``(T, V)`` log-softmax: a target's logit minus its row's
    log-sum-exp, both in fp32, the rows taken ``chunk`` at a time (``torch.logsumexp`` of the whole would hold a
    ``(T, V)`` temporary, and its backward and an indexing's each another, summed into a third).

    Saved for backward: the logits themselves and the ``(T,)`` normalisers. The gradient of row ``t`` is
    ``onehot(targets) * g - softmax(logits[t]) * sum(g)`` over the pairs reading row ``t``, written chunk by chunk
    into one ``(T, V)`` tensor of the logits' dtype (pairs of one row and target add up, in fp32).
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        normaliser = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)  # (T,)
        for start in range(0, logits.shape[0], chunk):
            normaliser[start : start + chunk] = torch.logsumexp(logits[start : start + chunk].float(), dim=-1)
        ctx.save_for_backward(logits, normaliser, rows, targets)
        ctx.chunk = chunk
        return logits[rows, targets].float() - normaliser[rows]  # (P,)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        logits, normaliser, rows, targets = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad = grad.float()
        per_row = torch.zeros_like(normaliser).index_add_(0, rows, grad)  # (T,) every row's summed g
        order = torch.argsort(rows)  # the pairs by row, so that each chunk reads its own
        rows, targets, grad = rows[order], targets[order], grad[order]
        starts = torch.arange(0, logits.shape[0] + ctx.chunk, ctx.chunk, device=rows.device)
        bounds = torch.searchsorted(rows, starts).tolist()  # the pairs of every chunk (one read back)
        out = torch.empty_like(logits)  # (T, V)
        for i, start in enumerate(range(0, logits.shape[0], ctx.chunk)):
            stop = min(start + ctx.chunk, logits.shape[0])
            block = (logits[start:stop].float() - normaliser[start:stop, None]).exp_()  # (chunk, V) softmax
            block.mul_(-per_row[start:stop, None])
            a, b = bounds[i], bounds[i + 1]
            block.index_put_((rows[a:b] - start, targets[a:b]), grad[a:b], accumulate=True)
            out[start:stop] = block
        return out, None, None, None


def _as_token_arrays(samples: Sequence) -> list[np.ndarray]:
    if isinstance(samples, torch.Tensor | np.ndarray) or not isinstance(samples, Sequence):
        raise TypeError(
            f"samples must be a sequence of token id sequences (lists, arrays or 1-D tensors), got "
            f"{type(samples).__name__}"
        )
    if not samples:
        raise ValueError("samples is empty; give at least one tokenized sample")
    tokens = []
    for i, sample in enumerate(samples):
        array = sample.cpu().numpy() if isinstance(sample, torch.Tensor) else np.asarray(sample)
        if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
            raise TypeError(
                f"samples[{i}] must be a 1-D sequence of token ids (ints), got shape {array.shape} of "
                f"{array.dtype}"
            )
        if array.size == 0:
            raise ValueError(f"samples[{i}] has no tokens; drop empty samples before building the tree")
        tokens.append(array.astype(np.int64))
    return tokens


def _common_run(tokens: list[np.ndarray], group: list[int], depth: int) -> int:
    """How many tokens from ``depth`` on every sample of ``group`` shares."""
    limit = min(len(tokens[s]) for s in group) - depth
    block = np.stack([tokens[s][depth : depth + limit] for s in group])  # (samples, limit)
    differs = np.flatnonzero((block != block[0]).any(axis=0))
    return int(differs[0]) if differs.size else limit


def _split(tokens: list[np.ndarray], group: list[int], at: int) -> list[list[int]]:
    """``group`` cut by the token at ``at`` (first-seen order); a sample ending there is a group of its own."""
    groups: dict[object, list[int]] = {}
    for s in group:
        key = ("end", s) if len(tokens[s]) == at else int(tokens[s][at])
        groups.setdefault(key, []).append(s)
    return list(groups.values())


def build_prefix_tree(samples: Sequence, *, min_shared_tokens: int = 1) -> PrefixTree:
    """Merge the common token prefixes of ``samples`` into one prefix-tree packed row.

    Args:
        samples: ``S`` tokenized samples (lists, arrays or 1-D tensors of ids, each non-empty), in any order.
        min_shared_tokens: the shortest run of tokens a node shared by several samples may hold (>= 1); a
            shorter common run is repeated in every group continuing it. See the module docstring for what
            each node and each label holds.

    Returns:
        A :class:`PrefixTree`: the row (``model_inputs()``), and every sample's tokens in it.

    Raises:
        ValueError / TypeError: no samples, an empty or non-integer sample, ``min_shared_tokens < 1``, or a
            row over int32 tokens.

    >>> tree = build_prefix_tree([[1, 2, 3], [1, 2, 3], [1, 2]])  # duplicates, and a strict prefix
    >>> tree.cu_seqlens.tolist(), tree.prefix_seq_idx.tolist(), round(tree.token_ratio, 2)
    ([0, 2, 3], [-1, 0], 2.67)
    >>> build_prefix_tree([[1, 2, 3], [1, 2, 4]], min_shared_tokens=3).prefix_seq_idx.tolist()  # too short
    [-1, -1]
    """
    if isinstance(min_shared_tokens, bool) or not isinstance(min_shared_tokens, int) or min_shared_tokens < 1:
        raise ValueError(
            f"min_shared_tokens={min_shared_tokens!r}: give an int >= 1 (1 merges every common prefix)"
        )
    tokens = _as_token_arrays(samples)
    check_int32_tokens(sum(len(t) for t in tokens), "the samples of a prefix tree")
    nodes: list[tuple[int, int, int]] = []  # (sample whose tokens it holds, start, end) per node
    parents: list[int] = []
    paths: list[list[int]] = [[] for _ in tokens]  # every sample's nodes, root first
    # depth first, children in first-seen order, so that every parent precedes its children in the row
    stack: list[tuple[list[int], int, int]] = [(list(range(len(tokens))), 0, -1)]
    while stack:
        group, depth, parent = stack.pop()
        run = len(tokens[group[0]]) - depth if len(group) == 1 else _common_run(tokens, group, depth)
        if len(group) > 1 and run < min_shared_tokens:
            # too short to share (or nothing in common): each group continuing differently gets its own copy
            stack.extend((g, depth, parent) for g in reversed(_split(tokens, group, depth + run)))
            continue
        node = len(nodes)
        nodes.append((group[0], depth, depth + run))
        parents.append(parent)
        for s in group:
            paths[s].append(node)
        rest = [s for s in group if len(tokens[s]) > depth + run]
        if rest:
            stack.append((rest, depth + run, node))
    lengths = [end - start for _, start, end in nodes]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    input_ids = torch.from_numpy(np.concatenate([tokens[s][a:b] for s, a, b in nodes]))
    cu_seqlens = torch.from_numpy(starts).to(torch.int32)
    prefix_seq_idx = torch.tensor(parents, dtype=torch.int32)
    index = [np.arange(starts[n], starts[n + 1]) for path in paths for n in path]
    return PrefixTree(
        input_ids=input_ids,
        cu_seqlens=cu_seqlens,
        prefix_seq_idx=prefix_seq_idx,
        position_ids=shared_prefix_position_ids(cu_seqlens, prefix_seq_idx),
        sample_index=torch.from_numpy(np.concatenate(index).astype(np.int64)),
        sample_cu=torch.tensor([0, *np.cumsum([len(t) for t in tokens]).tolist()], dtype=torch.int64),
    )
