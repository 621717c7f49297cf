"""torch.compile with packing_hf's attention: the padded backend is exact, decoder layers trace without graph
breaks, recompiles stay bounded over packed batches of varying shape, and no layer reads tensor values."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch._dynamo.utils import counters
from torch.overrides import TorchFunctionMode

from packing_hf.attention import host, register_attention, varlen_attention
from packing_hf.collator import PaddingFreeCollator

ATOL = 1e-5

CASES = {
    "causal": dict(causal=True),
    "bidirectional": dict(causal=False),
    "window": dict(causal=True, window_size=(2, 0)),
    "window_bidirectional": dict(causal=False, window_size=(2, 1)),
    "softcap": dict(causal=True, softcap=2.0),
    "alibi": dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "sinks": dict(causal=True, s_aux=torch.tensor([0.3, -1.0, 2.0, 0.0])),
}
# (query lengths, key lengths or None = the same tensor): equal and unequal lengths, more keys than queries
# (bottom-right causal), more queries than keys (rows without keys are 0), empty segments
LAYOUTS = [([5, 1, 9, 3], None), ([2, 1, 3], [5, 4, 3]), ([4], [2]), ([3, 0, 4], [3, 0, 4]), ([2, 3], [0, 3])]


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("case", list(CASES))
def test_padded_backend_matches_reference_with_gradients(case, layout):
    lengths_q, lengths_k = LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    tk = sum(lengths_k or lengths_q)
    q = torch.randn(sum(lengths_q), 4, 8, generator=g, requires_grad=True)
    k = torch.randn(tk, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(tk, 2, 8, generator=g, requires_grad=True)
    cu_q = _cu(lengths_q)
    cu_k = cu_q if lengths_k is None else _cu(lengths_k)
    max_q, max_k = max(lengths_q), max(lengths_k or lengths_q)
    weights = torch.randn(q.shape[0], 4, 8, generator=g)
    results = []
    for backend in ("reference", "sdpa_padded"):
        out = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, backend=backend, **CASES[case])
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        results.append((out, grads))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_padded_backend_zeroes_tokens_after_the_last_segment():
    q = torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    out = varlen_attention(q, q, q, cu, cu, 3, 3, backend="sdpa_padded")
    torch.testing.assert_close(
        out, varlen_attention(q, q, q, cu, cu, 3, 3, backend="reference"), atol=ATOL, rtol=0
    )
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))


def test_max_seqlen_shorter_than_a_segment_is_refused():
    q = torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q = 3 but the longest segment has 4 tokens"):
        varlen_attention(q, q, q, cu, cu, 3, 4)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        varlen_attention(q, q, q, cu, cu, 4, 4.0)


# --------------------------------------------------------------------------------------------------
# a tiny model fed by PaddingFreeCollator
# --------------------------------------------------------------------------------------------------


def _tiny_model(model_type: str, layers: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())


def _batch(lengths, seed=0):
    rng = random.Random(seed)
    rows = [{"input_ids": [rng.randrange(1, 128) for _ in range(n)]} for n in lengths]
    return PaddingFreeCollator()(rows), rows


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_no_graph_break_in_the_model(model_type):
    model = _tiny_model(model_type)
    batch, _ = _batch([7, 12, 5])
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(**batch)
    # the whole forward (embeddings, mask creation, every decoder layer, loss) is one graph: no break at all
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.slow
def test_compiled_packed_model_matches_each_sample_alone():
    """Compiled (dynamo + AOT autograd) packed logits and gradients equal the eager model's on every sample
    run alone, and the compiled graph needs no host read of the boundaries."""
    model = _tiny_model("llama")
    batch, rows = _batch([6, 11, 3, 9], seed=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(**batch)
    out.logits.sum().backward()
    packed_grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.zero_grad()
    cu = batch["cu_seq_lens_q"].tolist()
    for i, row in enumerate(rows):
        alone = model(input_ids=torch.tensor([row["input_ids"]]))
        torch.testing.assert_close(out.logits[0, cu[i] : cu[i + 1]], alone.logits[0], atol=1e-5, rtol=0)
        alone.logits.sum().backward()
    torch.testing.assert_close(
        packed_grad, model.model.layers[0].self_attn.q_proj.weight.grad, atol=1e-4, rtol=0
    )


@pytest.mark.slow
def test_recompiles_stay_bounded_over_varying_packed_batches():
    """Packed rows of varying total length, number of samples and longest sample: one graph for the first
    shape, one with dynamic sizes after the first change (automatic dynamic shapes), and one for a batch of a
    single sample (torch specializes sizes of 1); then no recompilation at all."""
    model = _tiny_model("llama", layers=1)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    rng = random.Random(0)
    shapes = set()
    sizes = [1] + [rng.randint(2, 8) for _ in range(10)] + [1]
    for step, n in enumerate(sizes):
        batch, _ = _batch([rng.randint(2, 30) for _ in range(n)], seed=step)
        shapes.add((batch["input_ids"].shape[1], n, batch["max_length_q"]))
        compiled(**batch).logits.sum().backward()
    assert len(shapes) == len(sizes)  # every step is a new shape ...
    assert counters["stats"]["unique_graphs"] <= 3  # ... but at most three graphs are ever built


class _HostReads(TorchFunctionMode):
    """Records every call that reads a tensor's values on the host (a device sync on an accelerator), and
    whether it happened inside a decoder layer."""

    READS = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
        torch.Tensor.__float__,
        torch.Tensor.nonzero,
        torch.nonzero,
        torch.equal,
        torch.Tensor.equal,
    }

    def __init__(self, model):
        super().__init__()
        self.in_layers, self.outside, self.depth = [], [], 0
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_: self._enter())
            layer.register_forward_hook(lambda *_: self._leave())

    def _enter(self):
        self.depth += 1

    def _leave(self):
        self.depth -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            (self.in_layers if self.depth else self.outside).append(func.__name__)
        return func(*args, **(kwargs or {}))


def _count_reads(model_type: str, layers: int) -> _HostReads:
    model = _tiny_model(model_type, layers)
    batch, _ = _batch([7, 12, 5])
    reads = _HostReads(model)
    with reads:
        model(**batch).logits.sum().backward()
    return reads


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_no_host_read_inside_the_layers_where_reads_cost(model_type, monkeypatch):
    """Where a read of the boundaries would cost (an accelerator's device sync), forward and backward read
    nothing inside the decoder layers; outside them transformers' own packed-sequence detection reads one
    bool per forward (``find_packed_sequence_indices``; it skips that read under torch.compile)."""
    monkeypatch.setattr(host, "reads_are_free", lambda tensor: False)
    reads = _count_reads(model_type, layers=2)
    assert reads.in_layers == []
    assert reads.outside == ["__bool__"]


def test_cpu_host_reads_do_not_grow_with_the_layers():
    """On CPU the per-segment loop reads each boundary tensor once per forward (cached for every later
    layer): the same reads with one layer as with three."""
    one, three = _count_reads("llama", layers=1), _count_reads("llama", layers=3)
    assert one.in_layers == three.in_layers
    assert three.in_layers.count("tolist") <= 4  # cu_seq_lens_q and _k: one read and one check each
    assert one.outside == three.outside == ["__bool__"]
