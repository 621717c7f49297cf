"""The trainers of ``packing-hf train``: one entry per ``trainer:`` value, read by the config, the checks and
the jobs.

An entry says what the rest of the app would otherwise spell out in lists of names that must agree: the
packed trainer class and its config class (names in :mod:`packing_hf.integrations`, imported only when asked
for: a config is checked before transformers and TRL are imported), the package of its stock trainer, the data
it reads, the model head, how it gets a reference model, whether it generates its samples, whether it cuts
packed rows over ``sp_size`` processes itself, and which of the app's steps it takes (tokenizing, batching,
measuring). ``tests/integration/app/test_cli_every_trainer.py`` keeps each entry equal to its class.

>>> trainer_entry("dpo").data.columns, trainer_entry("dpo").reference
(('chosen', 'rejected'), 'ref_model')
>>> [name for name, entry in CATALOGUE.items() if entry.generates]
['grpo', 'rloo']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CATALOGUE",
    "PREFERENCE",
    "PROMPT_ONLY",
    "RECORDS",
    "TRAINERS",
    "UNPAIRED_PREFERENCE",
    "DataFormat",
    "TrainerEntry",
    "trainer_entry",
    "trainers_where",
]


@dataclass(frozen=True)
class DataFormat:
    """What a trainer's job reads: packing_hf's record formats (``records``: messages, conversations,
    question/answer, ..., told apart per record by :mod:`packing_hf.app.records`) or one of TRL's formats,
    with the columns it needs and those that may come with them (:mod:`packing_hf.app.trl_data`)."""

    name: str
    columns: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()


RECORDS = DataFormat("records")
PREFERENCE = DataFormat("preference", ("chosen", "rejected"), ("prompt",))
UNPAIRED_PREFERENCE = DataFormat("unpaired preference", ("prompt", "completion", "label"))
PROMPT_ONLY = DataFormat("prompt-only", ("prompt",))


@dataclass(frozen=True)
class TrainerEntry:
    """One trainer of ``packing-hf train``.

    Attributes:
        name: the ``trainer:`` value.
        trainer_name: the packed trainer's name in :mod:`packing_hf.integrations` (:meth:`trainer_class`).
        config_name: its training-arguments class there (:meth:`config_class`), which parses the config's
            training keys.
        package: where its stock trainer comes from (``transformers`` or ``trl``: TRL is looked up before the
            run starts).
        data: what its job reads (:class:`DataFormat`): ``RECORDS`` for the main job
            (:mod:`packing_hf.app.train`), one of TRL's formats for the TRL job
            (:mod:`packing_hf.app.trl_job`).
        head: the model it trains, a causal LM or a sequence classifier with a one-score head (``score``).
        reference: ``none``; ``ref_model`` (the stock trainer takes a ``ref_model``: the job hands it a frozen
            copy of the policy); ``with_beta`` (a reference only for a KL term, ``beta > 0``, which TRL loads
            by the policy's name).
        generates: its samples are prompts plus what the model generates (``reward_funcs`` score them;
            nothing is tokenized ahead, so no ``max_length``).
        sequence_parallel: it cuts packed rows over ``sp_size`` processes itself (its class's
            ``packing_sequence_parallel``).
        app_tokenizes: the app renders and tokenizes its records (``prompt_format``, ``overflow``); otherwise
            TRL does.
        always_packs: its batches are always packed (multipack with ``max_tokens_per_batch``, else
            padding-free); otherwise ``batching`` / ``sample_packing`` choose.
        measures: its job measures the held-out eval loss before and after training and the padded baseline.
    """

    name: str
    trainer_name: str
    config_name: str
    package: Literal["transformers", "trl"]
    data: DataFormat
    head: Literal["causal", "score"] = "causal"
    reference: Literal["none", "ref_model", "with_beta"] = "none"
    generates: bool = False
    sequence_parallel: bool = False
    app_tokenizes: bool = False
    always_packs: bool = True
    measures: bool = False

    @property
    def reads_records(self) -> bool:
        """It reads packing_hf's record formats (the main job), not one of TRL's (the TRL job)."""
        return self.data is RECORDS

    @property
    def reads_trl_format(self) -> bool:
        return not self.reads_records

    @property
    def chooses_batching(self) -> bool:
        return not self.always_packs

    @property
    def tokenizes_ahead(self) -> bool:
        return not self.generates

    @property
    def peft_task_type(self) -> str:
        """The PEFT task type of its adapter."""
        return "SEQ_CLS" if self.head == "score" else "CAUSAL_LM"

    def trainer_class(self) -> type:
        """The packed trainer class (imports transformers, and TRL for a TRL trainer)."""
        from .. import integrations

        return getattr(integrations, self.trainer_name)

    def config_class(self) -> type:
        """The training-arguments class (imports transformers, and TRL for a TRL trainer)."""
        from .. import integrations

        return getattr(integrations, self.config_name)


def _entries(*entries: TrainerEntry) -> dict[str, TrainerEntry]:
    return {entry.name: entry for entry in entries}


CATALOGUE: dict[str, TrainerEntry] = _entries(
    TrainerEntry(
        "trainer", "Trainer", "TrainingArguments", "transformers", RECORDS,
        sequence_parallel=True, app_tokenizes=True, always_packs=False, measures=True,
    ),
    TrainerEntry(
        "sft", "SFTTrainer", "SFTConfig", "trl", RECORDS, sequence_parallel=True, always_packs=False
    ),
    TrainerEntry(
        "dpo", "DPOTrainer", "DPOConfig", "trl", PREFERENCE, reference="ref_model", sequence_parallel=True
    ),
    TrainerEntry("kto", "KTOTrainer", "KTOConfig", "trl", UNPAIRED_PREFERENCE, reference="ref_model"),
    TrainerEntry("reward", "RewardTrainer", "RewardConfig", "trl", PREFERENCE, head="score"),
    TrainerEntry("orpo", "ORPOTrainer", "ORPOConfig", "trl", PREFERENCE),
    TrainerEntry("cpo", "CPOTrainer", "CPOConfig", "trl", PREFERENCE),
    TrainerEntry(
        "grpo", "GRPOTrainer", "GRPOConfig", "trl", PROMPT_ONLY, reference="with_beta", generates=True
    ),
    TrainerEntry(
        "rloo", "RLOOTrainer", "RLOOConfig", "trl", PROMPT_ONLY, reference="with_beta", generates=True
    ),
)  # fmt: skip
TRAINERS: tuple[str, ...] = tuple(CATALOGUE)


def trainer_entry(name: str) -> TrainerEntry:
    """The entry of ``trainer: name``.

    >>> trainer_entry("ppo")
    Traceback (most recent call last):
    ...
    ValueError: trainer must be one of trainer, sft, dpo, kto, reward, orpo, cpo, grpo, rloo; got 'ppo'
    """
    if name not in CATALOGUE:
        raise ValueError(f"trainer must be one of {', '.join(TRAINERS)}; got {name!r}")
    return CATALOGUE[name]


def trainers_where(attribute: str) -> tuple[str, ...]:
    """The trainers whose entry has ``attribute`` true.

    >>> trainers_where("measures")
    ('trainer',)
    """
    return tuple(name for name, entry in CATALOGUE.items() if getattr(entry, attribute))
