"""A prefix-tree packed row equals every sample alone on real tiny models: logits, per-sample loss and
gradients, fp32.

The samples are multi-turn conversations branching at three depths (a shared system prompt, two answers to
the first turn, two answers to the second), with a duplicate, a sample that is a strict prefix of another
and an unrelated sample, given in shuffled order; :func:`packing_hf.prefix_tree.build_prefix_tree` merges
them into one row. Models: Llama, Qwen3, Gemma 3 (sliding window shorter than the samples), gpt-oss
(attention sinks, MoE), built with ``AutoConfig.for_model`` + ``from_config`` (``tiny_config``) under
packing_hf's attention. The same comparison catches a sibling leak (a segment given its sibling as parent).

Hybrids (Mamba/Mamba2, gated DeltaNet, KDA, lightning attention, short convolutions, RG-LRU), prepared by
``prepare_model_for_packing``, run every segment's mixer on its root-to-segment path: every hybrid of
``PREFIX_TREE_MIXERS`` equals every sample alone the same way, and the same comparison catches a mixer that
starts a segment from a zero state (the per-sample split before trees) or without its parent. The others
(pure state-space stacks here) are refused by name.
"""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import packing_hf
from packing_hf.architectures import boundaries, tiny_config
from packing_hf.architectures import preparation as preparation_module
from packing_hf.attention.guards import validate_packed_batch
from packing_hf.attention.interface import varlen_attention_forward
from packing_hf.errors import PackingRefused
from packing_hf.prefix_tree import build_prefix_tree
from packing_hf.registry import PREFIX_TREE_MIXERS
from packing_hf.shared_prefix import prefix_chains, shared_prefix_position_ids
from packing_hf.varlen import cu_seqlens_to_position_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _conversations(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(vocab, (n,), generator=g).tolist()

    system, user_1, answer_1a, answer_1b = tokens(6), tokens(4), tokens(5), tokens(3)
    user_2, answer_2a, answer_2b = tokens(4), tokens(3), tokens(5)
    turn_2 = system + user_1 + answer_1a + user_2
    samples = [
        turn_2 + answer_2a,
        turn_2 + answer_2b,
        system + user_1 + answer_1b,
        turn_2 + answer_2a,  # duplicate
        system + user_1 + answer_1a,  # strict prefix of the first
        tokens(7),  # unrelated
    ]
    random.Random(seed).shuffle(samples)
    return [torch.tensor(s) for s in samples]


def _model(model_type: str, **overrides):
    torch.manual_seed(0)
    config = tiny_config(model_type, **overrides)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation=packing_hf.register_attention(), dtype=torch.float32
    ).eval()


def _sibling_as_parent(tree, inputs: dict) -> dict:
    """Negative control: the last segment that has an earlier sibling reads that sibling as its parent (positions
    follow the wrong layout, so only the leak differs)."""
    parents = tree.prefix_seq_idx.tolist()
    leaking = max(i for i, p in enumerate(parents) if p >= 0 and parents[:i].count(p) > 0)
    sibling = max(j for j in range(leaking) if parents[j] == parents[leaking])
    parents[leaking] = sibling
    wrong = torch.tensor(parents, dtype=torch.int32)
    positions = shared_prefix_position_ids(tree.cu_seqlens, wrong)[None]
    return {**inputs, "prefix_seq_idx": wrong, "position_ids": positions}


def _grads(params) -> torch.Tensor:
    # a parameter no sample reaches (Inkling's relative-position projections on short rows) has no gradient
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params])


def _alone(model, samples) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Every sample run alone: its logits, its loss (mean next-token cross-entropy) and the gradients of the
    losses summed over samples."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    want_logits, want_losses = [], []
    for ids in samples:
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        loss = F.cross_entropy(logits[:-1], ids[1:])
        loss.backward()
        want_logits.append(logits.detach())
        want_losses.append(loss.detach())
    return want_logits, want_losses, _grads(params)


