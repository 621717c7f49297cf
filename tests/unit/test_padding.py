"""packing_hf.padding: the one padded <-> packed layout, and its equality with each copy it replaced.

Every ``_old_*`` function below is a frozen copy of a conversion the package wrote by hand before
``PackedLayout`` existed (named after where it lived). The tests run both on random layouts and require
bit-identical results (``torch.equal``) and gradients; :func:`test_a_wrong_layout_is_caught` is the negative
control: the same comparison fails on a layout with two slots swapped.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from packing_hf.attention.sdpa import _Call, _explicit_attention, _run_sdpa_padded
from packing_hf.padding import PackedLayout
from packing_hf.preference import PaddingFreePreferenceCollator, pack_padded_labels, unpack_shifted
from packing_hf.rollouts import pack_rollouts, unpack_rollouts
from packing_hf.varlen import IGNORE_INDEX, lengths_to_cu_seqlens

# -- frozen copies of the replaced conversions ----------------------------------------------------------


def _old_pack_padded_labels(labels, packed_index):  # packing_hf/preference.py
    flat = torch.cat([labels.reshape(-1), labels.new_full((1,), IGNORE_INDEX)])
    return flat[packed_index.to(labels.device)][None]


def _old_unpack_shifted(values, packed_index, num_rows, width):  # packing_hf/preference.py
    target = packed_index[1:].to(values.device)
    valid = target < num_rows * width
    target = target[valid]
    dest = (target // width) * (width - 1) + target % width - 1
    out = values.new_zeros((num_rows * (width - 1), *values.shape[2:]))
    out = out.index_copy(0, dest, values[0][valid])
    return out.reshape(num_rows, width - 1, *values.shape[2:])


def _old_unpack_rollouts(values, packs, batch, width):  # packing_hf/rollouts.py
    out = values[0].new_zeros(batch * width)
    for value, pack in zip(values, packs, strict=True):
        keep = pack.target < batch * width
        out = out.index_put((pack.target[keep],), value[0, keep])
    return out.view(batch, width)


def _old_tpo_scatter(logits, packed, rows, width):  # packing_hf/integrations/tpo.py, PackedTripleForward
    cu = packed["cu_seq_lens_q"].to(torch.int64)
    place = packed["packed_index"].clone()
    place[cu[:-1]] = torch.arange(rows, device=cu.device) * width
    padded = logits.new_zeros((rows * width, logits.shape[-1]))
    padded = padded.index_copy(0, place.to(logits.device), logits[0])
    return padded.view(rows, width, -1)


class _OldMixerLayout:  # packing_hf/architectures/mixers.py, PackedLayout
    def __init__(self, starts):
        self.rows, self.tokens = starts.shape
        first = starts.clone()
        first[:, 0] = True
        flat = first.reshape(-1)
        sample = torch.cumsum(flat.long(), dim=0) - 1
        begin = torch.nonzero(flat).reshape(-1)
        lengths = torch.diff(begin, append=begin.new_tensor([flat.numel()]))
        self.samples, self.longest = int(begin.numel()), int(lengths.max())
        offset = torch.arange(flat.numel(), device=flat.device) - begin[sample]
        self.index = sample * self.longest + offset

    def pad(self, packed):
        rest = packed.shape[2:]
        flat = packed.reshape(self.rows * self.tokens, *rest)
        padded = flat.new_zeros(self.samples * self.longest, *rest).index_copy(0, self.index, flat)
        return padded.reshape(self.samples, self.longest, *rest)

    def unpad(self, padded):
        rest = padded.shape[2:]
        flat = padded.reshape(self.samples * self.longest, *rest).index_select(0, self.index)
        return flat.reshape(self.rows, self.tokens, *rest)


def _old_padded_index(cu, width, total):  # packing_hf/attention/sdpa.py
    starts = cu[:-1].long()
    lengths = cu[1:].long() - starts
    offsets = torch.arange(width, device=cu.device)
    return (starts[:, None] + offsets).clamp(max=max(total - 1, 0)), lengths


def _old_run_sdpa_padded(call):  # packing_hf/attention/sdpa.py, before PackedLayout
    q, k, v = call.q, call.k, call.v
    tq, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    n = call.cu_q.shape[0] - 1
    if n == 0 or tq == 0 or k.shape[0] == 0 or call.max_q == 0:
        return q.new_zeros(tq, hq, dv)
    index_q, len_q = _old_padded_index(call.cu_q, call.max_q, tq)
    same = call.cu_k is call.cu_q
    index_k, len_k = (index_q, len_q) if same else _old_padded_index(call.cu_k, call.max_k, k.shape[0])
    qp = q[index_q].transpose(1, 2)
    kp, vp = k[index_k].transpose(1, 2), v[index_k].transpose(1, 2)
    lq, lk = qp.shape[-2], kp.shape[-2]
    gqa = hq != kp.shape[1]
    plain_window = call.window[0] < 0 and (call.causal or call.window[1] < 0)
    plain = plain_window and call.alibi_slopes is None and call.softcap == 0 and call.s_aux is None
    if same and plain and call.causal:
        out = F.scaled_dot_product_attention(
            qp, kp, vp, dropout_p=call.dropout_p, is_causal=True, scale=call.scale, enable_gqa=gqa
        )
    else:
        offsets_q = torch.arange(lq, device=q.device)
        offsets_k = torch.arange(lk, device=q.device)
        rel = offsets_k[None, None, :] - offsets_q[None, :, None] - (len_k - len_q)[:, None, None]
        allowed = (offsets_k < len_k[:, None])[:, None, :]
        left, right = call.window
        if call.causal:
            right = 0 if right < 0 else min(right, 0)
        if left >= 0:
            allowed = allowed & (rel >= -left)
        if right >= 0:
            allowed = allowed & (rel <= right)
        allowed = allowed.expand(-1, lq, -1)
        padding_query = offsets_q[None, :] >= len_q[:, None]
        no_key = ~allowed.any(dim=-1) | padding_query
        allowed = (allowed | no_key[..., None])[:, None]
        rel = rel[:, None]
        if call.softcap > 0 or call.s_aux is not None:
            out = _explicit_attention(
                qp, kp, vp, allowed, rel, scale=call.scale, softcap=call.softcap, dropout_p=call.dropout_p,
                alibi_slopes=call.alibi_slopes, s_aux=call.s_aux, extra_mask=None,
            )  # fmt: skip
        else:
            mask = allowed
            if call.alibi_slopes is not None:
                bias = -call.alibi_slopes.float()[None, :, None, None] * rel.abs()
                mask = bias.masked_fill(~allowed, float("-inf")).to(q.dtype)
            out = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, dropout_p=call.dropout_p, scale=call.scale, enable_gqa=gqa
            )
        out = out.masked_fill(no_key[:, None, :, None], 0.0)
    out = out.transpose(1, 2).reshape(n * lq, hq, dv)
    tokens = torch.arange(tq, device=q.device)
    segment = torch.searchsorted(call.cu_q[1:].long(), tokens, right=True)
    inside = segment < n
    segment = segment.clamp(max=n - 1)
    slot = segment * lq + (tokens - call.cu_q[:-1].long()[segment])
    return out[slot.clamp(max=n * lq - 1)] * inside[:, None, None].to(out.dtype)


# -- helpers ------------------------------------------------------------------------------------------


def _random_pairs(rng: random.Random, n: int) -> list[dict]:
    def ids(low: int) -> list[int]:
        return [rng.randrange(1, 50) for _ in range(rng.randrange(low, 6))]

    return [{"prompt_ids": ids(1), "chosen_ids": ids(1), "rejected_ids": ids(1)} for _ in range(n)]


def _preference_batches():
    """Random preference batches over the collator's layouts: shared prompts or not, packed-row padding."""
    rng = random.Random(0)
    for trial in range(12):
        collator = PaddingFreePreferenceCollator(
            shared_prompt=trial % 2 == 1, pad_to_multiple_of=(None, 8, 5)[trial % 3]
        )
        yield collator(_random_pairs(rng, rng.randrange(1, 5)))


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


