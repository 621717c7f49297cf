"""Vision-language models packed exactly: text-only rows through the wrappers, and image+text rows.

Tiny fp32 CPU copies of the real transformers classes (``*ForConditionalGeneration``), random weights and
synthetic images of different sizes (random ``pixel_values`` of the right shape). A packed row must give every
sample the logits and parameter gradients it gets alone; each test has a negative control that the same
comparison catches.
"""

from __future__ import annotations

import pytest
import torch

from packing_hf.architectures import build_tiny_model, prepare_model_for_packing, tiny_config
from packing_hf.attention.guards import validate_packed_batch
from packing_hf.multimodal import (
    PACKED_MEDIA_KEY,
    MultimodalCollator,
    image_block_masks,
    mm_token_types,
    mrope_position_ids,
)
from packing_hf.registry import IMAGE_ROWS_VERIFIED
from packing_hf.verify import DEFAULT_TOLERANCE, check_packing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# --------------------------------------------------------------------------------------------------
# text-only data through the multimodal classes

WRAPPERS = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v",
    "gemma3",
    "llava",
    "mllama",
    "llama4",
]


def _skip_if_transformers_fails_text_only(model):
    """transformers 5.24's Llama4ForConditionalGeneration fails on text-only input by itself (its forward reads
    ``image_outputs`` from a text model's output): nothing to compare packing against there."""
    import transformers

    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
    except AttributeError as exc:
        pytest.skip(
            f"transformers {transformers.__version__}: a text-only forward of the stock model fails: {exc}"
        )


@pytest.mark.parametrize("model_type", WRAPPERS)
@pytest.mark.parametrize("implementation", ["sdpa", "packing_hf"])
def test_text_only_rows_through_a_vlm_wrapper_are_exact_when_prepared(model_type, implementation):
    model = build_tiny_model(model_type, implementation)
    assert "ForConditionalGeneration" in type(model).__name__
    _skip_if_transformers_fails_text_only(model)
    with prepare_model_for_packing(model):
        report = check_packing(model, noise_floor=True)
    assert report.error is None and len(report.grads_max_abs_diff) == 3, report
    assert not report.leaked, report


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "glm4v"])
def test_mrope_wrappers_leak_stock_and_the_text_position_row_fixes_them(model_type):
    # negative control: their language model expands (1, T) positions to 3 mRoPE rows and builds the mask
    # without them, so stock packed samples see each other; prepared, the (4, B, T) positions keep them apart
    model = build_tiny_model(model_type, "sdpa")
    stock = check_packing(model, noise_floor=False, gradients=False)
    assert stock.leaked and stock.max_logits_diff > 100 * DEFAULT_TOLERANCE, stock
    with prepare_model_for_packing(model):
        assert not check_packing(model, noise_floor=False, gradients=False).leaked


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_a_hybrid_language_model_is_prepared_as_its_text_model(model_type):
    # the wrapper inherits its text model's fix (gated DeltaNet mixers split per sample): stock leaks or
    # raises, prepared is exact
    model = build_tiny_model(model_type, "sdpa")
    assert check_packing(model, noise_floor=False, gradients=False).leaked
    with prepare_model_for_packing(model) as handle:
        assert handle.mixers > 0
        report = check_packing(model, noise_floor=True)
    assert report.error is None and not report.leaked, report


def test_a_bidirectional_language_model_is_refused_even_for_text_only_rows():
    # PaliGemma's Gemma attends bidirectionally (use_bidirectional_attention): stock, a packed sample sees the
    # next ones (the leak the refusal prevents); prepare refuses instead of passing it through
    model = build_tiny_model("paligemma", "sdpa")
    assert model.config.text_config.use_bidirectional_attention
    assert check_packing(model, noise_floor=False, gradients=False).leaked
    with pytest.raises(
        ValueError, match="paligemma \\(language model gemma\\): its attention is bidirectional"
    ):
        prepare_model_for_packing(model)


