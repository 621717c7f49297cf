"""Per-sample token mixers: run every non-attention mixer of a packed row on its samples, right-padded.

State-space layers (Mamba, Mamba2/SSD), gated DeltaNet, KDA, lightning attention, RG-LRU blocks and short
causal convolutions carry a state or a convolution window along the sequence, whatever the attention mask
says: on a packed row ``[1, T]`` the last tokens of one sample flow into the next. Every one of them is
causal and starts from a zero state, so on a *right-padded* batch each real token sees exactly its own
sample's earlier tokens. :class:`MixerRepacking` uses that: a forward pre-hook on each mixer module turns
its packed input ``(B, T, ...)`` into a right-padded batch ``(n, L, ...)`` (one row per sample, ``L`` the
longest sample), and a forward hook gathers the real tokens of the output back to ``(B, T, ...)``. The
mixer itself is transformers' own code, untouched; the gather indices are derived from the decoder layer's
own arguments (:mod:`packing_hf.architectures.boundaries`), once per packed forward. Padding tokens are zeros placed *after* each sample, so they never reach a real
token (causality), and no padding mask is needed.

The hooks act only on packed calls (the decoder layer around the mixer found sample boundaries in its
arguments); padded batches and ``generate()`` pass through untouched.

>>> starts = torch.tensor([[True, False, False, True, False]])  # samples of 3 and 2 tokens
>>> layout = PackedLayout.from_starts(starts)
>>> layout.rows, layout.width, layout.index.tolist()  # 2 samples, the longest of 3 tokens
(2, 3, [0, 1, 2, 3, 4])
>>> x = torch.arange(5.0).reshape(1, 5, 1)
>>> layout.pad(x)[..., 0].tolist()
[[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]
>>> torch.equal(layout.unpad(layout.pad(x)), x)
True
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

import torch

from ..padding import PackedLayout
from ..shared_prefix import PREFIX_KEY
from .boundaries import LAYOUT_KEY

__all__ = [
    "MASK_ARGUMENTS",
    "PACKED_ONLY_ARGUMENTS",
    "MixerRepacking",
    "calls_in_flight",
    "find_mixers",
    "forward_names",
    "pop_layout",
    "push_layout",
    "takes_kwargs",
    "unpad_outputs",
]


class _CallState(threading.local):
    """The packed calls in flight on this thread, per hooked mixer module (by ``id``): never on the module, which
    two threads calling one model share. ``scopes``: the layouts pushed by the mixer's decoder layer,
    ``[(layout, checkpointed)]``; ``active``: the layouts of the mixer's own splits, pre-hook to post-hook."""

    def __init__(self) -> None:
        self.scopes: dict[int, list[tuple[PackedLayout, bool]]] = {}
        self.active: dict[int, list[PackedLayout]] = {}


_CALLS = _CallState()


def _push(table: dict[int, list], module: torch.nn.Module, value: Any) -> None:
    table.setdefault(id(module), []).append(value)


def _pop(table: dict[int, list], module: torch.nn.Module) -> Any:
    stack = table.get(id(module))
    if not stack:
        return None
    value = stack.pop()
    if not stack:
        del table[id(module)]
    return value


def push_layout(mixer: torch.nn.Module, layout: PackedLayout, checkpointed: bool) -> None:
    """Put ``layout`` in ``mixer``'s call scope on this thread (its decoder layer's pre-hook, for a layer that
    does not hand its keyword arguments on); :func:`pop_layout` takes it off (the layer's post-hook)."""
    _push(_CALLS.scopes, mixer, (layout, checkpointed))


def pop_layout(mixer: torch.nn.Module) -> None:
    """Take the newest layout :func:`push_layout` put in ``mixer``'s call scope on this thread off it."""
    _pop(_CALLS.scopes, mixer)


def calls_in_flight() -> int:
    """How many layouts this thread holds for mixer calls in flight (0 between forwards, also after one raised).

    >>> calls_in_flight()
    0
    """
    return sum(map(len, _CALLS.scopes.values())) + sum(map(len, _CALLS.active.values()))


# arguments describing padding of the packed row: the padded batch has its own (trailing zeros, no mask)
MASK_ARGUMENTS = frozenset({"attention_mask", "conv_mask", "causal_mask", "mask"})
# arguments describing the packed row as one sequence: meaningless (and refused by transformers' torch
# fallbacks, which raise on cu_seqlens / seq_idx) once the samples are rows of their own; a prefix tree's
# segments are rows holding their whole root-to-segment path by then (boundaries.tree_layout)
PACKED_ONLY_ARGUMENTS = frozenset(
    {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens", PREFIX_KEY}
)


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
        and layout.packed_shape[0] > 1
        and value.shape[1] == layout.packed_shape[1]
    ):  # shared by every row (rotary tables, positions): one copy per row first
        return layout.pad(value.expand(layout.packed_shape[0], *value.shape[1:]))
    if isinstance(value, tuple | list) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_repack(v, layout) for v in value)
    return value


