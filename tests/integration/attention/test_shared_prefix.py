"""A shared-prefix packed row equals every (prefix + branch) sample run alone: logits and gradients, fp32.

Real tiny models (llama, qwen2, mistral with a sliding window shorter than the samples) under
packing_hf's attention; the row holds two prefix groups (3 and 2 branches) and an ordinary sample. The
gradient of the shared row is the sum of the samples' gradients (the prefix counted once per branch).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import packing_hf
from packing_hf.architectures import tiny_config
from packing_hf.shared_prefix import shared_prefix_position_ids
from packing_hf.varlen import cu_seqlens_to_position_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (prefix, [branches]) groups, then an ordinary sample: token counts
GROUPS = [(7, [3, 5, 1]), (4, [6, 2])]
ALONE = 5


def _row(vocab: int, seed: int = 0):
    """Segments of a shared-prefix row, the samples it stands for, and random per-sample logit weights."""
    g = torch.Generator().manual_seed(seed)
    segments, prefix_idx, samples = [], [], []  # samples: (prefix segment or None, branch segment)
    for prefix_len, branch_lens in GROUPS:
        p = len(segments)
        segments.append(torch.randint(vocab, (prefix_len,), generator=g))
        prefix_idx.append(-1)
        for n in branch_lens:
            samples.append((p, len(segments)))
            segments.append(torch.randint(vocab, (n,), generator=g))
            prefix_idx.append(p)
    samples.append((None, len(segments)))
    segments.append(torch.randint(vocab, (ALONE,), generator=g))
    prefix_idx.append(-1)
    lengths = [len(s) for s in segments]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return segments, torch.tensor(prefix_idx, dtype=torch.int32), cu, samples


def _model(model_type: str):
    torch.manual_seed(0)
    config = tiny_config(model_type)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation=packing_hf.register_attention(), dtype=torch.float32
    ).eval()


def _alone(model, ids: torch.Tensor, weights: torch.Tensor):
    model.zero_grad()
    logits = model(input_ids=ids[None], use_cache=False).logits[0]
    (logits * weights).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def _packed(model, segments, prefix_idx, cu, weights, positions=None):
    model.zero_grad()
    ids = torch.cat(segments)[None]
    positions = shared_prefix_position_ids(cu, prefix_idx)[None] if positions is None else positions
    logits = model(
        input_ids=ids,
        position_ids=positions,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=int((cu[1:] - cu[:-1]).max()),
        max_length_k=int((cu[1:] - cu[:-1]).max()),
        prefix_seq_idx=prefix_idx,
        use_cache=False,
    ).logits[0]
    (logits * weights).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def _compare(model, segments, prefix_idx, cu, samples, tamper=None):
    """Largest relative error of the packed row's logits and gradients against the samples alone."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    total = int(cu[-1])
    packed_weights = torch.zeros(total, vocab)
    want_logits = torch.zeros(total, vocab)
    want_grads = None
    for p, b in samples:
        pieces = [segments[b]] if p is None else [segments[p], segments[b]]
        ids = torch.cat(pieces)
        weights = torch.randn(len(ids), vocab, generator=g)
        logits, grads = _alone(model, ids, weights)
        rows = torch.arange(int(cu[b]), int(cu[b + 1]))
        if p is not None:
            rows = torch.cat([torch.arange(int(cu[p]), int(cu[p + 1])), rows])
        packed_weights[rows] += weights  # the prefix's weight is the sum over its branches
        want_logits[rows] = logits
        want_grads = (
            grads if want_grads is None else [a + g_ for a, g_ in zip(want_grads, grads, strict=True)]
        )
    args = (segments, prefix_idx, cu, packed_weights)
    logits, grads = _packed(model, *args) if tamper is None else tamper(model, *args)
    errors = {"logits": float((logits - want_logits).abs().max() / want_logits.abs().max())}
    got, want = torch.cat([x.flatten() for x in grads]), torch.cat([x.flatten() for x in want_grads])
    errors["grads"] = float((got - want).abs().max() / want.abs().max())
    return errors


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_shared_prefix_row_equals_every_sample_alone(model_type):
    model = _model(model_type)
    errors = _compare(model, *_row(model.config.vocab_size))
    assert errors["logits"] < 1e-5 and errors["grads"] < 1e-5, errors


def _siblings_see_each_other(model, segments, prefix_idx, cu, weights):
    """Negative control: the branches of each group merged into one branch segment (they see each other)."""
    keep = [i for i in range(len(segments)) if not (prefix_idx[i] >= 0 and i > 0 and prefix_idx[i - 1] >= 0)]
    merged_cu = torch.tensor([*cu[keep].tolist(), int(cu[-1])], dtype=torch.int32)
    renumber = {old: new for new, old in enumerate(keep)}
    merged_idx = torch.tensor(
        [-1 if p < 0 else renumber[p] for p in prefix_idx[keep].tolist()], dtype=torch.int32
    )
    positions = shared_prefix_position_ids(merged_cu, merged_idx)[None]
    return _packed(model, segments, merged_idx, merged_cu, weights, positions=positions)


def _no_prefix(model, segments, prefix_idx, cu, weights):
    """Negative control: the same row and positions without prefix_seq_idx (branches miss their prefix).

    The attention refuses such a row (its positions contradict cu_seq_lens_q, see the test below); its
    boundary check is switched off here to show what the row would compute."""
    from unittest import mock

    from packing_hf.attention import interface

    positions = shared_prefix_position_ids(cu, prefix_idx)[None]
    model.zero_grad()
    with mock.patch.object(interface, "_check_row_boundaries", lambda *args: None):
        logits = model(
            input_ids=torch.cat(segments)[None], position_ids=positions, cu_seq_lens_q=cu, use_cache=False
        ).logits[0]
    (logits * weights).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("tamper", [_siblings_see_each_other, _no_prefix], ids=["siblings", "no_prefix"])
def test_negative_controls_are_caught(tamper):
    model = _model("llama")
    errors = _compare(model, *_row(model.config.vocab_size), tamper=tamper)
    assert errors["logits"] > 1e-3 and errors["grads"] > 1e-3, errors


def test_a_prefix_row_without_prefix_seq_idx_is_refused_by_the_attention():
    model = _model("llama")
    segments, prefix_idx, cu, _ = _row(model.config.vocab_size)
    positions = shared_prefix_position_ids(cu, prefix_idx)[None]
    with pytest.raises(ValueError, match="contradict the row's position_ids"), torch.no_grad():
        model(input_ids=torch.cat(segments)[None], position_ids=positions, cu_seq_lens_q=cu, use_cache=False)


def test_guards_accept_the_layout_and_refuse_an_attention_that_ignores_it():
    model = _model("llama")
    segments, prefix_idx, cu, _ = _row(model.config.vocab_size)
    handle = packing_hf.prepare_model_for_packing(model)
    try:
        batch = dict(
            input_ids=torch.cat(segments)[None],
            position_ids=shared_prefix_position_ids(cu, prefix_idx)[None],
            cu_seq_lens_q=cu,
            prefix_seq_idx=prefix_idx,
        )
        model(**batch)  # the guards accept positions continuing the prefix
        with pytest.raises(ValueError, match="position_ids"):
            model(**{**batch, "position_ids": cu_seqlens_to_position_ids(cu)[None]})
        model.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match="ignores: its branches would attend to each other"):
            model(**batch)
    finally:
        handle.revert()
