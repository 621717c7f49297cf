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
