"""The run's parallel layout, owned by one object: :class:`ParallelPlan`, built once when a packed trainer makes its
accelerator, asked by every other integrations module.

What it holds: the engine (none, DDP, DeepSpeed ZeRO-1/2/3, FSDP1/2, DataParallel), the world and this process's
rank **from the process group it runs in** (``torch.distributed``), the data-parallel size and rank the samplers
and streams shard over, the sequence-parallel (SP) size, rank and group (a real ``DeviceMesh`` with dimensions
``("dp", "sp")``), and the sizes accelerate was told (``tp_size`` / ``cp_size`` / ``sp_size`` of the
``ParallelismConfig`` it got: packing_hf keeps ``sp_size`` to itself where it serves it, see
:mod:`packing_hf.integrations.sequence_parallel`; under FSDP2 accelerate gets the data-parallel layout alone,
:func:`fsdp_layout`).

Why from the process group: transformers and accelerate count the processes themselves, and can be wrong about
it. Under DeepSpeed on a machine without GPUs and without ``use_cpu=True``, accelerate starts DeepSpeed's
process group of N processes but reports one process (``args.world_size == 1``): every rank would draw the
whole dataset, each sample trained N times per epoch. Under ``torchrun`` on CPU without ``use_cpu=True`` no
process group is started at all, and each of the N processes trains its own copy on all the data. Both are
refused by name here, with the fix (:func:`process_world`): a user launching N processes expects each sample
once per epoch across them, and neither set-up can give that (the first one's loss scaling and gradient
averaging disagree; the second one has no group to average over). Likewise FSDP asked for where accelerate runs
DDP (on CPU: accelerate enables FSDP on accelerators only), which would replicate what the user asked to shard.

Inside :mod:`packing_hf.integrations`, this module and :mod:`packing_hf.integrations.launcher` (what
``accelerate launch`` was asked for against what its processes got) are the only ones that read parallel sizes
or world sizes (from arguments, accelerate, ``torch.distributed`` or the environment); the others ask the plan or
a function of this module (``tests/unit/test_layout.py`` keeps it so). The SP groups come from
:func:`packing_hf.attention.sequence_parallel.sequence_parallel_mesh`, the one builder of the ``(dp, sp)`` mesh.

>>> plan = ParallelPlan()  # one process, no engine
>>> plan.engine, plan.world_size, plan.data_parallel, plan.sequence_parallel
('none', 1, (1, 0), False)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._limits import check_int
from .launcher import check_launch

__all__ = [
    "ParallelPlan",
    "apply_sp_size",
    "check_deepspeed_world",
    "configured_parallelism",
    "fsdp_layout",
    "fsdp_request",
    "hidden_sequence_parallelism",
    "process_world",
    "requested_sp_size",
    "sequence_parallel_size",
    "training_mode",
    "with_sp_size",
]

# set by ``accelerate launch --parallelism_config_*``: accelerate then builds its ParallelismConfig from the
# environment when the Trainer hands it none
_LAUNCHER_FLAG = "ACCELERATE_USE_PARALLELISM_CONFIG"
# the sizes of a ParallelismConfig that cut one sample's tokens (or its model) over processes
_TOKEN_SPLITS = ("tp_size", "cp_size", "sp_size")
# the sizes of a ParallelismConfig that lay out FSDP2's sharding (HSDP: replicas of sharded groups)
_DATA_PARALLEL = ("dp_replicate_size", "dp_shard_size")
# set by an Accelerator given an FSDP plugin, and by accelerate launch --use_fsdp
_FSDP_FLAG = "ACCELERATE_USE_FSDP"


def configured_parallelism(args: Any) -> Any:
    """The ``ParallelismConfig`` of training arguments: theirs, else the one ``accelerate launch
    --parallelism_config_*`` set up in the environment, else ``None``.

    >>> configured_parallelism(None) is None
    True
    """
    config = getattr(args, "parallelism_config", None)
    if config is None and os.environ.get(_LAUNCHER_FLAG, "false").lower() == "true":
        from accelerate import ParallelismConfig

        config = ParallelismConfig()  # reads the PARALLELISM_CONFIG_* variables the launcher set
    return config


def _sizes(config: Any, names: tuple[str, ...]) -> dict[str, int]:
    """The sizes ``names`` of a ``ParallelismConfig`` that are above 1."""
    sizes = {name: int(getattr(config, name, 1) or 1) for name in names} if config is not None else {}
    return {name: size for name, size in sizes.items() if size > 1}


def with_sp_size(parallelism_config: Any, sp_size: int) -> Any:
    """The ``ParallelismConfig`` of ``TrainingArguments(sp_size=N)``: a new one with ``sp_size`` (``None`` for 1), or
    the given one when it says the same; a given one that says otherwise is refused.

    >>> with_sp_size(None, 2).sp_size, with_sp_size(None, 1)
    (2, None)
    """
    given = int(getattr(parallelism_config, "sp_size", 1) or 1) if parallelism_config is not None else None
    if given is not None and given != sp_size:
        raise ValueError(
            f"sp_size={sp_size} but parallelism_config has sp_size={given}: set the size in one place"
        )
    if parallelism_config is not None or sp_size == 1:
        return parallelism_config
    from accelerate import ParallelismConfig

    return ParallelismConfig(sp_size=sp_size)


def apply_sp_size(args: Any) -> None:
    """``TrainingArguments(sp_size=N)`` checked (an int >= 1) and made the arguments' ``parallelism_config``
    (:func:`with_sp_size`); nothing where ``sp_size`` is unset. Called when the arguments are made.

    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(sp_size=2, parallelism_config=None)
    >>> apply_sp_size(args); args.parallelism_config.sp_size
    2
    """
    if args.sp_size is None:
        return
    args.sp_size = check_int(args.sp_size, "sp_size", 1)
    args.parallelism_config = with_sp_size(getattr(args, "parallelism_config", None), args.sp_size)


def sequence_parallel_size(parallelism_config: Any) -> int:
    """``sp_size`` of a ``ParallelismConfig`` packing_hf can serve (1 without one), else a ``ValueError``.

    packing_hf's SP runs inside any data-parallel engine (DDP, DeepSpeed ZeRO-1/2/3, FSDP2: the processes of an SP
    group are data-parallel for the parameters), not beside accelerate's tensor or context parallelism. Under
    FSDP2, ``dp_replicate_size`` / ``dp_shard_size`` lay out the sharding (:func:`fsdp_layout`).

    >>> from accelerate import ParallelismConfig
    >>> sequence_parallel_size(ParallelismConfig(sp_size=2)), sequence_parallel_size(None)
    (2, 1)
    """
    size = int(getattr(parallelism_config, "sp_size", 1) or 1) if parallelism_config is not None else 1
    if size == 1:
        return 1
    clashing = _sizes(parallelism_config, ("tp_size", "cp_size"))
    if clashing:
        raise ValueError(
            f"packing_hf's sequence parallelism (sp_size={size}) runs next to data parallelism (DDP, DeepSpeed "
            f"ZeRO, FSDP2) only, not with {clashing}; set those to 1"
        )
    return size


def requested_sp_size(args: Any) -> int:
    """The ``sp_size`` training arguments ask for (their ``ParallelismConfig``, else the launcher's; 1 without),
    checked by :func:`sequence_parallel_size`: the size the :class:`ParallelPlan` of a trainer that cuts rows
    itself holds once its accelerator is made (:func:`hidden_sequence_parallelism` keeps it from accelerate).
    For what must be decided before the plan exists: DPO's collator, built before the stock ``__init__`` that
    makes the accelerator, and used inside it to precompute reference log-probs.

    >>> requested_sp_size(None)
    1
    """
    return sequence_parallel_size(configured_parallelism(args))


def fsdp_request(args: Any) -> str | None:
    """Where FSDP was asked for (``None``: nowhere): the training arguments (``fsdp`` / ``fsdp_config``, which
    transformers turns into the plugin it hands accelerate), else ``ACCELERATE_USE_FSDP``, from which accelerate
    builds the plugin itself.

    >>> fsdp_request(None) is None
    True
    """
    if getattr(args, "fsdp_plugin_args", None) is not None:
        return "TrainingArguments(fsdp=..., fsdp_config=...)"
    if os.environ.get(_FSDP_FLAG, "false").lower() == "true":
        return (
            f"{_FSDP_FLAG}=true: accelerate launch --use_fsdp, an accelerate config with distributed_type: FSDP, or "
            "an earlier Accelerator of this process given an FSDP plugin"
        )
    return None


def _data_parallel_sizes(parallelism_config: Any) -> tuple[int, int]:
    """``(dp_replicate_size, dp_shard_size)`` of a ``ParallelismConfig`` (1 where unset; ``(1, 1)`` without one)."""
    replicate, shard = (int(getattr(parallelism_config, name, 1) or 1) for name in _DATA_PARALLEL)
    return replicate, shard


def fsdp_layout(parallelism_config: Any, sp_size: int, world: int) -> Any:
    """The ``ParallelismConfig`` accelerate gets under FSDP while packing_hf serves ``sp_size``: ``None`` (FSDP2
    shards over every process) when neither ``dp_replicate_size`` nor ``dp_shard_size`` is above 1, else the two
    with the SP processes folded into the shard dimension, as accelerate folds ``cp_size`` into its
    ``dp_shard_cp`` dimension: the parameters sharded over ``dp_shard_size x sp_size`` processes, replicated over
    ``dp_replicate_size`` (HSDP). The sizes must multiply to the number of processes ``world``.

    >>> from accelerate import ParallelismConfig
    >>> fsdp_layout(ParallelismConfig(sp_size=2), 2, 4) is None
    True
    >>> layout = fsdp_layout(ParallelismConfig(dp_replicate_size=2, sp_size=2), 2, 4)
    >>> layout.dp_replicate_size, layout.dp_shard_size, layout.sp_size
    (2, 2, 1)
    >>> fsdp_layout(ParallelismConfig(dp_shard_size=4, sp_size=2), 2, 4)
    Traceback (most recent call last):
    ValueError: dp_replicate_size=1 x dp_shard_size=4 x sp_size=2 must be the number of processes (4); ...
    """
    if not _sizes(parallelism_config, _DATA_PARALLEL):
        return None
    replicate, shard = _data_parallel_sizes(parallelism_config)
    if replicate * shard * sp_size != world:
        raise ValueError(
            f"dp_replicate_size={replicate} x dp_shard_size={shard} x sp_size={sp_size} must be the number of "
            f"processes ({world}); leave dp_replicate_size and dp_shard_size at 1 to shard over every process"
        )
    from accelerate import ParallelismConfig

    # every size given: a size left None is read from the launcher's PARALLELISM_CONFIG_* variables (sp_size too)
    return ParallelismConfig(
        dp_replicate_size=replicate, dp_shard_size=shard * sp_size, tp_size=1, cp_size=1, sp_size=1
    )


def training_mode(model: Any) -> bool:
    """Whether ``model`` (as the Trainer hands it to ``compute_loss``: the module, or an engine's wrapper around
    it) runs in training mode: the flag of the module inside a wrapper (``.module``: DDP, DeepSpeed's engine).

    DeepSpeed's engine never updates its own flag: its ``train()`` / ``eval()`` set the module's only, so an engine
    (as ``evaluate()`` before ``train()`` makes one, and calls) reads ``training=True`` in evaluation.

    >>> layer = torch.nn.Linear(1, 1)
    >>> wrapper = torch.nn.Module(); wrapper.module = layer; layer.eval()  # a wrapper whose eval() skipped itself
    Linear(in_features=1, out_features=1, bias=True)
    >>> wrapper.training, training_mode(wrapper)
    (True, False)
    """
    inner = getattr(model, "module", None)
    return bool((inner if isinstance(inner, torch.nn.Module) else model).training)


def process_world(accelerator_processes: int, deepspeed: bool = False) -> tuple[int, int]:
    """``(world_size, rank)`` of the process group this process runs in; refuses, by name, a launch whose
    processes accelerate does not count as it (``accelerator_processes``: ``accelerator.num_processes`` or
    ``TrainingArguments.world_size``; ``deepspeed``: whether DeepSpeed is configured, for the error's cause).

    >>> process_world(1)  # no process group, no launcher: one process
    (1, 0)
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    else:
        world, rank = 1, 0
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world == 1 and launched > 1:
        raise ValueError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}), but no process group joins them: "
            "each would train its own copy of the model on all the data. On CPU transformers starts the group "
            "(gloo) only with use_cpu=True: set TrainingArguments(use_cpu=True), or run one process"
        )
    if accelerator_processes != world:
        cause = (
            "DeepSpeed on a machine without GPUs (DS_ACCELERATOR=cpu) starts its process group itself, which "
            "accelerate does not count without use_cpu=True"
            if deepspeed
            else "accelerate counts the processes of a group started outside it (torch.distributed."
            "init_process_group before the Trainer) on a machine without GPUs only with use_cpu=True"
        )
        raise ValueError(
            f"the process group has {world} processes but accelerate counts {accelerator_processes} "
            "(TrainingArguments.world_size), so every process would draw the whole dataset and the loss would be "
            f"scaled for the wrong world: {cause}. Set TrainingArguments(use_cpu=True), which starts the group "
            "with gloo (or joins the one started) and counts it"
        )
    check_launch(world)  # what `accelerate launch` was asked for and did not pass on
    return world, rank


