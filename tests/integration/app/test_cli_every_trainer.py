"""Issue 40, item 3: every trainer of ``packing-hf train`` honours ``peft:``, and every key of the config is
used by the trainer or refused by name; so is every training argument that picks the engine or lays the
processes out (``ENGINE_KEYS``: ``sp_size``, ``deepspeed``, ``fsdp``, ``fsdp_config``, ``use_cpu``,
``parallelism_config``).

LoRA: each trainer runs one step through the command line (``packing_hf.app.cli.main``) on a tiny model built
from config with a LoRA block. The trained model is captured when the job saves it; the test then checks that
the output folder holds an adapter (and no full model), that only the adapter's weights moved, and that
``AutoPeftModelFor*.from_pretrained(output_dir)`` (the base found through ``base_model_name_or_path``) gives the
trained model's logits, while the base alone does not (the negative control).

Keys: ``KEYS`` lists every field of packing_hf's own config groups (model, data, job) with the trainers that
use it; a field without an entry fails. A trainer outside its set must refuse the key by name; a trainer
inside must accept it; and during each trainer's run every field is read, or declared unused for that run
(:func:`packing_hf.app.checks.unused_keys`, and refused when given), or shared with the trainer's own config.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from packing_hf.app.catalogue import CATALOGUE, TRAINERS, trainers_where
from packing_hf.app.checks import unused_keys
from packing_hf.app.cli import main
from packing_hf.app.config import (
    DataArguments,
    JobArguments,
    ModelArguments,
    load_train_config,
    read_yaml,
)
from packing_hf.app.modeling import BASE_MODEL_DIR, load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
LORA = '{"r": 4, "target_modules": ["q_proj", "v_proj"]}'
INPUT_IDS = torch.tensor([[1, 17, 230, 4021, 88, 9, 512, 77]])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def overrides(data_dir: Path, out: Path, trainer: str) -> list[str]:
    """One step of ``trainer`` on a model smaller than the configs' (shared by every trainer)."""
    args = [
        f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
        "gguf_file=null",
        "gguf_package=null",
        f"model_config={json.dumps(SMALL)}",
        "num_samples=4",
        "max_steps=1",
        "learning_rate=1e-2",
        f"output_dir={out}",
        "disable_tqdm=true",
        f"peft={LORA}",
    ]
    if trainer in ("trainer", "sft"):
        args += [f"trainer={trainer}", "max_length=384", "max_tokens_per_batch=768"]
        if trainer == "trainer":
            args += ["baseline_batches=0", "eval_num_samples=1"]
    elif trainer in ("grpo", "rloo"):
        args += ["per_device_train_batch_size=2", "num_generations=2", "max_completion_length=8"]
    else:
        args += ["max_length=384", f"per_device_train_batch_size={2 if trainer == 'kto' else 1}"]
    return args


def config_of(trainer: str) -> str:
    return str(
        ROOT / "configs" / ("tiny_cpu.yaml" if trainer in ("trainer", "sft") else f"tiny_{trainer}.yaml")
    )


def base_name(name: str) -> str | None:
    """The base model's name of a ``PeftModel`` parameter; None for the adapter's own weights."""
    if "lora_" in name or "modules_to_save" in name:
        return None
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer", "").replace(".original_module", "")