@pytest.mark.parametrize("implementation", ["sdpa", "packing_hf"])
def test_three_row_text_positions_of_a_packed_row_without_cu_seq_lens_are_refused(implementation):
    # transformers reads no sample boundaries from 3-row positions: stock and packing_hf's attention would let the
    # samples see each other; the guard (prepared, or given the model) names the fix instead
    model = build_tiny_model("qwen2_vl", implementation)
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]).expand(3, 1, 5),
    }
    with pytest.raises(ValueError, match="3-row multimodal RoPE.* Pass cu_seq_lens_q/k next to them"):
        validate_packed_batch(batch, model=model)
    with (
        prepare_model_for_packing(model),
        pytest.raises(ValueError, match="Pass cu_seq_lens_q/k next to them"),
    ):
        model(**batch)


# --------------------------------------------------------------------------------------------------
# image+text samples packed in one row


def _random_ids(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, 400, (n,), generator=generator).tolist()  # tiny special ids sit at 495..511


def _qwen_sample(config, texts: tuple[int, ...], grids: list[tuple[int, int, int]], generator) -> dict:
    """A Qwen-VL sample: text, then per image its placeholder block (t*h*w / merge^2 tokens) and text."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    ids, pixels = _random_ids(texts[0], generator), []
    for i, (t, h, w) in enumerate(grids):
        ids += [config.image_token_id] * (t * h * w // merge**2) + _random_ids(texts[i + 1], generator)
        pixels.append(torch.randn(t * h * w, patch, generator=generator))
    sample = {"input_ids": ids}
    if grids:
        sample["pixel_values"] = torch.cat(pixels)
        sample["image_grid_thw"] = torch.tensor(grids)
    return sample


def _fixed_size_sample(config, tokens_per_image: int, texts: tuple[int, ...], images: int, generator) -> dict:
    """A Gemma 3 / LLaVA sample: fixed-size images, ``tokens_per_image`` placeholders each."""
    vision = config.vision_config
    token = getattr(config, "image_token_id", None) or config.image_token_index
    ids, types = _random_ids(texts[0], generator), [0] * texts[0]
    for i in range(images):
        ids += [token] * tokens_per_image + _random_ids(texts[i + 1], generator)
        types += [1] * tokens_per_image + [0] * texts[i + 1]
    sample = {"input_ids": ids, "token_type_ids": types}
    if images:
        size = vision.image_size
        sample["pixel_values"] = torch.randn(images, vision.num_channels, size, size, generator=generator)
    return sample


def _alone_kwargs(model, sample: dict) -> dict:
    ids = torch.tensor([sample["input_ids"]])
    kwargs = {"input_ids": ids, "use_cache": False}
    for key in ("pixel_values", "image_grid_thw"):
        if key in sample:
            kwargs[key] = sample[key]
    if "token_type_ids" in sample:
        kwargs["token_type_ids"] = torch.tensor([sample["token_type_ids"]])
    if "image_grid_thw" in sample:
        kwargs["mm_token_type_ids"] = mm_token_types(ids, model.config.image_token_id)
    return kwargs


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")


def _packed_vs_alone(model, samples: list[dict], batch: dict) -> tuple[float, float]:
    """Largest logits difference, and gradient difference relative to the largest gradient, packed vs alone.

    Gradients are compared relative to the sample's largest gradient entry: random tiny Gemma 3 weights give
    gradients of 1e7 (its embedding scale), where fp32 rounding alone is ~1e1 in absolute terms.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    batch = {k: v for k, v in batch.items() if k != "labels"}
    cu = batch["cu_seq_lens_q"].tolist()
    packed = model(**batch).logits[0]  # (T, V)
    worst_logits = worst_grads = 0.0
    for i, sample in enumerate(samples):
        ids = torch.tensor(sample["input_ids"])
        alone = model(**_alone_kwargs(model, sample)).logits[0]
        piece = packed[cu[i] : cu[i + 1]]
        worst_logits = max(worst_logits, float((piece - alone).detach().abs().max()))
        grads_packed = torch.autograd.grad(_loss(piece, ids), params, retain_graph=True, allow_unused=True)
        grads_alone = torch.autograd.grad(_loss(alone, ids), params, allow_unused=True)
        diff = scale = 0.0
        for a, b in zip(grads_packed, grads_alone, strict=True):
            if a is not None or b is not None:
                a = torch.zeros_like(b) if a is None else a
                b = torch.zeros_like(a) if b is None else b
                diff = max(diff, float((a - b).abs().max()))
                scale = max(scale, float(b.abs().max()))
        worst_grads = max(worst_grads, diff / max(scale, 1.0))
    return worst_logits, worst_grads