def check_deepspeed_world(args: Any) -> None:
    """Refuse, by name, DeepSpeed training arguments whose processes accelerate miscounts (:func:`process_world`
    on ``args.world_size``), when the arguments are made: ZeRO-3 partitions a model built after them over the
    process group's world (``deepspeed.zero.Init``), where a miscounted world fails in DeepSpeed's batch-size
    assertion before any Trainer is made (which refuses it under ZeRO-1/2)."""
    process_world(args.world_size, deepspeed=True)


@contextlib.contextmanager
def hidden_sequence_parallelism(args: Any, serve: bool) -> Iterator[int]:
    """While accelerate is made: ``sp_size`` hidden from it when this trainer serves it (``serve``), yielding the
    size kept (1 when there is none, or when accelerate gets the config unchanged).

    accelerate 1.15 and transformers 5.24 read ``sp_size > 1`` as DeepSpeed's ALST/Ulysses; packing_hf's trainers
    run their own all-to-all, so accelerate is built without the config (and without the launcher's flag), or,
    under FSDP, with the data-parallel layout alone (:func:`fsdp_layout`); both are put back after.
    """
    size = requested_sp_size(args)
    if not serve or size == 1:
        yield 1
        return
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = fsdp_layout(configured_parallelism(args), size, world) if fsdp_request(args) else None
    given, args.parallelism_config = args.parallelism_config, layout
    flag = os.environ.pop(_LAUNCHER_FLAG, None)
    try:
        yield size
    finally:
        args.parallelism_config = given
        if flag is not None:
            os.environ[_LAUNCHER_FLAG] = flag