@pytest.fixture
def captured(monkeypatch):
    """The model as the job saves it: its parameters and its logits on ``INPUT_IDS``."""
    import transformers

    seen: dict = {}
    save_model = transformers.Trainer.save_model

    def capture(self, output_dir=None, _internal_call=False):
        model = self.model
        was_training = model.training
        model.eval()
        with torch.no_grad():
            seen["logits"] = model(input_ids=INPUT_IDS).logits.clone()
        model.train(was_training)
        seen["parameters"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return save_model(self, output_dir, _internal_call)

    monkeypatch.setattr(transformers.Trainer, "save_model", capture)
    return seen


@pytest.fixture
def reads(monkeypatch):
    """The fields of the config's groups that the job reads, and the config it ran."""
    import dataclasses

    import packing_hf.app.trl_job as trl_job

    seen: dict = {"reads": set()}
    run_job = trl_job.run_job

    def tracked(cfg, **kwargs):
        seen["cfg"] = cfg
        for group in (cfg.model, cfg.data, cfg.job):
            names = {f.name for f in dataclasses.fields(group)}

            class Tracked(type(group)):
                def __getattribute__(self, name, names=names):
                    if name in names:
                        seen["reads"].add(name)
                    return super().__getattribute__(name)

            group.__class__ = Tracked
        return run_job(cfg, **kwargs)

    monkeypatch.setattr(trl_job, "run_job", tracked)
    return seen


@pytest.mark.parametrize("trainer", TRAINERS)
def test_lora_from_the_cli_saves_an_adapter_that_reloads(
    trainer, data_dir, tmp_path, captured, reads, capsys
):
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification

    out = tmp_path / "out"
    status = main(["train", config_of(trainer), *overrides(data_dir, out, trainer)])
    printed = capsys.readouterr()
    assert status == 0, printed.err[-3000:] + printed.out[-3000:]
    read = set(reads["reads"])

    # every key was read by the job, or is declared unused in this run (and refused when given), or shared
    # with the trainer's config (TRL reads its copy), or consumed by the parsing (model -> model_name_or_path)
    cfg = reads["cfg"]
    shared = {f.name for f in dataclasses.fields(type(cfg.training))}
    for name in OWN_KEYS:
        assert name in read | set(unused_keys(cfg)) | shared | PARSED, f"{name} is neither used nor refused"

    # an adapter, no full model; its base named absolutely and saved beside it (a model built from config)
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str((out / BASE_MODEL_DIR).resolve()) and (Path(base) / "config.json").is_file()
    assert "trained (adapter)" in json.loads((out / "packing_summary.json").read_text())["model"]

    # only the adapter moved: every base weight is the model's before training
    head = "score" if trainer == "reward" else "causal"
    tokenizer = load_tokenizer(ModelArguments(tokenizer_name_or_path=str(data_dir / "smollm2_tokenizer")))
    initial = load_model(
        ModelArguments(model_type="llama", model_config=SMALL), tokenizer, seed=0, head=head
    ).state_dict()
    moved = []
    for name, value in captured["parameters"].items():
        if base_name(name) is None:
            moved.append(name)
        else:
            torch.testing.assert_close(value, initial[base_name(name)], rtol=0, atol=0, msg=name)
    assert any("lora_B" in name and captured["parameters"][name].abs().max() > 0 for name in moved)

    # the saved adapter alone reloads into the trained model; the base alone is another model
    auto = AutoPeftModelForSequenceClassification if trainer == "reward" else AutoPeftModelForCausalLM
    reloaded = auto.from_pretrained(str(out)).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=INPUT_IDS).logits
        with reloaded.disable_adapter():
            base_logits = reloaded(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(logits, captured["logits"], rtol=1e-5, atol=1e-5)
    assert (base_logits - captured["logits"]).abs().max() > 1e-4


def test_an_adapter_of_a_model_loaded_from_a_folder_names_the_folder(data_dir, tmp_path, captured):
    """A model loaded by path: the adapter names that folder (absolute), and no base weights are copied."""
    from peft import AutoPeftModelForCausalLM

    tokenizer = load_tokenizer(ModelArguments(tokenizer_name_or_path=str(data_dir / "smollm2_tokenizer")))
    folder = tmp_path / "my_model"
    load_model(ModelArguments(model_type="llama", model_config=SMALL), tokenizer, seed=0).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    args = [a for a in overrides(data_dir, out, "trainer") if not a.startswith(("model_config", "tokenizer"))]
    assert main(["train", config_of("trainer"), f"model={folder}", *args]) == 0
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(folder.resolve()) and not (out / BASE_MODEL_DIR).exists()
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=INPUT_IDS).logits, captured["logits"], rtol=1e-5, atol=1e-5
        )


# ---- every key: used by a trainer, or refused by name ---------------------------------------------------