# -- the layout itself --------------------------------------------------------------------------------


def test_pad_and_unpad_are_inverse_on_the_real_tokens():
    rng = random.Random(1)
    for _ in range(20):
        lengths = [rng.randrange(1, 7) for _ in range(rng.randrange(1, 5))]
        extra = rng.randrange(0, 3)  # padding of the packed row: no slot
        cu = lengths_to_cu_seqlens(lengths)
        total = sum(lengths) + extra
        layout = PackedLayout.from_cu_seqlens(cu, max(lengths), (total,))
        x = torch.randn(total, 3)
        back = layout.unpad(layout.pad(x), fill=7.0)
        assert torch.equal(back[: sum(lengths)], x[: sum(lengths)])
        assert (back[sum(lengths) :] == 7.0).all()
        padded = layout.pad(x, fill=-1.0)
        assert int((padded[..., 0] != -1.0).sum()) == sum(lengths)  # every real token once, the rest is fill


def test_from_cu_seqlens_and_from_starts_agree():
    rng = random.Random(2)
    for _ in range(10):
        lengths = [rng.randrange(1, 7) for _ in range(rng.randrange(1, 6))]
        starts = torch.zeros(1, sum(lengths), dtype=torch.bool)
        starts[0, lengths_to_cu_seqlens(lengths)[:-1].long()] = True
        a = PackedLayout.from_starts(starts)
        b = PackedLayout.from_cu_seqlens(lengths_to_cu_seqlens(lengths), max(lengths), (1, sum(lengths)))
        assert torch.equal(a.index, b.index) and (a.rows, a.width) == (b.rows, b.width)


