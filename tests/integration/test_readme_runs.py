"""Every code block of README.md and of the guides in docs/ that continue its session (:data:`GUIDES`) is run:
the Python blocks here, as written and in order in one namespace (README first, then each guide: they are one
session: the README's first block builds the tiny model, tokenizer and data the others use), in a temporary
working directory; every ``packing-hf`` / ``python`` command of a bash block by the test named for it in
:data:`COMMANDS` (a command without an entry, or an entry whose test is gone, fails). A Python block is left
out only when the line before its fence says why (``<!-- not run by the tests: needs a GPU ... -->``) and
:data:`NOT_RUN` lists it with the same reason."""

from __future__ import annotations

import ast
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# the pages whose blocks continue the README's session, in the order they run (README first)
GUIDES = (README, ROOT / "docs" / "rl.md", ROOT / "docs" / "vlm.md")
NOT_RUN_MARK = re.compile(r"<!-- not run by the tests: (?P<why>.+?) -->")

# first line of a Python block the tests do not run -> why (only what needs a GPU)
NOT_RUN: dict[str, str] = {}

# every packing-hf / python command of the README's bash blocks -> the test that runs it (file::function), or
# why no test can run it as written and which test runs the same code
COMMANDS: dict[str, str] = {
    "python examples/train_trainer.py --tiny": "tests/integration/app/test_examples.py::test_trainer_examples_train",
    "packing-hf preview path/to/train.jsonl -n 3": "tests/integration/app/test_cli_cases.py::test_a_field_missing_from_the_first_record_reaches_later_prompts",
    "packing-hf train configs/smollm2_demo.yaml dataset=path/to/train.jsonl eval_dataset=path/to/heldout.jsonl --max_steps 200": "tests/integration/app/test_cli.py::test_train_tiny_cpu_config_with_overrides",
    "packing-hf train configs/smollm2_demo.yaml dataset=my_data.jsonl streaming=true max_tokens_per_batch=4096 max_steps=1000 activation_checkpointing=true": "tests/integration/app/test_cli_streaming.py::test_streaming_trains_max_steps_in_batches_within_the_budget",
    "packing-hf train configs/smollm2_demo.yaml dataset=openai/gsm8k dataset_config=main": "needs the Hub (network); the same job on a local file: tests/integration/app/test_cli.py::test_train_tiny_cpu_config_with_overrides",
    "packing-hf train configs/smollm2_sft.yaml": "sized for a GPU (16k-token budget); parsed by tests/unit/app/test_config.py::test_every_shipped_config_parses, its trainer: sft job run by tests/integration/app/test_cli.py::test_train_sft_trainer_config_with_a_tiny_model",
    "packing-hf train configs/sft_trainer.yaml": "tests/integration/app/test_cli.py::test_train_sft_trainer_config_with_a_tiny_model",
    "packing-hf stats path/to/train.jsonl --max-tokens-per-batch 4096 16384 --plot lengths.png": "tests/integration/app/test_cli.py::test_stats_on_real_data_prints_the_table_and_writes_plot_and_json",
    "packing-hf stats path/to/train.jsonl --config configs/smollm2_demo.yaml": "tests/integration/app/test_cli_cases.py::test_stats_takes_the_train_configs_max_length_and_flags_what_train_refuses",
    "packing-hf verify --model path/to/model --attn-implementation sdpa": "tests/unit/app/test_verify_cli.py::test_cli_on_a_saved_model",
    "packing-hf train configs/tiny_dpo.yaml": "tests/integration/app/test_cli_trainers.py::test_shipped_trainer_config_runs_and_saves",
    'packing-hf train configs/tiny_dpo.yaml \'peft={"r": 16, "target_modules": "all-linear"}\'': "tests/integration/app/test_cli_trainers.py::test_shipped_trainer_config_runs_and_saves",
    "packing-hf train configs/tiny_grpo.yaml model=HuggingFaceTB/SmolLM2-135M-Instruct": "needs the Hub (network); the model= override: tests/unit/app/test_config.py::test_model_override_replaces_the_configs_model, the job: tests/integration/app/test_cli_trainers.py::test_shipped_trainer_config_runs_and_saves",
    "packing-hf train configs/tiny_hybrid.yaml": "tests/integration/app/test_cli_trainers.py::test_shipped_hybrid_and_vlm_configs_run_from_the_command_line",
    "packing-hf train configs/tiny_vlm.yaml": "tests/integration/app/test_cli_trainers.py::test_shipped_hybrid_and_vlm_configs_run_from_the_command_line",
    "packing-hf train configs/tiny_cpu.yaml resume=true": "tests/integration/app/test_cli_interrupt.py::test_ctrl_c_saves_a_checkpoint_and_resume_true_ends_where_the_uninterrupted_run_does",
    "python tools/gen_arch_table.py": "the whole architecture sweep (minutes); its checks per architecture: tests/integration/architectures/test_architectures.py::test_architecture",
}
_COMMAND = re.compile(r"^(?:\.venv/bin/)?(?:packing-hf|python) ")