EVERY = frozenset(TRAINERS)
TRL = frozenset(TRAINERS[2:])
TOKENIZE_AHEAD = EVERY - {"grpo", "rloo"}
STREAM = {"streaming": True, "max_tokens_per_batch": 2048, "max_steps": 1}
# key -> (the trainers that use it, a value other than its default, the keys that make that value live)
KEYS: dict[str, tuple[frozenset, object, dict]] = {
    "model": (EVERY, "some/model", {}),
    "model_name_or_path": (EVERY, "some/model", {}),
    "gguf_file": (EVERY, "m.gguf", {"model_name_or_path": "some/folder"}),
    "gguf_package": (EVERY, "some_package", {"gguf_file": "m.gguf"}),
    "tokenizer_name_or_path": (EVERY, "some/tokenizer", {}),
    "model_type": (EVERY, "llama", {}),
    "model_config": (EVERY, {"hidden_size": 64}, {"model_type": "llama"}),
    "attn_implementation": (EVERY, "eager", {}),
    "trust_remote_code": (EVERY, True, {}),
    "peft": (EVERY, {"r": 4}, {}),
    "dataset": (EVERY, "mine.jsonl", {}),
    "dataset_config": (EVERY, "main", {"dataset": "org/dataset"}),
    "dataset_split": (EVERY, "test", {"dataset": "org/dataset"}),
    "num_samples": (EVERY, 5, {}),
    "mixed_formats": (frozenset({"trainer", "sft"}), True, {}),
    "eval_dataset": (frozenset({"trainer"}), "held.jsonl", {}),
    "eval_num_samples": (frozenset({"trainer"}), 3, {}),
    "prompt_format": (frozenset({"trainer"}), "alpaca", {}),
    "completion_only_loss": (frozenset({"trainer", "sft"}), False, {}),
    "max_length": (TOKENIZE_AHEAD, 300, {}),
    "overflow": (frozenset({"trainer"}), "truncate", {}),
    "dataset_num_proc": (TOKENIZE_AHEAD, 2, {}),
    "streaming": (frozenset({"trainer", "sft"}), True, {k: v for k, v in STREAM.items() if k != "streaming"}),
    "column_mapping": (TRL, {"question": "prompt"}, {}),
    "stream_check_records": (frozenset({"trainer", "sft"}), 5, STREAM),
    "trainer": (EVERY, None, {}),  # the row itself
    "batching": (EVERY, "multipack", {"max_tokens_per_batch": 2048}),
    "sample_packing": (frozenset({"trainer", "sft"}), True, {}),
    "baseline_batches": (frozenset({"trainer"}), 2, {}),
    "baseline_time_share": (frozenset({"trainer"}), 0.5, {}),
    "save_model": (EVERY, False, {}),
    "resume": (EVERY, True, {}),  # resumes the latest checkpoint of output_dir (test_cli_interrupt runs it)
    "reward_funcs": (frozenset({"grpo", "rloo"}), "gsm8k", {}),
}
OWN_KEYS = [f.name for cls in (ModelArguments, DataArguments, JobArguments) for f in dataclasses.fields(cls)]
PARSED = {
    "model",
    "sample_packing",
    "batching",
}  # turned into model_name_or_path and cfg.batching when parsed


def test_every_key_of_the_config_has_an_entry():
    assert sorted(KEYS) == sorted(OWN_KEYS), (
        "a new config key needs its row in KEYS (who uses it, or refuses it)"
    )


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("key", [k for k in KEYS if k != "trainer"])
def test_a_key_is_accepted_by_the_trainers_that_use_it_and_refused_by_name_by_the_others(key, trainer):
    users, value, live = KEYS[key]
    if trainer in users:
        config = {"trainer": trainer, **live, key: value}
        if trainer in ("grpo", "rloo") and config.get("dataset", "embedded") != "embedded":
            config.setdefault("reward_funcs", "gsm8k")  # other data than the demo's: named when parsed
        cfg = load_train_config(config)
        assert key not in unused_keys(cfg)
    else:
        with pytest.raises(ValueError, match=rf"{key}: .* is not used: .*trainer: {trainer}\b"):
            load_train_config({"trainer": trainer, key: value})


@pytest.mark.parametrize(
    "config, overrides, refused",
    [
        (
            {"stream_check_records": 5},
            [],
            "stream_check_records: 5 is not used: it checks the first records of a stream",
        ),
        (
            {"dataset": "mine.jsonl", "eval_num_samples": 3},
            [],
            "eval_num_samples: 3 is not used: there is no eval data",
        ),
        (
            {"eval_dataset": "none", "eval_num_samples": 3},
            [],
            "eval_num_samples: 3 is not used: there is no eval data",
        ),
        (
            {"baseline_batches": 0, "baseline_time_share": 0.5},
            [],
            "baseline_time_share: 0.5 is not used: baseline_batches: 0",
        ),
        (
            {"dataset": "mine.jsonl", "dataset_split": "test"},
            [],
            "dataset_split: 'test' is not used: it selects a Hub",
        ),
        (
            {"model_type": "llama", "gguf_file": "m.gguf", "tokenizer_name_or_path": "tok"},
            [],
            "gguf_file: 'm.gguf' is not used: the model is built from model_type and the tokenizer read from",
        ),
        ({"eval_num_samples": 3}, ["trainer=dpo", "eval_num_samples=4"], "eval_num_samples: 4 is not used"),
    ],
)
def test_a_key_made_moot_by_another_is_refused_by_name(config, overrides, refused):
    with pytest.raises(ValueError, match=refused):
        load_train_config(config, overrides)


@pytest.mark.parametrize(
    "config, overrides, note",
    [
        (
            {"eval_num_samples": 3, "baseline_batches": 2},
            ["trainer=sft"],
            "eval_num_samples: 3 from <dict> is not used",
        ),
        ({"eval_num_samples": 3}, ["dataset=mine.jsonl"], "eval_num_samples: 3 from <dict> is not used"),
        (
            {"model_type": "llama", "gguf_file": "m.gguf"},
            ["tokenizer_name_or_path=tok"],
            "gguf_file: 'm.gguf' from <dict> is not used",
        ),
    ],
)
def test_a_config_key_made_moot_by_the_command_line_is_dropped_with_a_note(config, overrides, note):
    """``trainer=sft`` on a config written for ``trainer: trainer`` (or your dataset on the demo's config): the
    config's own keys for the other setting are dropped and said so, as ``model=...`` drops the config's model;
    the same key on the command line is refused (above). Negative control: without the override it is used."""
    notes = load_train_config(config, overrides).notes
    assert any(n.startswith(note) for n in notes), notes
    assert not [n for n in load_train_config(config).notes if "is not used" in n]


