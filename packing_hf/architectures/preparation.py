"""The hooks of a prepared model (:class:`PackingPreparation`) and how the sample boundaries reach them.

:func:`packing_hf.prepare_model_for_packing` decides what a model needs (refusals, the registry, the
check of unknown types) and builds the handle defined here. The handle installs, on one model instance:

- on the model, and on every decoder that calls hooked layers (so that ``model.model(...)`` /
  ``get_decoder()`` called on its own is served too): the batch guards, per-sample multimodal positions, and
  ``cu_seq_lens_q`` added to a packed one-row call, which transformers hands down to the decoder layers;
- on decoder layers whose mask ignores ``position_ids`` ("mask" models): a pre-hook restricting the mask to
  same-sample pairs, from the boundaries of the layer's own call;
- on decoder layers holding a token mixer: a pre-hook handing the mixer the right-padded layout of the
  layer's own call (a keyword argument, saved by activation checkpointing with the layer's arguments);
- for a pure state-space stack (every block a mixer): the whole block stack runs on the samples as a
  right-padded batch, split by the decoder's pre-hook and joined by its post-hook.

Why this holds under activation checkpointing, several forwards before one backward, copies and nested calls
is written down in docs/architecture.md ("Boundaries travel with the call").
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

import torch

from ..attention import ATTENTION_NAME
from ..attention.admission import PREPARED_ATTRIBUTE, note_split_config
from ..attention.guards import check_forward_call
from ..attention.host import remember_host_values
from ..multimodal import check_media, image_block_masks, mm_token_types, mrope_position_ids
from ..padding import PackedLayout
from ..registry import IMAGE_BLOCK_MASK, ArchitectureSupport, multimodal_refusal, wrapper_text_config
from ..shared_prefix import PREFIX_KEY
from ..varlen import PADDING_KEY
from .boundaries import LAYOUT_KEY, call_starts, derived, mixer_layout
from .mixers import (
    PACKED_ONLY_ARGUMENTS,
    MixerRepacking,
    forward_names,
    pop_layout,
    push_layout,
    takes_kwargs,
    unpad_outputs,
)
from .routers import ROUTER_MASK_TAG, router_loss_reads_mask, router_loss_requested

__all__ = ["PackingPreparation"]

# --------------------------------------------------------------------------------------------------
# the mask fix: every decoder layer sees only same-sample pairs


def _decoder_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int | None]]:
    """Modules held in a ``ModuleList`` whose forward takes an ``attention_mask``, with its position.

    Returns ``(layer, index)`` where ``index`` is the positional slot of ``attention_mask`` in ``args``.
    """
    layers = []
    for parent in model.modules():
        if not isinstance(parent, torch.nn.ModuleList):
            continue
        for layer in parent:
            params = list(inspect.signature(layer.forward).parameters)
            if "attention_mask" in params:
                layers.append((layer, params.index("attention_mask")))
    return layers


def _restrict_mask(
    mask: torch.Tensor | None, same: torch.Tensor, impl: str, dtype: torch.dtype, inverted: bool = False
) -> torch.Tensor | dict | None:
    """``mask`` ``(B|1, H|1, T, T)`` with cross-sample pairs removed; ``same`` ``(B, 1, T, T)`` bool.

    Float masks are additive (0 = attend, dtype min = masked); boolean ones keep where True, or mask where
    True when ``inverted``.
    """
    if isinstance(mask, dict):  # some models hand every layer a {layer_type: mask} mapping
        return {k: _restrict_mask(v, same, impl, dtype, inverted) for k, v in mask.items()}
    total = same.shape[-1]
    if mask is None:
        # sdpa skipped the mask (plain causal): materialize causal & same-sample in the format it expects
        causal = torch.ones(total, total, dtype=torch.bool, device=same.device).tril()
        keep = same & causal
        if impl == "eager":
            return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(
                ~keep, torch.finfo(dtype).min
            )
        return keep
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (total, total):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"cannot restrict an attention mask of shape {shape} to a packed row of {total} tokens; packed rows "
            "need a (B, 1, T, T) mask (no cache, no prefix)"
        )
    same = same.to(mask.device)
    if mask.dtype == torch.bool:
        return mask | ~same if inverted else mask & same
    return mask.masked_fill(~same, torch.finfo(mask.dtype).min)


# --------------------------------------------------------------------------------------------------
# vision-language wrappers: the language model decides; multimodal RoPE positions are kept per sample

_MEDIA_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")


def _language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder inside a vision-language wrapper (``model.model.language_model``), else ``model``."""
    inner = getattr(model, "model", None)
    for owner in (inner, model):
        language = getattr(owner, "language_model", None)
        if isinstance(language, torch.nn.Module):
            return language
    return model