def test_from_index_names_a_foreign_index_and_a_wrong_shape():
    with pytest.raises(ValueError, match="do not come from the same batch"):
        PackedLayout.from_index(torch.tensor([0, -1]), rows=2, width=2)
    with pytest.raises(ValueError, match=r"packed_shape \(1, 3\) does not hold the 2 indexed tokens"):
        PackedLayout.from_index(torch.tensor([0, 1]), rows=2, width=2, packed_shape=(1, 3))


def test_pad_and_unpad_name_a_tensor_of_another_batch():
    layout = PackedLayout.from_cu_seqlens(torch.tensor([0, 2, 5]), width=3, packed_shape=(1, 5))
    with pytest.raises(ValueError, match=r"expected a packed tensor of shape \(1, 5, ...\), got \(1, 4\)"):
        layout.pad(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"expected a padded tensor of shape \(2, 3, ...\), got \(2, 2\)"):
        layout.unpad(torch.zeros(2, 2))


def test_an_empty_grid_unpads_to_fill():
    layout = PackedLayout.from_index(torch.tensor([0, 0]), rows=0, width=3)
    assert layout.unpad(torch.zeros(0, 3, 2), fill=5).tolist() == [[5, 5], [5, 5]]


def test_a_grid_of_paths_pads_every_path_and_sums_the_copies_gradients():
    """``from_paths`` (a prefix tree's root-to-segment rows, with a row past the tree): every row holds its path
    (tokens repeated across rows), every token is read back from its own segment's row, and the backward of
    ``pad`` sums a token's gradients over every row holding it."""
    from packing_hf.architectures.boundaries import tree_layout
    from packing_hf.shared_prefix import prefix_chains

    cu, parents = (
        [0, 2, 3, 5, 6, 8],
        [-1, 0, 1, 0, -1],
    )  # root(2) > child(1) > grandchild(2); sibling(1); alone(2)
    layout = tree_layout(
        torch.tensor(cu, dtype=torch.int32), torch.tensor(parents), (1, 9)
    )  # 1 padding token
    x = torch.arange(1.0, 10.0).reshape(1, 9, 1).requires_grad_()
    grid = layout.pad(x)
    for s, chain in enumerate(prefix_chains(parents)):
        path = [t for n in (*chain, s) for t in range(cu[n], cu[n + 1])]
        row = grid[s, :, 0].tolist()
        assert row[: len(path)] == [float(t + 1) for t in path] and set(row[len(path) :]) <= {0.0}
    back = layout.unpad(grid, fill=-1.0)
    assert back[0, :8, 0].tolist() == x[0, :8, 0].tolist() and back[0, 8, 0] == -1.0
    grid.sum().backward()
    copies = [
        1 + sum(s in chain for chain in prefix_chains(parents)) for s in range(5)
    ]  # itself + descendants
    want = [c for s, c in enumerate(copies) for _ in range(cu[s + 1] - cu[s])] + [0]
    assert x.grad[0, :, 0].tolist() == [float(c) for c in want]  # a token's copies, and the padding none
    with pytest.raises(ValueError, match="rows repeat packed tokens"):
        layout.shifted()
    with pytest.raises(ValueError, match="do not come from the same row"):
        PackedLayout.from_paths(torch.tensor([0, 2]), torch.arange(3), torch.tensor([0, 2]), (1, 2))