# the Qwen-VL families of the registry's IMAGE_ROWS_VERIFIED (the docs' table claims image+text exact for them)
QWEN_VL = sorted(m for m in IMAGE_ROWS_VERIFIED if m.startswith("qwen"))


@pytest.fixture(scope="module")
def qwen_models():
    return {m: build_tiny_model(m, "sdpa").train() for m in QWEN_VL}


def _qwen_samples(model) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    config = model.config
    return [
        _qwen_sample(config, (5, 3), [(1, 4, 4)], generator),
        _qwen_sample(config, (3, 2, 4), [(1, 2, 6), (1, 4, 2)], generator),  # two images of other sizes
        _qwen_sample(config, (7,), [], generator),  # text only, between image samples
        _qwen_sample(config, (2, 3), [(1, 6, 4)], generator),
    ]


@pytest.mark.parametrize("model_type", QWEN_VL)
@pytest.mark.parametrize("positions", ["collator", "model"])
def test_qwen_vl_image_rows_equal_every_sample_alone(qwen_models, model_type, positions):
    """mRoPE positions per sample: from the collator (the model's get_rope_index), or inside the prepared model."""
    model = qwen_models[model_type].eval()
    samples = _qwen_samples(model)
    rope_index = model.model.get_rope_index if positions == "collator" else None
    batch = MultimodalCollator(rope_index, image_token_id=model.config.image_token_id)(samples)
    assert batch["position_ids"].shape == (
        (4, 1, batch["input_ids"].shape[1]) if rope_index else batch["input_ids"].shape
    )
    assert batch["pixel_values"].shape[0] == sum(len(s.get("pixel_values", ())) for s in samples)
    with prepare_model_for_packing(model):
        logits, grads = _packed_vs_alone(model, samples, batch)
    assert logits <= DEFAULT_TOLERANCE and grads <= DEFAULT_TOLERANCE, (logits, grads)


@pytest.mark.parametrize("model_type", QWEN_VL)
def test_qwen_vl_negative_controls_are_caught(qwen_models, model_type):
    model = qwen_models[model_type].eval()
    samples = _qwen_samples(model)
    collator = MultimodalCollator(model.model.get_rope_index, image_token_id=model.config.image_token_id)
    batch = collator(samples)
    total = batch["input_ids"].shape[1]
    # 1. the text row does not restart: transformers sees one sample, every sample attends to the previous ones
    merged = dict(batch, position_ids=batch["position_ids"].clone())
    merged["position_ids"][0, 0] = torch.arange(total)
    merged.pop("cu_seq_lens_q"), merged.pop("cu_seq_lens_k")
    # 2. image tokens placed by text positions (the model's positions for text, not each image's grid)
    flat = dict(batch, position_ids=batch["position_ids"][:1].expand(4, 1, total))
    for wrong in (merged, flat):
        logits, _ = _packed_vs_alone(
            model.eval(), samples, {**wrong, "cu_seq_lens_q": batch["cu_seq_lens_q"], "use_cache": False}
        )
        assert logits > 100 * DEFAULT_TOLERANCE, logits


@pytest.mark.parametrize("model_type", QWEN_VL)
def test_the_models_own_three_row_positions_are_accepted(qwen_models, model_type):
    """``get_rope_index`` gives ``(3, B, T)`` positions: one image sample, and a right-padded batch of two, run as
    stock runs them (its temporal row is no text position: it does not restart a sample)."""
    model = qwen_models[model_type].eval()
    samples = _qwen_samples(model)
    lone = _alone_kwargs(model, samples[1])  # two images
    lone["position_ids"], _ = model.model.get_rope_index(
        lone["input_ids"], lone["mm_token_type_ids"], lone["image_grid_thw"]
    )
    width = max(len(s["input_ids"]) for s in samples[:2])
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, sample in enumerate(samples[:2]):
        ids[row, : len(sample["input_ids"])] = torch.tensor(sample["input_ids"])
        mask[row, : len(sample["input_ids"])] = 1
    types = mm_token_types(ids, model.config.image_token_id)
    grids = torch.cat([samples[0]["image_grid_thw"], samples[1]["image_grid_thw"]])
    positions, _ = model.model.get_rope_index(ids, types, grids, attention_mask=mask)
    padded = {
        "input_ids": ids, "attention_mask": mask, "position_ids": positions, "mm_token_type_ids": types,
        "image_grid_thw": grids, "use_cache": False,
        "pixel_values": torch.cat([samples[0]["pixel_values"], samples[1]["pixel_values"]]),
    }  # fmt: skip
    assert positions.shape == (3, 2, width)
    with torch.no_grad():
        for batch in (lone, padded):
            stock = model(**batch).logits
            assert validate_packed_batch(batch, model=model) == {**batch, "use_cache": False}
            with prepare_model_for_packing(model):
                prepared = model(**batch).logits
            assert torch.equal(prepared, stock)
    # negative control: the temporal row read as the text positions makes the lone sample a packed row, refused
    with pytest.raises(ValueError, match="begins a packed sample"):
        validate_packed_batch({**lone, "position_ids": lone["position_ids"][0]}, model=model)


