"""No packed trainer builds the ``(tokens, vocabulary)`` logits: one real training step of every preference and RL
trainer whose head is TRL's fused one (DPO with a live reference model, KTO, GRPO, RLOO, GMPO) and of TPO
(packing_hf's chunked head, in training and evaluation), on tiny fp32 llamas with the SmolLM2 vocabulary
(49,152 entries, hidden size 32) and real GSM8K text.

Two checks on the whole step (data, every model call, backward, optimizer): the model's own ``lm_head``
module never projects a token (``torch.nn.Linear.forward``, wrapped, records each of its calls' token count: a
hook on it would make packing_hf's chunked head keep the full logits; TRL's fused head reads the weight without
calling the module, packing_hf's chunked head calls it on an empty slice), and no op outputs a
float tensor of ``tokens x vocabulary`` elements or more, ``tokens`` being the fewest tokens of any model call of
the step (a :class:`~torch.utils._python_dispatch.TorchDispatchMode` records the size of every non-view op
output, gradients and optimizer state included). TRL's fused head works in tiles of at most 4,096 tokens x
32,768 vocabulary entries, below ``tokens x 49,152`` whatever the row; packing_hf's own head is given chunks
of 32 tokens so that its chunk is below the row too (the automatic chunk is 128 MiB of logits, 682 tokens at
this vocabulary, more than these rows). Negative control, caught by the same checks: the full-logits path
(``packing_hf.Trainer`` with ``chunked_loss=False``). The exactness of every trainer against stock TRL is
tested in its own file; the trainers are built here with the few options these checks need (those files'
fixtures are module-local, and test modules cannot import each other under ``--import-mode=importlib``).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from unittest import mock

import datasets
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

trl = pytest.importorskip("trl")

import packing_hf  # noqa: E402
from packing_hf import loss_head  # noqa: E402
from packing_hf.integrations.dpo import DPOConfig, DPOTrainer  # noqa: E402
from packing_hf.integrations.gmpo import GMPOConfig, GMPOTrainer  # noqa: E402
from packing_hf.integrations.kto import KTOConfig, KTOTrainer  # noqa: E402
from packing_hf.integrations.rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402
from packing_hf.integrations.tpo import TPOConfig, TPOTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 49152  # the SmolLM2 tokenizer's; TRL's fused tile is 32,768 entries wide
OWN_CHUNK = 32  # packing_hf's chunked head: tokens per chunk, fewer than any row here


@dataclass
class _StepRecord(TorchDispatchMode):
    """What one step did: the token count of every model call and of every ``lm_head`` call, and the largest
    float tensor any op output (``numel``, with the op)."""

    model_tokens: list[tuple[str, int]] = field(default_factory=list)
    head_tokens: list[int] = field(default_factory=list)
    largest: tuple[int, str] = (0, "")
    heads: list[torch.nn.Module] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:  # a view allocates nothing
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                    self.largest = max(self.largest, (tensor.numel(), str(func)))
        return out

    def watch(self, model, name: str) -> list:
        """Record ``model``'s calls (``name`` and its decoder's input tokens) and its ``lm_head``'s (tokens
        projected)."""
        backbone = model.get_decoder()

        def decoder_call(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            embeds = kwargs.get("inputs_embeds")
            self.model_tokens.append((name, ids.numel() if ids is not None else embeds.shape[:-1].numel()))

        self.heads.append(model.get_output_embeddings())
        return [backbone.register_forward_pre_hook(decoder_call, with_kwargs=True)]

    @contextlib.contextmanager
    def watching_heads(self):
        """Every call of a watched ``lm_head`` records its token count, through ``torch.nn.Linear.forward``
        wrapped for the duration: a hook on the head would make packing_hf's chunked head keep the full logits
        (it honours the head's hooks)."""
        forward = torch.nn.Linear.forward

        def recording(module, x):
            if any(module is head for head in self.heads):
                self.head_tokens.append(x.shape[:-1].numel())
            return forward(module, x)

        with mock.patch.object(torch.nn.Linear, "forward", recording):
            yield

    def problems(self) -> list[str]:
        """What the step did that the chunked heads never do (empty: nothing)."""
        if not self.model_tokens:
            return ["no model call was recorded"]
        found = []
        if any(n > 0 for n in self.head_tokens):
            found.append(f"lm_head projected {self.head_tokens} tokens")
        tokens, (numel, op) = min(n for _, n in self.model_tokens), self.largest
        if numel >= tokens * VOCAB:
            found.append(
                f"{op} made a tensor of {numel} elements, at least the (tokens x vocabulary) logits of the "
                f"smallest model call ({tokens} x {VOCAB})"
            )
        return found


def _run(trainer, what: str, reference=None, evaluate: bool = False) -> _StepRecord:
    """One training step of ``trainer`` (and an evaluation when ``evaluate``) recorded and checked."""
    record = _StepRecord()
    hooks = record.watch(trainer.model, "policy")
    if reference is not None:
        hooks += record.watch(reference, "reference")
    try:
        with record, record.watching_heads():
            trainer.train()
            if evaluate:
                trainer.evaluate()
    finally:
        for hook in hooks:
            hook.remove()
    assert not record.problems(), f"{what}: {record.problems()}"
    return record


@pytest.fixture(scope="module")
def texts(gsm8k_rows):
    """Columns of 6 short GSM8K rows (~60 to 130 tokens a sequence): the prompt, the answer (``chosen``), its
    lines reversed (``rejected``) and its last line (``reference``)."""
    rows = [r for r in gsm8k_rows(200) if len(r["question"]) < 160 and len(r["answer"]) < 200][:6]
    return {
        "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
        "chosen": [" " + r["answer"] for r in rows],
        "rejected": [" " + "\n".join(r["answer"].split("\n")[::-1]) for r in rows],
        "reference": [" " + r["answer"].split("\n")[-1] for r in rows],
    }


def _rows(texts: dict, columns, rows: slice) -> datasets.Dataset:
    return datasets.Dataset.from_dict({c: texts[c][rows] for c in columns})


def _args(config_cls, tmp_path, **overrides):
    common = dict(
        output_dir=str(tmp_path / config_cls.__name__), per_device_train_batch_size=4, report_to="none",
        use_cpu=True, save_strategy="no", disable_tqdm=True, max_steps=1, seed=0, bf16=False,
    )  # fmt: skip
    return config_cls(**{**common, **overrides})


def _packed_llama(tiny_llama, seed: int = 0):
    return tiny_llama(seed=seed, attn_implementation=packing_hf.register_attention())


def _preference_rows(texts: dict, algorithm: str) -> datasets.Dataset:
    """Two examples: DPO pairs, or KTO's one desirable (the answer) and one undesirable (its lines reversed)."""
    if algorithm == "DPO":
        return _rows(texts, ("prompt", "chosen", "rejected"), slice(2))
    labels = [True, False]
    completions = [texts["chosen" if good else "rejected"][i] for i, good in enumerate(labels)]
    return datasets.Dataset.from_dict(
        {"prompt": texts["prompt"][:2], "completion": completions, "label": labels}
    )


@pytest.mark.parametrize(
    "trainer_cls, config_cls, rows",
    [(DPOTrainer, DPOConfig, 1), (KTOTrainer, KTOConfig, 2)],
    ids=["DPO", "KTO"],
)
def test_preference_trainers_with_a_live_reference_build_no_logits(
    tmp_path, tiny_llama, tokenizer, texts, trainer_cls, config_cls, rows
):
    data = _preference_rows(texts, config_cls.__name__[:3])
    reference = _packed_llama(tiny_llama, seed=1)
    trainer = trainer_cls(
        model=_packed_llama(tiny_llama),
        ref_model=reference,
        args=_args(
            config_cls, tmp_path, max_length=160, per_device_train_batch_size=2, per_device_eval_batch_size=2
        ),
        train_dataset=data,
        eval_dataset=data,
        processing_class=tokenizer,
    )
    record = _run(trainer, trainer_cls.__name__, reference, evaluate=True)
    # packed rows per model and pass: DPO's pairs, KTO's completions and KL completions; training + evaluation
    names = sorted(name for name, _ in record.model_tokens)
    assert names == ["policy"] * 2 * rows + ["reference"] * 2 * rows


def _completions(trainer) -> None:
    """TRL's generation replaced by deterministic completions of 4 to 24 tokens (RLOO returns the ids alone,
    GRPO and GMPO ``(ids, sampling log-probs)``)."""
    eos = trainer.processing_class.eos_token_id
    rloo = isinstance(trainer, trl.RLOOTrainer)

    def generate(prompt_ids, *args, **kwargs):
        rng = random.Random(len(prompt_ids))
        ids = [[rng.randrange(100, 5000) for _ in range(rng.randint(4, 23))] + [eos] for _ in prompt_ids]
        return ids if rloo else (ids, None)

    trainer._generate_single_turn = generate


def _reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


@pytest.mark.parametrize(
    "trainer_cls, config_cls",
    [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig), (GMPOTrainer, GMPOConfig)],
)
def test_rl_trainers_build_no_logits(tmp_path, tiny_llama, tokenizer, texts, trainer_cls, config_cls):
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)  # TRL loads the reference model from the policy's folder
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=packing_hf.register_attention(), dtype=torch.float32
    )
    trainer = trainer_cls(
        model=model,
        reward_funcs=_reward,
        args=_args(config_cls, tmp_path, num_generations=2, max_completion_length=24, beta=0.04),
        train_dataset=_rows(texts, ("prompt",), slice(2)),
        processing_class=tokenizer,
    )
    assert trainer.ref_model is not None
    _completions(trainer)
    record = _run(trainer, trainer_cls.__name__, trainer.ref_model)
    assert {name for name, _ in record.model_tokens} == {"policy", "reference"}