def _relative(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _compare(model, samples, tamper=None, alone=None) -> dict[str, float]:
    """Largest relative error of the tree row's per-sample logits, losses and gradients against every sample
    run alone (the loss: each sample's mean next-token cross-entropy, summed over samples). ``alone``: the
    samples' results already computed (:func:`_alone`)."""
    want_logits, want_losses, want_grads = alone or _alone(model, samples)
    params = [p for p in model.parameters() if p.requires_grad]
    tree = build_prefix_tree(samples)
    assert tree.token_ratio > 1.5  # the row really shares: fewer tokens than the samples hold
    inputs = tree.model_inputs()
    if tamper is not None:
        inputs = tamper(tree, inputs)
    model.zero_grad()
    logits = model(**inputs, use_cache=False).logits
    losses = [-lp.mean() for lp in tree.token_logprobs(logits)]
    torch.stack(losses).sum().backward()
    got_grads = _grads(params)
    got_logits = torch.cat(tree.sample_values(logits.detach()))
    return {
        "logits": _relative(got_logits, torch.cat(want_logits)),
        "loss": _relative(torch.stack(losses).detach(), torch.stack(want_losses)),
        "grads": _relative(got_grads, want_grads),
    }


MODELS = {
    "llama": {},
    "qwen3": {},
    "gemma3_text": {},  # tiny_config keeps a sliding window (4) shorter than the samples
    "gpt_oss": {},  # attention sinks, MoE routing
}


@pytest.mark.parametrize("model_type", list(MODELS))
def test_prefix_tree_row_equals_every_sample_alone(model_type):
    model = _model(model_type, **MODELS[model_type])
    if model_type == "gemma3_text":
        assert model.config.sliding_window < 8 and "sliding_attention" in model.config.layer_types
    if model_type == "gpt_oss":
        assert any("sinks" in name for name, _ in model.named_parameters())
    errors = _compare(model, _conversations(model.config.vocab_size))
    assert all(error < 1e-5 for error in errors.values()), errors


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_sibling_leak_is_caught_by_the_same_comparison(model_type):
    model = _model(model_type)
    errors = _compare(model, _conversations(model.config.vocab_size), tamper=_sibling_as_parent)
    assert errors["logits"] > 1e-3 and errors["grads"] > 1e-3, errors


def _zero_start(kwargs, starts):
    """Negative control: every segment's mixer row holds the segment alone (the per-sample split before trees:
    each segment starts from a zero state)."""
    return boundaries.mixer_layout({}, starts)


def _parent_missing(kwargs, starts):
    """Negative control: the deepest segment's mixer row skips its parent (it keeps the grandparent); the
    attention still sees the whole tree."""
    parents = kwargs["prefix_seq_idx"].tolist()
    deepest = max(range(len(parents)), key=lambda i: len(prefix_chains(parents)[i]))
    parents[deepest] = parents[parents[deepest]]
    wrong = torch.tensor(parents, dtype=torch.int32)
    return boundaries.tree_layout(kwargs["cu_seq_lens_q"], wrong, tuple(starts.shape))


# what the control tampers with is the mixers' layout alone; LFM2's short convolution (3 tokens) moves its
# losses least (4.5e-6 at a zero start), so the control reads the logits and gradients
_CONTROLS = {"zero_start": _zero_start, "parent_missing": _parent_missing}


@pytest.mark.parametrize("model_type", sorted(PREFIX_TREE_MIXERS))
def test_a_hybrid_tree_row_equals_every_sample_alone(model_type, monkeypatch):
    """Every lifted hybrid, prepared: its mixers run each segment after its ancestors (from its parent's final
    state), so the tree row equals every sample alone; a mixer starting a segment from a zero state (the
    per-sample split before trees) is caught by the same comparison. Bamba's control also drops one parent."""
    model = _model(model_type)
    samples = _conversations(model.config.vocab_size)
    handle = packing_hf.prepare_model_for_packing(model)
    try:
        assert handle.mixers > 0 and not handle.split_stack
        alone = _alone(model, samples)
        errors = _compare(model, samples, alone=alone)
        assert all(error < 1e-5 for error in errors.values()), errors
        for name in ["zero_start", "parent_missing"] if model_type == "bamba" else ["zero_start"]:
            monkeypatch.setattr(preparation_module, "mixer_layout", _CONTROLS[name])
            errors = _compare(model, samples, alone=alone)
            assert errors["logits"] > 1e-4 and errors["grads"] > 1e-4, (name, errors)
    finally:
        handle.revert()


@pytest.mark.parametrize(
    "samples, depth",
    [([[1, 2, 3, 4], [1, 2, 3, 5]], 1), ([[1, 2, 3, 4, 6], [1, 2, 3, 4, 7], [1, 2, 9]], 2)],
    ids=["one_level", "two_levels"],
)
def test_a_model_whose_mixers_do_not_follow_the_tree_is_refused_by_name(samples, depth):
    """A pure state-space stack (Mamba2: every block a mixer) runs its whole stack per sample, not along the
    tree: refused by the batch guards and the prepared model's forward, naming the model and why (a one-level
    shared prefix as well). An attention layer called on its own (past the model's guards) refuses a config
    with non-attention layers of a model type with no registered mixers (Llama given ``layer_types``)."""
    tree = build_prefix_tree(samples)
    inputs = tree.model_inputs()
    assert max(len(chain) for chain in prefix_chains(tree.prefix_seq_idx.tolist())) == depth
    model = _model("mamba2")
    handle = packing_hf.prepare_model_for_packing(model)
    try:
        with pytest.raises(
            PackingRefused, match="mamba2: a prefix-tree row .* Mamba2 layers carry their scan state"
        ):
            validate_packed_batch(inputs, model=model)
        with pytest.raises(PackingRefused, match="mamba2: a prefix-tree row") as refused, torch.no_grad():
            model(**inputs, use_cache=False)
        assert refused.value.reason == "prefix_seq_idx"
    finally:
        handle.revert()
    llama = _model("llama")
    llama.config.layer_types = ["conv", "full_attention"]
    layer = next(m for m in llama.modules() if type(m).__name__ == "LlamaAttention")
    q = torch.randn(1, layer.config.num_attention_heads, inputs["input_ids"].shape[1], layer.head_dim)
    kv = torch.randn(1, layer.config.num_key_value_heads, q.shape[2], layer.head_dim)
    with pytest.raises(PackingRefused, match=r"llama.* layer types \['conv'\] carry state"):
        varlen_attention_forward(
            layer, q, kv, kv, None, **{k: v for k, v in inputs.items() if k != "input_ids"}
        )


def test_the_guides_example_runs():
    """docs/prefix_trees.md's example (a tiny Llama; it asserts its own claims)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "prefix_trees.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    torch.manual_seed(0)
    exec(compile(code, "docs/prefix_trees.md", "exec"), {})


def test_a_prepared_model_accepts_a_tree_row_and_refuses_positions_that_ignore_it():
    """The batch guards of a prepared model check a tree row's positions against the ancestor chains."""
    model = _model("llama")
    tree = build_prefix_tree(_conversations(model.config.vocab_size))
    inputs = tree.model_inputs()
    handle = packing_hf.prepare_model_for_packing(model)
    try:
        with torch.no_grad():
            logits = model(**inputs).logits  # the guards accept positions continuing every ancestor
        assert logits.shape[1] == tree.input_ids.numel()
        restarting = cu_seqlens_to_position_ids(tree.cu_seqlens)[None]  # every segment from 0: no tree
        with pytest.raises(ValueError, match=r"position_ids\[0, \d+\] = 0 but cu_seq_lens_q puts token"):
            model(**{**inputs, "position_ids": restarting})
    finally:
        handle.revert()


# --------------------------------------------------------------------------------------------------
# Tree rows under the trainers' call patterns, on degenerate rows


def _degenerate_rows(vocab: int) -> list[tuple[list[torch.Tensor], list[bool]]]:
    """Two rows of samples, each with which samples carry targets (their loss is part of the step's).

    Row 1: a tree whose root (2 tokens) and its child (1 token) are only branch points (no sample ends there),
    1-token leaves, next to plain samples, one of them a single token (nothing to predict). Row 2: a tree whose
    samples have no targets (forward only), next to a tree with a duplicate and a strict prefix. Every token
    is distinct, so the trie is the one described."""
    x = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:32].tolist()
    row_1 = [
        [x[0], x[1], x[2], x[3]],
        [x[0], x[1], x[2], x[4], x[5]],
        [x[0], x[1], x[6]],
        [x[7], x[8], x[9]],
        [x[10]],
    ]
    row_2 = [
        [x[11], x[12], x[13]],
        [x[11], x[12], x[14]],
        [x[15], x[16], x[17]],
        [x[15], x[16], x[17], x[18]],
    ]
    row_2 += [[x[15], x[19]], [x[15], x[19]]]
    targets_1 = [True] * len(row_1)
    targets_2 = [False, False, True, True, True, True]
    return [
        ([torch.tensor(s) for s in row_1], targets_1),
        ([torch.tensor(s) for s in row_2], targets_2),
    ]