@pytest.mark.parametrize("model_type", QWEN_VL)
def test_three_row_positions_next_to_cu_seq_lens_pack_exactly(qwen_models, model_type):
    """Each sample's own 3-row positions and the row's boundaries: the prepared model adds the text row."""
    model = qwen_models[model_type].eval()
    samples = _qwen_samples(model)
    batch = MultimodalCollator(model.model.get_rope_index, image_token_id=model.config.image_token_id)(
        samples
    )
    three = dict(batch, position_ids=batch["position_ids"][1:])
    with prepare_model_for_packing(model):
        logits, grads = _packed_vs_alone(model, samples, three)
        assert logits <= DEFAULT_TOLERANCE and grads <= DEFAULT_TOLERANCE, (logits, grads)
        # negative control: image tokens placed by text positions, caught by the same comparison
        text = batch["position_ids"][:1].expand(3, 1, -1)
        logits, _ = _packed_vs_alone(model, samples, dict(batch, position_ids=text))
    assert logits > 100 * DEFAULT_TOLERANCE, logits


@pytest.mark.parametrize("model_type", QWEN_VL)
def test_a_stock_model_needs_use_cache_false_with_multimodal_collator_batches(qwen_models, model_type):
    """What docs/vlm.md and MultimodalCollator's docstring say: an unprepared wrapper keeps use_cache=True in its
    text config, and with a cache transformers builds the mask without the packed samples."""
    model = qwen_models[model_type].eval()
    samples = _qwen_samples(model)
    batch = MultimodalCollator(model.model.get_rope_index, image_token_id=model.config.image_token_id)(
        samples
    )
    cu = batch["cu_seq_lens_q"].tolist()
    assert model.config.get_text_config().use_cache
    with torch.no_grad():
        alone = model(**_alone_kwargs(model, samples[-1])).logits[0]
        exact = model(**batch, use_cache=False).logits[0, cu[-2] :]
        cached = model(**batch).logits[0, cu[-2] :]  # the default: a cache, samples merged
    assert float((exact - alone).abs().max()) <= DEFAULT_TOLERANCE
    assert float((cached - alone).abs().max()) > 100 * DEFAULT_TOLERANCE


def test_mrope_positions_restart_per_sample_and_match_the_model_alone(qwen_models):
    model = qwen_models["qwen2_5_vl"]
    samples = _qwen_samples(model)
    batch = MultimodalCollator()(samples)
    ids = batch["input_ids"]
    positions = mrope_position_ids(
        model.model.get_rope_index,
        ids,
        batch["cu_seq_lens_q"],
        mm_token_types(ids, model.config.image_token_id),
        image_grid_thw=batch["image_grid_thw"],
    )
    cu = batch["cu_seq_lens_q"].tolist()
    for i, sample in enumerate(samples):
        kwargs = _alone_kwargs(model, sample)
        if "image_grid_thw" in kwargs:
            alone, _ = model.model.get_rope_index(
                kwargs["input_ids"], kwargs["mm_token_type_ids"], kwargs["image_grid_thw"]
            )
        else:
            alone = torch.arange(len(sample["input_ids"])).expand(3, 1, -1)
        assert torch.equal(positions[1:, :, cu[i] : cu[i + 1]], alone)
        assert positions[0, 0, cu[i]] == 0


def _gemma3():
    config = tiny_config("gemma3", mm_tokens_per_image=4)
    config.vision_config.image_size, config.vision_config.patch_size = 32, 8  # 4 x 4 patches pooled to 2 x 2
    torch.manual_seed(0)
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float(), 4