def unpad_outputs(value: Any, layout: PackedLayout) -> Any:
    """Every ``(n, L, ...)`` right-padded tensor of ``value`` (tuples of them too) back to ``(B, T, ...)``.

    >>> layout = PackedLayout.from_starts(torch.tensor([[True, False, True]]))  # samples of 2 and 1 tokens
    >>> unpad_outputs((torch.tensor([[[1.0], [2.0]], [[3.0], [0.0]]]), None), layout)[0][..., 0].tolist()
    [[1.0, 2.0, 3.0]]
    """
    if (
        isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and tuple(value.shape[:2]) == (layout.rows, layout.width)
    ):
        return layout.unpad(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(unpad_outputs(v, layout) for v in value)
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


@functools.cache
def forward_names(cls: type) -> tuple[str, ...]:
    """The named parameters of ``cls.forward`` in order (no ``self``, no ``*args`` / ``**kwargs``).

    >>> forward_names(torch.nn.Linear)
    ('input',)
    """
    params = inspect.signature(cls.forward).parameters
    return tuple(
        n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )


def takes_kwargs(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``**kwargs`` (a decoder layer can then hand the layout to its mixer).

    >>> takes_kwargs(torch.nn.Linear)
    False
    """
    params = inspect.signature(cls.forward).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in params)


class MixerRepacking:
    """Hooks running each mixer module on the samples of a packed row as a right-padded batch.

    The hooks keep no layout of their own. A mixer's hook takes the :class:`PackedLayout` of the call it is
    part of from one of two places, both written by the prepared decoder layer around it
    (:mod:`packing_hf.architectures.prepare`):

    - the keyword argument ``packing_hf_layout`` of the mixer's call, which the layer adds to its own
      keyword arguments and hands on: activation checkpointing saves it with the layer's arguments, so the
      layer re-run during backward splits its mixer with the layout of the forward being re-run;
    - the mixer's call scope on the calling thread (:func:`push_layout`), pushed by the layer's pre-hook and
      popped by its post-hook (also when the forward raises): for layers that do not hand their keyword
      arguments on. A layer that does not, and is checkpointed, would re-run its mixer with no layout during
      backward: that is refused at the forward, by name.

    The layout of a split in flight is kept for the calling thread from the mixer's pre-hook to its post-hook
    (popped also when the mixer raises), keyed by the mixer module: two threads calling one prepared model
    each see their own call's layout, and a copy of the model (other modules) has nothing in flight. Hooks are
    bound methods of this object, so ``copy.deepcopy`` / ``pickle`` of the model copy them with it: a copy is
    prepared on its own.

    Args:
        mixers: the modules to hook.

    Attributes:
        enabled: split packed rows per sample (default ``True``); ``False`` lets the mixers run over the
            whole row (the stock leak): kept for negative controls and for measuring what the split costs.
        handles: the hook handles (removed by :meth:`remove`).
    """

    def __init__(self, mixers: list[torch.nn.Module]) -> None:
        self.enabled = True
        self.handles: list[Any] = []
        for module in mixers:
            self.handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_hook, always_call=True))

    def _pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        (args, kwargs), split = self._split_call(module, args, kwargs)
        # one entry per call that did not raise, split or not, so that the post-hook pops this call's own
        _push(_CALLS.active, module, split)
        return args, kwargs

    def _split_call(
        self, module: torch.nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple[tuple, dict], PackedLayout | None]:
        """The mixer's arguments for this call, and the layout its output is to be unpadded with (``None``: not
        split)."""
        kwargs = dict(kwargs)
        layout = kwargs.pop(LAYOUT_KEY, None)
        scope = _CALLS.scopes.get(id(module))
        if layout is None and scope:
            layout, checkpointed = scope[-1]
            if checkpointed:
                raise ValueError(
                    f"{type(module).__name__} runs per sample on packed rows, but its decoder layer does not hand "
                    "it its keyword arguments, so activation checkpointing would re-run it during backward "
                    "without the packed row's boundaries (wrong gradients). Turn gradient checkpointing off for "
                    "this model when training on packed rows, or train it padded"
                )
        if layout is None:
            return (args, kwargs), None
        names = forward_names(type(module))
        hidden = args[0] if args else kwargs.get(names[0]) if names else None
        if not layout.matches(hidden):
            return (args, kwargs), None  # not this packed row (e.g. a decode step): leave the call alone
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
        return (tuple(new_args) + tuple(args[len(new_args) :]), new_kwargs), split

    def _post_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        layout = _pop(_CALLS.active, module)
        if layout is None or output is None:  # not split, or the mixer raised (the hook runs then too)
            return None
        return unpad_outputs(output, layout)

    def remove(self) -> None:
        """Remove every hook (a second call is a no-op)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
