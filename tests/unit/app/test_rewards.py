"""The built-in GRPO / RLOO rewards on real GSM8K text: the answer match is 1.0 only for the right number, and
the demo reward (``gsm8k_shaped``) differs between wrong completions, so a tiny run has advantages to learn
from."""

from __future__ import annotations

import json

import pytest

from packing_hf.app.rewards import gsm8k_answer_match, gsm8k_shaped_reward, resolve_reward_funcs


@pytest.fixture(scope="module")
def rows(data_dir):
    with open(data_dir / "gsm8k_test.jsonl") as handle:
        return [json.loads(next(handle)) for _ in range(24)]


def test_shaped_reward_varies_over_real_wrong_completions(rows):
    # real completions that are wrong: every question answered with the next question's reference solution
    answers = [row["answer"] for row in rows]
    completions = answers[1:] + answers[:1]
    kept = [
        (c, a)
        for a, c in zip(answers, completions, strict=True)
        if a.split("####")[-1].strip() != c.split("####")[-1].strip()
    ]
    completions, answers = [c for c, _ in kept], [a for _, a in kept]
    shaped = gsm8k_shaped_reward(completions, answer=answers)
    # negative control: the answer match alone is 0.0 for every one of them, nothing for GRPO to learn from
    assert set(gsm8k_answer_match(completions, answer=answers)) == {0.0}
    assert len(set(shaped)) > len(shaped) // 2 and all(0.1 <= r < 0.4 for r in shaped)


def test_shaped_reward_gives_the_right_answer_full_credit(rows):
    answers = [row["answer"] for row in rows]
    conversational = [[{"role": "assistant", "content": a}] for a in answers]
    assert gsm8k_shaped_reward(conversational, answer=answers) == [1.0] * len(answers)
    # a number-free completion gets only its similarity, below any completion with a number
    assert 0.0 <= gsm8k_shaped_reward(["I do not know."], answer=answers[:1])[0] < 0.1


def test_the_shaped_reward_is_a_built_in():
    assert resolve_reward_funcs("gsm8k,gsm8k_shaped") == [gsm8k_answer_match, gsm8k_shaped_reward]
