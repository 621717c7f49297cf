"""MultipackBatchSampler with a real DataLoader (worker processes) and PaddingFreeCollator, on GSM8K."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from packing_hf import _binpack
from packing_hf.collator import PaddingFreeCollator
from packing_hf.sampler import MultipackBatchSampler

datasets = pytest.importorskip("datasets")


def unpack(batch: dict) -> list[tuple[int, ...]]:
    """The samples of a collated packed row, cut at its cu_seq_lens."""
    ids = batch["input_ids"][0].tolist()
    cu = batch["cu_seq_lens_q"].tolist()
    return [tuple(ids[a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)]


@pytest.fixture(scope="module")
def gsm8k_dataset(gsm8k_tokenized):
    return datasets.Dataset.from_list(gsm8k_tokenized)


def test_dataloader_with_workers_two_ranks_covers_the_data_once(gsm8k_dataset):
    budget = 1024
    seen: Counter = Counter()
    steps = []
    for rank in range(2):
        sampler = MultipackBatchSampler(gsm8k_dataset, budget, num_replicas=2, rank=rank, seed=5)
        sampler.set_epoch(1)
        loader = torch.utils.data.DataLoader(
            gsm8k_dataset, batch_sampler=sampler, collate_fn=PaddingFreeCollator(), num_workers=2
        )
        expected = list(sampler)  # the same plan, drawn in this process
        batches = list(loader)
        steps.append(len(batches))
        assert len(batches) == len(sampler) == len(loader)
        for batch, indices in zip(batches, expected, strict=True):
            assert batch["input_ids"].shape[0] == 1 and batch["input_ids"].shape[1] <= budget
            samples = unpack(batch)
            assert samples == [tuple(gsm8k_dataset[i]["input_ids"]) for i in indices]
            assert batch["max_length_q"] == max(map(len, samples))
            seen.update(samples)
    assert steps[0] == steps[1]
    assert seen == Counter(tuple(row["input_ids"]) for row in gsm8k_dataset)


def test_split_and_truncate_reach_the_collator_within_budget(gsm8k_dataset):
    budget = 160  # shorter than many GSM8K samples
    lengths = np.array([len(ids) for ids in gsm8k_dataset["input_ids"]])
    assert (lengths > budget).sum() > 10

    split = MultipackBatchSampler(gsm8k_dataset, budget, overflow="split", seed=0)
    loader = torch.utils.data.DataLoader(
        split.wrap_dataset(gsm8k_dataset),
        batch_sampler=split,
        collate_fn=PaddingFreeCollator(),
        num_workers=2,
    )
    pieces: dict[int, list[tuple[int, ...]]] = {}
    for batch, keys in zip(loader, list(split), strict=True):
        assert batch["input_ids"].shape[1] <= budget
        for key, sample in zip(keys, unpack(batch), strict=True):
            pieces[key] = sample
    n = len(gsm8k_dataset)
    for i in range(n):  # every token of every sample arrives exactly once, in order
        if lengths[i] <= budget:
            assert pieces[i] == tuple(gsm8k_dataset[i]["input_ids"])
    rebuilt: dict[int, tuple[int, ...]] = {}
    for j, (sample, _, _) in enumerate(split.pieces.tolist()):
        rebuilt[sample] = rebuilt.get(sample, ()) + pieces[n + j]
    assert all(rebuilt[i] == tuple(gsm8k_dataset[i]["input_ids"]) for i in np.nonzero(lengths > budget)[0])

    truncate = MultipackBatchSampler(gsm8k_dataset, budget, overflow="truncate", seed=0)
    with pytest.raises(ValueError, match="wrap_dataset"):  # without its view the batches would overflow
        list(
            torch.utils.data.DataLoader(
                gsm8k_dataset, batch_sampler=truncate, collate_fn=PaddingFreeCollator()
            )
        )
    loader = torch.utils.data.DataLoader(
        truncate.wrap_dataset(gsm8k_dataset), batch_sampler=truncate, collate_fn=PaddingFreeCollator()
    )
    row_lengths = [int(batch["input_ids"].shape[1]) for batch in loader]
    assert max(row_lengths) <= budget
    assert sum(row_lengths) == int(np.minimum(lengths, budget).sum())
    assert int(lengths.sum()) - sum(row_lengths) == truncate.stats()["truncated_tokens"] > 0


@pytest.fixture(scope="module")
def gsm8k_train_lengths(data_dir, tokenizer) -> np.ndarray:
    """Token lengths of the whole GSM8K train split (7,473 rows), in the conftest format."""
    with open(data_dir / "gsm8k_train.jsonl") as f:
        rows = [json.loads(line) for line in f]
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}{tokenizer.eos_token}" for r in rows]
    return np.array([len(ids) for ids in tokenizer(texts)["input_ids"]])


@pytest.mark.parametrize("budget", [4096, 16384])
def test_near_optimal_on_the_full_gsm8k_train_split(gsm8k_train_lengths, budget):
    lengths = gsm8k_train_lengths
    sampler = MultipackBatchSampler(lengths, budget)
    bound = _binpack.lower_bound_l2(lengths, budget)
    assert len(sampler) <= bound + max(1, int(0.001 * bound))
    assert sampler.efficiency() > 0.99
    assert sampler.efficiency() > _binpack.pack_next_fit(lengths, budget).efficiency()
