"""The prefix-tree data of the engine launches (``_deepspeed_worker.py``, ``_fsdp_worker.py``): per-turn samples of
multi-turn conversations sharing a system prompt and earlier turns (``share_prefixes=True`` merges them into trees),
and collators (prefix-tree or flat rows) that put each batch's sample indices in the batch, so that a trainer's
``training_step`` can count the samples of every rank.

Importing this module does nothing (pytest collects it for doctests).
"""

from __future__ import annotations

USER, ASSISTANT = 1, 2  # the role tokens opening every turn (never trained)
IDS_KEY = "packing_hf_test_sample_ids"


def per_turn_samples(vocab: int) -> list[dict]:
    """11 per-turn samples (ids in ``[3, vocab)``), each ``{"input_ids", "assistant_masks", "idx"}``: one sample per
    assistant turn of 4 conversations behind one system prompt, the turns up to it with only that answer trained (an
    earlier answer is a target in its own sample and context in the later ones). Conversations 0 and 1 share their
    first two exchanges and branch at the third user turn (their first two samples are duplicates); 2 shares their first
    exchange and branches at the second user turn; 3 shares the system prompt alone; the last sample shares nothing.

    >>> samples = per_turn_samples(64)
    >>> len(samples), samples[0]["input_ids"] == samples[3]["input_ids"], samples[-1]["idx"]
    (11, True, 10)
    """
    import torch

    generator = torch.Generator().manual_seed(7)

    def turn(role: int, length: int) -> tuple[int, list[int]]:
        return role, torch.randint(3, vocab, (length,), generator=generator).tolist()

    system = torch.randint(3, vocab, (8,), generator=generator).tolist()
    first, second = [turn(USER, 4), turn(ASSISTANT, 5)], [turn(USER, 3), turn(ASSISTANT, 4)]
    conversations = [
        [*first, *second, turn(USER, 3), turn(ASSISTANT, 5)],
        [*first, *second, turn(USER, 2), turn(ASSISTANT, 3)],
        [*first, turn(USER, 3), turn(ASSISTANT, 6)],
        [turn(USER, 5), turn(ASSISTANT, 4), turn(USER, 3), turn(ASSISTANT, 4)],
    ]
    samples = []
    for conversation in conversations:
        ids, mask = list(system), [0] * len(system)
        for role, tokens in conversation:
            trained = [int(role == ASSISTANT)] * len(tokens)
            ids, mask = [*ids, role, *tokens], [0] * len(mask) + [0, *trained]
            if role == ASSISTANT:
                samples.append({"input_ids": list(ids), "assistant_masks": list(mask)})
    alone = torch.randint(3, vocab, (12,), generator=generator).tolist()
    samples.append({"input_ids": alone, "assistant_masks": [0] * 4 + [1] * 8})
    return [{**sample, "idx": i} for i, sample in enumerate(samples)]


def recording_collator(flat: bool = False):
    """A :class:`~packing_hf.PrefixTreeCollator` (``flat``: a :class:`~packing_hf.PaddingFreeCollator`) that puts
    the indices of the batch's samples in the batch (``IDS_KEY``, a tensor; ``training_step`` takes it out again).

    >>> batch = recording_collator()(per_turn_samples(64)[:2])
    >>> batch["packing_hf_test_sample_ids"].tolist(), int(batch["tree_samples"])
    ([0, 1], 2)
    """
    from dataclasses import dataclass

    import torch

    import packing_hf

    base = packing_hf.PaddingFreeCollator if flat else packing_hf.PrefixTreeCollator

    @dataclass
    class Recording(base):
        drop_keys: tuple = ("idx",)
        input_columns = (*base.input_columns, "idx")

        def __call__(self, features, return_tensors="pt"):
            features = list(features)
            batch = super().__call__(features, return_tensors)
            batch[IDS_KEY] = torch.tensor([int(f["idx"]) for f in features])
            return batch

    return Recording()