def _engine(trainer: Any, world: int) -> tuple[str, int | None]:
    """``(engine, stage or version)`` of a trainer whose accelerator is made, on ``world`` processes; FSDP asked
    for but not run by accelerate is refused by name."""
    accelerator = trainer.accelerator
    state = getattr(accelerator, "state", None)
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = getattr(state, "deepspeed_plugin", None)
        return "deepspeed", int(getattr(plugin, "zero_stage", 0) or 0)
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = getattr(state, "fsdp_plugin", None)
        return "fsdp", int(getattr(plugin, "fsdp_version", 1) or 1)
    asked = fsdp_request(trainer.args)
    if asked and world > 1:
        # accelerate 1.15 (AcceleratorState) turns an FSDP plugin into DistributedType.FSDP only for multi-device
        # accelerator types (MULTI_GPU, MULTI_XPU, ...): on CPU it drops the plugin and wraps the model in DDP
        distributed = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
        raise ValueError(
            f"FSDP was asked for ({asked}), but accelerate runs {distributed} on {accelerator.device.type}: it "
            f"enables FSDP on accelerators only, so each of the {world} processes would hold the whole model, its "
            "gradients and optimizer state (DDP). Run on GPUs for FSDP, or ask for DDP: drop fsdp / fsdp_config "
            "from the training arguments and --use_fsdp (distributed_type: FSDP) from the launch"
        )
    if getattr(trainer.args, "n_gpu", 1) > 1:
        return "data_parallel", None
    return ("ddp" if accelerator.num_processes > 1 else "none"), None