def _parent_dropped(tree, inputs: dict) -> dict:
    """Negative control: the first child segment of two tokens or more loses its parent (a root, positions from
    0): its samples' later tokens no longer see their prefix, in the attention and in the mixers."""
    parents, cu = tree.prefix_seq_idx.tolist(), tree.cu_seqlens.tolist()
    orphan = next(i for i, p in enumerate(parents) if p >= 0 and cu[i + 1] - cu[i] >= 2)
    parents[orphan] = -1
    wrong = torch.tensor(parents, dtype=torch.int32)
    positions = shared_prefix_position_ids(tree.cu_seqlens, wrong)[None]
    return {**inputs, "prefix_seq_idx": wrong, "position_ids": positions}


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of one sample (0 for a single token: nothing to predict)."""
    return F.cross_entropy(logits[:-1], ids[1:], reduction="sum")


def _alone_rows(model, rows) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Per row: every sample's logits run alone (concatenated), and the gradients of its targeted samples'
    summed losses."""
    logits_per_row, grads_per_row = [], []
    for samples, targets in rows:
        model.zero_grad(set_to_none=True)
        pieces = []
        for ids, target in zip(samples, targets, strict=True):
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
            if target:
                _nll(logits, ids).backward()
            pieces.append(logits.detach())
        logits_per_row.append(torch.cat(pieces))
        grads_per_row.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    return logits_per_row, grads_per_row


