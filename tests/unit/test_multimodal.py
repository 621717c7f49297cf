"""MultimodalCollator and the multipack sampler on image+text rows (no model: the data layer only)."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from packing_hf import MultipackBatchSampler, lengths_from_dataset
from packing_hf.multimodal import MultimodalCollator, image_block_masks, mm_token_types

IMAGE = 9  # placeholder id
MERGE = 2  # Qwen-VL: 2 x 2 patches become one token


def _rows(n: int, seed: int = 0) -> list[dict]:
    """Qwen-VL-like rows, placeholders already expanded: h * w / MERGE^2 image tokens per image."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ids, grids, pixels = list(rng.integers(10, 100, rng.integers(5, 60))), [], 0
        for _ in range(rng.integers(0, 3)):
            h, w = 2 * rng.integers(1, 9, size=2)
            ids += [IMAGE] * int(h * w // MERGE**2) + list(rng.integers(10, 100, 4))
            grids.append([1, int(h), int(w)])
            pixels += int(h * w)
        rows.append(
            {
                "input_ids": [int(t) for t in ids],
                "image_grid_thw": grids or np.zeros((0, 3), dtype=np.int64),
                "pixel_values": np.ones((pixels, 6), dtype=np.float32),
            }
        )
    return rows


def test_the_sampler_plans_by_the_expanded_length_and_the_budget_holds_after_collation():
    rows = _rows(64)
    dataset = datasets.Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows]})
    lengths = lengths_from_dataset(dataset)
    # the planned length is the true sequence length: text plus every image's expanded placeholder block
    assert lengths.tolist() == [len(r["input_ids"]) for r in rows]
    assert any(r["input_ids"].count(IMAGE) > 0 for r in rows)
    budget = 256
    sampler = MultipackBatchSampler(lengths, max_tokens_per_batch=budget, seed=0)
    collator = MultimodalCollator()
    seen = []
    for indices in sampler:
        batch = collator([rows[i] for i in indices])
        total = batch["input_ids"].shape[1]
        assert total == sum(int(lengths[i]) for i in indices) <= budget
        # every image token of the row has its pixels and grid, in sample order
        grids = batch["image_grid_thw"]
        assert int((batch["input_ids"] == IMAGE).sum()) == int((grids.prod(-1) // MERGE**2).sum())
        assert batch["pixel_values"].shape[0] == int(grids.prod(-1).sum())
        seen.extend(indices)
    assert sorted(seen) == list(range(len(rows)))


def test_per_token_keys_are_concatenated_and_filled_for_text_only_samples():
    batch = MultimodalCollator()(
        [
            {"input_ids": [[1, IMAGE, IMAGE]], "token_type_ids": [[0, 1, 1]]},  # a processor's (1, L) shape
            {"input_ids": [4, 5]},
        ]
    )
    assert batch["input_ids"].tolist() == [[1, IMAGE, IMAGE, 4, 5]]
    assert batch["token_type_ids"].tolist() == [[0, 1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, IMAGE, IMAGE, -100, 5]]


def test_collation_that_would_cut_an_image_block_is_refused():
    with pytest.raises(ValueError, match="overflow must be 'error'"):
        MultimodalCollator(overflow="truncate")
    with pytest.raises(ValueError, match="longer than|max_length"):
        MultimodalCollator(max_length=3)([{"input_ids": [1, IMAGE, IMAGE, IMAGE]}])


def test_the_collator_computes_mrope_positions_with_the_given_rope_index():
    calls = []

    def rope_index(input_ids, mm_token_type_ids, image_grid_thw=None, attention_mask=None, **_):
        calls.append((input_ids.clone(), mm_token_type_ids.clone(), attention_mask.clone()))
        pos = attention_mask.long().cumsum(-1) - 1 + 100 * mm_token_type_ids.long()
        return pos.expand(3, -1, -1), None

    pixels = np.ones((4, 6), dtype=np.float32)  # a sample with placeholders carries its pixels
    rows = [
        {"input_ids": [1, IMAGE, IMAGE, 2], "pixel_values": pixels},
        {"input_ids": [3, IMAGE], "pixel_values": pixels},
    ]
    batch = MultimodalCollator(rope_index, image_token_id=IMAGE)(rows)
    assert batch["position_ids"].shape == (4, 1, 6)
    assert batch["position_ids"][0].tolist() == [[0, 1, 2, 3, 0, 1]]  # the text row restarts per sample
    assert batch["position_ids"][1].tolist() == [[0, 101, 102, 3, 0, 101]]  # each sample's own, restarting
    ids, types, mask = calls[0]  # one call, the samples as a right-padded batch
    assert ids.tolist() == [[1, IMAGE, IMAGE, 2], [3, IMAGE, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert torch.equal(types, mm_token_types(ids, IMAGE) * mask)


def test_image_block_masks_keep_blocks_and_samples_apart():
    masks = image_block_masks([0, 4, 7], torch.tensor([[0, 1, 1, 0, 1, 1, 0]]), sliding_window=2)
    full = masks["full_attention"][0, 0]
    assert full[1, 2] and full[2, 1]  # bidirectional within the image
    assert not full[3, 4] and not full[4, 3]  # never across samples
    assert full[5, 4] and full[4, 5] and not full[4, 6]  # the second sample's own block, text stays causal
    assert not masks["sliding_attention"][0, 0, 3, 0]  # window of 2
    eager = image_block_masks([0, 2], torch.tensor([[0, 1]]), dtype=torch.float32)["full_attention"]
    assert eager[0, 0, 0, 1] == torch.finfo(torch.float32).min and eager[0, 0, 1, 0] == 0


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        (
            {"input_ids": [5, 6, 7, 8], "image_grid_thw": [[1, 2, 2]]},
            r"image_grid_thw \(1 images\) but no pixel_values",
        ),
        ({"input_ids": [5, IMAGE, 7]}, "1 image placeholder tokens \\(id 9\\) but no pixel_values"),
        (
            {"input_ids": [5, 6, 7], "mm_token_type_ids": [0, 2, 0]},
            "1 video tokens in mm_token_type_ids but no",
        ),
        (
            {"input_ids": [5, 6, 7], "video_grid_thw": [[2, 2, 2]]},
            "video_grid_thw \\(1 videos\\) but no pixel_values",
        ),
    ],
)
def test_a_sample_announcing_images_without_their_pixels_is_refused(sample, match):
    collator = MultimodalCollator(image_token_id=IMAGE)
    with_pixels = {
        "input_ids": [5, IMAGE, 7],
        "pixel_values": np.ones((4, 6), np.float32),
        "image_grid_thw": [[1, 2, 2]],
    }
    with pytest.raises(ValueError, match="sample 1 has " + match):
        collator([with_pixels, sample])
    # control: the same samples with their pixels and grid (or with no image at all) are collated
    kind = "video" if "video" in match else "image"
    grid = sample.get(f"{kind}_grid_thw", [[1, 2, 2]])
    patches = int(np.prod(grid, axis=-1).sum())
    pixels = "pixel_values_videos" if kind == "video" else "pixel_values"
    collator([with_pixels, {**sample, pixels: np.ones((patches, 6), np.float32), f"{kind}_grid_thw": grid}])
    collator([with_pixels, {"input_ids": [5, 6, 7], "image_grid_thw": np.zeros((0, 3), dtype=np.int64)}])


class _QwenLikeModel:
    """Stands for a Qwen-VL model: a bound ``get_rope_index`` whose owner has ``vision_config.spatial_merge_size``."""

    class config:  # noqa: N801 - mirrors ``model.config``
        class vision_config:  # noqa: N801
            spatial_merge_size = MERGE

    def get_rope_index(self, input_ids, mm_token_type_ids, attention_mask=None, **_):
        pos = attention_mask.long().cumsum(-1) - 1
        return pos.expand(3, -1, -1), None


def test_placeholders_not_matching_the_grid_are_named_before_the_model_runs():
    rows = [r for r in _rows(12) if len(r["image_grid_thw"])][:3]
    collator = MultimodalCollator(_QwenLikeModel().get_rope_index, image_token_id=IMAGE)
    collator(rows)  # control: the processor's expansion passes
    short = dict(rows[1], input_ids=list(rows[1]["input_ids"]))
    short["input_ids"].remove(IMAGE)  # one placeholder fewer than image_grid_thw asks for
    wanted = int(np.prod(rows[1]["image_grid_thw"][0])) // MERGE**2
    with pytest.raises(
        ValueError, match="Image features and image tokens do not match: sample 1 of the packed row"
    ):
        collator([rows[0], short, rows[2]])
    extra = dict(  # a grid row (and its 4 patches) with no tokens
        rows[0],
        image_grid_thw=[*rows[0]["image_grid_thw"], [1, 2, 2]],
        pixel_values=np.ones((len(rows[0]["pixel_values"]) + 4, 6), np.float32),
    )
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        collator([extra])
    assert wanted > 0
