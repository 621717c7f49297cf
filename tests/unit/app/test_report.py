"""The summary table says when the machine was busy during the run instead of calling its figures steady."""

from __future__ import annotations

from packing_hf.app.report import load_average, print_summary


def _summary(start: float, end: float) -> dict:
    return {
        "model": "tiny llama",
        "device": "cpu",
        "precision": "fp32",
        "batching": "multipack",
        "global_step": 2,
        "train_runtime": 3.0,
        "losses": [2.0, 1.5],
        "baseline": {
            "packed_tokens_per_s": 900.0,
            "padded_tokens_per_s": 600.0,
            "real_tokens": 4000,
            "padded_batches": 2,
            "padded_tokens": 6000,
            "speedup": 1.5,
            "pair_speedups": [1.4, 1.6],
            "round_speedups": [1.5],
        },
        "seconds": {"train": 3.0},
        "total_seconds": 5.0,
        "cpu_seconds": {"train": 5.5},
        "total_cpu_seconds": 9.0,
        "machine_load": {"start": start, "end": end, "cores": 2},
    }


def _printed(summary: dict) -> str:
    lines: list[str] = []
    print_summary(summary, lines.append)
    return "\n".join(lines)


def test_a_busy_machine_is_said_beside_the_ratio_and_the_times():
    busy = _printed(_summary(start=1.0, end=6.5))
    assert "taken on a busy machine" in busy and "load average 1.00 at the start, 6.50 at the end" in busy
    assert "steadier" not in busy
    # the same run on an idle machine: no warning, the CPU time is the steadier figure
    idle = _printed(_summary(start=0.5, end=1.2))
    assert "busy machine" not in idle and "machine      not busy" in idle and "steadier" in idle


def test_the_load_average_is_read_with_the_cores_it_is_compared_to():
    now = load_average()
    assert now["cores"] >= 1 and (now["load"] is None or now["load"] >= 0)


def test_a_resumed_run_counts_its_steps_and_the_earlier_ones():
    summary = _summary(0.1, 0.1) | {
        "global_step": 100,
        "steps_this_run": 90,
        "resumed_from": {"checkpoint": "out/checkpoint-10", "global_step": 10},
    }
    printed = _printed(summary)
    assert "90 steps in 3.0 s, resumed from out/checkpoint-10 (10 steps before): 100 steps in all" in printed
    assert "(first step of this run)" in printed
    assert "2 steps in 3.0 s, train loss" in _printed(_summary(0.1, 0.1))


def test_losses_that_look_odd_are_explained_where_they_print():
    for trainer, words in (
        ("grpo", "num_iterations=1 the policy ratio is 1"),
        ("rloo", "leave-one-out advantages of a prompt's completions sum to 0"),
        ("cpo", "ln(vocabulary size)"),
    ):
        printed = _printed(_summary(0.1, 0.1) | {"trainer": trainer, "losses": [17.3, 37.2]})
        training = printed.split("training     ")[1].split("\n---")[0]
        assert words in " ".join(training.split()), trainer
    assert "(" not in _printed(_summary(0.1, 0.1) | {"trainer": "dpo"}).split("(last step)")[1].split("\n")[0]


def test_the_summary_and_the_plot_show_the_model_flops(tmp_path):
    from packing_hf.app.report import plot_losses
    from packing_hf.flops import summarize_logged_flops

    logs = [
        {"step": step, "loss": 2.0 / step, "model_flops_per_step": 4e12, "attention_flops_per_step": 1e12,
         "model_tflops_per_s": 2.0 * step, "mfu": 0.01 * step, "step_seconds_p50": 2.0 / step,
         "step_seconds_p90": 2.0 / step}
        for step in (1, 2)
    ]  # fmt: skip
    flops = summarize_logged_flops(logs)
    # 8e12 FLOPs in 2 s + 1 s: 8/3 TFLOP/s; MFU per TFLOP/s 0.01 / 2 (one peak x devices for the run)
    assert flops["model_tflops_per_s"] == 8 / 3 and abs(flops["mfu"] - 0.04 / 3) < 1e-12
    printed = _printed({**_summary(0.5, 0.5), "flops": flops})
    assert "compute      8 TFLOPs (attention 25.0%, per sample), 2.67 model TFLOP/s, MFU 1.3%" in printed
    assert "step 1.5 s p50 / 1.9 s p90" in printed
    assert "compute" not in _printed(_summary(0.5, 0.5))  # no FLOPs figures: no line
    path = plot_losses(logs, tmp_path / "curve.png")
    assert path is None or (tmp_path / "curve.png").stat().st_size > 0


def test_share_prefixes_prints_the_tree_token_ratio():
    from types import SimpleNamespace

    from packing_hf.app.report import prefix_tree_summary

    args = SimpleNamespace(share_prefixes=True, min_shared_tokens=1)
    trees = prefix_tree_summary(SimpleNamespace(args=args, tree_tokens_trained=[5000.0, 2000.0]))
    assert trees["tree_token_ratio"] == 2.5 and trees["tree_tokens"] == 2000 and trees["sample_tokens"] == 5000
    printed = _printed({**_summary(1.0, 1.0), "prefix_trees": trees})
    assert "prefix trees tree_token_ratio 2.50x: 2,000 tokens computed for 5,000 sample tokens" in printed
    assert prefix_tree_summary(SimpleNamespace(args=SimpleNamespace(share_prefixes=False))) is None
    assert "prefix trees" not in _printed(_summary(1.0, 1.0))
    off = {**trees, "tree_token_ratio": None, "counted": False}
    assert "not counted (packing_metrics: false)" in _printed({**_summary(1.0, 1.0), "prefix_trees": off})