def _llava():
    config = tiny_config("llava")
    config.vision_config.image_size, config.vision_config.patch_size = 28, 14  # 2 x 2 patches, CLS dropped
    torch.manual_seed(0)
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float(), 4


FIXED_SIZE = {"gemma3": _gemma3, "llava": _llava}


def test_every_family_the_registry_calls_image_exact_is_tested_here():
    # docs/architectures.md reads IMAGE_ROWS_VERIFIED: each member must be one of this module's parametrizations
    assert set(QWEN_VL) | set(FIXED_SIZE) == IMAGE_ROWS_VERIFIED


@pytest.mark.parametrize("model_type", sorted(m for m in IMAGE_ROWS_VERIFIED if m in FIXED_SIZE))
def test_fixed_size_image_rows_equal_every_sample_alone(model_type):
    model, per_image = FIXED_SIZE[model_type]()
    model.eval()
    generator = torch.Generator().manual_seed(0)
    samples = [
        _fixed_size_sample(model.config, per_image, (3, 2), 1, generator),
        _fixed_size_sample(model.config, per_image, (2, 3, 1), 2, generator),
        _fixed_size_sample(model.config, per_image, (6,), 0, generator),
        _fixed_size_sample(model.config, per_image, (1, 4), 1, generator),
    ]
    if model.config.model_type == "llava":
        for s in samples:
            s.pop("token_type_ids")
    batch = MultimodalCollator()(samples)
    with prepare_model_for_packing(model):
        logits, grads = _packed_vs_alone(model, samples, batch)
    assert logits <= DEFAULT_TOLERANCE and grads <= DEFAULT_TOLERANCE, (logits, grads)
    # negative control: no restarting positions (one long sample) is caught by the same comparison
    merged = {k: v for k, v in batch.items() if not k.startswith(("cu_seq", "max_length"))}
    merged["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    logits, _ = _packed_vs_alone(
        model, samples, {**merged, "cu_seq_lens_q": batch["cu_seq_lens_q"], "use_cache": False}
    )
    assert logits > 100 * DEFAULT_TOLERANCE
    if model.config.model_type == "gemma3":
        # the block mask turned off: transformers' own sliding mask on a packed row looks the image blocks up by
        # per-sample positions, so image tokens of later samples attend to the wrong tokens
        stock, _ = _packed_vs_alone(model, samples, {**batch, "use_cache": False})
        assert stock > 100 * DEFAULT_TOLERANCE, stock
        # and the blocks do act: without token_type_ids a sample's image tokens get other logits
        alone = _alone_kwargs(model, samples[0])
        causal = {k: v for k, v in alone.items() if k != "token_type_ids"}
        assert float((model(**alone).logits - model(**causal).logits).abs().max()) > 100 * DEFAULT_TOLERANCE


def test_image_blocks_never_continue_across_a_sample_boundary():
    masks = image_block_masks([0, 2, 4], torch.tensor([[0, 1, 1, 0]]))  # image at the end, then at the start
    assert not masks["full_attention"][0, 0, 1, 2] and not masks["full_attention"][0, 0, 2, 1]


def test_mllama_image_rows_are_refused_by_name():
    model = build_tiny_model("mllama", "sdpa")
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8]]),
        "position_ids": torch.tensor([[0, 1, 0, 1]]),
        "pixel_values": torch.zeros(1, 1, 1, 3, 8, 8),
    }
    with (
        prepare_model_for_packing(model),
        pytest.raises(ValueError, match="mllama: image\\+text rows: its cross-attention"),
    ):
        model(**batch)


@pytest.mark.parametrize("model_type", ["glm4v", "qwen3_vl_moe"])
def test_image_rows_of_an_unverified_wrapper_are_refused_and_text_rows_served(model_type):
    """A wrapper whose image handling has no per-sample proof packs text-only rows (exact, tested above) but
    refuses packed rows holding images instead of trusting them; unpacked image batches pass untouched."""
    from packing_hf.registry import IMAGE_ROWS_VERIFIED

    assert model_type not in IMAGE_ROWS_VERIFIED
    model = build_tiny_model(model_type, "sdpa")
    packed = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "position_ids": torch.tensor([[0, 1, 0, 1]])}
    with prepare_model_for_packing(model):
        model(**packed)  # text-only rows: served
        with pytest.raises(ValueError, match=f"{model_type}: image\\+text rows: packing_hf has not verified"):
            model(**packed, pixel_values=torch.zeros(4, 8))


