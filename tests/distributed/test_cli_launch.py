"""``packing-hf train`` under ``torchrun`` on 2 CPU processes (gloo, ``use_cpu=true``): the command is rank-aware.

``packing-hf train configs/tiny_cpu.yaml`` (through ``_cli_launch_worker.py``, which records every file each process
writes) once per layout: plain DDP, ``sp_size=2`` (one replica, its rows cut over the two processes), and the
sharding engines (ZeRO-3, ZeRO-3 + ``sp_size=2``, FSDP2: :func:`_check_engine_run`), all in one launch: the worker
runs the command once per layout in the same two processes (the interpreters and imports, most of a launch's cost,
once), ZeRO-3 first, as DeepSpeed starts the process group from nothing. Each run prints the command's lines once (not once per process), only
the main process writes (the run's files, the tokenized-dataset cache; the other process reads the cache once
written and writes nothing), the files are valid (the summary JSON, the loss curve, a model that loads), and the
summary's counts are the whole run's: every sample and token of the data, both processes' tokens in the step logs.
With ``sp_size=2`` the run trains exactly as one process does: the same losses and eval loss.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_cli_launch_worker.py")
TINY_CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
LAUNCH_TIMEOUT_S = 240
NUM_SAMPLES, EVAL_SAMPLES = 8, 2
TINY_MODEL = (
    '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, '
    '"num_key_value_heads": 1}'
)
# the layouts' overrides, in the order the launch runs them (ZeRO-3 first: DeepSpeed starts the process group)
LAYOUTS = {"zero3": [], "zero3_sp2": ["sp_size=2"], "fsdp2": [], "ddp": [], "sp2": ["sp_size=2"]}
ENGINES = {"zero3": "deepspeed ZeRO-3", "zero3_sp2": "deepspeed ZeRO-3", "fsdp2": "fsdp2"}
# ZeRO-3 with every parameter partitioned (DeepSpeed keeps parameters under its persistence threshold whole)
ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
}
# FSDP2 whose checkpoints are sharded: the final model must be saved whole all the same
FSDP2 = {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}

pytestmark = pytest.mark.distributed


def _overrides(data_dir: Path, out: Path) -> list[str]:
    """tiny_cpu.yaml made tiny: 8 samples for one epoch (every sample trained once), a 1-layer model."""
    return [
        f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
        f"num_samples={NUM_SAMPLES}",
        f"eval_num_samples={EVAL_SAMPLES}",
        "max_steps=-1",
        "num_train_epochs=1",
        "max_tokens_per_batch=384",
        "max_length=384",
        f"model_config={TINY_MODEL}",
        "disable_tqdm=true",
        f"output_dir={out}",
    ]


def _engine(folder: Path, layout: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """The overrides, the phase's environment and the launch's of a layout's engine: DeepSpeed ZeRO-3
    (``DS_ACCELERATOR=cpu``) or FSDP2 (the worker installs the CPU stand-in for accelerate's device gate), each run
    recording the job's weights."""
    env = {"PACKING_HF_TEST_WEIGHTS": str(folder / "weights.pt")} if layout in ENGINES else {}
    if layout.startswith("zero3"):
        (folder / "ds_zero3.json").write_text(json.dumps(ZERO3))
        return [f"deepspeed={folder / 'ds_zero3.json'}"], env, {"DS_ACCELERATOR": "cpu"}
    if layout == "fsdp2":
        (folder / "fsdp2.json").write_text(json.dumps(FSDP2))
        return (
            ["fsdp=full_shard", f"fsdp_config={folder / 'fsdp2.json'}"],
            env,
            {"PACKING_HF_TEST_FSDP_ON_CPU": "1"},
        )
    return [], env, {}


def _launch(folder: Path, data_dir: Path, torchrun_command, layouts: list[str]) -> None:
    """One torchrun launch running the command once per layout, in order, in the same processes (the worker's
    phases); each layout's files in ``folder/<layout>``, its output in ``output-rank<R>.txt`` there."""
    phases, launch_env = [], {}
    for layout in layouts:
        phase = folder / layout
        cache, out = phase / "cache", phase / "out"
        cache.mkdir(parents=True)
        engine, phase_env, engine_env = _engine(phase, layout)
        launch_env.update(engine_env)
        argv = [
            TINY_CONFIG,
            *_overrides(data_dir, out),
            "baseline_time_share=1000",  # the padded baseline runs whatever its estimate: its lines are checked too
            *LAYOUTS[layout],
            *engine,
        ]
        phases.append(
            {
                "dir": str(phase),
                "roots": [str(cache), str(out)],
                "argv": argv,
                "env": {**phase_env, "PACKING_HF_CACHE": str(cache)},
            }
        )
    (folder / "phases.json").write_text(json.dumps(phases, indent=1))
    command = [*torchrun_command(), str(WORKER), str(folder / "phases.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(**launch_env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    env.pop("PYTEST_XDIST_WORKER", None)
    timeout = LAUNCH_TIMEOUT_S * len(layouts)
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=folder)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"packing-hf train on 2 processes did not finish in {timeout}s:\n{exc.stderr}")
    (folder / "output.txt").write_text(proc.stdout + proc.stderr)
    outputs = "".join(f"\n{layout}: {_output(folder / layout)[-3000:]}" for layout in layouts)
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}{outputs}"


