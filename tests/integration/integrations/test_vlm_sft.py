"""packing_hf.SFTTrainer on TRL's vision-language format (``messages`` + ``images``) with max_tokens_per_batch.

A tiny Qwen2-VL whose vocabulary is the SmolLM2 tokenizer's plus the four Qwen-VL vision tokens, and an
offline Qwen2-VL processor (``Qwen2VLImageProcessor`` on PIL, no video processor: torchvision is not
installed) with a small chat template. Step 0 of the packed trainer must give the loss and gradients of
TRL's own padded VLM SFT on the same samples; with the packing preparation reverted, the same packed batch
gives another loss (the negative control).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from packing_hf.verify import DEFAULT_TOLERANCE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
)


def _processor(tokenizer_dir):
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor without its video processor (which needs torchvision)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    images = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    return ImageOnlyQwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=TEMPLATE)


def _model(processor):
    from transformers import AutoModelForImageTextToText

    from packing_hf.architectures import tiny_config

    tokenizer = processor.tokenizer
    config = tiny_config("qwen2_vl")
    config.text_config.vocab_size = len(tokenizer)
    config.image_token_id, config.video_token_id = processor.image_token_id, processor.video_token_id
    config.vision_start_token_id = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float()


def _dataset(rows):
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    samples = []
    for i, (row, (h, w)) in enumerate(zip(rows, [(56, 84), (56, 56), (84, 56), (56, 112)], strict=True)):
        image = Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))
        question = [{"type": "image"}, {"type": "text", "text": row["question"][: 40 + 30 * i]}]
        answer = [{"type": "text", "text": row["answer"][: 20 + 25 * i]}]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        samples.append({"messages": messages, "images": [image]})
    return datasets.Dataset.from_list(samples)


def _loss_and_grads(trainer, model, batch):
    model.zero_grad()
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sft_trainer_packs_vlm_messages_and_images_exactly_like_trl_padded(data_dir, gsm8k_rows, tmp_path):
    import trl

    import packing_hf
    from packing_hf.multimodal import VisionSFTCollator

    processor = _processor(data_dir / "smollm2_tokenizer")
    dataset = _dataset(gsm8k_rows(4))
    common = dict(report_to="none", use_cpu=True, max_length=None, max_steps=1, dataloader_drop_last=False)
    model = _model(processor)
    padded_model = copy.deepcopy(model)

    padded = trl.SFTTrainer(
        model=padded_model,
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, **common),
        train_dataset=dataset,
        processing_class=processor,
    )
    padded_batch = next(iter(padded.get_train_dataloader()))
    assert padded_batch["attention_mask"].shape[0] == 4 and not padded_batch["attention_mask"].all()  # padded

    packed = packing_hf.SFTTrainer(
        model=model,
        args=packing_hf.SFTConfig(output_dir=str(tmp_path / "packed"), max_tokens_per_batch=4096, **common),
        train_dataset=dataset,
        processing_class=processor,
    )
    assert isinstance(packed.data_collator, VisionSFTCollator)
    packed_batch = next(iter(packed.get_train_dataloader()))
    packed_batch.pop(packing_hf.integrations.callbacks.STATS_KEY, None)
    # one row holding the four samples, at their processed lengths (image placeholders expanded)
    lengths = torch.diff(packed_batch["cu_seq_lens_q"]).tolist()
    assert packed_batch["input_ids"].shape == (1, int(padded_batch["attention_mask"].sum()))
    assert sorted(lengths) == sorted(padded_batch["attention_mask"].sum(-1).tolist())
    assert packed_batch["pixel_values"].shape == padded_batch["pixel_values"].shape

    loss_padded, grads_padded = _loss_and_grads(padded, padded_model, padded_batch)
    # negative control: the model not prepared (as it is outside train()), the same packed row mixes samples
    # (its mRoPE positions are expanded from the flat ones and its mask is built without them)
    loss_stock, _ = _loss_and_grads(packed, model, packed_batch)
    assert abs(float(loss_stock - loss_padded)) > 100 * DEFAULT_TOLERANCE, (loss_stock, loss_padded)
    with packing_hf.prepare_model_for_packing(model):  # what the trainer's pre-flight applies during train()
        loss_packed, grads_packed = _loss_and_grads(packed, model, packed_batch)
    assert abs(float(loss_packed - loss_padded)) <= DEFAULT_TOLERANCE, (loss_packed, loss_padded)
    assert grads_packed.keys() == grads_padded.keys()
    for name, grad in grads_padded.items():
        scale = max(float(grad.abs().max()), 1.0)
        diff = float((grads_packed[name] - grad).abs().max()) / scale
        assert diff <= DEFAULT_TOLERANCE, (name, diff)

    # and end to end: one optimizer step of each trainer logs the step-0 loss, the same value
    model.zero_grad(), padded_model.zero_grad()
    packed_loss = packed.train().training_loss
    padded_loss = padded.train().training_loss
    # the packed trainer computes its loss with the chunked LM head (chunked_loss=True), TRL's padded one from
    # full logits: the same sums in another order, so they agree to fp32 rounding relative to the loss (~11)
    assert abs(packed_loss - padded_loss) <= DEFAULT_TOLERANCE * max(1.0, abs(padded_loss)), (
        packed_loss,
        padded_loss,
    )