# --------------------------------------------------------------------------------------------------
# the entry points: packing_hf.Trainer (pre-flight, multipack) on text-only data through a VLM wrapper


def test_trainer_packs_text_only_data_through_a_qwen_vl_wrapper(gsm8k_tokenized, tmp_path):
    import datasets

    import packing_hf

    model = build_tiny_model("qwen2_vl", "sdpa").train()
    rows = [{"input_ids": [t % 400 for t in r["input_ids"]]} for r in gsm8k_tokenized[:12]]
    seen = []
    model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(getattr(kwargs["position_ids"], "shape", None)),
        with_kwargs=True,
    )
    args = packing_hf.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        max_tokens_per_batch=512, max_steps=2, packing_preflight="error", learning_rate=1e-3,
    )  # fmt: skip
    trainer = packing_hf.Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows))
    # a batch holding several samples in one row (the random plan may start with a long sample alone)
    batch = next(b for b in trainer.get_train_dataloader() if len(b["cu_seq_lens_q"]) > 2)
    assert batch["input_ids"].shape[0] == 1
    # step 0 is exact: the packed loss is the token-weighted mean of every sample's loss alone
    cu = batch["cu_seq_lens_q"].tolist()
    model.eval()
    with prepare_model_for_packing(model), torch.no_grad():
        packed = model(**batch).loss
        total = count = 0.0
        for a, b in zip(cu[:-1], cu[1:], strict=False):
            labels = batch["labels"][:, a:b]
            n = int((labels[:, 1:] != -100).sum())
            total += (
                float(model(input_ids=batch["input_ids"][:, a:b], labels=labels, use_cache=False).loss) * n
            )
            count += n
    assert float(packed) == pytest.approx(total / count, rel=1e-5)
    seen.clear()
    model.train()
    trainer.train()
    assert seen and all(shape is not None and shape[0] == 4 for shape in seen), (
        seen
    )  # the text row reached the language model


def test_trainer_packs_image_rows_with_the_multimodal_collator(qwen_models, tmp_path):
    import datasets

    import packing_hf

    model = build_tiny_model("qwen2_vl", "sdpa").train()
    generator = torch.Generator().manual_seed(1)
    rows = [_qwen_sample(model.config, (4 + i, 3), [(1, 2 * (1 + i % 3), 4)], generator) for i in range(8)]
    dataset = datasets.Dataset.from_list(
        [{k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in r.items()} for r in rows]
    )
    seen = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(
            (kwargs["position_ids"].shape, kwargs["pixel_values"].shape)
        ),
        with_kwargs=True,
    )
    args = packing_hf.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        max_tokens_per_batch=96, max_steps=2, learning_rate=1e-3,
    )  # fmt: skip
    collator = MultimodalCollator(image_token_id=model.config.image_token_id)
    trainer = packing_hf.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    assert len(seen) == 2
    for positions, pixels in seen:  # mRoPE rows computed per sample inside the prepared model
        assert positions[0] == 4 and pixels[0] > 0


# --------------------------------------------------------------------------------------------------
# packed image rows reaching a model that was not prepared; placeholders that do not match the grid


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("positions", ["collator", "model"])
def test_packed_image_rows_are_refused_by_the_attention_of_an_unprepared_model(model_type, positions):
    model = build_tiny_model(model_type, "packing_hf").eval()
    samples = _qwen_samples(model)
    rope_index = model.model.get_rope_index if positions == "collator" else None
    batch = MultimodalCollator(rope_index, image_token_id=model.config.image_token_id)(samples)
    assert batch[PACKED_MEDIA_KEY] is True
    with pytest.raises(ValueError, match="packed row holding images .* has not prepared"):
        model(**batch, use_cache=False)
    # the leak the refusal stands for: the same row with the key dropped is served, and the image tokens of an
    # unprepared model get text positions (the model's positions), caught by the comparison with each sample alone
    unmarked = {k: v for k, v in batch.items() if k != PACKED_MEDIA_KEY}
    if positions == "model":
        logits, _ = _packed_vs_alone(model, samples, {**unmarked, "use_cache": False})
        assert logits > 100 * DEFAULT_TOLERANCE, logits
    # prepared, the same batch (key and all) is exact
    with prepare_model_for_packing(model):
        logits, grads = _packed_vs_alone(model, samples, batch)
    assert logits <= DEFAULT_TOLERANCE and grads <= DEFAULT_TOLERANCE, (logits, grads)


