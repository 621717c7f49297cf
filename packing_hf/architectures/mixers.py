"""Per-sample token mixers: run every non-attention mixer of a packed row on its samples, right-padded.

State-space layers (Mamba, Mamba2/SSD), gated DeltaNet, KDA, lightning attention, RG-LRU blocks and short
causal convolutions carry a state or a convolution window along the sequence, whatever the attention mask
says: on a packed row ``[1, T]`` the last tokens of one sample flow into the next. Every one of them is
causal and starts from a zero state, so on a *right-padded* batch each real token sees exactly its own
sample's earlier tokens. :class:`MixerRepacking` uses that: a forward pre-hook on each mixer module turns
its packed input ``(B, T, ...)`` into a right-padded batch ``(n, L, ...)`` (one row per sample, ``L`` the
longest sample), and a forward hook gathers the real tokens of the output back to ``(B, T, ...)``. The
mixer itself is transformers' own code, untouched; the gather indices are computed once per packed forward
and shared by every layer. Padding tokens are zeros placed *after* each sample, so they never reach a real
token (causality), and no padding mask is needed.

The hooks act only on packed forwards (the model pre-hook of :mod:`packing_hf.architectures.prepare`
found sample boundaries); padded batches and ``generate()`` pass through untouched.

>>> starts = torch.tensor([[True, False, False, True, False]])  # samples of 3 and 2 tokens
>>> layout = PackedLayout.from_starts(starts)
>>> layout.samples, layout.longest, layout.index.tolist()
(2, 3, [0, 1, 2, 3, 4])
>>> x = torch.arange(5.0).reshape(1, 5, 1)
>>> layout.pad(x)[..., 0].tolist()
[[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]
>>> torch.equal(layout.unpad(layout.pad(x)), x)
True
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MASK_ARGUMENTS", "PACKED_ONLY_ARGUMENTS", "MixerRepacking", "PackedLayout", "find_mixers"]

# arguments describing padding of the packed row: the padded batch has its own (trailing zeros, no mask)
MASK_ARGUMENTS = frozenset({"attention_mask", "conv_mask", "causal_mask", "mask"})
# arguments describing the packed row as one sequence: meaningless (and refused by transformers' torch
# fallbacks, which raise on cu_seqlens / seq_idx) once the samples are rows of their own
PACKED_ONLY_ARGUMENTS = frozenset(
    {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens"}
)


@dataclass(frozen=True)
class PackedLayout:
    """Where every token of packed rows goes in the right-padded batch of their samples.

    Attributes:
        rows: ``B``, packed rows in the batch.
        tokens: ``T``, tokens per packed row.
        samples: ``n``, samples over all rows.
        longest: ``L``, tokens of the longest sample.
        index: ``(B * T,)`` int64: the flat slot ``sample * L + offset`` of every packed token.
    """

    rows: int
    tokens: int
    samples: int
    longest: int
    index: torch.Tensor

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> PackedLayout:
        """The layout of packed rows from their ``(B, T)`` bool sample starts (one host sync).

        Every row starts a sample at its first token, marked or not.
        """
        rows, tokens = starts.shape
        first = starts.clone()
        first[:, 0] = True
        flat = first.reshape(-1)
        sample = torch.cumsum(flat.long(), dim=0) - 1  # (B*T,) sample of every token
        begin = torch.nonzero(flat).reshape(-1)  # (n,) flat index of every sample's first token
        lengths = torch.diff(begin, append=begin.new_tensor([flat.numel()]))
        longest = int(lengths.max())
        offset = torch.arange(flat.numel(), device=flat.device) - begin[sample]
        return cls(rows, tokens, int(begin.numel()), longest, sample * longest + offset)

    def matches(self, tensor: Any) -> bool:
        """Whether ``tensor`` is laid out as the packed rows: ``(B, T, ...)``."""
        return (
            isinstance(tensor, torch.Tensor)
            and tensor.dim() >= 2
            and tuple(tensor.shape[:2]) == (self.rows, self.tokens)
        )

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """``(B, T, ...)`` packed -> ``(n, L, ...)`` right-padded with zeros (differentiable)."""
        rest = packed.shape[2:]
        flat = packed.reshape(self.rows * self.tokens, *rest)
        padded = flat.new_zeros(self.samples * self.longest, *rest).index_copy(0, self.index, flat)
        return padded.reshape(self.samples, self.longest, *rest)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """``(n, L, ...)`` right-padded -> ``(B, T, ...)`` packed: the real tokens, in row order."""
        rest = padded.shape[2:]
        flat = padded.reshape(self.samples * self.longest, *rest).index_select(0, self.index)
        return flat.reshape(self.rows, self.tokens, *rest)


def _repack(value: Any, layout: PackedLayout | None) -> Any:
    """Pad every tensor of ``value`` laid out as the packed rows (tuples of them too, e.g. cos/sin)."""
    if layout is None:
        return value
    if layout.matches(value):
        return layout.pad(value)
    if (
        isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and value.shape[0] == 1
        and layout.rows > 1
        and value.shape[1] == layout.tokens
    ):  # shared by every row (rotary tables, positions): one copy per row first
        return layout.pad(value.expand(layout.rows, *value.shape[1:]))
    if isinstance(value, tuple | list) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_repack(v, layout) for v in value)
    return value


def _unpack(value: Any, layout: PackedLayout) -> Any:
    if (
        isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and tuple(value.shape[:2])
        == (
            layout.samples,
            layout.longest,
        )
    ):
        return layout.unpad(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_unpack(v, layout) for v in value)
    return value


def find_mixers(model: torch.nn.Module, class_names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The modules of ``model`` whose class is named in ``class_names`` (outermost only: no nesting).

    >>> len(find_mixers(torch.nn.Sequential(torch.nn.Linear(2, 2)), ("Linear",)))
    1
    """
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in class_names:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


