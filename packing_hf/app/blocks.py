"""The mapping-valued settings of a ``packing-hf train`` config, checked when it is parsed against what reads
them: ``fsdp_config`` (the keys transformers reads, each with a value it takes; refused without ``fsdp``),
``deepspeed``'s ``zero_optimization`` (DeepSpeed's own model of it),
``peft`` (built as the method's PEFT config, every value of its field's type) and ``column_mapping`` (names to
names). Their consumers check little
themselves, and late: transformers ignores an unknown ``fsdp_config`` key, and PEFT builds ``LoraConfig(r="x")``
and fails when the adapter is made, after the data and the model, naming no key.

>>> peft_config_from({"r": 8}).r
8
"""

from __future__ import annotations

import difflib
from typing import Any

__all__ = [
    "check_column_mapping",
    "check_engine",
    "check_fsdp_config",
    "check_nested",
    "check_peft",
    "peft_config_from",
]


def check_nested(values: dict[str, Any], classes: Any, source: str) -> None:
    """A config key holding a mapping is a field typed to take one (``model_config``, ``peft``, ``column_mapping``,
    ``deepspeed``, ``fsdp_config``, ``lr_scheduler_kwargs``, TRL's ``model_init_kwargs``, ...: a ``dict`` of one
    of ``classes``); any other is refused: configs are flat, one key per field."""
    import typing

    # the annotations, not dataclasses.fields' types, which HfArgumentParser rewrites (a `dict | str` field to str)
    takes = {
        name for cls in classes for name, hint in typing.get_type_hints(cls).items() if "dict" in str(hint)
    }
    for key, value in values.items():
        if isinstance(value, dict) and key not in takes:
            raise ValueError(
                f"{source}: key {key!r} holds a nested mapping; configs are flat (one key per dataclass field), "
                "write its entries at the top level"
            )


def _switch(value: Any) -> bool:
    """A bool, or the text transformers reads as one (``str_to_bool(str(value).lower())``)."""
    return isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false"))


def _names(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _fsdp_config_keys() -> dict[str, tuple[Any, str]]:
    """``fsdp_config``'s keys: those ``transformers.TrainingArguments`` reads (``_process_fsdp_args``, its XLA
    path), each with a test of its value and what the value must be. A switch transformers reads by truth value
    (``cpu_offload``, ``xla*``) takes a bool only: the text ``"false"`` would turn it on."""
    from accelerate.utils.constants import (
        FSDP_AUTO_WRAP_POLICY,
        FSDP_BACKWARD_PREFETCH,
        FSDP_SHARDING_STRATEGY,
        FSDP_STATE_DICT_TYPE,
    )

    def one_of(choices: list[str]):
        return lambda v: isinstance(v, str) and v.upper() in choices, f"one of {', '.join(choices)}"

    switch = (_switch, "true or false")
    flag = (lambda v: isinstance(v, bool), "true or false (a bool: transformers reads it by truth value)")
    return {
        "version": (lambda v: v in (1, 2) and not isinstance(v, bool), "1 or 2 (FSDP2, the default)"),
        "reshard_after_forward": (
            lambda v: _switch(v) or (isinstance(v, str) and v.upper() in FSDP_SHARDING_STRATEGY),
            f"true or false (FSDP2), or a sharding strategy (FSDP1: {', '.join(FSDP_SHARDING_STRATEGY).lower()})",
        ),
        "cpu_offload": flag,
        "activation_checkpointing": switch,
        "cpu_ram_efficient_loading": switch,
        "state_dict_type": one_of(FSDP_STATE_DICT_TYPE),
        "auto_wrap_policy": (
            lambda v: v in FSDP_AUTO_WRAP_POLICY,
            f"one of {', '.join(FSDP_AUTO_WRAP_POLICY)}",
        ),
        "transformer_layer_cls_to_wrap": (_names, "a layer class name or a list of them"),
        "min_num_params": (
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            "an int >= 0",
        ),
        "forward_prefetch": switch,
        "backward_prefetch": one_of(FSDP_BACKWARD_PREFETCH),
        "use_orig_params": switch,
        "sync_module_states": switch,
        "limit_all_gathers": switch,
        "xla": flag,
        "xla_fsdp_v2": flag,
        "xla_fsdp_grad_ckpt": flag,
        "xla_fsdp_settings": (lambda v: isinstance(v, dict), "a mapping"),
    }


def _engine_mapping(name: str, value: Any, origin) -> dict[str, Any] | None:
    """The mapping an engine key gives (``deepspeed`` / ``fsdp_config``): the YAML mapping, its JSON, or the JSON
    file it names (as transformers reads them); None for no value."""
    import json
    from pathlib import Path

    if value is None or isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{origin(name)}: {name} must be a mapping or a JSON file's path, got {value!r}")
    text, where = value, name
    if not value.lstrip().startswith("{"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(
                f"{origin(name)}: {name}: {value!r} is not a file; give the path of a JSON file or the mapping itself"
            )
        text, where = path.read_text(encoding="utf-8"), f"{name} ({path})"
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{origin(name)}: {where} is not valid JSON ({error.msg}, line {error.lineno})"
        ) from None
    if not isinstance(mapping, dict):
        raise ValueError(f"{origin(name)}: {where} must hold a mapping, got a {type(mapping).__name__}")
    return mapping


def check_fsdp_config(value: Any, origin) -> None:
    """``fsdp_config`` as given (a mapping, its JSON or a JSON file's path): every key one transformers reads
    (``fsdp_``-prefixed as accelerate writes them, or not), each with a value it takes; refused by name
    otherwise, before transformers builds the arguments (it ignores an unknown key, and fails on a bad value
    without naming it: ``int('x')``)."""
    config = _engine_mapping("fsdp_config", value, origin)
    if not config:
        return
    keys = _fsdp_config_keys()
    seen: dict[str, str] = {}
    for given, setting in config.items():
        key = given[5:] if given.startswith("fsdp_") else given
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=2, cutoff=0.6)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise ValueError(
                f"{origin('fsdp_config')}: fsdp_config has no key {given!r}{hint}: transformers would ignore it; "
                f"its keys: {', '.join(keys)}"
            )
        if key in seen:
            raise ValueError(
                f"{origin('fsdp_config')}: fsdp_config: {seen[key]!r} and {given!r} are the same setting; keep one"
            )
        seen[key] = given
        test, wanted = keys[key]
        if not test(setting):
            raise ValueError(
                f"{origin('fsdp_config')}: fsdp_config: {given} must be {wanted}, got {setting!r}"
            )