def _check_sequence_parallel_engine(sp_size: int, world: int, engine: str, level: int | None, config: Any) -> None:
    """Refuse, by name, an engine packing_hf's ``sp_size`` does not run inside, and data-parallel sizes of the
    ``ParallelismConfig`` (``dp_shard_size``, ``dp_replicate_size``) that the engine, when not FSDP2 (whose layout
    :func:`fsdp_layout` hands accelerate), would not honour: DDP and DeepSpeed replicate over the
    ``world / sp_size`` SP groups.

    FSDP1 is refused: accelerate's FSDP1 plugin cannot be built on CPU (it asks for an accelerator device), so its
    composition with SP is untested, and transformers deprecates FSDP1.

    >>> from accelerate import ParallelismConfig
    >>> _check_sequence_parallel_engine(2, 4, "ddp", None, ParallelismConfig(dp_replicate_size=2, sp_size=2))
    >>> _check_sequence_parallel_engine(2, 4, "fsdp", 1, None)
    Traceback (most recent call last):
    ValueError: sp_size=2 with FSDP1 is not supported (untested, and deprecated by transformers); ...
    """
    if engine == "fsdp":
        if level != 2:
            raise ValueError(
                f"sp_size={sp_size} with FSDP{level} is not supported (untested, and deprecated by transformers); "
                "set fsdp_config={'version': 2}, or use DDP or DeepSpeed ZeRO"
            )
        return
    replicate, shard = _data_parallel_sizes(config)
    if shard > 1 or replicate not in (1, world // sp_size):
        raise ValueError(
            f"dp_replicate_size={replicate} and dp_shard_size={shard} with sp_size={sp_size} on {world} processes: "
            f"{engine} replicates the parameters over the {world // sp_size} SP groups and shards nothing itself; "
            f"set dp_shard_size=1 and dp_replicate_size to 1 or {world // sp_size}, or run FSDP2, whose sharding "
            "they lay out"
        )


@dataclass(frozen=True)
class ParallelPlan:
    """How the run is laid out over processes; :meth:`of` builds it from a trainer whose accelerator is made.

    Attributes:
        engine: ``"none"`` (one process), ``"ddp"``, ``"deepspeed"``, ``"fsdp"`` or ``"data_parallel"`` (several
            GPUs in one process).
        engine_level: the ZeRO stage (``"deepspeed"``) or the FSDP version (``"fsdp"``), else ``None``.
        world_size, rank: the process group's (``torch.distributed``), 1 and 0 without one.
        local_devices: the devices each process trains on: ``args.n_gpu`` under ``"data_parallel"``, else 1.
        sp_size, sp_rank, sp_group: the sequence-parallel group this process cuts packed rows with (``sp_size``
            consecutive ranks; ``None`` group without SP).
        mesh: the ``DeviceMesh`` ``("dp", "sp")`` the SP groups come from (``None`` without SP).
        accelerate_sizes: the ``tp_size`` / ``cp_size`` / ``sp_size`` above 1 of the ``ParallelismConfig``
            accelerate was given (``sp_size`` is absent where packing_hf serves it).
    """

    engine: str = "none"
    engine_level: int | None = None
    world_size: int = 1
    rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0
    sp_group: Any = None
    mesh: Any = None
    accelerate_sizes: dict[str, int] = field(default_factory=dict)
    local_devices: int = 1

    @classmethod
    def of(cls, trainer: Any, sp_size: int = 1) -> ParallelPlan:
        """The plan of ``trainer`` (its accelerator made), with ``sp_size`` kept from accelerate (1: none).

        Collective when ``sp_size > 1`` (every process builds the mesh): called once per trainer, in its
        ``__init__``.
        """
        accelerator = trainer.accelerator
        world, rank = process_world(accelerator.num_processes, getattr(trainer, "is_deepspeed_enabled", False))
        engine, level = _engine(trainer, world)
        accelerate_sizes = _sizes(getattr(accelerator, "parallelism_config", None), _TOKEN_SPLITS)
        # DataParallel: one process drives every GPU it sees (transformers' args.n_gpu), which its world omits
        local = int(trainer.args.n_gpu) if engine == "data_parallel" else 1
        if sp_size == 1:
            return cls(engine, level, world, rank, accelerate_sizes=accelerate_sizes, local_devices=local)
        if trainer.args.max_tokens_per_batch is None:
            raise ValueError(
                f"sp_size={sp_size} cuts packed rows over processes; set max_tokens_per_batch (the row's token budget)"
            )
        if world % sp_size:
            raise ValueError(f"sp_size={sp_size} must divide the number of processes ({world})")
        _check_sequence_parallel_engine(sp_size, world, engine, level, configured_parallelism(trainer.args))
        from ..attention.sequence_parallel import sequence_parallel_mesh

        mesh = sequence_parallel_mesh(sp_size, accelerator.device.type)  # the one builder of the (dp, sp) layout
        return cls(
            engine,
            level,
            world,
            rank,
            sp_size,
            mesh.get_local_rank("sp"),
            mesh.get_group("sp"),
            mesh,
            accelerate_sizes,
            local,
        )

    @property
    def sequence_parallel(self) -> bool:
        """Whether packed rows are cut over an SP group."""
        return self.sp_size > 1

    @property
    def devices(self) -> int:
        """How many devices train together (the MFU divides the model FLOP/s by ``peak x devices``): every
        process of the world, each with its ``local_devices``.

        >>> ParallelPlan("data_parallel", None, 1, 0, local_devices=2).devices
        2
        """
        return self.world_size * self.local_devices

    @property
    def data_parallel(self) -> tuple[int, int]:
        """``(replicas, replica index)`` the samplers and streams shard the data over: the SP groups are the
        replicas (every process of a group holds its row)."""
        return self.world_size // self.sp_size, self.rank // self.sp_size

    @property
    def counts_rows(self) -> bool:
        """Whether this process counts its rows into a step's totals (under SP only the group's first one does,
        so that each row counts once); also the process that writes a replica's stream state."""
        return self.sp_rank == 0

    @property
    def shards_sample_tokens(self) -> dict[str, int]:
        """The sizes accelerate was told that cut one sample's tokens or model over processes (tensor, context or
        DeepSpeed's sequence parallelism): multipack and packing_hf's loss refuse them by name."""
        return dict(self.accelerate_sizes)

    @property
    def gathers_in_module_calls(self) -> bool:
        """Whether the engine holds the parameters partitioned outside each module's calls, gathered by its hooks
        around a call and its backward (DeepSpeed ZeRO-3): code reading a module's weight itself (the chunked LM
        head, :mod:`packing_hf.integrations.chunked_head`) must then run as a call of the module.

        >>> [ParallelPlan(*engine).gathers_in_module_calls for engine in (("deepspeed", 3), ("deepspeed", 2))]
        [True, False]
        """
        return self.engine == "deepspeed" and self.engine_level == 3

    @property
    def shards_sequences(self) -> dict[str, int]:
        """The context / sequence parallelism accelerate was told (``cp_size``, ``sp_size`` above 1), which cuts
        every sequence over processes: trainers that do not cut packed rows themselves refuse it by name.

        >>> ParallelPlan(accelerate_sizes={"sp_size": 2, "tp_size": 2}).shards_sequences
        {'sp_size': 2}
        """
        return {name: size for name, size in self.accelerate_sizes.items() if name in ("cp_size", "sp_size")}

    @property
    def chunked_head_refusal(self) -> str | None:
        """Why code running the LM head's weight itself (the chunked LM head) cannot under this engine, or ``None``.

        DeepSpeed ZeRO-3 and FSDP2 hold the weight themselves (a partition, a shard) and gather it around the head's
        calls, inside one of which the chunked head runs (``tests/distributed``: equal to the full logits under the
        same engine and to DDP). Refused: DataParallel, which calls replicas of the model in threads (the head's
        input captured from a replica, its weight a copy), and FSDP1, which flattens the weight into its
        ``FlatParameter`` and is untested (accelerate's FSDP1 plugin cannot be built on CPU).

        >>> ParallelPlan("fsdp", 1, 2, 0).chunked_head_refusal
        "FSDP1 flattens the head's weight into its FlatParameter (untested); use FSDP2 (fsdp_config={'version': 2})"
        """
        if self.engine == "data_parallel":
            return "torch.nn.DataParallel calls replicas of the model in threads, whose head's weight is a copy"
        if self.engine == "fsdp" and self.engine_level == 1:
            return (
                "FSDP1 flattens the head's weight into its FlatParameter (untested); use FSDP2 "
                "(fsdp_config={'version': 2})"
            )
        return None

    def describe(self) -> str:
        """One line for logs and errors: ``deepspeed ZeRO-3, 4 processes (dp 2 x sp 2)``.

        >>> ParallelPlan("deepspeed", 3, 4, 0, 2).describe()
        'deepspeed ZeRO-3, 4 processes (dp 2 x sp 2)'
        """
        level = {"deepspeed": f" ZeRO-{self.engine_level}", "fsdp": f"{self.engine_level}"}.get(self.engine, "")
        layout = f" (dp {self.data_parallel[0]} x sp {self.sp_size})" if self.sequence_parallel else ""
        layout += f" ({self.local_devices} GPUs each)" if self.local_devices > 1 else ""
        return f"{self.engine}{level}, {self.world_size} process{'es' if self.world_size > 1 else ''}{layout}"