def _rope_index(model: torch.nn.Module) -> Any:
    """The wrapper's multimodal RoPE function (Qwen-VL family: ``model.model.get_rope_index``), if any."""
    for owner in (getattr(model, "model", None), model):
        function = getattr(owner, "get_rope_index", None)
        if callable(function):
            return function
    return None


def _served_configs(config: Any) -> list[Any]:
    """The configs the attention and mask functions see: the model's, and a multimodal wrapper's text config."""
    text = wrapper_text_config(config)
    return [config] if text is None else [config, text]


def _media_present(kwargs: dict) -> bool:
    return any(kwargs.get(k) is not None for k in _MEDIA_KEYS)


class _CallStack:
    """The prepared model calls in flight on this thread: ``[(id(module), starts or None, tree)]`` (``tree``:
    the call is a prefix-tree row).

    Read only where a layer cannot see the boundaries in its own arguments (pure state-space stacks, whose
    blocks get hidden states alone; ALiBi models, whose blocks get no positions; several packed rows of a
    model whose layers get neither ``position_ids`` nor ``cu_seq_lens_q``). Entries are pushed by the model's
    pre-hook and popped by its post-hook, which also runs when the forward raises. A copy or an unpickled
    model starts with an empty stack of its own.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def entries(self) -> list[tuple[int, torch.Tensor | None, bool]]:
        entries = getattr(self._local, "entries", None)
        if entries is None:
            entries = self._local.entries = []
        return entries

    def top(self) -> torch.Tensor | None:
        entries = self.entries
        return entries[-1][1] if entries else None

    def tree(self) -> bool:
        """Whether the call in flight is a prefix-tree row."""
        entries = self.entries
        return bool(entries) and entries[-1][2]

    def __deepcopy__(self, memo: dict) -> _CallStack:
        return _CallStack()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._local = threading.local()


class _LayerSpec:
    """What the pre-hook of one decoder layer does: restrict its mask (``mask_index``: the positional slot of
    ``attention_mask``) and / or hand a layout to its ``mixers``. Plain data, copied with the model."""

    def __init__(
        self, layer: torch.nn.Module, mask_index: int | None, mixers: tuple[torch.nn.Module, ...]
    ) -> None:
        self.names = forward_names(type(layer))
        self.mask_index = mask_index
        self.mixers = mixers
        self.passes_kwargs = takes_kwargs(type(layer))


# the tag a decoder layer leaves on the attention mask object it was given: its sample starts. A layer that
# cannot read the boundaries from its own arguments finds them there when it is re-run by a checkpoint wrapper
# that runs module hooks inside the checkpoint (the mask object is the same one: the model builds it per call)
_MASK_TAG = "_packing_hf_starts"


def _same_sample(starts: torch.Tensor) -> torch.Tensor:
    sample = torch.cumsum(starts.long(), dim=-1)  # (B, T) sample index of every token
    return (sample[:, :, None] == sample[:, None, :]).unsqueeze(1)  # (B, 1, T, T)


def _cu_seq_lens(starts: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
    """``cu_seq_lens`` ``(n + 1,)`` int32 of a ``(1, T)`` packed row, its host copy and its longest sample."""
    host = torch.nonzero(starts[0]).reshape(-1).tolist() + [int(starts.shape[-1])]
    longest = max(b - a for a, b in zip(host[:-1], host[1:], strict=False))
    return torch.tensor(host, dtype=torch.int32, device=starts.device), host, longest


def _decoders(layers: list[torch.nn.Module], root: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules owning the ``ModuleList`` of each of ``layers`` (the decoders that call them)."""
    wanted = {id(layer) for layer in layers}
    found: list[torch.nn.Module] = []
    for module in root.modules():
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList) and any(id(m) in wanted for m in child):
                if all(module is not f for f in found):
                    found.append(module)
    return found