@dataclass
class Block:
    line: int  # of the opening fence
    language: str
    source: str
    not_run: str | None  # why, from the marker on the line before the fence
    page: str = "README.md"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks, current, previous = [], None, ""
    for number, line in enumerate(text.splitlines(), 1):
        if current is None and line.startswith("```") and len(line.strip()) > 3:
            mark = NOT_RUN_MARK.search(previous)
            current = Block(number, line.strip()[3:], "", mark["why"] if mark else None, page)
            lines = []
        elif current is not None and line.strip() == "```":
            current.source = "\n".join(lines)
            blocks.append(current)
            current = None
        elif current is not None:
            lines.append(line)
        previous = line
    return blocks


def readme_commands(blocks: list[Block]) -> list[str]:
    """The commands of the bash blocks: continuation lines joined, comments and runs of spaces dropped."""
    commands = []
    for block in blocks:
        if block.language != "bash":
            continue
        joined = re.sub(r"\\\n\s*", " ", block.source)
        for line in joined.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            command = re.sub(r"\s+", " ", command)
            if _COMMAND.match(command):
                commands.append(command.removeprefix(".venv/bin/"))
    return commands


def run_blocks(blocks: list[Block]) -> None:
    """Run the Python blocks in order in one namespace; a block that raises fails with its page and line."""
    namespace: dict = {"__name__": "__readme__"}
    for block in blocks:
        if block.language != "python" or block.not_run:
            continue
        code = compile(block.source, f"{block.page}, block at line {block.line}", "exec")
        try:
            exec(code, namespace)
        except Exception as error:
            raise AssertionError(
                f"{block.page}: the Python block at line {block.line} raised {type(error).__name__}: {error}"
            ) from error


BLOCKS = [b for page in GUIDES for b in readme_blocks(page.read_text(), str(page.relative_to(ROOT)))]


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the blocks' tempfile.mkdtemp() lands here
    python = [b for b in BLOCKS if b.language == "python"]
    assert len(python) >= 8
    run_blocks(BLOCKS)


def test_a_block_that_raises_is_caught_with_its_line():
    # negative control: the runner on blocks whose second one fails
    blocks = [
        Block(10, "python", "value = 1", None),
        Block(20, "python", "value = value + undefined_name", None),
        Block(30, "python", "raise SystemExit('never reached')", None),
    ]
    with pytest.raises(AssertionError, match=r"block at line 20 raised NameError: name 'undefined_name'"):
        run_blocks(blocks)


def test_blocks_left_out_are_the_declared_ones_and_need_a_gpu():
    left_out = {b.source.splitlines()[0]: b.not_run for b in BLOCKS if b.language == "python" and b.not_run}
    assert left_out == NOT_RUN
    assert all(why.startswith("needs a GPU") for why in NOT_RUN.values())
    marked = "<!-- not run by the tests: needs a GPU (CUDA) -->\n```python\nx = 1\n```\n"
    assert readme_blocks(marked)[0].not_run == "needs a GPU (CUDA)"


def _test_exists(reference: str) -> bool:
    path, _, name = reference.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def test_every_readme_command_is_run_by_a_named_test():
    commands = readme_commands(BLOCKS)
    assert len(commands) >= 10
    missing = [c for c in commands if c not in COMMANDS]
    assert not missing, f"README commands no test runs (add them to COMMANDS with their test): {missing}"
    stale = [c for c in COMMANDS if c not in commands]
    assert not stale, f"COMMANDS entries no longer in the README: {stale}"
    for command, where in COMMANDS.items():
        references = re.findall(r"tests/[\w/]+\.py::\w+", where)
        assert references, f"{command}: names no test"
        for reference in references:
            assert _test_exists(reference), f"{command}: {reference} does not exist"


def test_a_new_untested_command_fails_the_mapping():
    # negative control: a bash block with a command COMMANDS does not know
    blocks = readme_blocks(
        "```bash\n.venv/bin/packing-hf train configs/brand_new.yaml \\\n    --max_steps 1\n```\n"
    )
    assert readme_commands(blocks) == ["packing-hf train configs/brand_new.yaml --max_steps 1"]
    assert readme_commands(blocks)[0] not in COMMANDS
