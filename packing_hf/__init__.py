"""packing_hf: fast and exact sequence packing for Hugging Face Transformers and TRL.

Importing this package is light and changes nothing in transformers or torch: every public name is
resolved lazily on first access. Reading ``packing_hf.ATTENTION_NAME`` registers packing_hf's attention
with transformers (it adds a name, replaces nothing), so ``attn_implementation=packing_hf.ATTENTION_NAME``
works as is; ``patch_flash_attention()`` is the only call that swaps a transformers function, reversibly.

>>> import packing_hf
>>> packing_hf.lengths_to_cu_seqlens([3, 2]).tolist()
[0, 3, 5]
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    # varlen.py: pure-torch boundary bookkeeping
    "lengths_to_cu_seqlens": "varlen",
    "cu_seqlens_to_lengths": "varlen",
    "lengths_to_position_ids": "varlen",
    "lengths_to_seq_idx": "varlen",
    "cu_seqlens_to_position_ids": "varlen",
    "cu_seqlens_to_seq_idx": "varlen",
    "position_ids_to_cu_seqlens": "varlen",
    "seq_lengths_to_cu_seqlens": "varlen",
    "max_length_from_cu_seqlens": "varlen",
    # shared_prefix.py: branches attending to a shared prefix segment
    "shared_prefix_position_ids": "shared_prefix",
    "shared_prefix_plan": "shared_prefix",
    "check_prefix_seq_idx": "shared_prefix",
    # collator.py / fixed.py
    "PaddingFreeCollator": "collator",
    "pack_sequences": "fixed",
    "concatenate_and_pack": "fixed",
    # sampler.py
    "MultipackBatchSampler": "sampler",
    "lengths_from_dataset": "sampler",
    "CostModel": "cost",
    "fit_cost_model": "cost",
    # preference.py: chosen/rejected pairs in one packed row
    "PaddingFreePreferenceCollator": "preference",
    "PaddingFreeRewardCollator": "preference",
    # unpaired.py: KTO examples and their KL completions as packed rows
    "PaddingFreeUnpairedCollator": "unpaired",
    # multimodal.py: image+text samples in one packed row
    "MultimodalCollator": "multimodal",
    # rollouts.py: online-RL rollouts in packed rows
    "pack_rollouts": "rollouts",
    "unpack_rollouts": "rollouts",
    # streaming/: iterable datasets packed on the fly
    "PackedStream": "streaming",
    "read_stream": "streaming",
    "streaming_dataset_reader": "streaming",
    # attention/
    "ATTENTION_NAME": "attention",
    "varlen_attention": "attention",
    "available_backends": "attention",
    "select_backend": "attention",
    "patch_flash_attention": "attention",
    "unpatch_flash_attention": "attention",
    "flash_attention_patched": "attention",
    "register_attention": "attention",
    "shared_prefix_attention": "attention",
    "validate_packed_batch": "attention.guards",
    # attention/sequence_parallel.py: Ulysses sequence parallelism over packed rows
    "shard_packed_batch": "attention.sequence_parallel",
    "sequence_parallel_loss": "attention.sequence_parallel",
    "shard_loss_counts": "attention.sequence_parallel",
    "sequence_parallel_groups": "attention.sequence_parallel",
    "check_sequence_parallel_model": "attention.sequence_parallel",
    # verify.py: the packed-vs-alone check
    "check_packing": "verify",
    "PackingReport": "verify",
    # architectures/: registry, per-model fixes, tiny copies, the sweep
    "prepare_model_for_packing": "architectures",
    "revert_model_for_packing": "architectures",
    "PackingPreparation": "architectures",
    "check_architecture": "architectures",
    "tiny_config": "architectures",
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
    from .architectures import (
        PackingPreparation,
        check_architecture,
        prepare_model_for_packing,
        revert_model_for_packing,
        tiny_config,
    )
    from .attention import (
        ATTENTION_NAME,
        available_backends,
        flash_attention_patched,
        patch_flash_attention,
        register_attention,
        select_backend,
        shared_prefix_attention,
        unpatch_flash_attention,
        varlen_attention,
    )
    from .attention.guards import validate_packed_batch
    from .attention.sequence_parallel import (
        check_sequence_parallel_model,
        sequence_parallel_groups,
        sequence_parallel_loss,
        shard_loss_counts,
        shard_packed_batch,
    )
    from .collator import PaddingFreeCollator
    from .cost import CostModel, fit_cost_model
    from .fixed import concatenate_and_pack, pack_sequences
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
    from .rollouts import pack_rollouts, unpack_rollouts
    from .sampler import MultipackBatchSampler, lengths_from_dataset
    from .shared_prefix import check_prefix_seq_idx, shared_prefix_plan, shared_prefix_position_ids
    from .streaming import PackedStream, read_stream, streaming_dataset_reader
    from .unpaired import PaddingFreeUnpairedCollator
    from .varlen import (
        cu_seqlens_to_lengths,
        cu_seqlens_to_position_ids,
        cu_seqlens_to_seq_idx,
        lengths_to_cu_seqlens,
        lengths_to_position_ids,
        lengths_to_seq_idx,
        max_length_from_cu_seqlens,
        position_ids_to_cu_seqlens,
        seq_lengths_to_cu_seqlens,
    )
    from .verify import PackingReport, check_packing
