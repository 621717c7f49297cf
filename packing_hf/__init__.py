"""packing_hf: fast and exact sequence packing for Hugging Face Transformers and TRL.

Importing this package is light and changes nothing in transformers or torch: every public name is
resolved lazily on first access. Reading ``packing_hf.ATTENTION_NAME`` registers packing_hf's attention
with transformers (it adds a name, replaces nothing), so ``attn_implementation=packing_hf.ATTENTION_NAME``
works as is; ``patch_flash_attention()`` is the only call that swaps a transformers function, reversibly.

The top level names what users call: the trainers and their configs, the collators, the sampler, the
streams, the attention (its name and ``varlen_attention``), ``prepare_model_for_packing`` and the checks.
Everything else stays importable from its module (``packing_hf.varlen.lengths_to_cu_seqlens``,
``packing_hf.fixed.pack_sequences``, ``packing_hf.attention.patch_flash_attention``, ...). The names an earlier
top level exported still answer for this release, with a ``FutureWarning`` naming their module (``_MOVED``).

>>> import packing_hf
>>> packing_hf.PaddingFreeCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])["cu_seq_lens_q"].tolist()
[0, 3, 5]
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    # collator.py
    "PaddingFreeCollator": "collator",
    # sampler.py
    "MultipackBatchSampler": "sampler",
    "CostModel": "cost",
    "fit_cost_model": "cost",
    "lengths_from_dataset": "sampler",
    # preference.py: chosen/rejected pairs in one packed row
    "PaddingFreePreferenceCollator": "preference",
    "PaddingFreeRewardCollator": "preference",
    # unpaired.py: KTO examples and their KL completions as packed rows
    "PaddingFreeUnpairedCollator": "unpaired",
    # multimodal.py: image+text samples in one packed row
    "MultimodalCollator": "multimodal",
    # prefix_tree.py: samples sharing token prefixes as one prefix-tree row, each prefix computed once
    "build_prefix_tree": "prefix_tree",
    "PrefixTree": "prefix_tree",
    # tree_collator.py: a micro-batch as one prefix-tree row, its targets as (row, target, weight) pairs
    "PrefixTreeCollator": "tree_collator",
    # prefix_plan.py: samples grouped by shared prefixes, for the sampler to plan by computed tokens
    "find_prefix_groups": "prefix_plan",
    "PrefixGroups": "prefix_plan",
    # streaming/: iterable datasets packed on the fly
    "PackedStream": "streaming",
    "read_stream": "streaming",
    "streaming_dataset_reader": "streaming",
    # attention/
    "ATTENTION_NAME": "attention",
    "varlen_attention": "attention",
    "register_attention": "attention",
    "validate_packed_batch": "attention.guards",
    # verify.py: the packed-vs-alone check
    "check_packing": "verify",
    "PackingReport": "verify",
    # architectures/: preparing a model for packing, the architecture check
    "prepare_model_for_packing": "architectures",
    "revert_model_for_packing": "architectures",
    "check_architecture": "architectures",
    # integrations/
    "Trainer": "integrations",
    "TrainingArguments": "integrations",
    "SFTTrainer": "integrations",
    "SFTConfig": "integrations",
    "DPOTrainer": "integrations",
    "DPOConfig": "integrations",
    "RewardTrainer": "integrations",
    "RewardConfig": "integrations",
    "KTOTrainer": "integrations",
    "KTOConfig": "integrations",
    "ORPOTrainer": "integrations",
    "ORPOConfig": "integrations",
    "CPOTrainer": "integrations",
    "CPOConfig": "integrations",
    "TPOTrainer": "integrations",
    "TPOConfig": "integrations",
    "GRPOTrainer": "integrations",
    "GRPOConfig": "integrations",
    "RLOOTrainer": "integrations",
    "RLOOConfig": "integrations",
    "GMPOTrainer": "integrations",
    "GMPOConfig": "integrations",
}

__all__ = sorted([*_LAZY, "__version__"])

# Names the top level held in earlier versions -> the module each lives in now. Reading one still works for this
# release, with a FutureWarning naming the import to use: a forward, not an AttributeError, because
# `from packing_hf import pack_sequences` turns any AttributeError into a bare "cannot import name" and the
# pointer would be lost where old code meets it most.
_MOVED: dict[str, str] = {
    # boundary bookkeeping
    "lengths_to_cu_seqlens": "varlen",
    "cu_seqlens_to_lengths": "varlen",
    "lengths_to_position_ids": "varlen",
    "lengths_to_seq_idx": "varlen",
    "cu_seqlens_to_position_ids": "varlen",
    "cu_seqlens_to_seq_idx": "varlen",
    "position_ids_to_cu_seqlens": "varlen",
    "seq_lengths_to_cu_seqlens": "varlen",
    "max_length_from_cu_seqlens": "varlen",
    # shared-prefix layout
    "shared_prefix_position_ids": "shared_prefix",
    "shared_prefix_plan": "shared_prefix",
    "check_prefix_seq_idx": "shared_prefix",
    # fixed-length rows, online-RL rollouts
    "pack_sequences": "fixed",
    "concatenate_and_pack": "fixed",
    "pack_rollouts": "rollouts",
    "unpack_rollouts": "rollouts",
    # attention: backends, the flash-attention patch, shared-prefix attention, sequence parallelism
    "available_backends": "attention",
    "select_backend": "attention",
    "patch_flash_attention": "attention",
    "unpatch_flash_attention": "attention",
    "flash_attention_patched": "attention",
    "shared_prefix_attention": "attention",
    "shard_packed_batch": "attention.sequence_parallel",
    "sequence_parallel_loss": "shard_loss",
    "sequence_parallel_groups": "attention.sequence_parallel",
    "shard_loss_counts": "shard_loss",
    "check_sequence_parallel_model": "attention.sequence_parallel",
    # architectures
    "PackingPreparation": "architectures",
    "tiny_config": "architectures",
}

_TOLD: set[str] = set()  # the moved names whose warning was shown

_DISTILLATION = (
    "a distillation trainer: its loss compares the student's and a teacher's per-token distributions on "
    "the same padded batch, and packing_hf packs neither forward"
)
# TRL 1.16 trainers packing_hf does not pack: asking packing_hf for one names it and says why, instead of a
# bare "no attribute" (their padded TRL trainers work as they are)
_NOT_PACKED: dict[str, tuple[str, str]] = {
    "OnlineDPOTrainer": (
        "trl.experimental.online_dpo",
        "it generates the pairs it trains on and judges them in the same step; packing_hf packs offline "
        "preference data and the online rollouts of the GRPO family only",
    ),
    "AsyncGRPOTrainer": (
        "trl.experimental.async_grpo",
        "its rollouts come from an external vLLM server and are batched by its own queue; packing_hf packs "
        "GRPOTrainer / RLOOTrainer",
    ),
    "A2POTrainer": (
        "trl.experimental.a2po",
        "its value-estimation stage and regression loss run their own padded forwards, which are not packed",
    ),
    "GKDTrainer": ("trl.experimental.gkd", _DISTILLATION),
    "GOLDTrainer": ("trl.experimental.gold", _DISTILLATION),
    "DistillationTrainer": ("trl", _DISTILLATION),
    "AsyncDistillationTrainer": ("trl.experimental.async_distillation", _DISTILLATION),
    "ServerDistillationTrainer": ("trl.experimental.server_distillation", _DISTILLATION),
    "IWOPDTrainer": ("trl.experimental.iw_opd", _DISTILLATION),
    "SDFTTrainer": ("trl.experimental.sdft", _DISTILLATION),
    "SDPOTrainer": ("trl.experimental.sdpo", _DISTILLATION),
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        if name in _MOVED:
            home = f"packing_hf.{_MOVED[name]}"
            value = getattr(importlib.import_module(home), name)
            # once per name and process, kept here: `from packing_hf import x` reads the name twice, and the
            # warnings registry that would show it once is reset whenever an import changes the filters
            # (transformers' does)
            if name not in _TOLD:
                _TOLD.add(name)
                warnings.warn(
                    f"packing_hf.{name} moved to {home}: import it from there (`from {home} import {name}`); "
                    "the top-level name is a forward that will be removed in the next release",
                    FutureWarning,
                    stacklevel=2,
                )
            return value
        if name in _NOT_PACKED:
            where, why = _NOT_PACKED[name]
            packed = ", ".join(n for n in __all__ if n.endswith("Trainer"))
            raise AttributeError(
                f"packing_hf has no {name}: {why}. Use {where}.{name} with padded batches; the trainers "
                f"packing_hf packs exactly are {packed}"
            )
        raise AttributeError(f"module 'packing_hf' has no attribute {name!r}")
    module = importlib.import_module(f"packing_hf.{module_name}")
    if name == "ATTENTION_NAME":
        # `attn_implementation=packing_hf.ATTENTION_NAME` must work as soon as the name is read: registering
        # adds a key to transformers' attention registries (it replaces nothing and patches nothing)
        value = module.register_attention()
    else:
        value = getattr(module, name)
    globals()[name] = value  # cache: the next access skips __getattr__
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # static type checkers and IDEs see the real names
    from .architectures import check_architecture, prepare_model_for_packing, revert_model_for_packing
    from .attention import ATTENTION_NAME, register_attention, varlen_attention
    from .attention.guards import validate_packed_batch
    from .collator import PaddingFreeCollator
    from .cost import CostModel, fit_cost_model
    from .integrations import (
        CPOConfig,
        CPOTrainer,
        DPOConfig,
        DPOTrainer,
        GMPOConfig,
        GMPOTrainer,
        GRPOConfig,
        GRPOTrainer,
        KTOConfig,
        KTOTrainer,
        ORPOConfig,
        ORPOTrainer,
        RewardConfig,
        RewardTrainer,
        RLOOConfig,
        RLOOTrainer,
        SFTConfig,
        SFTTrainer,
        TPOConfig,
        TPOTrainer,
        Trainer,
        TrainingArguments,
    )
    from .multimodal import MultimodalCollator
    from .preference import PaddingFreePreferenceCollator, PaddingFreeRewardCollator
    from .prefix_plan import PrefixGroups, find_prefix_groups
    from .prefix_tree import PrefixTree, build_prefix_tree
    from .sampler import MultipackBatchSampler, lengths_from_dataset
    from .streaming import PackedStream, read_stream, streaming_dataset_reader
    from .tree_collator import PrefixTreeCollator
    from .unpaired import PaddingFreeUnpairedCollator
    from .verify import PackingReport, check_packing