def _enclosing_layer(root: torch.nn.Module, mixer: torch.nn.Module) -> torch.nn.Module | None:
    """The child of a ``ModuleList`` that holds ``mixer`` (its decoder layer), if any."""
    for module in root.modules():
        if isinstance(module, torch.nn.ModuleList):
            for layer in module:
                if layer is not mixer and any(m is mixer for m in layer.modules()):
                    return layer
    return None


class PackingPreparation:
    """Handle returned by :func:`prepare_model_for_packing`: ``revert()`` undoes everything it did.

    Every hook reads the sample boundaries of its own call (see docs/architecture.md, "Boundaries travel
    with the call"): a decoder layer from its ``cu_seq_lens_q`` / ``seq_idx`` arguments, which the model
    pre-hook adds to packed calls; the hooks are bound methods of this handle, whose state lives
    on the hooked modules or travels in the call's arguments. So activation checkpointing, several packed
    forwards before one backward, ``copy.deepcopy`` / ``pickle`` of the model (a copy carries its own handle
    and hooks) and calls of the inner decoder stay exact.

    Attributes:
        model_type: the architecture prepared.
        support: its registry entry.
        mask_fix: whether per-sample mask hooks are installed on the decoder layers.
        layers: how many decoder layers got a mask hook.
        mixers: how many token-mixer modules (SSM, DeltaNet, convolution, ...) run per sample on packed rows.
        split_stack: a pure state-space model (every block a mixer): its whole block stack runs on the samples
            of a packed row as a right-padded batch.
        split_mixers: run those mixers per sample (default ``True``); ``False`` lets them run over the
            whole packed row, which leaks: for negative controls and for measuring what the split costs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        entry: ArchitectureSupport,
        mask_fix: bool,
        mixers: list[torch.nn.Module] | None = None,
    ) -> None:
        # a plain reference (not a weakref): a deep copy or pickle of the model then carries a handle to itself
        self._model = model
        self.model_type = entry.model_type
        self.support = entry
        self.mask_fix = mask_fix
        self._handles: list[Any] = []
        self._calls = _CallStack()
        self.layers = 0
        self._impl = str(getattr(model.config, "_attn_implementation", None))
        # multimodal RoPE wrapper (Qwen-VL family): packed rows get (4, B, T) positions, computed per sample
        self._rope_index = _rope_index(model) if wrapper_text_config(model.config) is not None else None
        wrapper_type = self._wrapper_type = str(getattr(model.config, "model_type", ""))
        wrapper = wrapper_text_config(model.config) is not None
        self._image_refusal = multimodal_refusal(wrapper_type, "image") if wrapper else None
        if self._image_refusal is not None:
            self._image_refusal = f"{wrapper_type}: {self._image_refusal}; pack its text-only data, or pad"
        self._image_blocks = wrapper_type in IMAGE_BLOCK_MASK
        # MoE: the padding closing a row is left out of the router's load-balancing loss (see _router_padding)
        self._router = router_loss_reads_mask(model)
        receiver = getattr(model, "base_model", None) if self._router else None
        self._router_receiver = (
            receiver if isinstance(receiver, torch.nn.Module) and receiver is not model else None
        )
        mixers = list(mixers or ())
        self.split_stack = bool(mixers) and entry.split_stack
        self._split = True
        self._repacking = MixerRepacking(mixers) if mixers and not self.split_stack else None
        self.mixers = len(mixers)
        # the attention and the batch guards ask a module whether its model is prepared (not the config,
        # which an unprepared twin built from it may share): every module of this model points at this handle
        for module in model.modules():
            setattr(module, PREPARED_ATTRIBUTE, self)
        self._note_configs(True)
        specs, hooked = self._layer_specs(mixers)
        self._install_hooks(specs, hooked)

    def _layer_specs(
        self, mixers: list[torch.nn.Module]
    ) -> tuple[list[tuple[torch.nn.Module, _LayerSpec]], list[torch.nn.Module]]:
        """The decoder layers to hook, each with the slot of its ``attention_mask`` (the mask fix) and the mixers
        it holds (their per-sample layout); and the layers whose decoders are hooked too (for a pure state-space
        stack: the blocks holding its mixers). Refuses a model whose layers cannot carry the boundaries."""
        model, model_type = self._model, self.model_type
        specs: dict[int, tuple[torch.nn.Module, int | None, list[torch.nn.Module]]] = {}
        if self.mask_fix:
            layers = _decoder_layers(_language_model(model))
            if not layers:
                raise ValueError(
                    f"{model_type}: no decoder layer taking an attention_mask was found to apply the "
                    "per-sample mask fix; packing cannot be made exact for this model"
                )
            for layer, index in layers:
                specs[id(layer)] = (layer, index, [])
            self.layers = len(layers)
        enclosing = [(mixer, _enclosing_layer(model, mixer)) for mixer in mixers]
        if self._repacking is not None:
            for mixer, layer in enclosing:
                if layer is None:
                    raise ValueError(
                        f"{model_type}: the token mixer {type(mixer).__name__} sits in no decoder layer of a "
                        "ModuleList, so no call carries its packed boundaries; packing cannot be made exact here"
                    )
                specs.setdefault(id(layer), (layer, None, []))[2].append(mixer)
        hooked = [layer for layer, _, _ in specs.values()]
        if self.split_stack:
            hooked = [layer for _, layer in enclosing if layer is not None]
        layer_specs = [(layer, _LayerSpec(layer, index, tuple(held))) for layer, index, held in specs.values()]
        return layer_specs, hooked

    def _install_hooks(
        self, specs: list[tuple[torch.nn.Module, _LayerSpec]], hooked: list[torch.nn.Module]
    ) -> None:
        """The hooks on the model, on every decoder that calls ``hooked`` layers (it can be called on its own)
        and on the router loss's receiver, and on each layer of ``specs``; kept for :meth:`revert`."""
        model = self._model
        decoders = [d for d in _decoders(hooked, model) if d is not model]
        if self._router_receiver is not None and all(d is not self._router_receiver for d in decoders):
            decoders.append(self._router_receiver)  # it drops the router loss's mask (_drop_router_mask)
        self._stack_decoders = decoders if self.split_stack else []
        for module in [model, *decoders]:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
            )
        for layer, spec in specs:
            self._handles.append(
                layer.register_forward_pre_hook(functools.partial(self._layer_pre, spec), with_kwargs=True)
            )
            if spec.mixers:
                self._handles.append(
                    layer.register_forward_hook(functools.partial(self._layer_post, spec), always_call=True)
                )

    # -- model and decoder hooks --------------------------------------------------------------------
    def _note_configs(self, used: bool) -> None:
        """Tell the mask function that a model with split mixers uses these configs: a hint only, which lets it
        leave the decision to the attention layers (they read this model's tag, not the config)."""
        if self.mixers:
            for config in _served_configs(self._model.config):
                note_split_config(config, used)

    @property
    def _needs_boundaries(self) -> bool:
        return self.mask_fix or self._repacking is not None or self.split_stack

    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        entries = self._calls.entries
        if entries and module is not self._model:
            # the decoder inside a prepared call of the whole model: already checked, same packed row
            starts = entries[-1][1]
            checked = dict(kwargs)
            checked.pop(PADDING_KEY, None)
            _drop_router_mask(checked)
        else:
            self._note_configs(True)  # a copy, or a twin's revert, may have left its config without the note
            args, checked, starts = check_forward_call(module, args, kwargs)
            padding = checked.pop(PADDING_KEY, None)
            if padding is not None and module is self._model and self._router is not None:
                checked = self._router_padding(module, args, checked, padding)
            if starts is not None and _media_present(checked):
                if self._image_refusal is not None:
                    raise ValueError(self._image_refusal)
                # before the vision tower and the per-sample positions fail on them far from the cause
                check_media(
                    checked, f"{self._wrapper_type}: the packed row", needs_grid=self._rope_index is not None
                )
            if self._rope_index is not None and starts is not None and module is self._model:
                checked = self._multimodal_positions(module, args, checked, starts)
            if self._image_blocks and starts is not None and checked.get("token_type_ids") is not None:
                checked = self._image_block_mask(module, checked, starts)
            if starts is not None and self._needs_boundaries:
                # the decoder layers read the boundaries from their own arguments, which transformers hands
                # down: cu_seq_lens_q for one row (the attention reads it too: the same boundaries as the
                # positions), seq_idx (B, T) for several rows
                if starts.shape[0] == 1 and checked.get("cu_seq_lens_q") is None:
                    cu, host, longest = _cu_seq_lens(starts)
                    remember_host_values(cu, host)
                    checked.update(
                        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest
                    )
                elif starts.shape[0] > 1 and checked.get("seq_idx") is None:
                    checked["seq_idx"] = (torch.cumsum(starts.int(), dim=-1) - 1).to(torch.int32)
        if self.split_stack and starts is not None and any(module is d for d in self._stack_decoders):
            args, checked = self._pad_stack(module, args, checked, starts)
        entries.append((id(module), starts, checked.get(PREFIX_KEY) is not None))
        return args, checked

    def _post_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        entries = self._calls.entries
        if entries and entries[-1][0] == id(module):
            entries.pop()
        mask = kwargs.get("attention_mask")
        if output is not None and getattr(mask, ROUTER_MASK_TAG, None) == "handed":
            raise ValueError(
                f"{self.model_type}: the router-loss mask this call was given never reached "
                f"{type(self._router_receiver).__name__} (the base model its forward should pass attention_mask "
                "to), so the padding's place in the router loss is not known. Collate without pad_to_multiple_of / "
                "length_buckets for this model"
            )
        layout = kwargs.get(LAYOUT_KEY)
        if isinstance(layout, PackedLayout) and output is not None:
            return _unpad_output(output, layout)
        return None

    def _router_padding(self, module: torch.nn.Module, args: tuple, kwargs: dict, padding: Any) -> dict:
        """Leave the padding closing a packed row out of the router's load-balancing loss.

        The model's forward gives ``load_balancing_loss_func`` its own ``attention_mask``, as stock does for a
        padded batch: this call gets a ``(1, T)`` mask with zeros on the padding (tagged), which the base model's
        pre-hook drops before the decoder builds any attention mask from it (the packed boundaries keep the
        samples apart). The loss is then the model's own over the real tokens: that of the unpadded row.
        A model computing its router loss some other way is refused when it is asked for one.
        """
        n_pad = int(padding)
        if n_pad == 0:
            return kwargs
        if not router_loss_requested(module.config, kwargs):
            return kwargs
        if not self._router or self._router_receiver is None:
            raise ValueError(
                f"{self.model_type}: this row ends with {n_pad} padding tokens (pad_to_multiple_of / length_buckets) "
                "and the model returns a router load-balancing loss (output_router_logits), which its forward does "
                "not compute from an attention_mask packing_hf could hand it: the padding would be routed and "
                "counted like real tokens. Collate without pad_to_multiple_of / length_buckets, or set "
                "output_router_logits=False"
            )
        ids = kwargs.get("input_ids", args[0] if args else None)
        reference = ids if isinstance(ids, torch.Tensor) else kwargs.get("inputs_embeds")
        total = int(reference.shape[1])
        mask = torch.ones(1, total, dtype=torch.long, device=reference.device)  # (1, T)
        mask[:, total - n_pad :] = 0
        setattr(mask, ROUTER_MASK_TAG, "handed")
        return {**kwargs, "attention_mask": mask}

    def _pad_stack(
        self, module: torch.nn.Module, args: tuple, kwargs: dict, starts: torch.Tensor
    ) -> tuple[tuple, dict]:
        """A pure state-space stack runs on the samples as a right-padded batch: every block sees it (its
        shape is the layout), so checkpointed blocks and copies need nothing else; unpadded after the stack."""
        kwargs = dict(kwargs)
        embeds = kwargs.pop("inputs_embeds", None)
        input_ids = kwargs.pop("input_ids", None)
        if args:
            input_ids, args = args[0], args[1:]
        if embeds is None:
            embeds = module.get_input_embeddings()(input_ids)  # (B, T, D)
        layout = PackedLayout.from_starts(starts.to(embeds.device))
        if not layout.matches(embeds):
            return args, kwargs
        if not self._split:  # negative control: the whole row as one sequence (leaks)
            kwargs["inputs_embeds"] = embeds
            return args, kwargs
        for key in PACKED_ONLY_ARGUMENTS | {"position_ids", "attention_mask"}:
            kwargs.pop(key, None)
        kwargs["inputs_embeds"] = layout.pad(embeds)  # (n, L, D)
        kwargs[LAYOUT_KEY] = layout  # read back by the post-hook
        return args, kwargs

    # -- decoder layer hooks ------------------------------------------------------------------------
    def _layer_pre(
        self, spec: _LayerSpec, layer: torch.nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        mask_in_kwargs = "attention_mask" in kwargs or spec.mask_index is None or len(args) <= spec.mask_index
        mask = kwargs.get("attention_mask") if mask_in_kwargs else args[spec.mask_index]
        starts = call_starts(spec.names, args, kwargs)
        if starts is None:
            if spec.mixers and self._calls.tree():
                raise ValueError(
                    f"{self.model_type}: a prefix-tree row ({PREFIX_KEY}) reached a decoder layer holding a token "
                    f"mixer ({type(layer).__name__}) that is not handed the row's keyword arguments, so its mixers "
                    "cannot run every segment after its ancestors. Pack these samples without shared prefixes"
                )
            starts = self._calls.top()  # the forward in flight, for layers that get no boundaries
            if starts is not None and isinstance(mask, torch.Tensor):
                setattr(mask, _MASK_TAG, starts)
            elif isinstance(mask, torch.Tensor):
                starts = getattr(
                    mask, _MASK_TAG, None
                )  # re-run by a checkpoint wrapper: the same mask object
        hidden = args[0] if args else kwargs.get(spec.names[0] if spec.names else "hidden_states")
        if (
            starts is None
            or not isinstance(hidden, torch.Tensor)
            or tuple(starts.shape) != tuple(hidden.shape[:2])
        ):
            return None
        args, kwargs = list(args), dict(kwargs)
        if spec.mask_index is not None:
            dtype = hidden.dtype
            inverted = self.support.inverted_bool_mask
            same = derived(starts, "same", lambda: _same_sample(starts))
            restricted = _restrict_mask(mask, same, self._impl, dtype, inverted)
            if mask_in_kwargs:
                kwargs["attention_mask"] = restricted
            else:
                args[spec.mask_index] = restricted
        if spec.mixers:
            layout = mixer_layout(kwargs, starts)
            checkpointed = bool(
                getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled()
            )
            for mixer in spec.mixers:
                push_layout(mixer, layout, checkpointed)
            if spec.passes_kwargs:
                kwargs[LAYOUT_KEY] = layout
        return tuple(args), kwargs

    def _layer_post(self, spec: _LayerSpec, layer: torch.nn.Module, args: tuple, output: Any) -> None:
        for mixer in spec.mixers:
            pop_layout(mixer)

    def _multimodal_positions(
        self, module: torch.nn.Module, args: tuple, kwargs: dict, starts: torch.Tensor
    ) -> dict:
        """Packed ``(B, T)`` positions of a multimodal-RoPE model as ``(4, B, T)``: text row, then mRoPE rows.

        Without images the three mRoPE rows equal the text positions (what the model computes for a lone text
        sample); with images they are computed per sample by the model's own ``get_rope_index``
        (:func:`packing_hf.multimodal.mrope_position_ids`). Transformers reads the first row to keep the
        samples apart; 3-row positions (each sample's own, next to ``cu_seq_lens_q``: the batch guard checked
        them) get that row from the boundaries.
        """
        position_ids = kwargs.get("position_ids")
        if not isinstance(position_ids, torch.Tensor):
            return kwargs
        if position_ids.dim() == 3:
            if position_ids.shape[0] == 4:
                return kwargs
            text = (torch.cumsum(torch.ones_like(starts, dtype=torch.long), dim=-1) - 1).to(
                position_ids.device
            )
            text = text - torch.cummax(torch.where(starts.to(text.device), text, 0), dim=-1).values  # (B, T)
            return {**kwargs, "position_ids": torch.cat([text[None].to(position_ids.dtype), position_ids])}
        kwargs = dict(kwargs)
        if not _media_present(kwargs):
            kwargs["position_ids"] = position_ids[None].expand(4, -1, -1)
            return kwargs
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(input_ids, torch.Tensor) or input_ids.shape[0] != 1:
            raise ValueError(
                f"{self.model_type}: packed rows holding images need input_ids of shape (1, T) (one padding-free "
                "row) to compute each sample's multimodal positions"
            )
        config = module.config
        types = kwargs.get("mm_token_type_ids")
        if types is None:
            types = mm_token_types(
                input_ids, getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)
            )
        cu = torch.nonzero(starts[0]).reshape(-1).tolist() + [int(input_ids.shape[-1])]
        kwargs["position_ids"] = mrope_position_ids(
            self._rope_index,
            input_ids,
            cu,
            types,
            image_grid_thw=kwargs.get("image_grid_thw"),
            video_grid_thw=kwargs.get("video_grid_thw"),
            second_per_grid_ts=kwargs.get("second_per_grid_ts"),
        )
        return kwargs

    def _image_block_mask(self, module: torch.nn.Module, kwargs: dict, starts: torch.Tensor) -> dict:
        """Per-sample block masks for a packed row whose image tokens attend within their image (Gemma 3)."""
        token_type_ids = kwargs["token_type_ids"]
        if not bool((token_type_ids == 1).any()):
            return kwargs
        if self._impl == ATTENTION_NAME:
            raise ValueError(
                f"{self.model_type}: packed image+text rows need its bidirectional image-block mask, which "
                "packing_hf's varlen attention (causal within each sample) does not express; load the model with "
                "attn_implementation='sdpa' or 'eager'"
            )
        if starts.shape[0] != 1:
            raise ValueError(f"{self.model_type}: packed image+text rows must be one padding-free row (1, T)")
        text = module.config.get_text_config()
        cu = torch.nonzero(starts[0]).reshape(-1).tolist() + [int(starts.shape[-1])]
        dtype = None if self._impl != "eager" else next(module.parameters()).dtype
        kwargs = dict(kwargs)
        kwargs["attention_mask"] = image_block_masks(
            cu, token_type_ids, sliding_window=getattr(text, "sliding_window", None), dtype=dtype
        )
        return kwargs

    @property
    def split_mixers(self) -> bool:
        if self.split_stack:
            return self._split
        return self._repacking is not None and self._repacking.enabled

    @split_mixers.setter
    def split_mixers(self, value: bool) -> None:
        if self.split_stack:
            self._split = bool(value)
            return
        if self._repacking is None:
            raise ValueError(f"{self.model_type}: no token mixer is split per sample in this model")
        self._repacking.enabled = bool(value)

    # -- revert -------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return bool(self._handles)

    def revert(self) -> None:
        """Remove every hook; the model behaves exactly as before preparation. A second call is a no-op.

        Reverting a copy of a prepared model (``copy.deepcopy``, ``trl.create_reference_model``) removes the
        copy's hooks only; the original stays prepared, and the other way round.
        """
        if not self._handles:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        model = self._model
        if self._repacking is not None:
            self._repacking.remove()
        for module in model.modules():
            if module.__dict__.get(PREPARED_ATTRIBUTE) is self:
                delattr(module, PREPARED_ATTRIBUTE)
        self._note_configs(False)
        if getattr(model, "_packing_hf_preparation", None) is self:
            del model._packing_hf_preparation

    def __enter__(self) -> PackingPreparation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revert()

    def __repr__(self) -> str:
        state = "active" if self.active else "reverted"
        return (
            f"PackingPreparation({self.model_type}, mask_fix={self.mask_fix}, layers={self.layers}, "
            f"mixers={self.mixers}, {state})"
        )


def _drop_router_mask(kwargs: dict) -> None:
    """Remove from ``kwargs`` the router-loss mask of :meth:`PackingPreparation._router_padding`, marking it
    received."""
    mask = kwargs.get("attention_mask")
    if getattr(mask, ROUTER_MASK_TAG, None) is not None:
        del kwargs["attention_mask"]
        setattr(mask, ROUTER_MASK_TAG, "received")


def _unpad_output(output: Any, layout: PackedLayout) -> Any:
    """A stack's output back to the packed rows: ``last_hidden_state`` and every ``hidden_states`` entry."""
    if isinstance(output, tuple):
        return unpad_outputs(output, layout)
    for key in ("last_hidden_state", "hidden_states"):
        value = getattr(output, key, None)
        if value is not None:
            output[key] = unpad_outputs(value, layout)
    return output
