"""GRPO/RLOO ``share_prefixes=True``: rollouts branching at several depths as one prefix-tree row per forward.

The packed log-prob method (:class:`packing_hf.integrations.rl.PackedRolloutsMixin`) on tree rows against
TRL's own unpacked ``GRPOTrainer._get_per_token_logps_and_entropies`` on the padded ``(B, P + C)`` batch,
both through TRL's fused LM head (``add_fused_lm_head``), on real tiny models (fp32): per-token log-probs,
entropies, and the gradients of a loss over them. The rollouts: two prompts of different lengths, each
with completions that share their first turns and branch at 2 to 4 depths, a duplicate completion and one
that is a strict prefix of another. Models: Llama and Gemma 3 (sliding window 4, shorter than the shared
turns). A sibling leak (a branch reading its sibling as its parent) is caught by the same comparison.
The whole trainer (one real GRPO step) is tested in ``test_rl.py``.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

trl = pytest.importorskip("trl")

from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import packing_hf  # noqa: E402
from packing_hf.architectures import tiny_config  # noqa: E402
from packing_hf.attention.admission import needs_preparation  # noqa: E402
from packing_hf.integrations.rl import PackedRolloutsMixin  # noqa: E402
from packing_hf.rollouts import RolloutPack, pack_rollouts  # noqa: E402
from packing_hf.shared_prefix import shared_prefix_position_ids  # noqa: E402

REL = 1e-5
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _branching_rollouts(vocab: int, depth: int, seed: int = 0):
    """TRL's padded batch ``(ids, mask, C)`` of two prompts, each with completions branching at ``depth`` turns:
    the full path, one rollout leaving it at every turn, a duplicate of the full path and a strict prefix."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    prompts, completions = [], []
    for prompt_length in (7, 4):
        prompt = tokens(prompt_length)
        turns = [tokens(3 + t % 2) for t in range(depth)]
        path = [tok for turn in turns for tok in turn]
        group = [path]
        for t in range(depth):  # leaves the full path after turn t - 1 (t = 0: right after the prompt)
            group.append([tok for turn in turns[:t] for tok in turn] + tokens(2))
        group += [path, path[: len(path) - len(turns[-1])]]  # a duplicate; a strict prefix
        prompts += [prompt] * len(group)
        completions += group
    p_width, c_width = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(prompts), p_width + c_width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[b, p_width - len(p) : p_width + len(c)] = torch.tensor(p + c)
        mask[b, p_width - len(p) : p_width + len(c)] = 1
    return ids, mask, c_width


def _models(model_type: str):
    """(unpacked sdpa model, packed model on packing_hf's attention), same weights, both with TRL's fused head."""
    out = []
    for attention in ("sdpa", packing_hf.register_attention()):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            tiny_config(model_type), attn_implementation=attention, dtype=torch.float32
        ).train()
        if attention != "sdpa" and needs_preparation(model.config):  # a hybrid's mixers follow the tree
            packing_hf.prepare_model_for_packing(model)
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        out.append(model)
    return out


def _packed_scorer(model, **args):
    """The state the mixin's log-prob method reads from its trainer (one rank, no autocast, no preflight)."""
    scorer = SimpleNamespace(
        model=model,
        args=SimpleNamespace(
            **{"max_tokens_per_batch": None, "share_prompt": False, "min_shared_tokens": 1, **args}
        ),
        parallel_plan=SimpleNamespace(world_size=1),
        accelerator=SimpleNamespace(autocast=nullcontext),
        packing_stats=defaultdict(int),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _prepare_for_packing=lambda model: None,
    )
    scorer._plan_packs = lambda *a: PackedRolloutsMixin._plan_packs(scorer, *a)
    return scorer


