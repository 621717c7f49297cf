"""packing_hf.GRPOTrainer / RLOOTrainer / GMPOTrainer against stock TRL on padded rollouts: same log-probs, losses, gradients.

Both trainers load one tiny llama (fp32) from the same folder (so TRL builds the reference model from it
too): sdpa for stock, packing_hf's varlen attention for the packed one. Generation is replaced on both by
the same deterministic completions (lengths 1 to 14, some without EOS), the reward is a deterministic
function of the completion ids, and the prompts are real GSM8K questions tokenized with the SmolLM2
tokenizer.
"""

from __future__ import annotations

import random

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

trl = pytest.importorskip("trl")

from trl.experimental import gmpo as stock_gmpo  # noqa: E402

import packing_hf  # noqa: E402
from packing_hf.architectures import preparation as preparation_module  # noqa: E402
from packing_hf.architectures.mixers import MixerRepacking  # noqa: E402
from packing_hf.integrations import preflight as preflight_module  # noqa: E402
from packing_hf.integrations.gmpo import GMPOConfig, GMPOTrainer  # noqa: E402
from packing_hf.integrations.rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402
from packing_hf.rollouts import RolloutPack  # noqa: E402
from packing_hf.varlen import cu_seqlens_to_position_ids  # noqa: E402

REL = 1e-5
G = 2
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# metrics that are timings or counters of wall-clock work, not results
PACKING_FIELDS = (
    "max_tokens_per_batch",
    "packing_preflight",
    "share_prompt",
    "share_prefixes",
    "min_shared_tokens",
)
_TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_llama):
    """A tiny llama saved once; both trainers (and TRL's reference model) load it."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts(gsm8k_rows):
    """``prompts(n)``: a fresh Dataset of ``n`` short GSM8K questions (prompt lengths vary, ~15 to 40 tokens)."""
    rows = [r["question"].split(". ")[0] for r in gsm8k_rows(40)]
    rows = [q for q in rows if 40 < len(q) < 160]
    return lambda n: datasets.Dataset.from_dict({"prompt": [f"Q: {q}\nA:" for q in rows[:n]]})


def _completion(prompt_ids, index: int, eos: int) -> list[int]:
    """A deterministic completion for the ``index``-th rollout of a call: 1 to 14 tokens, most ending in EOS."""
    rng = random.Random(sum(prompt_ids) * 31 + len(prompt_ids) * 7 + index)
    ids = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 14))]
    if rng.random() < 0.75:
        ids[-1] = eos
    return ids


def _inject_generations(trainer) -> None:
    """Replace TRL's generation on ``trainer`` by :func:`_completion` (same on stock and packed trainers)."""
    eos = trainer.processing_class.eos_token_id
    rloo = isinstance(trainer, trl.RLOOTrainer)  # RLOO returns the ids alone, GRPO (ids, sampling log-probs)

    def generate(prompt_ids, *args, **kwargs):
        completions = [_completion(p, i, eos) for i, p in enumerate(prompt_ids)]
        return completions if rloo else (completions, None)

    trainer._generate_single_turn = generate


def reward_digits(completion_ids, **kwargs):
    """A deterministic reward: spread over the group, so advantages are not all zero."""
    return [float(sum(ids) % 7) - 3.0 + 0.1 * len(ids) for ids in completion_ids]


def _common(tmp_path, name: str, **overrides) -> dict:
    defaults = dict(
        output_dir=str(tmp_path / name),
        num_generations=G,
        per_device_train_batch_size=4,
        max_completion_length=16,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        seed=0,
        bf16=False,  # TRL defaults to bf16 autocast, even on CPU; exactness is measured in fp32
        beta=0.04,
        logging_steps=1,
    )
    return {**defaults, **overrides}


def _kinds(algorithm: str):
    """[(stock trainer, config), (packed trainer, config)] of ``algorithm``."""
    if algorithm == "gmpo":
        return [(stock_gmpo.GMPOTrainer, stock_gmpo.GMPOConfig), (GMPOTrainer, GMPOConfig)]
    if algorithm == "rloo":
        return [(trl.RLOOTrainer, trl.RLOOConfig), (RLOOTrainer, RLOOConfig)]
    return [(trl.GRPOTrainer, trl.GRPOConfig), (GRPOTrainer, GRPOConfig)]