def _tree_forward(model, samples, targets, tamper=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree row's forward: every sample's logits (concatenated) and the targeted samples' summed loss."""
    tree = build_prefix_tree(samples)
    inputs = tree.model_inputs()
    if tamper is not None:
        inputs = tamper(tree, inputs)
    logits = model(**inputs, use_cache=False).logits
    logprobs = tree.token_logprobs(logits)
    loss = sum(-lp.sum() for lp, target in zip(logprobs, targets, strict=True) if target)
    return torch.cat(tree.sample_values(logits.detach())), loss


def _grad_error(model, expected: dict[str, torch.Tensor]) -> float:
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    return max(float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-30)) for n, w in expected.items())


def _logit_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _summed(grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: sum(g[n] for g in grads) for n in grads[0]}


@pytest.fixture(scope="module", params=["llama", "bamba"])
def prepared(request):
    """A prepared tiny model (packing_hf's attention), its degenerate rows and their samples run alone."""
    torch.set_num_threads(1)
    model = _model(request.param)
    rows = _degenerate_rows(model.config.vocab_size)
    with packing_hf.prepare_model_for_packing(model):
        yield model, rows, *_alone_rows(model, rows)


def _one_step(model, rows, tamper=None) -> list[torch.Tensor]:
    """Both rows' forwards, then one backward of the summed losses; every row's per-sample logits."""
    model.zero_grad(set_to_none=True)
    outputs = [_tree_forward(model, s, t, tamper if i else None) for i, (s, t) in enumerate(rows)]
    sum(loss for _, loss in outputs).backward()
    return [logits for logits, _ in outputs]


@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["plain", "non_reentrant", "reentrant"])
def test_several_tree_rows_before_one_backward_under_checkpointing(prepared, checkpointing):
    """Two different degenerate tree rows, then one backward of their summed losses, without activation
    checkpointing and with it (``use_reentrant`` False and True: the layers re-run during backward read the
    tree of their own call). Negative control, the same comparison: the second row with a segment reading its
    sibling."""
    model, rows, want_logits, want_grads = prepared
    model.train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    try:
        got = _one_step(model, rows)
        errors = [_logit_error(g, w) for g, w in zip(got, want_logits, strict=True)]
        errors.append(_grad_error(model, _summed(want_grads)))
        assert max(errors) < 1e-5, errors
        if checkpointing is not False:
            return
        _one_step(model, rows, tamper=_parent_dropped)
        assert _grad_error(model, _summed(want_grads)) > 1e-3
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