def test_validate_packed_batch_refuses_packed_image_rows_for_an_unprepared_model(qwen_models):
    """Under sdpa nothing of packing_hf runs inside a stock model: given the model, validate_packed_batch sees that
    it is not prepared (the predict test below measures what such a model computes on such a row)."""
    import packing_hf

    model = qwen_models["qwen2_vl"].eval()
    batch = MultimodalCollator(image_token_id=model.config.image_token_id)(_qwen_samples(model))
    with pytest.raises(
        ValueError, match="several image samples .* has not prepared.*prepare_model_for_packing"
    ):
        packing_hf.validate_packed_batch(batch, model=model)
    with prepare_model_for_packing(model):
        assert packing_hf.validate_packed_batch(batch, model=model)[PACKED_MEDIA_KEY] is True


def test_text_only_rows_and_one_sample_rows_carry_no_media_key():
    model = build_tiny_model("qwen2_vl", "packing_hf").eval()
    samples = _qwen_samples(model)
    collator = MultimodalCollator(image_token_id=model.config.image_token_id)
    assert PACKED_MEDIA_KEY not in collator([samples[2], samples[2]])  # text only: served unprepared, exact
    assert PACKED_MEDIA_KEY not in collator(samples[:1])  # one sample: nothing to keep apart
    with torch.no_grad():
        model(**collator([samples[2], samples[2]]), use_cache=False)


@pytest.mark.parametrize("positions", ["collator", "model"])
def test_one_placeholder_short_is_named_as_transformers_names_it_before_the_model_runs(
    qwen_models, positions
):
    model = qwen_models["qwen2_vl"].eval()
    samples = _qwen_samples(model)
    token = model.config.image_token_id
    ids = samples[1]["input_ids"]
    samples[1] = {**samples[1], "input_ids": ids[: ids.index(token)] + ids[ids.index(token) + 1 :]}
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):  # stock, alone
        model(**_alone_kwargs(model, samples[1]))
    calls = []
    hook = model.model.language_model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with (
            prepare_model_for_packing(model),
            pytest.raises(
                ValueError,
                match="Image features and image tokens do not match: sample 1 of the packed row has",
            ),
        ):
            rope_index = model.model.get_rope_index if positions == "collator" else None
            model(**MultimodalCollator(rope_index, image_token_id=token)(samples))
    finally:
        hook.remove()
    assert calls == []  # refused before the language model ran


def test_trainer_predict_runs_packed_image_rows_on_the_prepared_model(tmp_path):
    """``Trainer.predict`` packs its test batches with the same collator as evaluation: it prepares the model like
    ``evaluate`` does (issue 40: an unprepared Qwen2-VL gave image tokens text positions there, without an error)."""
    import datasets

    import packing_hf

    model = build_tiny_model("qwen2_vl", "sdpa").eval()
    samples = [s for s in _qwen_samples(model) if "pixel_values" in s]  # a dataset column is in every row
    dataset = datasets.Dataset.from_list(
        [{k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in samples]
    )
    collator = MultimodalCollator(image_token_id=model.config.image_token_id)
    args = packing_hf.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        max_tokens_per_batch=256, per_device_eval_batch_size=len(samples),
    )  # fmt: skip
    trainer = packing_hf.Trainer(model=model, args=args, data_collator=collator)
    predictions = trainer.predict(dataset).predictions  # the logits, then the model's other outputs
    predicted = torch.as_tensor(predictions[0] if isinstance(predictions, tuple) else predictions)[
        0
    ]  # (T, V)
    batch = collator(samples)
    cu = batch["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        alone = torch.cat([model(**_alone_kwargs(model, s)).logits[0] for s in samples])
        assert float((predicted - alone).abs().max()) <= DEFAULT_TOLERANCE
        # negative control: the same packed row through the model as it is outside the trainer (unprepared)
        stock = model(**batch, use_cache=False).logits[0]
    assert predicted.shape[0] == cu[-1]
    assert float((stock - alone).abs().max()) > 100 * DEFAULT_TOLERANCE


def _short_patches(samples: list[dict]) -> list[dict]:
    """The first sample's image loses its last 4 patch rows: fewer patches than its image_grid_thw asks for."""
    return [{**samples[0], "pixel_values": samples[0]["pixel_values"][:-4]}, *samples[1:]]


def _without_grid(samples: list[dict]) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "image_grid_thw"} for s in samples]