def _build(tmp_path, model_dir, tokenizer, data, algorithm: str = "grpo", **config):
    """(stock trainer, packed trainer) of ``algorithm`` on the same weights, prompts and generations."""
    trainers = []
    kinds = _kinds(algorithm)
    for (trainer_cls, config_cls), attn in zip(kinds, ("sdpa", packing_hf.register_attention()), strict=True):
        name = "stock" if trainer_cls.__module__.startswith("trl") else "packed"
        options = {k: v for k, v in config.items() if name == "packed" or k not in PACKING_FIELDS}
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
        trainer = trainer_cls(
            model=model,
            reward_funcs=reward_digits,
            args=config_cls(**_common(tmp_path, name, **options)),
            train_dataset=data(),
            processing_class=tokenizer,
        )
        _inject_generations(trainer)
        trainers.append(trainer)
    stock, packed = trainers
    if stock.ref_model is not None:  # a reference unlike the policy, so the KL term is not ~0
        torch.manual_seed(1)
        other = {k: v + 0.02 * torch.randn_like(v) for k, v in stock.ref_model.state_dict().items()}
        for trainer in trainers:
            trainer.ref_model.load_state_dict(other)
    return stock, packed


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max()) or 1.0
    err = float((got - want).abs().max())
    assert err <= REL * scale, f"{what}: max error {err} > {REL} x {scale}"


def _terms(key: str, log: dict) -> list[float]:
    """The magnitudes a logged ``key`` is a small difference of (``assert_close``'s ``terms``): the loss (through
    the importance ratio ``exp(logp - old_logp)`` and the KL term) and the KL cancel per-token log-probs, of
    size ~``entropy`` for these near-uniform tiny policies (~10.8 = log of the vocabulary); the loss is ~0 when
    the ratios are 1 and the group's advantages cancel."""
    return [log["entropy"]] if key in ("loss", "kl") and "entropy" in log else []


def _micro_batches(stock, packed):
    """The first micro-batch of both trainers (generation, rewards, old/ref log-probs: TRL's _prepare_inputs)."""
    out = []
    for trainer in (stock, packed):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train; the loss reads it
        torch.manual_seed(0)  # TRL shuffles the generation batch with the global generator
        generation_batch = next(iter(trainer.get_train_dataloader()))
        out.append((generation_batch, trainer._prepare_inputs(generation_batch)))
    (rows_s, batch_s), (rows_p, batch_p) = out
    assert [r["prompt"] for r in rows_s] == [r["prompt"] for r in rows_p]
    assert torch.equal(batch_s["completion_ids"], batch_p["completion_ids"])
    return batch_s, batch_p


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return loss.detach(), grads


def _per_token(trainer, batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, batch["completion_ids"].size(1), compute_entropy=True
        )


@pytest.mark.parametrize(
    "config",
    [
        {"loss_type": "grpo"},
        {"loss_type": "dapo", "max_tokens_per_batch": 48},  # several packed forwards per micro-batch
        {"loss_type": "dr_grpo"},
        {"loss_type": "bnpo", "mask_truncated_completions": True},
        {"loss_type": "cispo"},
        {"loss_type": "sapo", "top_entropy_quantile": 0.5},
        {"loss_type": "luspo", "importance_sampling_level": "sequence"},
        {"loss_type": "vespo", "entropy_coef": 0.01},
        # prompt sharing: each group's prompt computed once (one forward, then under a budget)
        {"loss_type": "dapo", "share_prompt": True},
        {
            "loss_type": "grpo",
            "share_prompt": True,
            "max_tokens_per_batch": 64,
            "mask_truncated_completions": True,
        },
    ],
    ids=lambda c: "+".join(
        [c["loss_type"], *(k for k in ("share_prompt", "max_tokens_per_batch") if k in c)]
    ),
)
def test_grpo_logps_loss_gradients_and_metrics_match_stock(
    tmp_path, model_dir, tokenizer, prompts, config, assert_close
):
    stock, packed = _build(tmp_path, model_dir, tokenizer, lambda: prompts(2), **config)
    _check_micro_batch(stock, packed, config, assert_close)