def test_tpo_training_and_evaluation_build_no_logits(tmp_path, tiny_llama, tokenizer, texts, monkeypatch):
    monkeypatch.setattr(loss_head, "DEFAULT_CHUNK_BYTES", OWN_CHUNK * 4 * VOCAB)  # fp32 logits of 32 tokens
    columns = ("prompt", "chosen", "rejected", "reference")
    trainer = TPOTrainer(
        model=_packed_llama(tiny_llama),
        args=_args(
            TPOConfig, tmp_path, per_device_train_batch_size=2, max_length=128, per_device_eval_batch_size=2
        ),
        train_dataset=_rows(texts, columns, slice(2)),
        eval_dataset=_rows(texts, columns, slice(2, 4)),
        processing_class=tokenizer,
    )
    record = _run(trainer, "TPO", evaluate=True)
    assert len(record.head_tokens) == 2  # training and evaluation both ran the chunked head (on no token)


@pytest.mark.parametrize("chunked", [True, False])
def test_negative_control_the_full_logits_are_caught(
    tmp_path, tiny_llama, tokenizer, texts, monkeypatch, chunked
):
    """The same checks on ``packing_hf.Trainer``: its chunked loss passes, its full-logits loss is caught."""
    monkeypatch.setattr(loss_head, "DEFAULT_CHUNK_BYTES", OWN_CHUNK * 4 * VOCAB)  # fp32 logits of 32 tokens
    ids = tokenizer([p + a for p, a in zip(texts["prompt"][:3], texts["chosen"], strict=False)])["input_ids"]
    args = _args(
        packing_hf.TrainingArguments,
        tmp_path,
        packing_metrics=False,
        chunked_loss=chunked,
    )
    trainer = packing_hf.Trainer(
        model=_packed_llama(tiny_llama),
        args=args,
        train_dataset=[{"input_ids": x, "labels": x} for x in ids],
        data_collator=packing_hf.PaddingFreeCollator(),
    )
    if chunked:
        _run(trainer, "Trainer")
        return
    with pytest.raises(AssertionError) as caught:
        _run(trainer, "Trainer")
    message = str(caught.value)
    assert "lm_head projected" in message and "at least the (tokens x vocabulary) logits" in message, message