def check_engine(training: Any, origin) -> None:
    """Once the arguments are built: ``fsdp_config`` without ``fsdp`` is refused by name (transformers reads it
    only with ``fsdp: true``, and ``accelerate launch --use_fsdp`` builds its plugin from its own settings); the
    ``zero_optimization`` block of ``deepspeed`` checked by DeepSpeed's own model of it (DeepSpeed reads it when
    training starts, after the data and the model)."""
    check_zero_optimization(training, origin)
    config = getattr(training, "fsdp_config", None)
    if config and not getattr(training, "fsdp", None):
        raise ValueError(
            f"{origin('fsdp_config')}: fsdp_config is not used: fsdp is not set, and transformers reads fsdp_config "
            "only with fsdp: true (an accelerate launch with --use_fsdp takes its own FSDP settings); set fsdp: "
            "true, or remove fsdp_config"
        )


def check_zero_optimization(training: Any, origin) -> None:
    """``deepspeed``'s ``zero_optimization`` block (as transformers loaded it, ``"auto"`` values left for it to
    fill) through DeepSpeed's ``DeepSpeedZeroConfig``, which refuses an unknown key or a value of the wrong type:
    the first error, with its key, refused now."""
    loaded = getattr(getattr(training, "hf_deepspeed_config", None), "config", None)
    zero = loaded.get("zero_optimization") if isinstance(loaded, dict) else None
    if not isinstance(zero, dict):
        return
    import pydantic
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**{key: value for key, value in zero.items() if value != "auto"})
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(map(str, ("zero_optimization", *first["loc"])))
        problem = "DeepSpeed has no such key" if first["type"] == "extra_forbidden" else first["msg"]
        raise ValueError(
            f"{origin('deepspeed')}: deepspeed: {where}: {problem} (got {first.get('input')!r}); see "
            "DeepSpeed's ZeRO configuration for its keys"
        ) from None


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (from YAML or JSON) is of the annotated type ``hint``: plain types, ``X | None``,
    ``Literal``, ``list[X]`` / ``tuple[X, Y]``, ``dict[K, V]`` and enums; a type it cannot read from a config file
    (a class of the library's own) is not judged here."""
    import enum
    import re
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:
        # a literal with a placeholder ("pissa_niter_[number of iters]") stands for the texts around it
        return any(
            (type(value) is type(arg) and value == arg)
            or (
                isinstance(arg, str)
                and "[" in arg
                and isinstance(value, str)
                and re.fullmatch(re.sub(r"\\\[.*?\\\]", ".+", re.escape(arg)), value) is not None
            )
            for arg in args
        )
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple, set, frozenset):
        if not isinstance(value, list | tuple):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(_fits(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return False
        return not args or all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in {m.value for m in hint} or value in hint.__members__
    return True


def _type_name(hint: Any) -> str:
    """``hint`` as a config file's reader would say it: ``int``, ``str | list[str] | None``, ``'none' | 'all'``."""
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is typing.Literal:
        return " | ".join(map(repr, args))
    if hint is type(None):
        return "None"
    return hint.__name__ if isinstance(hint, type) and not args else str(hint).replace("typing.", "")


def peft_config_from(values: dict[str, Any] | None, task_type: str = "CAUSAL_LM"):
    """The ``peft:`` block of a config as a ``peft.PeftConfig`` (None without one): its keys are the fields of
    the method's config (``peft_type``, default ``LORA``: ``r``, ``lora_alpha``, ``target_modules``, ...), each
    value of its field's type (PEFT itself checks few of them when the config is built, and a wrong one fails
    when the adapter is made, naming no key). Prompt-learning methods are refused (not exact when packed).

    >>> peft_config_from({"r": 8, "target_modules": "all-linear"}).r
    8
    >>> peft_config_from({"peft_type": "lora", "lora_alhpa": 8})
    Traceback (most recent call last):
    ...
    ValueError: peft: LoraConfig has no key 'lora_alhpa' (did you mean 'lora_alpha'?); see peft.LoraConfig for its keys
    >>> peft_config_from({"r": "x"})
    Traceback (most recent call last):
    ...
    ValueError: peft: r must be int, got 'x' (a str); see peft.LoraConfig for its keys
    """
    if values is None:
        return None
    try:
        import peft
    except ImportError as error:
        from ..errors import missing_extra

        raise missing_extra("the config's peft: adapter", "peft", error) from None
    import dataclasses
    import typing

    from ..integrations.peft_models import refuse_prompt_learning

    values = dict(values)
    method = str(values.pop("peft_type", "LORA")).upper()
    mapping = peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING
    if method not in mapping:
        raise ValueError(f"peft: unknown peft_type {method!r}; one of {', '.join(sorted(mapping))}")
    cls = mapping[method]
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"peft: {cls.__name__} has no key {key!r}{hint}; see peft.{cls.__name__} for its keys"
            )
        if key in hints and not _fits(value, hints[key]):
            raise ValueError(
                f"peft: {key} must be {_type_name(hints[key])}, got {value!r} (a {type(value).__name__}); see "
                f"peft.{cls.__name__} for its keys"
            )
    values.setdefault("task_type", task_type)
    try:
        config = cls(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"peft: {cls.__name__} refuses these values: {error}") from None
    refuse_prompt_learning(None, config, stock="transformers.Trainer")
    return config


def check_peft(values: dict[str, Any] | None, origin) -> None:
    """The ``peft:`` block built as its PEFT config when the config is parsed (the job builds it again for its
    task), a ``ValueError`` naming where it came from (``origin('peft')``) and the failing key otherwise."""
    try:
        peft_config_from(values)
    except ValueError as error:
        raise ValueError(f"{origin('peft')}: {error}") from None


def check_column_mapping(mapping: dict[str, Any] | None) -> dict[str, str] | None:
    """``column_mapping`` as ``{column in the data: column TRL reads}``: names to names, no two onto one.

    >>> check_column_mapping({"question": "prompt", "good": 1})
    Traceback (most recent call last):
    ...
    ValueError: column_mapping: 'good': 1 must map a column name to a column name (two strings)
    """
    if mapping is None:
        return None
    targets: dict[str, str] = {}
    for name, target in mapping.items():
        if not isinstance(name, str) or not isinstance(target, str):
            raise ValueError(
                f"column_mapping: {name!r}: {target!r} must map a column name to a column name (two strings)"
            )
        if target in targets:
            raise ValueError(
                f"column_mapping: {targets[target]!r} and {name!r} both become {target!r}; map one column onto it"
            )
        targets[target] = name
    return dict(mapping)