@pytest.mark.parametrize(
    "config",
    [
        {},  # KL to the reference (beta=0.04)
        {"max_tokens_per_batch": 48},  # several packed forwards per micro-batch
        # no reference model (GMPO's default); entropy mask inside the geometric mean
        {"beta": 0.0, "share_prompt": True, "top_entropy_quantile": 0.5},
        {"share_prompt": True, "max_tokens_per_batch": 64, "mask_truncated_completions": True},
    ],
    ids=["kl", "budget", "no_kl+share_prompt+entropy_mask", "share_prompt+budget+mask_truncated"],
)
def test_gmpo_logps_loss_gradients_and_metrics_match_stock(
    tmp_path, model_dir, tokenizer, prompts, config, assert_close
):
    stock, packed = _build(tmp_path, model_dir, tokenizer, lambda: prompts(2), algorithm="gmpo", **config)
    assert type(stock).__module__ == "trl.experimental.gmpo.gmpo_trainer"
    _check_micro_batch(stock, packed, config, assert_close)


def _check_micro_batch(stock, packed, config: dict, assert_close) -> None:
    """Reference log-probs, advantages, policy log-probs and entropies, loss, gradients, metrics: as stock."""
    batch_s, batch_p = _micro_batches(stock, packed)
    assert ("ref_per_token_logps" in batch_p) == ("ref_per_token_logps" in batch_s) == (stock.beta != 0.0)
    if stock.beta != 0.0:
        _close(batch_p["ref_per_token_logps"], batch_s["ref_per_token_logps"], "reference log-probs")
    _close(batch_p["advantages"], batch_s["advantages"], "advantages")

    logps_p, entropy_p, _ = _per_token(packed, batch_p)
    logps_s, entropy_s, _ = _per_token(stock, batch_s)
    _close(logps_p, logps_s, "policy per-token log-probs")
    mask = batch_s["completion_mask"].bool()
    _close(entropy_p[mask], entropy_s[mask], "entropies")
    assert packed.packing_stats["packed_tokens"] < packed.packing_stats["padded_tokens"]  # padding avoided
    if "max_tokens_per_batch" in config:
        assert packed.packing_stats["forwards"] > 3  # the budget split the forwards
    if config.get("share_prompt"):  # each group's prompt stored once: fewer tokens than one copy per rollout
        rollouts = int((torch.cat([batch_p["prompt_mask"], batch_p["completion_mask"]], 1)).sum())
        assert packed.packing_stats["packed_tokens"] < 3 * rollouts  # 3 passes (ref, policy, policy)
    if config.get("share_prefixes"):  # prompts and shared turns computed once (per subtree under a budget)
        stats = packed.packing_stats
        assert (
            stats["rollout_tokens"] > (1 if "max_tokens_per_batch" in config else 2) * stats["packed_tokens"]
        )

    _check_loss_and_metrics(stock, packed, batch_s, batch_p, assert_close)


def _check_loss_and_metrics(stock, packed, batch_s, batch_p, assert_close) -> None:
    stock._metrics["train"].clear()
    packed._metrics["train"].clear()
    loss_p, grads_p = _loss_and_grads(packed, batch_p)
    loss_s, grads_s = _loss_and_grads(stock, batch_s)
    metrics = {key: values[-1] for key, values in stock._metrics["train"].items()}
    assert_close(loss_p, loss_s, "loss", rel=REL, terms=_terms("loss", metrics))
    _close(grads_p, grads_s, "gradients")
    extra = {"tree_token_ratio"} if packed.args.share_prefixes else set()  # tokens alone / computed in trees
    assert set(packed._metrics["train"]) == set(stock._metrics["train"]) | extra
    if extra:
        assert min(packed._metrics["train"]["tree_token_ratio"]) > 1.0
    for key, values in stock._metrics["train"].items():
        terms = _terms(key, metrics)
        assert_close(packed._metrics["train"][key], values, f"metric {key}", rel=REL, terms=terms)


def _branching_generations(trainer) -> None:
    """Replace TRL's generation on ``trainer``: the 6 rollouts of a prompt share their first turns and branch at
    three depths (one leaves right after the prompt), with a duplicate and a strict prefix of another."""
    eos = trainer.processing_class.eos_token_id

    def rollouts(prompt) -> list[list[int]]:
        rng = random.Random(sum(prompt))
        a, other, b1, b2, c1, c2 = ([rng.randrange(100, 5000) for _ in range(n)] for n in (4, 3, 3, 2, 3, 2))
        full = a + b1 + c1 + [eos]
        return [full, a + b1 + c2, a + b2 + [eos], list(full), a + b1, other + [eos]]

    def generate(prompt_ids, *args, **kwargs):
        completions = [rollouts(p)[i % 6] for i, p in enumerate(prompt_ids)]
        return completions if isinstance(trainer, trl.RLOOTrainer) else (completions, None)

    trainer._generate_single_turn = generate