def _output(phase: Path) -> str:
    """What a phase's processes printed (the main one's, then the other's)."""
    files = [phase / f"output-rank{rank}.txt" for rank in (0, 1)]
    return "".join(f.read_text() for f in files if f.is_file())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_dir) -> dict:
    """The same run on one process (in this process), with the attention sp_size=2 gives the model."""
    from packing_hf.app.cli import main

    out = tmp_path_factory.mktemp("cli-one-process") / "out"
    overrides = [*_overrides(data_dir, out), "attn_implementation=packing_hf", "baseline_batches=0"]
    assert main(["train", TINY_CONFIG, *overrides]) == 0
    return json.loads((out / "packing_summary.json").read_text())


def _writes(folder: Path, rank: int) -> list[str]:
    return (folder / f"writes-rank{rank}.txt").read_text().splitlines()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packing_hf_train_on_2_processes_prints_and_writes_once(
    layout, run_once, torchrun_command, data_dir, one_process
):
    folder = run_once("cli-launch", lambda f: _launch(f, data_dir, torchrun_command, list(LAYOUTS))) / layout
    output = _output(folder)
    out = folder / "out"

    # the command's own lines, once each (a progress bar may share a line with one: cut at \r)
    lines = re.findall(r"\[packing-hf\] [^\r\n]*", output)
    assert lines and [line for line, n in Counter(lines).items() if n > 1] == []
    for once in (
        "[packing-hf] reading the config",
        "packing-hf train: summary",
        "[packing-hf] saving the model",
    ):
        assert output.count(once) == 1, once
    assert "(fp32, the main one of 2 processes)" in output

    # one writer: the main process wrote the cache and the run's files, the other process no file at all (the
    # Trainer makes the checkpoint folder on every process, exist_ok)
    # (under ZeRO-3 and FSDP2 with sharded checkpoints every process writes its own partition of a checkpoint)
    own_partition = str(out / "checkpoint-") if layout in ENGINES else None
    assert [
        w
        for w in _writes(folder, 1)
        if not w.startswith("os.mkdir ") and not (own_partition and own_partition in w)
    ] == []
    written = _writes(folder, 0)
    assert any(f"{folder / 'cache' / 'tokenized'}" in w for w in written)
    assert any(w.endswith(str(out / "packing_summary.json")) for w in written)
    assert not list((folder / "cache" / "tokenized").glob("*.partial"))
    assert len(list((folder / "cache" / "tokenized").iterdir())) == 2  # the training and the eval records

    # valid files: the summary, the loss curve, a model that loads
    summary = json.loads((out / "packing_summary.json").read_text())
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and model.config.model_type == "llama"

    # the whole run's counts: every sample and token of the data once, both processes' tokens in the logs
    assert summary["processes"] == 2
    assert summary["num_samples"] == NUM_SAMPLES == one_process["num_samples"]
    assert summary["num_tokens"] == one_process["num_tokens"]
    assert summary["eval_samples"] == EVAL_SAMPLES and summary["eval_tokens"] == one_process["eval_tokens"]
    state = json.loads((out / f"checkpoint-{summary['global_step']}" / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry]
    assert len(steps) == summary["global_step"] == len(summary["losses"])
    assert sum(entry["real_tokens_per_step"] for entry in steps) == summary["num_tokens"]
    assert summary["baseline"]["real_tokens"] > 0

    if layout in ENGINES:
        _check_engine_run(layout, folder, summary, model, one_process)
    elif layout == "sp2":
        # one replica of 2 processes trains exactly as one process: the same steps, losses and eval loss
        assert summary["global_step"] == one_process["global_step"]
        assert summary["losses"] == pytest.approx(one_process["losses"], rel=1e-5)
        assert summary["eval_loss_after"] == pytest.approx(one_process["eval_loss_after"], rel=1e-5)
    else:
        # two replicas: each step holds a packed batch of each process, so fewer steps than one process
        assert summary["global_step"] < one_process["global_step"]


def _check_engine_run(layout: str, folder: Path, summary: dict, saved, one_process: dict) -> None:
    """A sharding engine's run (ZeRO-3 with every parameter partitioned, with and without ``sp_size=2``; FSDP2 with
    sharded checkpoints): every phase ran on the sharded model (the padded baseline too: asserted by the caller), the
    summary counts the whole model, and the saved model is the trained one, whole.

    The worker recorded the parameters (gathered there, not by the save) when the eval before training began and
    when the save began, and the eval samples: the saved model equals the trained parameters exactly (fp32) and
    not the initial ones, and the eval losses of the summary are the padded eval of those parameters, recomputed
    here on one process (the negative control: the initial parameters do not give the loss after training)."""
    import torch

    from packing_hf.app.baseline import evaluate_loss, padded_collator

    assert summary["model"] == one_process["model"]  # the whole model's parameters, not a partition's (0.0M)
    # the engine's own checkpoint: ZeRO-3's partitions, FSDP2's sharded state dict (the final model is whole all the same)
    checkpoint = folder / "out" / f"checkpoint-{summary['global_step']}"
    engine_folder = (
        f"global_step{summary['global_step']}" if layout.startswith("zero3") else "pytorch_model_fsdp_0"
    )
    assert (checkpoint / engine_folder).is_dir(), sorted(p.name for p in checkpoint.iterdir())
    recorded = torch.load(folder / "weights.pt", weights_only=False)
    trained, initial = recorded["trained"], recorded["initial"]
    state = dict(saved.named_parameters())
    assert sorted(state) == sorted(trained)
    for name, tensor in trained.items():
        assert torch.equal(state[name].detach(), tensor), f"{layout}: the saved {name} is not the trained one"
    assert max(float((trained[n] - initial[n]).abs().max()) for n in trained) > 1e-4, "training moved nothing"

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "out")
    samples, collator = recorded["eval_samples"], padded_collator(tokenizer)

    def loss_of(weights: dict) -> float:
        saved.load_state_dict(weights, strict=False)
        return evaluate_loss(saved, samples, collator=collator, max_tokens_per_batch=384)

    before, after = loss_of(initial), loss_of(trained)
    assert summary["eval_loss_before"] == pytest.approx(before, rel=1e-5)
    assert summary["eval_loss_after"] == pytest.approx(after, rel=1e-5)
    assert summary["eval_loss_after"] != pytest.approx(before, rel=1e-5)
