"""The trainer's LossPolicy: every trainer class declares what its stock loss is (checked when the class is made, a
wrong declaration caught), takes the route its declaration gives it in a real training step, and the policy is the
one writer of the step's loss state (route, denominator, ``loss_is_scaled_for_ga``)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

trl = pytest.importorskip("trl")

import packing_hf  # noqa: E402
from packing_hf.architectures.tiny import tiny_config  # noqa: E402
from packing_hf.integrations import (  # noqa: E402
    CPOConfig,
    CPOTrainer,
    DPOConfig,
    DPOTrainer,
    GMPOTrainer,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    ORPOConfig,
    ORPOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
    TPOConfig,
    TPOTrainer,
    Trainer,
)
from packing_hf.integrations.loss import PackingLossMixin  # noqa: E402
from packing_hf.integrations.loss_policy import (  # noqa: E402
    LossPolicy,
    LossRoute,
    StockLoss,
    check_declaration,
    stock_compute_loss_owner,
)
from packing_hf.integrations.parallel import ParallelPlan  # noqa: E402
from packing_hf.integrations.skeleton import PackedTrainerSkeleton  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DECLARED = {
    Trainer: StockLoss.CAUSAL_LM,
    SFTTrainer: StockLoss.SFT,
    DPOTrainer: StockLoss.PER_EXAMPLE,
    KTOTrainer: StockLoss.PER_EXAMPLE,
    RewardTrainer: StockLoss.PER_EXAMPLE,
    ORPOTrainer: StockLoss.PER_EXAMPLE,
    CPOTrainer: StockLoss.PER_EXAMPLE,
    TPOTrainer: StockLoss.PER_EXAMPLE,
    GRPOTrainer: StockLoss.PER_EXAMPLE,
    RLOOTrainer: StockLoss.PER_EXAMPLE,
    GMPOTrainer: StockLoss.PER_EXAMPLE,
}


# ---- declarations ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trainer_class", list(DECLARED), ids=lambda c: c.__name__)
def test_every_trainer_declares_what_its_stock_loss_is(trainer_class):
    """The declaration is a class attribute, consistent with the stock ``compute_loss`` the class falls back on,
    and packing_hf defines ``compute_loss`` once (the loss mixin) in front of it."""
    assert trainer_class.packing_loss is DECLARED[trainer_class]
    check_declaration(trainer_class, PackedTrainerSkeleton)  # raises on a mismatch
    owner = stock_compute_loss_owner(trainer_class, PackedTrainerSkeleton)
    assert not owner.__module__.startswith("packing_hf"), owner
    own = [k.__name__ for k in trainer_class.__mro__ if "compute_loss" in k.__dict__ and k.__module__.startswith("packing_hf")]
    assert own == (["PackingLossMixin"] if issubclass(trainer_class, PackingLossMixin) else []), own


@pytest.mark.parametrize(
    ("base", "wrong", "right"),
    [
        (Trainer, StockLoss.PER_EXAMPLE, StockLoss.CAUSAL_LM),
        (Trainer, StockLoss.SFT, StockLoss.CAUSAL_LM),
        (SFTTrainer, StockLoss.CAUSAL_LM, StockLoss.SFT),
        (DPOTrainer, StockLoss.CAUSAL_LM, StockLoss.PER_EXAMPLE),
        (GRPOTrainer, StockLoss.CAUSAL_LM, StockLoss.PER_EXAMPLE),
    ],
    ids=lambda v: getattr(v, "__name__", getattr(v, "name", v)),
)
def test_a_wrong_declaration_is_caught_when_the_class_is_made(base, wrong, right):
    """A causal-LM declaration on a trainer with a loss of its own would replace that loss by the model's; the
    class is refused when it is made, naming the right declaration. The right one (negative control) passes."""
    with pytest.raises(TypeError, match=rf"declares packing_loss=StockLoss.{wrong.name}.*StockLoss.{right.name}"):
        type("Wrong", (base,), {"packing_loss": wrong})
    assert type("Right", (base,), {"packing_loss": right}).packing_loss is right


# ---- the route table ------------------------------------------------------------------------------------------


def _fake_trainer(**args):
    options = dict(
        loss_normalization="token", chunked_loss=True, logit_metrics="labelled", loss_type="nll",
        label_smoothing_factor=0.0, n_gpu=0,
    )  # fmt: skip
    options.update(args)
    return SimpleNamespace(
        args=SimpleNamespace(**options), compute_loss_func=None, label_smoother=None, aux_loss_enabled=False,
        stock="trl.DPOTrainer", wording=SimpleNamespace(loss_term="preference pair"), model=None,
        accelerator=SimpleNamespace(reduce=lambda totals, reduction: totals * 2),
    )  # fmt: skip


@functools.cache
def _model():
    return AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=32))


def _batch():
    return packing_hf.PaddingFreeCollator()([{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6, 7]}])


_SP = ParallelPlan("ddp", None, 2, 0, 2)  # two processes, one sequence-parallel group (no mesh needed here)


@pytest.mark.parametrize(
    ("declared", "plan", "args", "call", "expected"),
    [
        (StockLoss.CAUSAL_LM, ParallelPlan(), {}, "train", LossRoute.MODEL),
        (StockLoss.CAUSAL_LM, ParallelPlan(), {"chunked_loss": False}, "train", LossRoute.STOCK),
        (StockLoss.CAUSAL_LM, ParallelPlan(), {"loss_normalization": "sample"}, "train", LossRoute.PACKED),
        (StockLoss.CAUSAL_LM, ParallelPlan(), {"loss_normalization": "sample"}, "predict", LossRoute.STOCK),
        (StockLoss.CAUSAL_LM, ParallelPlan(), {}, "eval_loss", LossRoute.MODEL),
        (StockLoss.CAUSAL_LM, _SP, {}, "train", LossRoute.SEQUENCE_PARALLEL),
        (StockLoss.CAUSAL_LM, _SP, {}, "eval_loss", LossRoute.SEQUENCE_PARALLEL),
        (StockLoss.CAUSAL_LM, _SP, {}, "predict", LossRoute.STOCK),
        (StockLoss.SFT, ParallelPlan(), {}, "train", LossRoute.SFT_PLAIN),
        (StockLoss.SFT, ParallelPlan(), {"logit_metrics": "trl"}, "train", LossRoute.STOCK),
        (StockLoss.SFT, ParallelPlan(), {"loss_type": "dft"}, "train", LossRoute.STOCK),
        (StockLoss.SFT, ParallelPlan(), {"loss_normalization": "sample"}, "train", LossRoute.PACKED),
        (StockLoss.SFT, _SP, {}, "train", LossRoute.SEQUENCE_PARALLEL),
        (StockLoss.PER_EXAMPLE, ParallelPlan(), {}, "train", LossRoute.STOCK),
        (StockLoss.PER_EXAMPLE, _SP, {}, "train", LossRoute.STOCK),  # DPO: its adapters cut the row
        (StockLoss.PER_EXAMPLE, _SP, {}, "eval_loss", LossRoute.STOCK),
    ],
)
def test_the_policy_routes_each_declaration(declared, plan, args, call, expected):
    """One table: the declaration, the layout, the settings and the call (a training step, an evaluation of the
    loss alone, a prediction wanting logits) give one route."""
    policy, trainer, model, batch = LossPolicy(declared, plan), _fake_trainer(**args), _model(), _batch()
    model.train(call == "train")
    with policy.counting_step():
        count = policy.count(trainer, [batch], "cpu", lambda: torch.tensor(5))
    assert count is not None
    with policy.prediction(call == "eval_loss"):
        route, head = policy.route(trainer, model, dict(batch), False, call != "train", count)
    assert route is expected
    # the chunked head serves a loss alone, never stock's nor a call wanting the logits
    assert (head is not None) == (expected is not LossRoute.STOCK and call != "predict" and args.get("chunked_loss", True))


def test_a_per_example_loss_refuses_packing_hfs_normalisation_at_the_step():
    """A ``loss_weights`` column reaching a trainer whose loss is one term per pair is refused by name when the step
    is counted; the same batch without weights (negative control) takes the stock route."""
    policy, trainer = LossPolicy(StockLoss.PER_EXAMPLE, ParallelPlan()), _fake_trainer()
    weighted = {**_batch(), "loss_weights": torch.ones(1, 7)}
    with policy.counting_step(), pytest.raises(ValueError, match="trl.DPOTrainer, whose loss is one term per"):
        policy.count(trainer, [weighted], "cpu", lambda: torch.tensor(5))
    with policy.counting_step():
        assert int(policy.count(trainer, [_batch()], "cpu", lambda: torch.tensor(5))) == 5
    assert policy.step_route is LossRoute.STOCK


# ---- real trainers take their declared route ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(data_dir):
    return AutoTokenizer.from_pretrained(data_dir / "smollm2_tokenizer")


def _causal_lm(tokenizer):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))


_PAIRS = {"prompt": ["1+1=", "2+3="], "chosen": ["2", "5"], "rejected": ["3", "6"]}
_COMMON = dict(max_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)


def _build(name, tokenizer, out):
    model = _causal_lm(tokenizer)
    common = dict(_COMMON, output_dir=str(out))
    if name.startswith("trainer"):
        samples = [{"input_ids": list(range(1, n))} for n in (5, 9, 3, 7)]
        options = {"trainer_sample": {"loss_normalization": "sample"}, "trainer_full": {"chunked_loss": False}}
        args = packing_hf.TrainingArguments(max_tokens_per_batch=16, **options.get(name, {}), **common)
        return Trainer(model=model, args=args, train_dataset=samples)
    if name.startswith("sft"):
        data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="], "completion": ["2", "5"]})
        metrics = "trl" if name == "sft_trl" else "labelled"
        args = SFTConfig(packing=True, padding_free=True, max_length=64, logit_metrics=metrics, **common)
        return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    if name == "dpo":
        args = DPOConfig(max_tokens_per_batch=64, precompute_ref_log_probs=True, **common)
        return DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict(_PAIRS),
                          processing_class=tokenizer)  # fmt: skip
    if name == "kto":
        data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="], "completion": ["2", "6"], "label": [True, False]})
        args = KTOConfig(per_device_train_batch_size=2, precompute_ref_log_probs=True, **common)
        return KTOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    if name == "reward":
        config = AutoConfig.for_model(
            "llama", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, num_labels=1,
        )  # fmt: skip
        data = datasets.Dataset.from_dict({"chosen": ["1+1=2", "2+3=5"], "rejected": ["1+1=3", "2+3=6"]})
        args = RewardConfig(max_tokens_per_batch=64, **common)
        return RewardTrainer(model=AutoModelForSequenceClassification.from_config(config), args=args,
                             train_dataset=data, processing_class=tokenizer)  # fmt: skip
    if name in ("orpo", "cpo"):
        config_class, trainer_class = (ORPOConfig, ORPOTrainer) if name == "orpo" else (CPOConfig, CPOTrainer)
        args = config_class(max_tokens_per_batch=64, max_length=32, **common)
        return trainer_class(model=model, args=args, train_dataset=datasets.Dataset.from_dict(_PAIRS),
                             processing_class=tokenizer)  # fmt: skip
    assert name == "tpo"
    data = datasets.Dataset.from_dict({**_PAIRS, "reference": ["2", "5"]})
    args = TPOConfig(max_tokens_per_batch=64, max_length=32, bf16=False, **common)
    return TPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("trainer", LossRoute.MODEL),
        ("trainer_full", LossRoute.STOCK),
        ("trainer_sample", LossRoute.PACKED),
        ("sft", LossRoute.SFT_PLAIN),
        ("sft_trl", LossRoute.STOCK),
        ("dpo", LossRoute.STOCK),
        ("kto", LossRoute.STOCK),
        ("reward", LossRoute.STOCK),
        ("orpo", LossRoute.STOCK),
        ("cpo", LossRoute.STOCK),
        ("tpo", LossRoute.STOCK),
    ],
)
def test_each_trainer_takes_the_route_it_declares(name, expected, smollm2, tmp_path):
    """One real training step of every trainer class: every ``compute_loss`` call takes the route of its class's
    declaration (and settings), decided by the trainer's own policy, and the loss it returns is finite."""
    trainer = _build(name, smollm2, tmp_path)
    policy = trainer.loss_policy
    assert policy.declared is type(trainer).packing_loss
    routes = []
    route = policy.route

    def recording(*args, **kwargs):
        decided = route(*args, **kwargs)
        routes.append(decided[0])
        return decided

    policy.route = recording
    result = trainer.train()
    assert routes and set(routes) == {expected}, routes
    assert torch.isfinite(torch.tensor(result.training_loss))
    scaled = expected in (LossRoute.PACKED, LossRoute.SEQUENCE_PARALLEL)
    assert trainer.loss_is_scaled_for_ga == (True if scaled else policy.stock_scaled_for_ga)


