"""Tiny copies of causal-LM configs that keep what decides whether packing is exact.

:func:`tiny_config` shrinks width, depth, vocabulary and expert count of any config (or a default config
by ``model_type``) but keeps every layer type, windows, chunks, softcapping, sinks, ALiBi and MoE routing;
:func:`build_tiny_model` builds it in fp32 on the CPU. The pre-flight check and the architecture sweep
run on these.

>>> cfg = tiny_config("mistral")
>>> cfg.hidden_size, cfg.num_hidden_layers, cfg.sliding_window, cfg.vocab_size
(64, 2, 4, 512)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from ..attention import resolve_attn_implementation
from ..registry import support

__all__ = ["build_tiny_model", "tiny_config"]

# Sizes of a tiny model: small enough to run the whole check in well under a second on one CPU core,
# large enough that every architectural feature is still exercised (GQA, several experts, a sliding
# window and attention chunk shorter than the test samples).
_TINY_HIDDEN = 64
_TINY_HEADS = 4
_TINY_HEAD_DIM = 16
_TINY_VOCAB = 512
_TINY_LAYERS = 2
_TINY_WINDOW = 4

# config field -> tiny value, applied to fields the config has and that are not None
_TINY_FIELDS: dict[str, int] = {
    "hidden_size": _TINY_HIDDEN,
    "num_attention_heads": _TINY_HEADS,
    "head_dim": _TINY_HEAD_DIM,
    "attention_head_dim": _TINY_HEAD_DIM,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "dff": 128,
    "d_ff": 128,
    "dim_ff": 128,
    "feed_forward_size": 128,
    "word_embed_proj_dim": _TINY_HIDDEN,
    "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "vocab_size": _TINY_VOCAB,
    # per-layer input embeddings (gemma3n, gemma4): a vocabulary-sized table per layer
    "vocab_size_per_layer_input": _TINY_VOCAB,
    "hidden_size_per_layer_input": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    # multi-head latent attention (deepseek-style)
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    # windows and chunks shorter than the test samples, so that they actually bite
    "sliding_window": _TINY_WINDOW,
    "sliding_window_size": _TINY_WINDOW,
    "attention_window_size": _TINY_WINDOW,
    "attention_chunk_size": _TINY_WINDOW,
    "rotary_dim": 8,
    "max_window_layers": 1,
    "first_k_dense_replace": 1,
    # state-space / linear-attention layers of hybrid models
    "mamba_d_state": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_head_dim": 32,
    "mamba_num_heads": 4,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 8,
    "mamba_dt_rank": 8,
    "ssm_state_size": 16,
    "state_size": 16,
    "time_step_rank": 8,
    "n_groups": 1,
    "chunk_size": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
}

# _TINY_FIELDS never set above the config's own value (the expert-group counts)
_CAPPED_FIELDS = frozenset(("n_group", "topk_group", "num_expert_group"))
# fields some default configs leave at None although their model needs a value -> tiny value
_NONE_FIELDS: dict[str, int] = {"head_dim": _TINY_HEAD_DIM, "num_key_value_heads": _TINY_HEADS}

# fields counting layers, per naming scheme
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _config_dict(config) -> dict:
    """Constructor kwargs of ``config``: its own (non-derived) fields, resolved through attribute_map."""
    data = config.to_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "model_type", "auto_map", "dtype"):
        data.pop(key, None)
    return data


def _representative_layers(layer_types: Sequence[str], keep: int) -> list[int]:
    """Indices of ``keep`` layers covering every distinct layer type, in model order."""
    chosen: list[int] = []
    seen: set[str] = set()
    for i, kind in enumerate(layer_types):
        if kind not in seen:
            seen.add(kind)
            chosen.append(i)
    for i in range(len(layer_types)):
        if len(chosen) >= keep:
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen)


# vision tower fields -> tiny value (the tower only has to run: it never decides whether packing is exact)
_TINY_VISION: dict[str, int] = {
    "hidden_size": 32,
    "embed_dim": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "num_attention_heads": 2,
    "attention_heads": 2,
    "depth": 2,
    "num_hidden_layers": 2,
    "projection_dim": 32,
}


def _tiny_vision(vision: dict, text_hidden: int) -> dict:
    """A tiny vision tower config (as a dict): width, depth and heads shrunk, its output sized for the text model."""
    out = {**vision, **{k: v for k, v in _TINY_VISION.items() if isinstance(vision.get(k), int)}}
    if "out_hidden_size" in vision:
        out["out_hidden_size"] = text_hidden
    elif "embed_dim" in vision and "hidden_size" in vision:  # Qwen2-VL: embed_dim inside, hidden_size out
        out["hidden_size"] = text_hidden
    for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if isinstance(vision.get(key), list):
            out[key] = [1] if key == "fullatt_block_indexes" else [0]
    return out


def tiny_config(config, **overrides):
    """A tiny copy of a causal-LM config that keeps the architecture's features.

    Shrinks width, depth, vocabulary and expert count, but keeps what decides whether packing is exact:
    the attention kind of every layer type (sliding / full / linear / Mamba: one layer of each), sliding
    windows and attention chunks (made shorter than the test samples, so they act), logit softcapping,
    attention sinks, ALiBi, MoE routing.

    Args:
        config: a ``PretrainedConfig`` (e.g. the one of the model you will train) or a ``model_type``
            string (``"llama"``), which starts from that architecture's default config.
        **overrides: config fields to set after shrinking.

    Returns:
        A new config of the same class; ``config`` itself is not modified.

    >>> cfg = tiny_config("mistral")
    >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.sliding_window, cfg.vocab_size
    (64, 2, 4, 512)
    """
    from transformers import AutoConfig

    base = AutoConfig.for_model(config) if isinstance(config, str) else config
    data = _config_dict(base)
    present = _field_resolver(base, data)
    # every step adds the fields it changes to `new`; later steps read what earlier ones decided
    new: dict = {}
    _shrink_sizes(data, present, new)
    _shrink_heads(data, present, new)
    _shrink_depth(data, present, new)
    _fit_token_ids(data, present, new)
    _shrink_sub_configs(base, data, new)
    _fit_mrope_sections(base, data, present, new)
    _apply_support_tiny(base, data, new)
    new.update(overrides)
    return type(base)(**{**data, **new})


def _field_resolver(base, data: dict) -> Callable[[str], str | None]:
    """``present(name)``: the key of field ``name`` in ``data`` (through the config's attribute_map), or None."""
    attribute_map = getattr(type(base), "attribute_map", {}) or {}

    def present(name: str) -> str | None:
        name = attribute_map.get(name, name)
        return name if name in data else None

    return present


def _shrink_sizes(data: dict, present: Callable[[str], str | None], new: dict) -> None:
    """Every integer field of :data:`_TINY_FIELDS` the config has, set to its tiny value."""
    for name, value in _TINY_FIELDS.items():
        key = present(name)
        if key is not None and isinstance(data[key], int) and not isinstance(data[key], bool):
            new[key] = min(value, data[key]) if name in _CAPPED_FIELDS else value
    for name, value in _NONE_FIELDS.items():
        key = present(name)
        if key is not None and data[key] is None:
            new[key] = value
    if present("qk_rope_head_dim") and present("head_dim"):
        # multi-head latent attention: head_dim is the rotary part of the query/key heads
        new[present("head_dim")] = _TINY_FIELDS["qk_rope_head_dim"]
    experts = [
        k for k in ("num_experts", "num_local_experts", "n_routed_experts") if isinstance(data.get(k), int)
    ]
    if experts and present("num_experts_per_tok") and data[present("num_experts_per_tok")] is None:
        new[present("num_experts_per_tok")] = _TINY_FIELDS["num_experts_per_tok"]


def _shrink_heads(data: dict, present: Callable[[str], str | None], new: dict) -> None:
    """Key/value heads in the tiny head count, keeping the attention's flavour."""
    heads_key, kv_key = present("num_attention_heads"), present("num_key_value_heads")
    if kv_key is not None and isinstance(data[kv_key], int) and heads_key is not None:
        # keep the flavour: multi-head stays multi-head, multi-query stays multi-query, GQA gets 2 groups
        original_kv, original_heads = data[kv_key], data[heads_key]
        new[kv_key] = _TINY_HEADS if original_kv == original_heads else 1 if original_kv == 1 else 2


def _shrink_depth(data: dict, present: Callable[[str], str | None], new: dict) -> None:
    """One layer of each type (at least ``_TINY_LAYERS``), and the per-layer lists and dicts cut to match."""
    layers_key = next((k for k in map(present, _LAYER_FIELDS) if k is not None), None)
    if layers_key is None:
        return
    original_layers = int(data[layers_key])
    layer_types = data.get("layer_types")
    keep = _TINY_LAYERS
    if isinstance(layer_types, list) and len(layer_types) == original_layers:
        keep = max(keep, len(set(layer_types)))
        chosen = _representative_layers(layer_types, keep)
    else:
        chosen = list(range(min(keep, original_layers)))
    new[layers_key] = len(chosen)
    for key, value in data.items():
        if isinstance(value, list) and len(value) == original_layers and original_layers > len(chosen):
            new[key] = [value[i] for i in chosen]
        elif key == "per_layer_config" and isinstance(value, dict):
            # {"05": {...}} keyed by layer index: keep the chosen layers' entries under their new index
            # per-layer head counts follow the tiny ones (a validator may require kv heads == heads)
            sizes = {**_TINY_FIELDS, **{f: new[f] for f in ("num_key_value_heads",) if f in new}}
            new[key] = {
                f"{chosen.index(int(k)):02d}": {f: sizes.get(f, v) for f, v in per.items()}
                for k, per in value.items()
                if int(k) in chosen
            }


def _fit_token_ids(data: dict, present: Callable[[str], str | None], new: dict) -> None:
    """Special token ids moved inside the tiny vocabulary (a multimodal wrapper's into its text model's)."""
    vocab_key = present("vocab_size")
    vocab = new.get(vocab_key, data.get(vocab_key)) if vocab_key else None
    wrapper = vocab is None and isinstance(data.get("text_config"), dict)
    if wrapper:
        vocab = _TINY_VOCAB  # a multimodal wrapper: its image/video token ids index the tiny text vocabulary
    if not isinstance(vocab, int):
        return
    # special token ids outside the tiny vocabulary would index past the embedding table (a wrapper's
    # start below the text config's own, so that an image token never doubles as end-of-sequence)
    spare = vocab - 1 - (16 if wrapper else 0)
    for key, value in data.items():
        if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= vocab:
            new[key] = spare
            spare -= 1
        elif key.endswith("_token_id") and isinstance(value, list):
            new[key] = [v if v < vocab else vocab - 1 for v in value]


def _shrink_sub_configs(base, data: dict, new: dict) -> None:
    """Nested configs: a text_config is a model of its own; attention/FFN sub-configs (dbrx, mpt) hold sizes."""
    for key, value in data.items():
        if key == "text_config" and isinstance(value, dict) and getattr(base, key, None) is not None:
            new[key] = tiny_config(getattr(base, key)).to_dict()
        elif key == "vision_config" and isinstance(value, dict):
            text = new.get("text_config") or data.get("text_config") or {}
            new[key] = _tiny_vision(value, text.get("hidden_size", _TINY_HIDDEN))
        elif key in ("attn_config", "ffn_config") and isinstance(value, dict):
            new[key] = {**value, **{k: v for k, v in _TINY_FIELDS.items() if isinstance(value.get(k), int)}}


def _fit_mrope_sections(base, data: dict, present: Callable[[str], str | None], new: dict) -> None:
    """Multimodal RoPE splits head_dim / 2 frequencies into (temporal, height, width) sections: resized to the
    tiny head_dim."""
    rope = data.get("rope_parameters")
    mrope = "mrope_section" in (getattr(type(base), "ignore_keys_at_rope_validation", None) or ())
    if isinstance(rope, dict) and (isinstance(rope.get("mrope_section"), list) or (mrope and rope)):
        head_dim = new.get(present("head_dim") or "", _TINY_HEAD_DIM)
        half = (head_dim or _TINY_HEAD_DIM) // 2
        section = [half // 4, half // 4]
        new["rope_parameters"] = {**rope, "mrope_section": [half - sum(section), *section]}


def _apply_support_tiny(base, data: dict, new: dict) -> None:
    """The registry's per-architecture tiny fields (``support(model_type).tiny``), last."""
    for key, value in support(str(getattr(base, "model_type", ""))).tiny.items():
        # a dict (a sub-config such as dbrx's attn_config) adds to the fields the config already has
        current = new.get(key, data.get(key))
        new[key] = {**current, **value} if isinstance(value, dict) and isinstance(current, dict) else value


def _built_whole() -> contextlib.AbstractContextManager:
    """A context in which ``from_config`` builds a model whole on this process.

    Once ``TrainingArguments`` name a DeepSpeed ZeRO-3 config, transformers builds every model inside
    ``deepspeed.zero.Init``, which partitions its parameters over the processes (each holds an empty shard until
    DeepSpeed's engine gathers it): a tiny copy checked on one process would fail in its first layer ("'weight' must
    be 2-D"). transformers skips ``zero.Init`` inside its own ``set_zero3_state`` (meant for nested builds).
    """
    from transformers import modeling_utils
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    skip = getattr(modeling_utils, "set_zero3_state", None)
    if skip is None:  # pragma: no cover - a transformers without it: say what cannot be checked
        raise RuntimeError(
            "DeepSpeed ZeRO-3 is enabled and this transformers version has no way to build a model outside "
            "deepspeed.zero.Init (modeling_utils.set_zero3_state), so packing_hf cannot build the whole tiny copy "
            "its pre-flight check runs; set packing_preflight='off' and check the architecture with "
            "packing_hf.check_architecture in a process without the DeepSpeed config"
        )
    return skip()


def build_tiny_model(config, attn_implementation: str = "sdpa", seed: int = 0):
    """A tiny fp32 CPU causal LM from ``tiny_config(config)``, seeded, in eval mode.

    >>> build_tiny_model("qwen2").config.hidden_size
    64
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    cfg = tiny_config(config)
    # a vision-language wrapper that is no causal LM of the auto mappings (Qwen2-VL, LLaVA, ...)
    auto = AutoModelForCausalLM
    if (
        getattr(cfg, "text_config", None) is not None
        and cfg.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        auto = AutoModelForImageTextToText
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with _built_whole():
            model = auto.from_config(cfg, attn_implementation=resolve_attn_implementation(attn_implementation))
    finally:
        torch.random.set_rng_state(generator_state)  # do not disturb the caller's random stream
    return model.float().eval()