def _logps_entropies_grads(model, score):
    """``score() -> (logps, entropies)`` ``(B, C)``, and the gradient of a loss reading both (weights vary per
    token, so a value read at the wrong place changes the gradient)."""
    model.zero_grad()
    logps, entropies = score()
    weights = torch.linspace(-1.0, 1.0, logps.numel()).reshape(logps.shape)
    ((logps * weights).sum() + (entropies * weights.flip(0)).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logps.detach(), entropies.detach(), grads


def _compare(model_type: str, depth: int, max_tokens_per_batch: int | None = None) -> dict:
    """Largest relative errors of the tree rows' log-probs, entropies and gradients against TRL unpacked."""
    stock, packed = _models(model_type)
    ids, mask, c_width = _branching_rollouts(stock.config.vocab_size, depth)
    trl_self = SimpleNamespace(accelerator=SimpleNamespace(autocast=nullcontext))
    trl_method = trl.GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__  # TRL's, without its profiler
    want = _logps_entropies_grads(
        stock,
        lambda: trl_method(trl_self, stock, ids, mask, c_width, compute_entropy=True)[:2],
    )
    scorer = _packed_scorer(packed, share_prefixes=True, max_tokens_per_batch=max_tokens_per_batch)
    got = _logps_entropies_grads(
        packed,
        lambda: PackedRolloutsMixin._get_per_token_logps_and_entropies(
            scorer, packed, ids, mask, c_width, compute_entropy=True
        )[:2],
    )
    completion = mask[:, -c_width:].bool()
    errors = {}
    for name, g, w in zip(("logps", "entropy", "grads"), got, want, strict=True):
        if name != "grads":  # TRL writes zeros on padding, the packed method too (checked by the log-probs)
            g, w = (g[completion], w[completion]) if name == "entropy" else (g, w)
        errors[name] = float((g - w).abs().max()) / float(w.abs().max())
    errors["tree_token_ratio"] = scorer._metrics["train"]["tree_token_ratio"][-1]
    errors["forwards"] = scorer.packing_stats["forwards"]
    return errors


@pytest.mark.parametrize(
    "model_type, depth, budget",
    [("llama", 2, None), ("llama", 4, None), ("gemma3_text", 3, None), ("bamba", 3, None), ("llama", 3, 18)],
    ids=["llama-depth2", "llama-depth4", "gemma3-sliding-depth3", "bamba-hybrid-depth3", "llama-depth3-budget"],
)
def test_tree_rollouts_equal_trl_unpacked(model_type, depth, budget):
    errors = _compare(model_type, depth, budget)
    assert max(errors["logps"], errors["entropy"], errors["grads"]) < REL, errors
    if budget is None:
        assert errors["tree_token_ratio"] > 2.0, errors  # every group's prompt and shared turns computed once
    else:  # every tree cut into subtrees that fit the budget: less shared, same values
        assert errors["forwards"] >= 4 and errors["tree_token_ratio"] > 1.0, errors


def _sibling_leak(self: RolloutPack) -> dict:
    """Negative control: the last branch that has an earlier sibling reads that sibling as its parent."""
    inputs = ORIGINAL_MODEL_INPUTS(self)
    parents = self.prefix_seq_idx.tolist()
    leaking = max(i for i, p in enumerate(parents) if p >= 0 and parents[:i].count(p) > 0)
    parents[leaking] = max(j for j in range(leaking) if parents[j] == parents[leaking])
    wrong = torch.tensor(parents, dtype=torch.int32)
    positions = shared_prefix_position_ids(self.cu_seq_lens, wrong)[None]
    return {**inputs, "prefix_seq_idx": wrong, "position_ids": positions}


ORIGINAL_MODEL_INPUTS = RolloutPack.model_inputs


def test_a_sibling_leak_is_caught_by_the_same_comparison(monkeypatch):
    monkeypatch.setattr(RolloutPack, "model_inputs", _sibling_leak)
    errors = _compare("llama", 2)
    assert errors["logps"] > 1e-3 and errors["grads"] > 1e-3, errors


def test_tree_packs_share_every_prefix_at_every_depth():
    """The layout itself: one token per distinct prefix of the rollouts, prompts included."""
    ids, mask, c_width = _branching_rollouts(50, depth=3)
    [pack] = pack_rollouts(ids, mask, c_width, share_prefixes=True)
    distinct = {
        tuple(ids[b, mask[b].bool()][: j + 1].tolist())
        for b in range(ids.size(0))
        for j in range(int(mask[b].sum()))
    }
    assert pack.input_ids.numel() == len(distinct)
    assert max(_depths(pack.prefix_seq_idx.tolist())) == 3  # prompt+first turn, then two more branch points
    with pytest.raises(ValueError, match="pass only share_prefixes=True"):
        pack_rollouts(ids, mask, c_width, share_prompts=True, share_prefixes=True)


def _depths(parents: list[int]) -> list[int]:
    depths = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths
