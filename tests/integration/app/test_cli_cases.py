"""Issue 14, case by case through the command line: what a new user's data and typos meet.

Every case runs ``packing-hf`` in process with a tiny model (or stops before any model loads) and asserts
the message the user reads, not only the exit status.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from packing_hf.app.cli import main

ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def tok(data_dir) -> str:
    return str(data_dir / "smollm2_tokenizer")


def train(tok: str, tmp_path: Path, *overrides: str) -> int:
    return main(
        [
            "train",
            TINY_CONFIG,
            f"tokenizer_name_or_path={tok}",
            "max_steps=1",
            # the embedded data's held-out rows (your own dataset= has none unless eval_dataset= is given)
            *([] if any(o.startswith("dataset=") for o in overrides) else ["eval_num_samples=2"]),
            "save_strategy=no",  # no checkpoint: these runs test other things (kept out of the suite's time)
            f"output_dir={tmp_path / 'out'}",
            "disable_tqdm=true",
            *overrides,
        ]
    )


# ---- data: nothing lost, nothing silent -------------------------------------------------------------


def test_a_field_missing_from_the_first_record_reaches_later_prompts(tmp_path, tok, capsys):
    data = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"instruction": "Say hi", "output": "hi"},
            {"instruction": "Translate to English", "input": "bonjour le monde", "output": "hello world"},
        ],
    )
    assert main(["preview", data, "--tokenizer", tok, "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "Translate to English\n\nbonjour le monde<|im_end|>" in out
    assert "«hello world<|im_end|>\n»" in out and f"({data}:2)" in out


def test_mixed_formats_fail_with_the_line_unless_allowed(tmp_path, tok, capsys):
    data = write_jsonl(
        tmp_path / "m.jsonl", [{"text": "plain words"}, {"instruction": "Add 2 and 3", "output": "5"}]
    )
    assert train(tok, tmp_path, f"dataset={data}") == 1
    err = capsys.readouterr().err
    assert (
        f"{data}:2: a 'instruction' record in a file of 'text' records" in err
        and "mixed_formats: true" in err
    )
    assert main(["preview", data, "--tokenizer", tok, "mixed_formats=true"]) == 0
    out = capsys.readouterr().out
    assert "None<|im_end|>" not in out and "«5<|im_end|>\n»" in out


def test_openai_tool_calls_are_trained(tmp_path, tok, capsys):
    call = {
        "id": "1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    data = write_jsonl(
        tmp_path / "tools.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "1", "content": "18 C"},
                    {"role": "assistant", "content": "18 C."},
                ]
            }
        ],
    )
    assert main(["preview", data, "--tokenizer", tok]) == 0
    out = capsys.readouterr().out
    assert (
        '«<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n»'
        in out
    )
    assert "<|im_start|>tool\n18 C<|im_end|>" in out


def test_sharegpt_conversations_are_accepted(tmp_path, tok, capsys):
    data = tmp_path / "sharegpt.json"
    data.write_text(
        json.dumps(
            [
                {
                    "system": "Be brief.",
                    "tools": '[{"name": "add"}]',
                    "conversations": [
                        {"from": "human", "value": "2+3?"},
                        {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 3}}'},
                        {"from": "observation", "value": "5"},
                        {"from": "gpt", "value": "5"},
                    ],
                }
            ]
        )
    )
    assert main(["preview", str(data), "--tokenizer", tok]) == 0
    out = capsys.readouterr().out
    assert "1 records (1 conversations)" in out and '"arguments": {"a": 2, "b": 3}' in out
    assert "«<tool_call>" in out and "«5<|im_end|>\n»" in out  # the call and the answer are trained


def test_no_assistant_turn_is_an_error_not_a_zero_loss(tmp_path, tok, capsys):
    data = write_jsonl(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    assert train(tok, tmp_path, f"dataset={data}") == 1
    err = capsys.readouterr().err
    assert f"nothing to train on in {data}" in err and "3 with no assistant turn" in err


def test_all_empty_answers_are_an_error(tmp_path, tok, capsys):
    data = write_jsonl(tmp_path / "e.jsonl", [{"question": "q?", "answer": ""}] * 2)
    assert train(tok, tmp_path, f"dataset={data}") == 1
    assert "2 with empty answer" in capsys.readouterr().err


def test_a_number_as_answer_names_the_line(tmp_path, tok, capsys):
    data = write_jsonl(
        tmp_path / "n.jsonl", [{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": 6}]
    )
    assert train(tok, tmp_path, f"dataset={data}") == 1
    assert f"{data}:2: answer must be a string, got int 6" in capsys.readouterr().err


def test_data_errors_come_before_the_model_loads(tmp_path, tok, capsys):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q?"}])
    # the model folder does not exist: the data error must be what the user sees
    status = train(tok, tmp_path, f"dataset={data}", "model_type=null", "model_config=null",
                   f"model_name_or_path={tmp_path / 'no_model'}", "gguf_package=null", "gguf_file=null")  # fmt: skip
    captured = capsys.readouterr()
    assert status == 1 and f"{data}:1: cannot tell the record format" in captured.err
    assert "loading the model" not in captured.out


# ---- config and arguments: one line, before anything heavy -------------------------------------------


def test_a_typo_gets_a_short_did_you_mean(tmp_path, capsys):
    assert main(["train", TINY_CONFIG, "max_tokns_per_batch=512"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "packing-hf train: error: unknown config key 'max_tokns_per_batch' in the command-line overrides. "
        "Did you mean 'max_tokens_per_batch'? `packing-hf train --help` lists the keys"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "max_steps=-5",
            "the command line: max_steps must be >= 1 (or -1 to train num_train_epochs epochs), got -5",
        ),
        (
            "--max_steps=0",
            "the command line: max_steps must be >= 1 (or -1 to train num_train_epochs epochs)",
        ),
        ("model_type=lama", "unknown model_type 'lama'; did you mean 'llama'"),
        ("attn_implementation=sdap", "unknown attn_implementation 'sdap'; did you mean 'sdpa'"),
        # checked when the config is parsed, before the model loads (a bad peft value was a TypeError at the adapter)
        ('peft={"r": "x"}', "the command line: peft: r must be int, got 'x' (a str)"),
        ('fsdp_config={"bogus_key": 1}', "the command line: fsdp_config has no key 'bogus_key'"),
    ],
)
def test_bad_values_are_one_line_errors(override, message, capsys):
    assert main(["train", TINY_CONFIG, override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    if "max_steps" in override:  # the command line's value is not blamed on the YAML file
        assert TINY_CONFIG not in err


def test_a_bad_value_in_the_yaml_names_the_yaml(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model_type: llama\nmax_steps: -5\n")
    assert main(["train", str(config)]) == 2
    assert f"{config}: max_steps must be >= 1" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_flash_attention_without_its_package_is_one_line(capsys):
    assert main(["train", TINY_CONFIG, "attn_implementation=flash_attention_2"]) == 2
    err = capsys.readouterr().err
    assert (
        "attn_implementation: flash_attention_2 needs the flash_attn package" in err and err.count("\n") == 1
    )
    assert main(["verify", "--model-type", "llama", "--attn-implementation", "flash_attention_2"]) == 2
    assert "needs the flash_attn package" in capsys.readouterr().err


def test_invalid_yaml_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: 2\nlearning_rate: [oops\n")
    assert main(["train", str(bad)]) == 2
    assert f"packing-hf train: error: {bad}:3:1: invalid YAML" in capsys.readouterr().err


def test_verify_bad_arguments_are_one_line(tmp_path, capsys):
    assert main(["verify", "--model", str(tmp_path / "missing")]) == 2
    assert "no model folder there (no config.json)" in capsys.readouterr().err
    assert main(["verify", "--model-type", "llama", "--lengths", "0,3"]) == 2
    assert "--lengths must be positive sample lengths" in capsys.readouterr().err


def test_train_help_lists_the_keys_by_group(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for group in (
        "model (ModelArguments)",
        "data (DataArguments)",
        "job (JobArguments)",
        "training, the most used",
    ):
        assert group in out
    for key in (
        "gguf_file",
        "eval_dataset",
        "mixed_formats",
        "baseline_batches",
        "max_tokens_per_batch",
        "learning_rate",
    ):
        assert f"    {key} (default" in out
    assert main(["train", "--help", "all"]) == 0
    every = capsys.readouterr().out
    assert "    adam_beta1 (default" in every
    # whole help texts, wrapped, never cut with "..."; the keys `train` gives a meaning of its own say it
    assert not [line for line in every.splitlines() if line.rstrip().endswith("...")]
    assert max(len(line) for line in every.splitlines()) <= 110
    assert "Prompt-learning methods are refused (not exact when packed)." in " ".join(every.split())
    entry = re.search(r"\n    resume_from_checkpoint \(default None\):(.*?)\n    \S", every, re.S)
    resume = " ".join(entry.group(1).split())
    assert "true = the latest one in output_dir" in resume and "Not directly used" not in resume


# ---- a run: progress before every phase, the user's config saved, one final table -------------------


def test_a_run_announces_its_phases_and_saves_the_users_config(tmp_path, tok, capsys):
    # baseline_time_share: the tiny model's baseline is timed whatever it costs against its short training
    assert (
        train(tok, tmp_path, "attn_implementation=packing_hf", "num_samples=24", "baseline_time_share=1000")
        == 0
    )
    out = capsys.readouterr().out
    phases = [
        "reading the config",
        "reading and checking the records of embedded",
        "loading the tokenizer",
        "tokenizing 24 records",
        "loading the model",
        "planning multipack batches",
        "eval loss before training: 2 held-out samples of embedded:eval",
        "training: 1 step\n",
        "eval loss after training",
        "saving the model",  # before the optional diagnostics: a failing one cannot lose the model
        "padded baseline:",
        "packing-hf train: summary",
    ]
    positions = [out.find(phase) for phase in phases]
    assert -1 not in positions and positions == sorted(positions), dict(zip(phases, positions, strict=True))
    assert "the first 24 of 1,000 (num_samples)" in out and "the first 2 of 200 (eval_num_samples)" in out
    for row in ("fill (real / provisioned tokens)", "tokens/s (forward+backward)", "eval loss (held out)"):
        assert row in out
    assert "each padded to its longest" in out and "every sample padded to the dataset's longest" in out
    summary = json.loads((tmp_path / "out" / "packing_summary.json").read_text())
    assert summary["attn_implementation"] == "packing_hf_varlen"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["use_cache"] is True  # training turned it off; the saved model is the user's


# ---- stats: one plot, labelled by what it shows; over-budget samples flagged ---------------------------


def test_stats_two_budgets_one_plot_and_over_budget_flagged(tmp_path, tok, capsys):
    png = tmp_path / "stats.png"
    status = main(
        ["stats", "embedded", "--tokenizer", tok, "--num-samples", "200", "--max-tokens-per-batch", "256", "2048",
         "--plot", str(png)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and png.is_file() and list(tmp_path.iterdir()) == [png]  # the name asked for
    assert "WARNING: " in out and "samples are longer than max_tokens_per_batch=256" in out
    assert "padded means padded per batch" in out and "padding every sample to the dataset's longest" in out


def test_stats_takes_the_train_configs_max_length_and_flags_what_train_refuses(tmp_path, tok, capsys):
    rows = [{"question": f"{i}+{i}?", "answer": str(2 * i)} for i in range(30)]
    rows.append({"question": "long " * 600, "answer": "x"})  # over tiny_cpu.yaml's max_length: 512
    data = write_jsonl(tmp_path / "t.jsonl", rows)
    assert main(["stats", data, "--tokenizer", tok, "--config", TINY_CONFIG]) == 0
    out = capsys.readouterr().out
    assert "max_length=512, overflow: error: 1 sample is longer (the longest, " in out
    assert "t.jsonl:31, has " in out and "train REFUSES this data" in out
    assert "max_tokens_per_batch=512," in out  # the config's budget
    assert not re.search(r"(?<![\d,])1 samples", out) and "rows of 512 tokens" in out
    assert "rows of max_length" not in out
    assert main(["stats", data, "--tokenizer", tok, "--config", TINY_CONFIG, "--overflow", "drop"]) == 0
    out = capsys.readouterr().out
    assert "train drops them: the figures below leave them out" in out and ": 30 samples," in out


# ---- what fails fast: bad data and missing optional packages, before the heavy imports ---------------


_FIRST_THINGS = r"""
import json, sys
from packing_hf.app.cli import main

heavy = ("torch", "transformers", "trl", "peft", "datasets")
out = {"data": main(["train", "configs/smollm2_demo.yaml", f"dataset={sys.argv[1]}", f"output_dir={sys.argv[2]}"])}
out["loaded_at_data_error"] = sorted(m for m in heavy if m in sys.modules)
sys.modules["trl"] = sys.modules["peft"] = None  # as after `make train`, which installs neither
out["trl"] = main(["train", "configs/tiny_dpo.yaml", f"output_dir={sys.argv[2]}"])
out["peft"] = main(["train", "configs/tiny_cpu.yaml", 'peft={"r": 4}', f"output_dir={sys.argv[2]}"])
out["loaded_at_import_error"] = sorted(m for m in heavy if sys.modules.get(m) is not None)
import packing_hf
from packing_hf.app.modeling import peft_config_from
for name, call in (("api_trl", lambda: packing_hf.DPOTrainer), ("api_peft", lambda: peft_config_from({"r": 4}))):
    try:
        call()
    except ImportError as error:
        out[name] = str(error)
print(json.dumps(out))
"""


def test_bad_data_and_missing_trl_or_peft_fail_before_the_heavy_imports_in_one_line(tmp_path):
    """A fresh interpreter: a bad record is reported before torch / transformers / TRL are imported; after
    `make train` (no TRL, no PEFT) a config that needs one says `make setup` and the pip extra, one line each,
    no traceback; the Python API raises ImportError with the same advice."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "2+2?", "answer": "4"}\n{"question": "3+3?"\n')
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_THINGS, str(bad), str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    errors = [line for line in done.stderr.splitlines() if line.startswith("packing-hf train: error:")]
    assert out["data"] == 1 and f"{bad}:2: malformed JSON" in errors[0]
    assert out["loaded_at_data_error"] == []
    assert out["trl"] == 1 and out["peft"] == 1 and "Traceback" not in done.stderr
    for line, package, extra in ((errors[1], "TRL", "trl"), (errors[2], "PEFT", "peft")):
        assert f"needs {package}, which is not installed: run `make setup`" in line
        assert f"`pip install 'packing-hf[{extra}]'`" in line
    assert "trainer: dpo needs TRL" in errors[1] and "peft: adapter needs PEFT" in errors[2]
    assert not {"torch", "transformers", "datasets"} & set(out["loaded_at_import_error"])
    assert out["api_trl"].startswith(
        "packing_hf.DPOTrainer needs TRL, which is not installed: run `make setup`"
    )
    assert "pip install 'packing-hf[peft]'" in out["api_peft"]
