"""The offline demo dataset: Alpaca-style records generated deterministically, never downloaded.

>>> records = make_embedded_dataset(3, seed=0)
>>> sorted(records[0])
['input', 'instruction', 'output']
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["make_embedded_dataset"]

_WORDS = (
    "apple river candle tiger window garden silver planet rocket violin forest harbor pencil marble "
    "lantern meadow falcon copper island thunder ribbon canyon glacier orchard compass velvet beacon "
    "cactus dolphin ember fossil quartz saddle tundra walnut yacht zebra anchor bamboo cobalt "
    "dune echo fern granite hazel iris jasmine kettle lemon maple nectar olive pepper quill"
).split()
_NAMES = "Ada Ben Chloe Dev Elena Farid Grace Hugo Iris Jonas Kemal Lena Mateo Nora Omar Priya".split()
_ITEMS = "apples books coins marbles pencils stamps shells cards stickers buttons".split()


def _task_sum(rng: random.Random) -> tuple[str, str, str]:
    numbers = [rng.randint(1, 999) for _ in range(rng.randint(2, 12))]
    steps, total = [], 0
    for n in numbers:
        total += n
        steps.append(f"{total - n} + {n} = {total}")
    answer = "Adding one number at a time:\n" + "\n".join(steps[1:]) + f"\nThe sum is {total}."
    return "Add these numbers.", ", ".join(map(str, numbers)), answer


def _task_sort(rng: random.Random) -> tuple[str, str, str]:
    words = rng.sample(_WORDS, rng.randint(3, 20))
    return (
        "Sort these words in alphabetical order.",
        " ".join(words),
        "In alphabetical order: " + ", ".join(sorted(words)) + ".",
    )


def _task_count_letters(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(_WORDS)
    letter = rng.choice(sorted(set(word)))
    positions = [str(i + 1) for i, c in enumerate(word) if c == letter]
    count = len(positions)
    plural = "time" if count == 1 else "times"
    return (
        f"How many times does the letter '{letter}' appear in the word '{word}'?",
        "",
        f"The word '{word}' is spelled {'-'.join(word)}. The letter '{letter}' appears at position(s) "
        f"{', '.join(positions)}, so it appears {count} {plural}.",
    )


def _task_minutes(rng: random.Random) -> tuple[str, str, str]:
    minutes = rng.randint(61, 2000)
    hours, rest = divmod(minutes, 60)
    return (
        f"Convert {minutes} minutes to hours and minutes.",
        "",
        f"There are 60 minutes in an hour. {minutes} divided by 60 is {hours} with a remainder of {rest}, "
        f"so {minutes} minutes is {hours} hours and {rest} minutes.",
    )


def _task_table(rng: random.Random) -> tuple[str, str, str]:
    base, upto = rng.randint(2, 19), rng.randint(3, 15)
    rows = "\n".join(f"{base} x {i} = {base * i}" for i in range(1, upto + 1))
    return f"Write the multiplication table of {base} from 1 to {upto}.", "", rows


def _task_story(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    start, given, bought = rng.randint(5, 60), rng.randint(1, 5), rng.randint(2, 30)
    end = start - given + bought
    question = (
        f"{a} has {start} {item}. {a} gives {given} {item} to {b} and then buys {bought} more. "
        f"How many {item} does {a} have now?"
    )
    answer = (
        f"{a} starts with {start} {item}. After giving {given} away, {a} has {start} - {given} = "
        f"{start - given}. After buying {bought} more, {a} has {start - given} + {bought} = {end}. "
        f"The answer is {end}."
    )
    return question, "", answer


def _task_reverse(rng: random.Random) -> tuple[str, str, str]:
    words = rng.sample(_WORDS, rng.randint(2, 14))
    return "Reverse the order of these words.", " ".join(words), " ".join(reversed(words))


def _task_compare(rng: random.Random) -> tuple[str, str, str]:
    numbers = rng.sample(range(1, 10_000), rng.randint(2, 9))
    largest, smallest = max(numbers), min(numbers)
    return (
        "Find the largest and the smallest number in this list.",
        ", ".join(map(str, numbers)),
        f"The largest number is {largest} and the smallest number is {smallest}; "
        f"their difference is {largest - smallest}.",
    )


_TASKS: tuple[Callable[[random.Random], tuple[str, str, str]], ...] = (
    _task_sum,
    _task_sort,
    _task_count_letters,
    _task_minutes,
    _task_table,
    _task_story,
    _task_reverse,
    _task_compare,
)


def make_embedded_dataset(num_samples: int = 1000, seed: int = 0) -> list[dict[str, str]]:
    """Generate the offline default dataset: ``num_samples`` Alpaca-style records, deterministically.

    Eight small task families (sums with worked steps, sorting, letter counting, unit conversion,
    multiplication tables, word problems, reversing, min/max) whose answers are computed, not copied
    from anywhere, with lengths spread from ~10 to ~250 tokens so packing has something to do.

    Args:
        num_samples: how many records to generate (>= 1).
        seed: the same seed always gives the same records, on any machine.

    Returns:
        ``[{"instruction": str, "input": str, "output": str}, ...]``.

    >>> make_embedded_dataset(2, seed=1) == make_embedded_dataset(2, seed=1)
    True
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    rng = random.Random(seed)
    records = []
    for _ in range(num_samples):
        instruction, input_text, output = rng.choice(_TASKS)(rng)
        records.append({"instruction": instruction, "input": input_text, "output": output})
    return records