# -- each replaced copy: bit-identical on random layouts -------------------------------------------------


def test_preference_labels_and_shifted_values_equal_the_old_copies():
    for batch in _preference_batches():
        rows, width = batch["input_ids"].shape
        labels = torch.where(batch["completion_mask"].bool(), batch["input_ids"], IGNORE_INDEX)
        index = batch["packed_index"]
        assert _same(pack_padded_labels(labels, index), _old_pack_padded_labels(labels, index))
        values = torch.randn(1, index.numel() - 1, 3, requires_grad=True)
        got, want = (
            unpack_shifted(values, index, rows, width),
            _old_unpack_shifted(values, index, rows, width),
        )
        assert _same(got, want)
        weights = torch.randn_like(want)
        (grad_got,) = torch.autograd.grad((got * weights).sum(), values)
        (grad_want,) = torch.autograd.grad((want * weights).sum(), values)
        assert _same(grad_got, grad_want)


def test_rollout_outputs_equal_the_old_copy():
    rng = random.Random(3)
    for trial in range(10):
        batch, p_width, c_width = rng.randrange(1, 6), rng.randrange(1, 5), rng.randrange(1, 5)
        mask = torch.zeros(batch, p_width + c_width, dtype=torch.long)
        for b in range(batch):
            p, c = rng.randrange(1, p_width + 1), rng.randrange(0, c_width + 1)
            mask[b, p_width - p : p_width + c] = 1
        ids = torch.randint(1, 50, mask.shape) * mask
        budget = None if trial % 2 else p_width + c_width + rng.randrange(0, 6)
        packs = pack_rollouts(ids, mask, logits_to_keep=c_width, max_tokens_per_batch=budget)
        values = [torch.randn(1, pack.target.numel(), requires_grad=True) for pack in packs]
        got, want = (
            unpack_rollouts(values, packs, batch, c_width),
            _old_unpack_rollouts(values, packs, batch, c_width),
        )
        assert _same(got, want)
        weights = torch.randn_like(want)
        grads_got = torch.autograd.grad((got * weights).sum(), values)
        grads_want = torch.autograd.grad((want * weights).sum(), values)
        assert all(_same(a, b) for a, b in zip(grads_got, grads_want, strict=True))


def test_tpo_logits_equal_the_old_scatter():
    from packing_hf.integrations.tpo import PackedTripleForward
    from packing_hf.pair_rows import PaddingFreeTripleCollator

    class Echo(torch.nn.Module):  # logits: a random function of the token and its position
        def forward(self, input_ids, position_ids, **kwargs):
            return {
                "logits": torch.sin(
                    input_ids[..., None] * 1.7 + position_ids[..., None] * 0.3 + torch.arange(4.0)
                )
            }

    rng = random.Random(4)
    for trial in range(6):
        features = [
            {**pair, "reference_ids": [rng.randrange(1, 50) for _ in range(rng.randrange(1, 4))]}
            for pair in _random_pairs(rng, rng.randrange(1, 4))
        ]
        batch = PaddingFreeTripleCollator(include_reference=trial % 2 == 0)(features)
        rows, width = batch["input_ids"].shape
        got = PackedTripleForward(Echo(), batch)(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        )
        logits = Echo()(batch["packed_input_ids"], batch["position_ids"])["logits"]
        assert _same(got["logits"], _old_tpo_scatter(logits, batch, rows, width))