# ---- the engine and the process layout: training arguments every trainer honours, or refuses by name ----------

SP = frozenset(trainers_where("sequence_parallel"))
# key -> (the trainers that honour it, a value, the keys that make it live, what the trainer's arguments then hold)
ENGINE_KEYS: dict[str, tuple[frozenset, object, dict, dict]] = {
    "sp_size": (SP, 2, {"max_tokens_per_batch": 2048}, {"sp_size": 2, "parallelism_config.sp_size": 2}),
    "deepspeed": (
        EVERY,
        {"zero_optimization": {"stage": 3}},
        {},
        {"deepspeed": {"zero_optimization": {"stage": 3}}},
    ),
    "fsdp": (EVERY, "full_shard", {}, {"fsdp": True}),
    "fsdp_config": (EVERY, {"version": 2}, {"fsdp": "full_shard"}, {"fsdp_config.version": 2}),
    "use_cpu": (EVERY, True, {}, {"use_cpu": True}),
    "parallelism_config": (frozenset(), {"sp_size": 2}, {}, {}),
}


def _held(training, path: str):
    value = training
    for name in path.split("."):
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    return value


@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_catalogue_entry_says_what_its_trainer_class_is(trainer):
    """The catalogue (what the config, its checks and the jobs read) agrees with the packed trainer class: the
    config class that parses its keys, the package of its stock trainer, whether it cuts packed rows over sp_size
    itself (``packing_sequence_parallel``: what the config lets ``sp_size`` through for), and whether its stock
    trainer takes a ``ref_model`` (the job hands it a copy) and ``reward_funcs`` (generated samples)."""
    import inspect

    entry = CATALOGUE[trainer]
    cls = entry.trainer_class()
    assert cls.packing_sequence_parallel == entry.sequence_parallel
    assert cls.config_class is entry.config_class()
    assert cls.stock.split(".")[0] == entry.package
    stock = next(c for c in cls.__mro__ if not c.__module__.startswith("packing_hf"))
    assert f"{stock.__module__}.{stock.__qualname__}".startswith(entry.package + ".")
    takes = inspect.signature(stock.__init__).parameters
    assert ("ref_model" in takes) == (entry.reference == "ref_model")
    assert ("reward_funcs" in takes) == entry.generates


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("key", list(ENGINE_KEYS))
def test_an_engine_key_reaches_the_trainers_arguments_or_is_refused_by_name(key, trainer, tmp_path):
    users, value, live, held = ENGINE_KEYS[key]
    config = {"trainer": trainer, "output_dir": str(tmp_path), **live, key: value}
    if trainer in users:
        training = load_train_config(config).training
        for path, want in held.items():
            assert _held(training, path) == want, path
    else:
        with pytest.raises(ValueError, match=rf"{key}(: {value})? is not (used|taken)\b"):
            load_train_config(config)


def test_engine_mappings_are_read_from_yaml(tmp_path):
    """A YAML config may nest the engine's configuration (``deepspeed:``, ``fsdp_config:``); other keys stay flat."""
    path = tmp_path / "run.yaml"
    path.write_text("deepspeed:\n  zero_optimization:\n    stage: 3\nfsdp_config:\n  version: 2\n")
    assert read_yaml(path) == {
        "deepspeed": {"zero_optimization": {"stage": 3}},
        "fsdp_config": {"version": 2},
    }
    path.write_text("learning_rate:\n  value: 1\n")
    with pytest.raises(ValueError, match="key 'learning_rate' holds a nested mapping"):
        load_train_config(path)


def test_sequence_parallelism_gets_packing_hf_attention_or_is_refused():
    """``sp_size`` runs inside packing_hf's attention: chosen when the config names none (with a note), refused by
    name next to another one; and it needs multipack rows to cut."""
    cfg = load_train_config({"max_tokens_per_batch": 2048, "sp_size": 2})
    assert cfg.model.attn_implementation == "packing_hf"
    assert any(note.startswith("attn_implementation: packing_hf (sp_size: 2") for note in cfg.notes)
    with pytest.raises(ValueError, match="attn_implementation: sdpa with sp_size: 2 would attend within"):
        load_train_config({"max_tokens_per_batch": 2048, "sp_size": 2, "attn_implementation": "sdpa"})
    with pytest.raises(ValueError, match="sp_size: 2 cuts packed rows .* batching is 'padding_free'"):
        load_train_config({"trainer": "dpo", "sp_size": 2})
    assert load_train_config({"sp_size": 1}).model.attn_implementation is None