@pytest.mark.parametrize(
    "algorithm, config",
    [("grpo", {"loss_type": "dapo"}), ("grpo", {"loss_type": "grpo", "max_tokens_per_batch": 40})],
    ids=["dapo", "grpo+budget"],
)
def test_share_prefixes_on_multi_level_rollouts_matches_stock(
    tmp_path, model_dir, tokenizer, prompts, algorithm, config, assert_close
):
    """One real step on rollouts branching at three depths laid out as prefix trees (``share_prefixes=True``):
    reference and policy log-probs, entropies, loss, parameter gradients and metrics equal stock TRL on the
    padded batch, which ``share_prefixes=False`` equals (the tests above)."""
    config = {**config, "share_prefixes": True, "num_generations": 6, "per_device_train_batch_size": 6}
    stock, packed = _build(tmp_path, model_dir, tokenizer, lambda: prompts(2), algorithm=algorithm, **config)
    for trainer in (stock, packed):
        _branching_generations(trainer)
    _check_micro_batch(stock, packed, config, assert_close)
    assert packed.packing_stats["shared_prompts"] > 0


def test_share_prompt_and_share_prefixes_are_refused_together(tmp_path):
    with pytest.raises(ValueError, match="share_prefixes already shares every prompt"):
        GRPOConfig(**_common(tmp_path, "both", share_prompt=True, share_prefixes=True))
    with pytest.raises(ValueError, match="min_shared_tokens=4 is read only with share_prefixes=True"):
        GRPOConfig(**_common(tmp_path, "min", min_shared_tokens=4))


def _one_long_sequence(self):
    """The packed row run as one sequence: no cu_seq_lens, positions running on (segments see each other)."""
    return {"input_ids": self.input_ids, "labels": self.labels}


def _branches_without_prefix(self):
    """Shared-prefix row without prefix_seq_idx: every branch an ordinary segment that misses its prompt."""
    inputs = ORIGINAL_MODEL_INPUTS(self)
    assert inputs.pop("prefix_seq_idx") is not None
    inputs["position_ids"] = cu_seqlens_to_position_ids(self.cu_seq_lens)[None]
    return inputs


ORIGINAL_MODEL_INPUTS = RolloutPack.model_inputs


@pytest.mark.parametrize(
    "share, tamper", [(False, _one_long_sequence), (True, _branches_without_prefix)], ids=["packed", "shared"]
)
def test_negative_control_layout_errors_are_caught(
    tmp_path, model_dir, tokenizer, prompts, monkeypatch, share, tamper
):
    stock, packed = _build(tmp_path, model_dir, tokenizer, lambda: prompts(2), beta=0.0, share_prompt=share)
    batch_s, batch_p = _micro_batches(stock, packed)
    logps_s, _, _ = _per_token(stock, batch_s)
    _close(_per_token(packed, batch_p)[0], logps_s, "policy per-token log-probs")  # exact as built
    monkeypatch.setattr(RolloutPack, "model_inputs", tamper)
    with pytest.raises(AssertionError, match="policy"):
        _close(_per_token(packed, batch_p)[0], logps_s, "policy per-token log-probs")


@pytest.mark.parametrize(
    "share, tamper", [(False, _one_long_sequence), (True, _branches_without_prefix)], ids=["packed", "shared"]
)
def test_gmpo_negative_control_layout_errors_are_caught(
    tmp_path, model_dir, tokenizer, prompts, monkeypatch, share, tamper, assert_close
):
    # the loss/gradient comparison of the GMPO test catches a packed row whose segments see each other
    # (or whose branches miss their prompt): the geometric-mean weight and KL read the wrong log-probs
    stock, packed = _build(
        tmp_path, model_dir, tokenizer, lambda: prompts(2), algorithm="gmpo", share_prompt=share
    )
    batch_s, batch_p = _micro_batches(stock, packed)
    _check_loss_and_metrics(stock, packed, batch_s, batch_p, assert_close)  # exact as built
    monkeypatch.setattr(RolloutPack, "model_inputs", tamper)
    with pytest.raises(AssertionError, match="loss|gradients"):
        _check_loss_and_metrics(stock, packed, batch_s, batch_p, assert_close)


