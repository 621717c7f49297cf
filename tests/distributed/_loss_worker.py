"""The loss-contract harness: data, model, padded reference and one-optimizer-step gradient capture, shared by
``tests/integration/integrations/test_loss.py`` (one process) and ``test_loss_multiprocess.py`` (this file run by
torchrun on 2 and 3 processes, gloo on CPU: ``torchrun --nproc_per_node N _loss_worker.py OUT_DIR``).

Every setting trains exactly one optimizer step over the whole data set (every sample once), so its gradient
must equal the padded single-process reference of the same normalisation. Importing this module does nothing
(pytest collects it for doctests).
"""

from __future__ import annotations

import json
import os
import sys

NUM_SAMPLES = 12
VOCAB = 64
SEED = 0
NORMALIZATIONS = ("token", "sample", "sample_sum")
RELATIVE_TOLERANCE = 1e-6


def make_samples(weighted: bool) -> list[dict]:
    """12 samples of 3..19 tokens: prompts masked in ``labels``, sample 5 with no trained label at all (it must
    count as no sample), and with ``weighted`` a per-token ``loss_weights`` of quarters in [0, 2], zeros included."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    samples = []
    for i in range(NUM_SAMPLES):
        length = 3 + (i * 7) % 17
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        prompt = length if i == 5 else i % 4
        sample = {"input_ids": ids, "labels": [-100] * min(prompt, length) + ids[prompt:]}
        if weighted:
            quarters = torch.randint(0, 9, (length,), generator=generator)
            sample["loss_weights"] = (quarters / 4).tolist()
        samples.append(sample)
    return samples


def make_tree_samples() -> list[dict]:
    """:func:`make_samples` (weighted) with every other sample behind the first three tokens of sample 0, and two of
    them also behind sample 2 whole (per-turn-like: a sample continuing another): prefixes for ``share_prefixes``."""
    samples = make_samples(True)
    shared, turn = samples[0]["input_ids"][:3], samples[2]
    for i, sample in enumerate(samples):
        head = {"input_ids": [], "labels": [], "loss_weights": []}
        if i % 2 == 0 and i > 0:
            head = {"input_ids": shared, "labels": [-100] * 3, "loss_weights": [1.0] * 3}
        if i in (7, 9):
            head = {"input_ids": turn["input_ids"], "labels": [-100] * len(turn["input_ids"]),
                    "loss_weights": turn["loss_weights"]}  # fmt: skip
        for key in head:
            sample[key] = list(head[key]) + list(sample[key])
    return samples


def make_untrained_samples() -> list[dict]:
    """6 samples without a target (prompt-only, one token, only the first label): a step of them must train
    nothing (every gradient zero) and log the loss 0."""
    return [
        {"input_ids": [7, 8, 9, 10], "labels": [-100] * 4},
        {"input_ids": [11], "labels": [11]},
        {"input_ids": [12, 13], "labels": [12, -100]},
    ] * 2


def make_model():
    """The tiny llama every setting starts from (fp32, no dropout, same seed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def padded_collator(features: list[dict]) -> dict:
    """Right-padded ``[B, max_len]`` batches (the stock layout): padding ids 0, labels -100, weights 0."""
    import torch

    width = max(len(f["input_ids"]) for f in features)

    def pad(key: str, value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([list(f[key]) + [value] * (width - len(f[key])) for f in features], dtype=dtype)

    batch = {
        "input_ids": pad("input_ids", 0, torch.long),
        "labels": pad("labels", -100, torch.long),
        "attention_mask": torch.tensor(
            [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
        ),
    }
    if "loss_weights" in features[0]:
        batch["loss_weights"] = pad("loss_weights", 0.0, torch.float32)
    return batch


def one_step(
    out_dir: str,
    samples,
    normalization: str,
    gradient_accumulation_steps: int = 1,
    batch_size: int = 0,
    **kwargs,
):
    """Train one optimizer step; return ``(gradient {name: float64 tensor}, logged loss)``.

    ``kwargs`` go to ``packing_hf.TrainingArguments``; without ``max_tokens_per_batch`` the batches are
    :func:`padded_collator`'s, ``batch_size`` (default ``NUM_SAMPLES / gradient_accumulation_steps``) samples each."""
    from transformers import TrainerCallback

    import packing_hf

    class Capture(TrainerCallback):
        grads: dict = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            self.grads = {
                n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None
            }

    capture = Capture()
    packed = kwargs.get("max_tokens_per_batch") is not None
    args = packing_hf.TrainingArguments(
        out_dir,
        loss_normalization=normalization,
        gradient_accumulation_steps=gradient_accumulation_steps,
        per_device_train_batch_size=batch_size or NUM_SAMPLES // gradient_accumulation_steps,
        max_steps=1,
        max_grad_norm=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        packing_metrics=False,
        seed=SEED,
        **kwargs,
    )
    trainer = packing_hf.Trainer(
        model=make_model(),
        args=args,
        train_dataset=samples,
        data_collator=None
        if kwargs.get("share_prefixes")
        else packing_hf.PaddingFreeCollator()
        if packed
        else padded_collator,
        callbacks=[capture],
    )
    trainer.train()
    loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    return capture.grads, loss


def relative_difference(a: dict, b: dict) -> float:
    """``|a - b| / |b|`` over all parameters (one flat vector)."""
    import torch

    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    flat_a = torch.cat([a[n].flatten() for n in sorted(a)])
    flat_b = torch.cat([b[n].flatten() for n in sorted(b)])
    return float((flat_a - flat_b).norm() / flat_b.norm())


def stream_batches_per_pass(samples, max_tokens_per_batch: int) -> int:
    """How many micro-batches one pass of the stream yields on this rank (padding batches included): the
    gradient accumulation that makes one optimizer step of exactly one pass."""
    import packing_hf
    from packing_hf.streaming import PackedStream

    stream = PackedStream(packing_hf.streaming.read_stream(samples), max_tokens_per_batch, seed=SEED)
    return sum(1 for _ in stream)


def main(out_dir: str) -> None:
    """One rank: for every normalisation, with and without weights, the packed one-step gradient and loss on
    map-style data and on a stream, and those of a step without targets (rank 0 writes them)."""
    import torch
    import torch.distributed as dist

    budget = 24
    results = {}
    for weighted in (False, True):
        samples = make_samples(weighted)
        for normalization in NORMALIZATIONS:
            key = f"{normalization}-{'weighted' if weighted else 'plain'}"
            # map-style: the whole epoch (every rank's share) in one step
            grads, loss = one_step(
                os.path.join(out_dir, "run"), samples, normalization, gradient_accumulation_steps=16,
                max_tokens_per_batch=budget,
            )  # fmt: skip
            results[key] = {"loss": loss, "grads": {n: g.tolist() for n, g in grads.items()}}
            if weighted and normalization == "sample":
                # a stream: ranks that run out first train on padding batches, which must weigh nothing
                passes = stream_batches_per_pass(samples, budget)
                grads, loss = one_step(
                    os.path.join(out_dir, "stream"), packing_hf_stream(samples), normalization,
                    gradient_accumulation_steps=passes, max_tokens_per_batch=budget,
                )  # fmt: skip
                results[key + "-stream"] = {"loss": loss, "grads": {n: g.tolist() for n, g in grads.items()}}
    # prefix trees: the step's denominator all-reduced from the pairs of every rank's trees
    grads, loss = one_step(
        os.path.join(out_dir, "tree"), make_tree_samples(), "sample", gradient_accumulation_steps=16,
        max_tokens_per_batch=2 * budget, share_prefixes=True,
    )  # fmt: skip
    results["sample-tree"] = {"loss": loss, "grads": {n: g.tolist() for n, g in grads.items()}}
    # the default loss (token, no weights: stock's count, gathered over the ranks) of a step without targets
    grads, loss = one_step(
        os.path.join(out_dir, "untrained"), make_untrained_samples(), "token", batch_size=3
    )
    results["untrained"] = {"loss": loss, "grads": {n: g.tolist() for n, g in grads.items()}}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump({"world_size": dist.get_world_size(), "results": results}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # a clean gloo shutdown: no abort at interpreter exit


def packing_hf_stream(samples):
    import packing_hf

    return packing_hf.streaming.read_stream(samples)


if __name__ == "__main__":
    main(sys.argv[1])