def test_a_reference_copy_in_the_same_step(prepared):
    """A deep copy of the prepared model (``trl.create_reference_model`` makes one) forwards every tree row
    under ``no_grad`` between the policy's forwards of the same step: both equal every sample alone."""
    model, rows, want_logits, want_grads = prepared
    reference = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    losses = []
    for (samples, targets), want in zip(rows, want_logits, strict=True):
        with torch.no_grad():
            ref_logits, _ = _tree_forward(reference, samples, targets)
        logits, loss = _tree_forward(model, samples, targets)
        losses.append(loss)
        assert max(_logit_error(ref_logits, want), _logit_error(logits, want)) < 1e-5
    sum(losses).backward()
    assert _grad_error(model, _summed(want_grads)) < 1e-5
    assert all(p.grad is None for p in reference.parameters())


def test_two_threads_forward_different_tree_rows_on_one_model(prepared):
    """Two threads, started together at a barrier, each forwarding and back-propagating its own tree row on
    the same prepared model, a few times: every logit equals its samples alone, and the gradients add up to
    both rows' samples alone."""
    model, rows, want_logits, want_grads = prepared
    rounds = 3
    barrier = threading.Barrier(len(rows))
    results: list[list] = [[] for _ in rows]

    def run(index: int) -> None:
        samples, targets = rows[index]
        try:
            for _ in range(rounds):
                barrier.wait()
                logits, loss = _tree_forward(model, samples, targets)
                loss.backward()
                results[index].append(logits)
        except BaseException as exc:  # to the main thread's assertion
            barrier.abort()
            results[index].append(exc)

    model.zero_grad(set_to_none=True)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rows))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for got, want in zip(results, want_logits, strict=True):
        assert len(got) == rounds and not any(isinstance(r, BaseException) for r in got), got
        assert max(_logit_error(logits, want) for logits in got) < 1e-5
    summed = {n: rounds * g for n, g in _summed(want_grads).items()}
    assert _grad_error(model, summed) < 1e-5


def test_two_models_sharing_one_config_object(prepared):
    """A second model built from the same config object (``type(model)(model.config)``) with the same weights,
    prepared on its own: one tree row on each in the same step, each model's gradients equal its row's samples
    alone. A hybrid's twin left unprepared is refused on a tree row, whatever the prepared model accepted."""
    model, rows, want_logits, want_grads = prepared
    twin = type(model)(model.config).eval()
    twin.load_state_dict(model.state_dict())
    assert twin.config is model.config
    if _needs_preparation(model):
        with pytest.raises(PackingRefused, match="prepare_model_for_packing"), torch.no_grad():
            _tree_forward(twin, *rows[1])
    with packing_hf.prepare_model_for_packing(twin):
        model.zero_grad(set_to_none=True)
        logits_1, loss_1 = _tree_forward(model, *rows[0])
        logits_2, loss_2 = _tree_forward(twin, *rows[1])
        (loss_1 + loss_2).backward()
    assert max(_logit_error(logits_1, want_logits[0]), _logit_error(logits_2, want_logits[1])) < 1e-5
    assert max(_grad_error(model, want_grads[0]), _grad_error(twin, want_grads[1])) < 1e-5


def _needs_preparation(model) -> bool:
    return model.config.model_type in PREFIX_TREE_MIXERS


def test_a_mixer_layer_that_does_not_see_the_tree_is_refused(monkeypatch):
    """A decoder layer that finds no boundaries in its own arguments is served the boundaries of the prepared
    call in flight, which tell samples apart but not which segment continues which: on a tree row its mixers
    would start every segment from a zero state, so it is refused by name. Control: a flat row through the
    same layers stays exact. (Stands for a model whose decoder does not hand its layers keyword arguments.)"""
    model = _model("bamba")
    monkeypatch.setattr(preparation_module, "call_starts", lambda names, args, kwargs: None)
    tree = build_prefix_tree([[1, 2, 3, 4], [1, 2, 3, 5]])
    with packing_hf.prepare_model_for_packing(model), torch.no_grad():
        with pytest.raises(ValueError, match=r"bamba: a prefix-tree row .* not handed the row's keyword"):
            model(**tree.model_inputs(), use_cache=False)
        flat = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 5]])
        cu = torch.tensor([0, 4, 8], dtype=torch.int32)
        logits = model(
            input_ids=flat, position_ids=cu_seqlens_to_position_ids(cu)[None], use_cache=False
        ).logits
        alone = torch.cat([model(input_ids=flat[:, :4]).logits, model(input_ids=flat[:, 4:]).logits], dim=1)
        assert _logit_error(logits, alone) < 1e-5