def _integer_pixels(samples: list[dict]) -> list[dict]:
    return [{**s, "pixel_values": s["pixel_values"].long()} if "pixel_values" in s else s for s in samples]


MALFORMED = {
    "fewer patches than the grid": (
        _short_patches,
        "pixel_values has 12 patch rows but its image_grid_thw asks for 16",
    ),
    "no image_grid_thw": (_without_grid, "pixel_values of shape .* come without image_grid_thw"),
    "int64 pixel_values": (
        _integer_pixels,
        "pixel_values are torch.int64, but a vision tower takes floating-point",
    ),
}


@pytest.mark.parametrize("problem", sorted(MALFORMED))
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_malformed_image_inputs_are_refused_by_name(qwen_models, model_type, problem):
    """At collation (the samples) and in the prepared model (the packed row), instead of a bare size mismatch
    or an attribute error inside the vision tower, or integer pixels embedded as if normalised."""
    model = qwen_models[model_type].eval()
    samples = _qwen_samples(model)
    spoil, message = MALFORMED[problem]
    positions = MultimodalCollator(model.model.get_rope_index, image_token_id=model.config.image_token_id)
    with pytest.raises(ValueError, match=f"sample 0: {message}"):
        positions(spoil(samples))
    collator = MultimodalCollator(image_token_id=model.config.image_token_id)
    batch = collator(samples)
    if problem == "fewer patches than the grid":
        batch["pixel_values"] = batch["pixel_values"][:-4]
        message = message.replace("12", "56").replace("16", "60")
    elif problem == "no image_grid_thw":
        del batch["image_grid_thw"]
    else:
        batch["pixel_values"] = batch["pixel_values"].long()
    with torch.no_grad(), prepare_model_for_packing(model):
        with pytest.raises(ValueError, match=f"{model_type}: the packed row: {message}"):
            model(**batch)
        model(**collator(samples))  # negative control: the well-formed row of the same samples is served


@pytest.mark.parametrize("model_type", ["qwen2_vl", "glm4v", "qwen3_vl"])
def test_validate_packed_batch_refuses_positions_an_unprepared_language_model_drops(model_type):
    """Qwen2-VL / GLM-4V's language model reads (1, T) positions as 3 mRoPE rows and hands its layers and mask
    none: under packing_hf's attention too, a restarting row without cu_seq_lens leaks. ``validate_packed_batch``
    refuses it for the unprepared model, accepts it next to cu_seq_lens_q (exact) or prepared; Qwen3-VL hands its
    layers the text row (no leak), the control the same checks accept."""
    from packing_hf import PaddingFreeCollator

    model = build_tiny_model(model_type, "packing_hf").eval()
    first, second = [3, 4, 5, 6], [7, 8, 9]
    batch = {
        "input_ids": torch.tensor([first + second]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
    }
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([second]), use_cache=False).logits[0]
        leak = (model(**batch, use_cache=False).logits[0, 4:] - alone).abs().max().item()
    drops = model_type != "qwen3_vl"
    assert (leak > 100 * DEFAULT_TOLERANCE) == drops, leak
    if drops:
        with pytest.raises(ValueError, match=r"hands its layers and its mask no positions.*cu_seq_lens_q"):
            validate_packed_batch(batch, model=model)
    else:
        validate_packed_batch(batch, model=model)
    flash = PaddingFreeCollator(return_flash_attn_kwargs=True)([{"input_ids": first}, {"input_ids": second}])
    with torch.no_grad():
        exact = model(**validate_packed_batch(flash, model=model)).logits[0, 4:]
    assert (exact - alone).abs().max().item() <= DEFAULT_TOLERANCE
    with prepare_model_for_packing(model):
        validate_packed_batch(batch, model=model)
    if drops:  # sdpa reads no cu_seq_lens: the mask it builds without positions leaks with them too
        with pytest.raises(ValueError, match="hands its layers and its mask no positions"):
            validate_packed_batch(flash, model=build_tiny_model(model_type, "sdpa"))