def test_mixer_layout_equals_the_old_copy():
    rng = random.Random(5)
    for _ in range(10):
        b, t = rng.randrange(1, 4), rng.randrange(1, 12)
        starts = torch.rand(b, t) < 0.3
        old, new = _OldMixerLayout(starts), PackedLayout.from_starts(starts)
        assert torch.equal(new.index, old.index) and (new.rows, new.width) == (old.samples, old.longest)
        x = torch.randn(b, t, 2, 3, requires_grad=True)
        weights = torch.randn(old.samples, old.longest, 2, 3)
        got, want = new.pad(x), old.pad(x)
        assert _same(got, want)
        assert _same(*(torch.autograd.grad((y * weights).sum(), x)[0] for y in (got, want)))
        padded = torch.randn(old.samples, old.longest, 5)
        assert _same(new.unpad(padded), old.unpad(padded))


def _sdpa_calls():
    """Random calls over every branch of the padded SDPA backend: causal fast path, windows, cross lengths,
    ALiBi, softcap, sinks, GQA, tokens after the last segment, empty segments."""
    rng = random.Random(6)
    options = [
        {}, {"window": (2, 0)}, {"causal": False}, {"causal": False, "window": (1, 2)}, {"alibi": True},
        {"softcap": 5.0}, {"sinks": True}, {"cross": True}, {"cross": True, "causal": False},
    ]  # fmt: skip
    for trial, option in enumerate(options * 2):
        lengths_q = [rng.randrange(0 if trial % 5 == 4 else 1, 7) for _ in range(rng.randrange(1, 5))]
        lengths_k = [n + rng.randrange(0, 3) for n in lengths_q] if option.get("cross") else lengths_q
        cu_q = torch.tensor(
            [0, *itertools.accumulate(lengths_q)], dtype=torch.int32
        )  # empty segments allowed
        cu_k = (
            torch.tensor([0, *itertools.accumulate(lengths_k)], dtype=torch.int32)
            if option.get("cross")
            else cu_q
        )
        hq, hkv = (4, 2) if trial % 3 == 0 else (2, 2)
        tq, tk = sum(lengths_q) + trial % 2, sum(lengths_k) + trial % 2  # a padding tail now and then
        q, k, v = torch.randn(tq, hq, 8), torch.randn(tk, hkv, 8), torch.randn(tk, hkv, 8)
        yield dict(
            q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_(), cu_q=cu_q, cu_k=cu_k,
            max_q=max(max(lengths_q), 1), max_k=max(max(lengths_k), 1), causal=option.get("causal", True),
            scale=8**-0.5, window=option.get("window", (-1, -1)), softcap=option.get("softcap", 0.0),
            dropout_p=0.0, alibi_slopes=torch.rand(hq) if option.get("alibi") else None,
            s_aux=torch.randn(hq) if option.get("sinks") else None,
        )  # fmt: skip


def test_sdpa_padded_backend_equals_the_old_copy():
    for fields in _sdpa_calls():
        call = _Call(**fields)
        got, want = _run_sdpa_padded(call), _old_run_sdpa_padded(call)
        assert _same(got, want)
        weights = torch.randn_like(want)
        inputs = (call.q, call.k, call.v)
        grads_got = torch.autograd.grad((got * weights).sum(), inputs)
        grads_want = torch.autograd.grad((want * weights).sum(), inputs)
        assert all(_same(a, b) for a, b in zip(grads_got, grads_want, strict=True))


def test_a_wrong_layout_is_caught():
    """Negative control: the comparisons above fail on a layout with two slots swapped."""
    for batch in _preference_batches():
        index = batch["packed_index"].clone()
        real = torch.nonzero(index < batch["input_ids"].numel()).reshape(-1)
        if real.numel() < 2:
            continue
        index[real[0]], index[real[1]] = index[real[1]].clone(), index[real[0]].clone()
        labels = torch.arange(batch["input_ids"].numel()).reshape(batch["input_ids"].shape)
        assert not _same(
            pack_padded_labels(labels, index), _old_pack_padded_labels(labels, batch["packed_index"])
        )
        return
    raise AssertionError("no batch with two real tokens")
