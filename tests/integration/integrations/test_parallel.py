"""The run's parallel layout (``packing_hf/integrations/parallel.py``): one plan per trainer, built with its
accelerator, and the launches whose processes the Trainer would not run together refused by name.

The multi-process plans (DDP, DeepSpeed ZeRO-2/3, sequence parallelism inside them) are checked with real processes in
``tests/distributed/test_deepspeed_multiprocess.py`` and ``test_sequence_parallel_multiprocess.py``.
"""

from __future__ import annotations

import pytest
from accelerate import ParallelismConfig

import packing_hf
from packing_hf.integrations.parallel import ParallelPlan, fsdp_layout, sequence_parallel_size


def _trainer(tmp_path, tiny_llama, **options):
    args = packing_hf.TrainingArguments(
        str(tmp_path), report_to="none", max_tokens_per_batch=64, use_cpu=True, **options
    )
    data = [{"input_ids": list(range(1, n))} for n in (5, 9, 7)]
    return packing_hf.Trainer(model=tiny_llama(vocab_size=32), args=args, train_dataset=data)


def test_one_plan_per_trainer(tmp_path, tiny_llama):
    plan = _trainer(tmp_path, tiny_llama).parallel_plan
    assert isinstance(plan, ParallelPlan)
    assert (plan.engine, plan.world_size, plan.rank, plan.data_parallel) == ("none", 1, 0, (1, 0))
    assert not plan.sequence_parallel and plan.counts_rows and plan.describe() == "none, 1 process"


def test_the_mfu_divides_by_every_device_of_the_run(tmp_path, tiny_llama):
    """DataParallel (``args.n_gpu > 1``: one process driving every GPU it sees, no process group): the MFU in the
    logs divides by the run's devices (the plan's), not by ``args.world_size``, which counts processes (1) and
    would report it ``n_gpu`` times too high. On CPU torch's DataParallel runs the module itself; the GPU count
    set here is what transformers counts on a two-GPU machine without a launcher."""
    from packing_hf.integrations.callbacks import STATS_KEY, PackingStatsCollator, StepClock

    args = packing_hf.TrainingArguments(
        str(tmp_path), report_to="none", max_tokens_per_batch=64, use_cpu=True, peak_tflops=1.0
    )
    args._n_gpu = 2
    trainer = packing_hf.Trainer(
        model=tiny_llama(vocab_size=32), args=args, train_dataset=[{"input_ids": [1, 2]}]
    )
    plan = trainer.parallel_plan
    assert (plan.engine, plan.world_size, plan.devices, args.world_size) == ("data_parallel", 1, 2, 1)
    assert plan.describe() == "data_parallel, 1 process (2 GPUs each)"
    (clock,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, StepClock)]
    clock.on_train_begin(args, trainer.state, trainer.control, model=trainer.model)
    metrics = trainer._packing_metrics
    assert metrics.devices == 2
    metrics._clock.mark = iter([10.0, 12.0]).__next__  # one step of 2 s
    metrics.start_step()
    metrics.update(
        PackingStatsCollator(packing_hf.PaddingFreeCollator())([{"input_ids": [1, 2, 3]}])[STATS_KEY]
    )
    metrics.end_step()
    out = metrics.compute(num_steps=1)
    assert out["mfu"] == pytest.approx(out["model_tflops_per_s"] / (1.0 * 2), rel=1e-12)
    # negative control: one process's single device (what args.world_size says) doubles the figure
    assert out["mfu"] != pytest.approx(out["model_tflops_per_s"] / 1.0, rel=1e-6)


def test_a_launch_the_trainer_runs_as_one_process_is_refused(tmp_path, tiny_llama, monkeypatch):
    """``torchrun --nproc_per_node 2`` on CPU without ``use_cpu=True``: no process group joins the processes
    (transformers' parallel mode is NOT_PARALLEL), so each would train its own copy on all the data."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = packing_hf.TrainingArguments(str(tmp_path), report_to="none", max_tokens_per_batch=64)
    data = [{"input_ids": list(range(1, n))} for n in (5, 9, 7)]
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*no process group.*use_cpu=True"):
        packing_hf.Trainer(model=tiny_llama(vocab_size=32), args=args, train_dataset=data)


def test_sequence_parallel_sizes_it_cannot_serve_are_refused(tmp_path, tiny_llama):
    assert sequence_parallel_size(ParallelismConfig(sp_size=2)) == 2
    with pytest.raises(ValueError, match=r"runs next to data parallelism.*'tp_size': 2"):
        sequence_parallel_size(ParallelismConfig(sp_size=2, tp_size=2))
    with pytest.raises(ValueError, match="sp_size=2 must divide the number of processes \\(1\\)"):
        _trainer(tmp_path, tiny_llama, parallelism_config=ParallelismConfig(sp_size=2))


def test_sp_size_is_an_argument_and_a_config_key(tmp_path):
    """``sp_size`` is a training argument (the same as ``ParallelismConfig(sp_size=N)``), so the ``packing-hf train``
    YAML and command line take it; a ``parallelism_config`` saying otherwise is refused."""
    from packing_hf.app.config import load_train_config

    args = packing_hf.TrainingArguments(str(tmp_path), report_to="none", sp_size=2)
    assert args.parallelism_config.sp_size == 2
    with pytest.raises(ValueError, match="sp_size=2 but parallelism_config has sp_size=4"):
        packing_hf.TrainingArguments(
            str(tmp_path), report_to="none", sp_size=2, parallelism_config=ParallelismConfig(sp_size=4)
        )
    config = {"output_dir": str(tmp_path), "max_steps": 2, "max_tokens_per_batch": 2048, "trainer": "sft"}
    cfg = load_train_config(config, ["sp_size=2"])
    assert type(cfg.training).__name__ == "SFTConfig" and cfg.training.parallelism_config.sp_size == 2


def test_the_fsdp_layout_folds_sp_into_the_shard_dimension(monkeypatch):
    """Under FSDP2 with ``sp_size``, accelerate gets the data-parallel sizes alone, the SP processes in the shard
    dimension; none of its sizes comes from the launcher's variables (``accelerate launch
    --parallelism_config_sp_size 2`` sets ``PARALLELISM_CONFIG_SP_SIZE``, which a size left unset would read)."""
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    config = ParallelismConfig(dp_shard_size=2)  # sp_size 2 and dp_replicate_size 2 from the launcher
    layout = fsdp_layout(config, 2, 8)
    sizes = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
    assert [getattr(layout, name) for name in sizes] == [2, 4, 1, 1, 1]
    assert layout.total_size == 8 and layout.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert fsdp_layout(ParallelismConfig(sp_size=2, dp_replicate_size=1), 2, 8) is None  # FSDP2 over everyone
    with pytest.raises(
        ValueError, match=r"dp_replicate_size=2 x dp_shard_size=2 x sp_size=2 must be the number"
    ):
        fsdp_layout(config, 2, 4)