class _GradientProbe(TrainerCallback):
    """Keeps the accumulated gradient seen right before every optimizer step."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(
            torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])
        )


def _train_both(stock, packed, assert_close):
    probes = []
    for trainer in (stock, packed):
        probes.append(_GradientProbe())
        trainer.add_callback(probes[-1])
        torch.manual_seed(0)  # TRL shuffles every generation batch with the global generator
        trainer.train()
    grads_s, grads_p = (probe.grads for probe in probes)
    assert len(grads_s) == len(grads_p) == stock.state.global_step
    for step, (g_p, g_s) in enumerate(zip(grads_p, grads_s, strict=True)):
        _close(g_p, g_s, f"accumulated gradient of step {step}")
    params = [torch.cat([p.detach().flatten() for p in t.model.parameters()]) for t in (stock, packed)]
    _close(params[1], params[0], "parameters after training")
    logs = [[h for h in t.state.log_history if "loss" in h] for t in (stock, packed)]
    assert len(logs[0]) == len(logs[1]) == stock.state.global_step
    for step_s, step_p in zip(*logs, strict=True):
        for key, value in step_s.items():
            if key in _TIMING or not isinstance(value, float):
                continue
            assert_close(step_p[key], value, f"logged {key}", rel=REL, terms=_terms(key, step_s))


@pytest.mark.parametrize(
    "algorithm, share",
    [("grpo", False), ("rloo", False), ("gmpo", False), ("grpo", True), ("rloo", True), ("gmpo", True)],
    ids=lambda v: v if isinstance(v, str) else ("share_prompt" if v else "packed"),
)
def test_training_with_accumulation_and_iterations_matches_stock(
    tmp_path, model_dir, tokenizer, prompts, algorithm, share, assert_close
):
    # 2 optimizer steps of 2 micro-batches; every generation is reused for 2 iterations, so the old-policy
    # log-probs come from a no-grad packed pass and the importance ratios move away from 1
    config = dict(
        gradient_accumulation_steps=2,
        num_iterations=2,
        max_steps=2,
        optim="sgd",
        learning_rate=0.5,
        max_tokens_per_batch=64,
        share_prompt=share,
    )
    if algorithm == "gmpo":  # a log-space clip range the moved ratios leave, so GMPO's clipping is exercised
        config["epsilon"] = 0.02
    stock, packed = _build(tmp_path, model_dir, tokenizer, lambda: prompts(4), algorithm=algorithm, **config)
    _train_both(stock, packed, assert_close)
    if algorithm == "gmpo":
        assert any(h.get("clip_ratio/region_mean", 0) > 0 for h in stock.state.log_history)
    assert packed.packing_stats["forwards"] > 0
    assert (packed.packing_stats["shared_prompts"] > 0) == share
    assert not packed.model._forward_pre_hooks  # the pre-flight preparation was given back


@pytest.mark.parametrize(
    "config, extra, match",
    [
        ({"use_liger_kernel": True}, {}, "use_liger_kernel=True"),
        ({}, {"images": True}, "vision-language rollouts are not packed"),
        ({"max_tokens_per_batch": 0}, {}, "max_tokens_per_batch must be an int >= 1"),
    ],
    ids=["liger", "vision", "budget"],
)
def test_inexact_options_are_refused(tmp_path, model_dir, tokenizer, prompts, config, extra, match):
    data = prompts(2)
    if extra.pop("images", False):
        data = data.add_column("images", [[]] * len(data))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        GRPOTrainer(
            model=model,
            reward_funcs=reward_digits,
            args=GRPOConfig(**_common(tmp_path, "refused", **config)),
            train_dataset=data,
            processing_class=tokenizer,
        )


def test_rollout_over_the_budget_is_refused(tmp_path, model_dir, tokenizer, prompts):
    _, packed = _build(tmp_path, model_dir, tokenizer, lambda: prompts(2), beta=0.0, max_tokens_per_batch=8)
    packed.model.train()
    packed.current_gradient_accumulation_steps = 1
    batch = packed._prepare_inputs(next(iter(packed.get_train_dataloader())))
    with pytest.raises(ValueError, match="max_tokens_per_batch=8"):
        packed.compute_loss(packed.model, batch)


def test_router_aux_loss_is_refused(tmp_path, tokenizer, prompts):
    from packing_hf.architectures.tiny import tiny_config

    moe = AutoModelForCausalLM.from_config(tiny_config("mixtral", vocab_size=len(tokenizer)))
    with pytest.raises(ValueError, match="router load-balancing loss"):
        GRPOTrainer(
            model=moe,
            reward_funcs=reward_digits,
            args=GRPOConfig(**_common(tmp_path, "moe", beta=0.0)),
            train_dataset=prompts(2),
            processing_class=tokenizer,
        )


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, tokenizer):
    """A tiny Bamba (Mamba2 layer, then attention) with the SmolLM2 vocabulary, saved once."""
    from packing_hf.architectures.tiny import tiny_config

    path = tmp_path_factory.mktemp("tiny_bamba")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("bamba", vocab_size=len(tokenizer))).save_pretrained(path)
    return path


class _LeakingRepacking(MixerRepacking):
    """Negative control: the prepared hybrid runs its Mamba2 mixer over whole packed rows (the stock leak)."""

    def __init__(self, mixers):
        super().__init__(mixers)
        self.enabled = False


@pytest.mark.parametrize(
    "reentrant, leak, share_prompt",
    [(False, False, True), (True, False, False), (False, True, False)],
    ids=["shared_prompts", "reentrant", "negative_control"],
)
def test_hybrid_with_checkpointing_and_several_packs_per_backward_matches_stock(
    tmp_path, hybrid_dir, tokenizer, prompts, reentrant, leak, share_prompt, monkeypatch, assert_close
):
    """Issue 29's reproduction: GRPO on a hybrid with activation checkpointing on (TRL's default), every
    generation batch split over 2 steps, and a token budget that makes each micro-batch several packed
    forwards before its one backward. Every accumulated gradient and logged metric equals stock TRL's, also
    with every prompt shared by its completions (a depth-1 prefix tree: the Mamba2 mixer runs each completion
    after its prompt)."""
    config = dict(
        share_prompt=share_prompt,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        steps_per_generation=2,
        max_steps=2,
        optim="sgd",
        learning_rate=0.5,
        max_tokens_per_batch=64,
    )
    stock, packed = _build(tmp_path, hybrid_dir, tokenizer, lambda: prompts(4), **config)
    assert packed.args.gradient_checkpointing
    if leak:  # the pre-flight check passes as it does for the exact model; the trained model then leaks
        report = preflight_module.check_architecture(packed.model.config, packing_hf.register_attention())
        monkeypatch.setattr(preflight_module, "check_architecture", lambda *args, **kwargs: report)
        monkeypatch.setattr(preparation_module, "MixerRepacking", _LeakingRepacking)
        with pytest.raises(AssertionError, match="gradient|loss"):
            _train_both(stock, packed, assert_close)
        return
    _train_both(stock, packed, assert_close)
    assert packed.packing_stats["forwards"] > packed.state.global_step  # several packs per backward
    assert (packed.packing_stats["shared_prompts"] > 0) is share_prompt


def test_share_prompt_on_a_model_whose_mixers_do_not_follow_the_tree_is_refused_when_built(
    tmp_path, hybrid_dir, tokenizer, prompts
):
    """A shared prompt is a depth-1 prefix tree: ``share_prompt=True`` follows
    :func:`packing_hf.attention.admission.prefix_tree_refusal` when the trainer is built (not at the first
    forward). A pure Mamba2 stack (whose whole stack runs per sample, not along the tree) is refused by name;
    a hybrid whose mixers follow the tree (Bamba) is built sharing its prompts."""
    from packing_hf.architectures.tiny import tiny_config
    from packing_hf.errors import PackingRefused

    path = tmp_path / "tiny_mamba2"  # TRL reads the model's config back from its path
    AutoModelForCausalLM.from_config(tiny_config("mamba2", vocab_size=len(tokenizer))).save_pretrained(path)
    mamba2 = AutoModelForCausalLM.from_pretrained(path)
    for option in ("share_prompt", "share_prefixes"):
        with pytest.raises(PackingRefused, match=rf"{option}=True: mamba2: a prefix-tree row"):
            GRPOTrainer(
                model=mamba2,
                reward_funcs=reward_digits,
                args=GRPOConfig(**_common(tmp_path, "packed", **{option: True})),
                train_dataset=prompts(2),
                processing_class=tokenizer,
            )
    _, packed = _build(tmp_path, hybrid_dir, tokenizer, lambda: prompts(2), share_prompt=True)
    assert packed.args.share_prompt is True