class MixerRepacking:
    """Hooks running each mixer module on the samples of a packed row as a right-padded batch.

    Set :attr:`layout` before a packed forward (``None`` for any other forward: the hooks then do
    nothing). :attr:`enabled` ``False`` lets the mixers run over the whole row (the stock leak): kept for
    negative controls and for measuring what the per-sample split costs.

    Args:
        mixers: the modules to hook.

    Attributes:
        layout: the :class:`PackedLayout` of the packed forward in flight, or ``None``.
        enabled: split packed rows per sample (default ``True``).
        handles: the hook handles (removed by :meth:`remove`).
    """

    def __init__(self, mixers: list[torch.nn.Module]) -> None:
        self.layout: PackedLayout | None = None
        self.enabled = True
        self.handles: list[Any] = []
        self._active: dict[int, PackedLayout] = {}  # id(module) -> layout of its forward in flight
        for module in mixers:
            params = inspect.signature(module.forward).parameters
            names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            self.handles.append(
                module.register_forward_pre_hook(self._make_pre_hook(names), with_kwargs=True)
            )
            self.handles.append(module.register_forward_hook(self._post_hook))

    def _make_pre_hook(self, names: list[str]):
        def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            layout = self.layout
            if layout is None:
                return None
            hidden = args[0] if args else kwargs.get(names[0]) if names else None
            if not layout.matches(hidden):
                return None  # not this packed row (e.g. a decode step): leave the call alone
            # A packed row has no padding, so the mixer needs no mask (a per-sample 4-D attention mask may
            # reach it through its decoder layer); the padded batch's padding trails every sample.
            split = layout if self.enabled else None  # disabled: the whole row as one sequence (leaks)
            new_args = []
            for name, value in zip(names, args, strict=False):
                new_args.append(None if name in MASK_ARGUMENTS else _repack(value, split))
            new_kwargs = {}
            for name, value in kwargs.items():
                if name in PACKED_ONLY_ARGUMENTS:
                    continue
                new_kwargs[name] = None if name in MASK_ARGUMENTS else _repack(value, split)
            if split is not None:
                self._active[id(module)] = layout
            return tuple(new_args) + tuple(args[len(new_args) :]), new_kwargs

        return pre_hook

    def _post_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        layout = self._active.pop(id(module), None)
        if layout is None:
            return None
        return _unpack(output, layout)

    def remove(self) -> None:
        """Remove every hook (a second call is a no-op)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._active.clear()
        self.layout = None
