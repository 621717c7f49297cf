"""The architecture registry: how packing works for every causal-LM ``model_type`` (data only: what the
attention admits, and the process state of prepared models, live in :mod:`packing_hf.attention.admission`).

Every causal-LM architecture falls in one of four classes (measured by the architecture sweep,
:mod:`packing_hf.architectures.sweep`, and written to ``docs/architectures.md`` by ``tools/gen_arch_table.py``):

- ``exact``: transformers' own mask creation already keeps packed samples apart (it reads restarting
  ``position_ids``); only the batch guards are needed (no cache, no attention mask).
- ``mask``: the model builds its causal mask *without* ``position_ids`` (OPT, BLOOM, MPT, gpt-oss,
  Falcon before transformers 5.24, ...), so every token sees the previous samples of the row;
  :mod:`packing_hf.architectures.prepare` restricts the mask each decoder layer receives to same-sample pairs. ALiBi (BLOOM, MPT, Falcon) stays
  exact: its bias is linear in the key position, so the per-sample offset is a constant per query row,
  which softmax ignores; attention sinks (gpt-oss) are a per-head logit, also independent of the row.
- ``mixers``: hybrid and recurrent models whose non-attention token mixers (Mamba/Mamba2 scans, gated
  DeltaNet, KDA, lightning attention, RG-LRU blocks, short convolutions) carry a state or a convolution
  window along the row, whatever the mask says; :mod:`packing_hf.architectures.prepare` runs each mixer
  module (named in :attr:`ArchitectureSupport.mixers`) on the row's samples as a right-padded batch
  (:mod:`packing_hf.architectures.mixers`), which is exact because every such mixer is causal from a zero
  state. Their attention layers keep samples apart as in ``exact``.
- ``refused``: layers that carry information along the row and that packing_hf cannot split per sample
  (sparse top-k selection, pooled key blocks, models with no per-token mixer module to hook).
- ``unknown`` (not registered): checked on a tiny copy of its config the first time it is prepared.

>>> support("llama").status, support("opt").status, support("bamba").status, support("deepseek_v32").status
('exact', 'mask', 'mixers', 'refused')
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Literal

__all__ = [
    "IMAGE_BLOCK_MASK",
    "IMAGE_ROWS_UNVERIFIED",
    "IMAGE_ROWS_VERIFIED",
    "MIXERS_BY_LAYER_TYPE",
    "PREFIX_TREE_MIXERS",
    "REGISTRY",
    "UNSEEN_BY_ATTENTION",
    "ArchitectureSupport",
    "Status",
    "iter_sweep",
    "multimodal_refusal",
    "router_loss_coefficient",
    "support",
    "wrapper_text_config",
]

Status = Literal["exact", "mask", "mixers", "refused", "unknown"]


@dataclass(frozen=True)
class ArchitectureSupport:
    """How packing works for one ``model_type``.

    Attributes:
        model_type: ``config.model_type``.
        status: ``"exact"``, ``"mask"`` or ``"mixers"`` (both fixed by
            :func:`packing_hf.prepare_model_for_packing`), ``"refused"`` or ``"unknown"`` (not in the registry;
            checked on a tiny copy when prepared).
        reason: why stock transformers leaks, or why packing is refused.
        own_attention: the model computes attention itself instead of dispatching through
            ``AttentionInterface``, so ``attn_implementation=packing_hf.ATTENTION_NAME`` cannot apply.
        inverted_bool_mask: the model's boolean attention masks mean True = masked (MPT), instead of
            transformers' True = attend.
        mask_fix: a ``"mixers"`` model whose attention mask also ignores ``position_ids``: its decoder layers get
            the per-sample mask of status ``"mask"`` as well.
        mixers: class names of the non-attention token-mixer modules that
            :func:`packing_hf.prepare_model_for_packing` runs per sample (status ``"mixers"``).
        split_stack: every block is a mixer (a pure state-space model): the whole block stack runs on the
            samples as a right-padded batch, split once before the first block and joined after the last.
        tiny: config fields for the tiny copy used by the sweep (on top of :func:`packing_hf.architectures.tiny.tiny_config`).
        sweep: whether the architecture sweep (table and test) covers it.

    >>> support("bloom").own_attention
    True
    """

    model_type: str
    status: Status
    reason: str = ""
    own_attention: bool = False
    inverted_bool_mask: bool = False
    tiny: dict[str, Any] = field(default_factory=dict)
    sweep: bool = True
    mixers: tuple[str, ...] = ()
    mask_fix: bool = False
    split_stack: bool = False


def _entry(model_type: str, status: Status, reason: str = "", **kwargs: Any) -> ArchitectureSupport:
    return ArchitectureSupport(model_type, status, reason, **kwargs)


def _transformers_at_least(wanted: str) -> bool:
    """Whether the installed transformers is ``wanted`` (``"5.24"``) or newer: entries whose leak a release
    fixed depend on it.

    >>> _transformers_at_least("5.0")
    True
    """
    from packaging.version import Version

    return Version(version("transformers")) >= Version(wanted)


# transformers 5.24 moved Falcon, CodeGen and GPT-J onto create_causal_mask (and the last two onto
# AttentionInterface): their entries depend on it
_TRANSFORMERS_5_24 = _transformers_at_least("5.24")

_NO_POSITION_MASK = "builds its causal mask without position_ids, so packed samples attend to earlier samples"
_ALIBI = "; ALiBi stays exact once the mask is per sample (its bias shifts by a per-row constant)"
_SSM = (
    "layers carry their scan state and convolution window across the row (transformers' torch path takes no "
    "seq_idx)"
)
_STATE = "layers carry a recurrent state across the whole row"
_CONV = "short causal convolutions mix the last tokens of one sample into the next; they take no seq_idx"
_DELTANET = (
    "gated DeltaNet layers carry their state and convolution across the row (transformers' torch path raises "
    "on cu_seqlens without fla)"
)
_DSA = (
    "the DSA indexer picks top-k keys over ReLU scores, whose ties are broken by absolute key index, so the "
    "selected keys depend on where a sample sits in the row"
)
_OWN = "computes attention itself (not through AttentionInterface): use eager with packing"
_ENCODER = "an encoder (bidirectional) architecture, not a causal decoder"
_ENC_DEC = "the decoder of an encoder-decoder model: positions come from the input length, not position_ids"
_MULTIMODAL = "a multimodal wrapper: pack its text-only variant (e.g. the *_text model type) instead"

_ENTRIES = [
    # --- exact on stock eager/sdpa: mask creation reads the restarting position_ids ----------------
    *[
        _entry(m, "exact")
        for m in (
            "apertus arcee aria_text beam bitnet cohere cohere2 cohere2_moe cwm deepseek_v2 deepseek_v3 "
            "diffllama doge ernie4_5 ernie4_5_moe exaone4 exaone_moe flex_olmo flint gemma gemma2 gemma3_text "
            "glm glm4 glm4_moe glm4_moe_lite gpt-sw3 gpt2 gpt_bigcode gpt_neox granite granite_swa granitemoe "
            "granitemoe_swa granitemoeshared helium hunyuan_v1_dense hunyuan_v1_moe hy_v3 hyperclovax "
            "internlm3 iquestcoder jais2 jetmoe kolibri1 laguna llama llama4_text longcat_flash mellum "
            "mimo_v2_flash minicpm3 minimax_m2 minimax_m3_vl_text ministral ministral3 mistral mixtral "
            "modernbert-decoder nanochat nemotron olmo olmo2 olmo3 olmoe persimmon phi phi3 phimoe qwen2 "
            "qwen2_moe qwen3 qwen3_moe seed_oss smollm3 solar_open stablelm starcoder2 vaultgemma youtu axk1 "
            "apertus1p5_text exaone sarvam_mla sarvam_moe"
        ).split()
    ],
    # the model's own attention code ignores the varlen implementation's (absent) mask
    _entry(
        "dory",
        "exact",
        # its saved config lists attention and MLP blocks apart ("mlp" entries, counts doubled): give the pairs
        tiny={
            "num_hidden_layers": 4,
            "n_input_layers": 1,
            "n_recurrent_layers": 2,
            "n_output_layers": 1,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        },
    ),
    _entry("codegen", "exact", "", own_attention=not _TRANSFORMERS_5_24),
    _entry("gpt_neox_japanese", "exact", "", own_attention=True),
    _entry("gpt_neo", "exact", "", own_attention=True),
    _entry("gptj", "exact", "", own_attention=not _TRANSFORMERS_5_24),
    _entry("ctrl", "exact"),
    # causal decoders of transformers 5.23 added to the sweep (issue 18); the tiny fields fill what their
    # default configs leave unset (or too large for a tiny copy)
    _entry("gemma4_text", "exact"),
    _entry("gemma4_unified_text", "exact"),
    _entry("hrm_text", "exact", tiny={"num_layers_per_stack": 1}),  # keeps its H/L cycles over the stack
    _entry("gemma3n_text", "exact", tiny={"num_kv_shared_layers": 0}),
    _entry(
        "cohere_compass_text",
        "exact",
        tiny={"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    ),
    _entry("dbrx", "exact", tiny={"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}}),
    _entry("dots1", "exact", tiny={"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2}),
    # --- fixed by restricting the mask per sample -------------------------------------------------
    _entry("opt", "mask", _NO_POSITION_MASK),
    _entry("biogpt", "mask", _NO_POSITION_MASK),
    _entry("afmoe", "mask", _NO_POSITION_MASK + " (full and sliding-window layers)"),
    _entry("gpt_oss", "mask", _NO_POSITION_MASK + "; attention sinks are per-head logits, unaffected"),
    _entry("bloom", "mask", _NO_POSITION_MASK + _ALIBI, own_attention=True),
    _entry("falcon", "exact", "", own_attention=True)
    if _TRANSFORMERS_5_24
    else _entry("falcon", "mask", _NO_POSITION_MASK + _ALIBI, own_attention=True),
    _entry("mpt", "mask", _NO_POSITION_MASK + _ALIBI, own_attention=True, inverted_bool_mask=True),
    _entry("xglm", "mask", _NO_POSITION_MASK, own_attention=True),
    _entry(
        "openai-gpt",
        "mask",
        "applies a fixed causal triangle and ignores position_ids in its mask",
        own_attention=True,
    ),
    # --- fixed by running every non-attention token mixer per sample (right-padded) ----------------
    _entry("bamba", "mixers", f"Mamba2 {_SSM}", tiny={"attn_layer_indices": [1]}, mixers=("BambaMixer",)),
    _entry(
        "jamba",
        "mixers",
        f"Mamba {_SSM}",
        tiny={"attn_layer_period": 2, "attn_layer_offset": 1},
        mixers=("JambaMambaMixer",),
    ),
    _entry("falcon_h1", "mixers", f"Mamba2 {_SSM}", tiny={"mamba_d_ssm": 128}, mixers=("FalconH1Mixer",)),
    _entry("falcon_mamba", "mixers", f"Mamba {_SSM}", mixers=("FalconMambaMixer",), split_stack=True),
    _entry("mamba", "mixers", f"Mamba {_SSM}", mixers=("MambaMixer",), split_stack=True),
    _entry(
        "mamba2",
        "mixers",
        f"Mamba2 {_SSM}",
        tiny={"num_heads": 4, "head_dim": 32},
        mixers=("Mamba2Mixer",),
        split_stack=True,
    ),
    _entry(
        "granitemoehybrid",
        "mixers",
        f"Mamba2 {_SSM}; its attention mask is built without position_ids",
        mask_fix=True,
        tiny={"layer_types": ["mamba", "attention"]},
        mixers=("GraniteMoeHybridMambaLayer",),
    ),
    _entry("nemotron_h", "mixers", f"Mamba2 {_SSM}", mixers=("NemotronHMamba2Mixer",)),
    _entry("zamba", "mixers", f"Mamba {_SSM}", mixers=("ZambaMambaMixer",)),
    _entry("zamba2", "mixers", f"Mamba2 {_SSM}", tiny={"mamba_headdim": 16}, mixers=("Zamba2MambaMixer",)),
    _entry("bailing_hybrid", "mixers", f"linear-attention {_STATE}", mixers=("BailingHybridDeltaAttention",)),
    _entry("kimi_linear", "mixers", f"KDA linear-attention {_STATE}", mixers=("KimiLinearDeltaAttention",)),
    _entry(
        "minimax", "mixers", f"lightning (linear) attention {_STATE}", mixers=("MiniMaxLightningAttention",)
    ),
    _entry(
        "lfm2",
        "mixers",
        _CONV,
        tiny={"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
        mixers=("Lfm2ShortConv",),
    ),
    _entry(
        "lfm2_moe",
        "mixers",
        _CONV,
        tiny={"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
        mixers=("Lfm2MoeShortConv",),
    ),
    _entry("lfm3", "mixers", _CONV, mixers=("Lfm3ShortConv",)),
    _entry(
        "inkling_text",
        "mixers",
        _CONV + " (k/v and block short convolutions)",
        mixers=("InklingShortConvolution",),
    ),
    _entry(
        "inkling2_text",
        "mixers",
        _CONV + " (k/v short convolutions)",
        own_attention=True,
        mixers=("Inkling2ShortConvolution", "Inkling2DynamicShortConvolution"),
    ),
    _entry(
        "inkling2_loop_text",
        "refused",
        _CONV
        + "; with them run per sample its logits match every sample alone, but exactness is not proven: "
        "it cannot be copied to fp64 (its loop gates cast to float32) and the first sample's gradients differ "
        "from it alone by 4.5e-5 with or without packing_hf's fix, above the fixed 1e-5 tolerance",
        own_attention=True,
    ),
    _entry("qwen3_next", "mixers", _DELTANET, mixers=("Qwen3NextGatedDeltaNet",)),
    _entry("lara_mini", "mixers", _DELTANET, mixers=("LaraMiniGatedDeltaNet",)),
    _entry("qwen3_5_text", "mixers", _DELTANET, mixers=("Qwen3_5GatedDeltaNet",)),
    _entry("qwen3_5_moe_text", "mixers", _DELTANET, mixers=("Qwen3_5MoeGatedDeltaNet",)),
    _entry("olmo_hybrid", "mixers", _DELTANET, mixers=("OlmoHybridGatedDeltaNet",)),
    _entry(
        "zaya",
        "refused",
        _CONV + " (the query/key convolutions of its compressed attention)",
        tiny={"num_experts_per_tok": 1},
    ),
    _entry(
        "qwen4_exp_text",
        "refused",
        _DELTANET,
        tiny={
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 8,
            "indexer_compress_ratio": 2,
            "ngram_vocab_size_base": 512,
            "ple_embed_dim": 64,
            "hc_lowrank": 16,
            "split_ngram_parts": 4,
            "make_ngram_vocab_size_divisible_by": 8,
        },
    ),
    _entry(
        "recurrent_gemma",
        "mixers",
        "the convolution of its RG-LRU recurrent blocks runs across the whole row",
        tiny={"num_hidden_layers": 3},  # recurrent, recurrent, attention
        mixers=("RecurrentGemmaRecurrentBlock",),
    ),
    # --- refused ----------------------------------------------------------------------------------
    _entry("rwkv", "refused", "RWKV time-mixing is a recurrence over the whole row", own_attention=True),
    _entry("xlstm", "refused", "xLSTM blocks are a recurrence over the whole row", own_attention=True),
    _entry("deepseek_v32", "refused", _DSA),
    _entry("glm_moe_dsa", "refused", _DSA),
    _entry("axk2", "refused", _DSA),
    _entry("dots3_note_text", "refused", _DSA, tiny={"head_dim": 16, "index_topk": 4}),
    _entry("hy_v4", "refused", _DSA, own_attention=True),
    _entry(
        "deepseek_v4",
        "refused",
        "compressed (pooled) key/value blocks are built over the whole row, across sample boundaries",
        own_attention=True,
    ),
    _entry(
        "cpmant",
        "refused",
        "relative position buckets and segment ids are computed from the row, ignoring position_ids",
        own_attention=True,
    ),
    *[
        _entry(m, "refused", _ENCODER, sweep=False)
        for m in (
            "bert bert-generation big_bird camembert data2vec-text electra ernie megatron-bert rembert roberta "
            "roberta-prelayernorm roc_bert roformer xlm xlm-roberta xlm-roberta-xl xmod xlnet reformer"
        ).split()
    ],
    *[
        _entry(m, "refused", _ENC_DEC, sweep=False)
        for m in (
            "bart bigbird_pegasus blenderbot blenderbot-small marian mbart mvp pegasus plbart prophetnet trocr whisper"
        ).split()
    ],
    *[
        _entry(m, "refused", _MULTIMODAL, sweep=False)
        for m in (
            "dots3_note emu3 fuyu gemma3n gemma4_unified gemma4_unified_assistant gemma4_assistant git "
            "moshi moss_transcribe_diarize musicgen musicgen_melody phi4_multimodal qwen4_exp blt"
        ).split()
    ],
]

REGISTRY: dict[str, ArchitectureSupport] = {e.model_type: e for e in _ENTRIES}

# --- vision-language wrappers (``*ForConditionalGeneration`` with a ``text_config``) ---------------------
# The wrapper's language model is a text decoder whose own entry decides (text-only and image+text data
# alike); these are the wrapper-specific parts that cannot be kept per sample, by wrapper model_type and by
# kind of data ("text": packed text-only rows, "image": packed rows holding images).
_CROSS_ATTENTION = (
    "image+text rows: its cross-attention layers attend from every text token to the images of the whole "
    "batch row (cross_attention_mask is per row, not per packed sample)"
)
_UNVERIFIED_BLOCKS = (
    "image+text rows: its image tokens attend bidirectionally within their image (token_type_ids), a mask "
    "packing_hf has not verified per sample for this model"
)
# wrappers whose image+text rows are refused because packing_hf has not verified their image masks per sample
IMAGE_ROWS_UNVERIFIED = frozenset({"gemma4", "paligemma", "molmo2", "deepseek_ocr2"})
_MULTIMODAL_REFUSED: dict[tuple[str, str], str] = {
    ("mllama", "image"): _CROSS_ATTENTION,
    **{(m, "image"): _UNVERIFIED_BLOCKS for m in IMAGE_ROWS_UNVERIFIED},
}
# wrappers whose packed image+text rows tests/integration/architectures/test_multimodal.py proves exact (every
# sample's logits and gradients alone, synthetic images of different sizes, negative controls); that test module
# parametrizes over this set and fails if a member has no test
IMAGE_ROWS_VERIFIED = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava"})
# wrappers whose image tokens attend bidirectionally within their image block (token_type_ids == 1):
# prepare_model_for_packing hands their layers per-sample block masks on packed image rows
IMAGE_BLOCK_MASK = frozenset({"gemma3"})


def wrapper_text_config(config: Any) -> Any | None:
    """The text decoder's config of a multimodal wrapper (``config.text_config``), or ``None`` for a text model.

    A wrapper is a config holding a ``text_config`` of its own model type next to a vision (or audio) tower:
    its language model is a text decoder whose registry entry decides whether packed rows stay exact.

    >>> from transformers import AutoConfig
    >>> wrapper_text_config(AutoConfig.for_model("llava")).model_type
    'llama'
    >>> wrapper_text_config(AutoConfig.for_model("llama")) is None
    True
    """
    text = getattr(config, "text_config", None)
    if text is None or text is config or not hasattr(text, "model_type"):
        return None
    if getattr(text, "model_type", None) == getattr(config, "model_type", None):
        return None
    return text


def router_loss_coefficient(config: Any, model: Any = None) -> float:
    """The weight of the router load-balancing loss (MoE) in the model's own loss: ``router_aux_loss_coef`` (of
    ``model`` when it has one: the MoE causal LMs copy it from the config when built) when
    ``output_router_logits`` is set on ``config`` or on a multimodal wrapper's text config, else 0.

    >>> from types import SimpleNamespace
    >>> router_loss_coefficient(SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.02))
    0.02
    >>> router_loss_coefficient(SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.02))
    0.0
    """
    if config is None:
        return 0.0
    for holder in (config, wrapper_text_config(config)):
        if holder is not None and getattr(holder, "output_router_logits", False):
            # no coefficient on a config asking for router logits: its weight is unknown, read as counted (1)
            coefficient = getattr(model, "router_aux_loss_coef", None)
            if coefficient is None:
                coefficient = getattr(holder, "router_aux_loss_coef", 1.0)
            return float(coefficient or 0.0)
    return 0.0


def multimodal_refusal(model_type: str, data: Literal["text", "image"]) -> str | None:
    """Why the wrapper ``model_type`` cannot pack ``data`` rows exactly (``None``: its text decoder decides).

    Image+text rows are served only for the wrappers in ``IMAGE_ROWS_VERIFIED``: any other wrapper's image
    handling (its vision tower, image-token positions and masks) has no proof per sample, so its image rows are
    refused rather than trusted.

    >>> multimodal_refusal("mllama", "text") is None, multimodal_refusal("mllama", "image") is not None
    (True, True)
    >>> multimodal_refusal("qwen2_vl", "image") is None, multimodal_refusal("llava_next", "image") is not None
    (True, True)
    """
    known = _MULTIMODAL_REFUSED.get((model_type, data))
    if known is not None or data != "image" or model_type in IMAGE_ROWS_VERIFIED:
        return known
    return (
        "image+text rows: packing_hf has not verified this wrapper's image handling per sample (proven exact: "
        f"{', '.join(sorted(IMAGE_ROWS_VERIFIED))})"
    )


def support(model_type: str) -> ArchitectureSupport:
    """The registry entry of ``model_type`` (status ``"unknown"`` when it is not registered).

    >>> support("not_a_model").status
    'unknown'
    """
    return REGISTRY.get(model_type) or ArchitectureSupport(
        model_type, "unknown", "not in packing_hf's registry"
    )


def iter_sweep() -> Iterator[ArchitectureSupport]:
    """Registry entries covered by the architecture sweep, in model-type order.

    >>> len(list(iter_sweep())) >= 30
    True
    """
    return iter(sorted((e for e in REGISTRY.values() if e.sweep), key=lambda e: e.model_type))


# Models that consult neither the attention nor the mask interface (no attention at all, or attention and
# masks computed in the model's own code): loaded with attn_implementation=packing_hf.ATTENTION_NAME they
# never call packing_hf, so only prepare_model_for_packing / packing_hf.Trainer (which refuse or fix them)
# can see them. Listed in the docs; the architecture test keeps this set exact.
UNSEEN_BY_ATTENTION = frozenset({"cpmant", "falcon_mamba", "mamba", "mamba2", "openai-gpt", "rwkv", "xlstm"})

# "mixers" models that build a token mixer only at the layers whose config.layer_types entry is not attention:
# a config whose layers are all attention has no mixer and packs like an "exact" one (read the layers, not the
# type). tests/unit/architectures/test_registry.py builds every one attention-only and finds no mixer module;
# zamba, zamba2 and the inkling models keep mixers whatever layer_types says, the Mamba-family configs derive
# layer_types from other fields.
MIXERS_BY_LAYER_TYPE = frozenset(
    "bailing_hybrid kimi_linear lara_mini lfm2 lfm2_moe lfm3 minimax olmo_hybrid qwen3_5_moe_text qwen3_5_text "
    "qwen3_next".split()
)

# "mixers" models whose prepared mixers run a prefix-tree row exactly: each segment on a row holding its
# root-to-segment path (packing_hf.architectures.boundaries.tree_layout), so it starts from its parent's final
# state. Each is proven by tests/integration/attention/test_prefix_tree.py (every sample alone, fp32 logits,
# losses and gradients, with a negative control); the others stay refused
# (packing_hf.attention.admission.prefix_tree_refusal).
PREFIX_TREE_MIXERS = frozenset(
    "bailing_hybrid bamba falcon_h1 granitemoehybrid inkling_text jamba kimi_linear lara_mini lfm2 lfm2_moe lfm3 "
    "minimax nemotron_h olmo_hybrid qwen3_5_moe_text qwen3_5_text qwen3_next recurrent_gemma zamba zamba2".split()
)
