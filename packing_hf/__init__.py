"""packing_hf: fast and exact sequence packing for Hugging Face Transformers and TRL.

Importing this package is light and changes nothing in transformers or torch: every public name is
resolved lazily on first access. Reading ``packing_hf.ATTENTION_NAME`` registers packing_hf's attention
with transformers (it adds a name, replaces nothing), so ``attn_implementation=packing_hf.ATTENTION_NAME``
works as is; ``patch_flash_attention()`` is the only call that swaps a transformers function, reversibly.

The top level names what users call: the trainers and their configs, the collators, the sampler, the
streams, the attention (its name and ``varlen_attention``), ``prepare_model_for_packing`` and the checks.
Everything else stays importable from its module (``packing_hf.varlen.lengths_to_cu_seqlens``,
``packing_hf.fixed.pack_sequences``, ``packing_hf.attention.patch_flash_attention``, ...).

>>> import packing_hf
>>> packing_hf.PaddingFreeCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])["cu_seq_lens_q"].tolist()
[0, 3, 5]
"""

from __future__ import annotations

import importlib
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
    from .sampler import MultipackBatchSampler, lengths_from_dataset
    from .streaming import PackedStream, read_stream, streaming_dataset_reader
    from .unpaired import PaddingFreeUnpairedCollator
    from .verify import PackingReport, check_packing