# ---- one writer of the step's loss state ----------------------------------------------------------------------


def test_loss_is_scaled_for_ga_is_the_policys(tmp_path):
    """``loss_is_scaled_for_ga`` reads the policy's step: stock's value (None) on the stock route, True on
    packing_hf's (its loss is already over the step's denominator); an assignment is refused by name, and a
    subclass's class attribute (its own compute_loss's word) is what the stock route keeps."""
    samples = [{"input_ids": list(range(1, n))} for n in (5, 9, 3, 7)]
    batch = packing_hf.PaddingFreeCollator()(samples)

    def build(trainer_class, normalization):
        args = packing_hf.TrainingArguments(
            str(tmp_path), max_tokens_per_batch=16, loss_normalization=normalization, **_COMMON
        )
        return trainer_class(model=_model(), args=args, train_dataset=samples)

    def counted(trainer):
        with trainer.loss_policy.counting_step():
            trainer._get_num_items_in_batch([batch], torch.device("cpu"))
        return trainer.loss_policy.step_route, trainer.loss_is_scaled_for_ga

    assert counted(build(Trainer, "token")) == (LossRoute.STOCK, None)
    assert counted(build(Trainer, "sample")) == (LossRoute.PACKED, True)
    trainer = build(Trainer, "sample")
    counted(trainer)
    with pytest.raises(AttributeError, match="LossPolicy decides it for each step"):
        trainer.loss_is_scaled_for_ga = True

    class Declaring(Trainer):
        loss_is_scaled_for_ga = False

    assert counted(build(Declaring, "token")) == (LossRoute.STOCK, False)
    assert counted(build(Declaring, "sample")) == (LossRoute.PACKED, True)
    # the step's loss state lives on the policy alone: no flag of it on the trainer
    flags = {"_packing_step_route", "_packing_counting", "_packing_user_loss_scaled", "_packing_loss_only",
             "_chunked_refusals", "loss_is_scaled_for_ga"}  # fmt: skip
    assert flags.isdisjoint(vars(trainer)), flags & set(vars(trainer))


def test_sft_plain_route_logs_the_forward_times(smollm2, tmp_path):
    """SFT's plain route goes through the one ``compute_loss``, so its micro-batches' forward times reach the packing
    metrics (``forward_seconds_max``), as every other route's do; before, its own ``compute_loss`` skipped them.
    TRL's route (``logit_metrics="trl"``) is the control: it always logged them."""
    for metrics in ("labelled", "trl"):
        data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="], "completion": ["2", "5"]})
        args = SFTConfig(
            output_dir=str(tmp_path / metrics), packing=True, padding_free=True, max_length=64,
            logit_metrics=metrics, logging_steps=1, **_COMMON,
        )  # fmt: skip
        trainer = SFTTrainer(model=_causal_lm(smollm2), args=args, train_dataset=data, processing_class=smollm2)
        trainer.train()
        logged = [log for log in trainer.state.log_history if "loss" in log]
        assert logged and logged[0].get("forward_seconds_max", 0) > 0, (metrics, logged)
