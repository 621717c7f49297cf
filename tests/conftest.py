"""Shared fixtures: real data and tokenizer from ../shared/data, tiny from_config models."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# packing_hf's caches (GGUF conversions, tokenized datasets, help text) go to a folder of this run, not ~/.cache
os.environ.setdefault("PACKING_HF_CACHE", tempfile.mkdtemp(prefix="packing_hf_cache_"))

# Property tests draw the same examples on every run (CI must not pass or fail by chance); set
# HYPOTHESIS_PROFILE=explore to draw new ones while developing.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist every worker gets one core; more threads per worker would only fight.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
# Resolved by the root conftest.py (../shared/data, or the workplace location for clones elsewhere).
DATA_DIR = Path(os.environ.get("PACKING_HF_DATA", ROOT.parent / "shared" / "data"))
TOKENIZER_DIR = DATA_DIR / "smollm2_tokenizer"
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not item.keywords: every test under tests/gpu/ has the keyword "gpu" (its folder), the
        # CPU halves of the GPU tests there included
        if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.fail(f"real data not found at {DATA_DIR}; set PACKING_HF_DATA to the shared data folder")
    return DATA_DIR


@pytest.fixture(scope="session")
def tokenizer(data_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def load_gsm8k(split: str = "train", limit: int | None = None) -> list[dict]:
    rows = []
    with open(DATA_DIR / f"gsm8k_{split}.jsonl") as f:
        for line in f:
            rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


@pytest.fixture(scope="session")
def gsm8k_tokenized(tokenizer) -> list[dict]:
    """The first 256 GSM8K train rows as question + answer + EOS, tokenized: [{'input_ids': [...]}, ...]."""
    rows = load_gsm8k("train", limit=256)
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}{tokenizer.eos_token}" for r in rows]
    return [{"input_ids": ids} for ids in tokenizer(texts)["input_ids"]]


def make_tiny_causal_lm(
    model_type: str = "llama", attn_implementation: str = "sdpa", seed: int = 0, **overrides
):
    """A tiny randomly initialised causal LM built from config (fp32, CPU, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(
        vocab_size=49152 if model_type == "llama" else 1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.float().eval()


@pytest.fixture(scope="session")
def tiny_causal_lm_factory():
    """``make_tiny_causal_lm`` as a fixture (test modules cannot ``import conftest`` under importlib mode)."""
    return make_tiny_causal_lm


# ---- shared by the Trainer / SFTTrainer integration tests --------------------------------------------
# Fixtures rather than importable helpers: under --import-mode=importlib test modules cannot import conftest.
# (tests/distributed/_train_worker.py runs as its own script under torchrun and keeps its own copies.)

TINY_LLAMA = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


@pytest.fixture(scope="session")
def tiny_llama(tiny_causal_lm_factory):
    """``tiny_llama(**overrides)``: a fresh tiny llama (SmolLM2 vocabulary unless ``vocab_size``), train mode."""
    return lambda **overrides: tiny_causal_lm_factory(**{**TINY_LLAMA, **overrides}).train()


@pytest.fixture(scope="session")
def gsm8k_rows(data_dir):
    """``gsm8k_rows(n, offset=0)``: GSM8K train rows ``offset .. offset + n - 1`` ({'question', 'answer'})."""
    return lambda n, offset=0: load_gsm8k("train", limit=offset + n)[offset:]


@pytest.fixture(scope="session")
def recording_collator():
    """A ``PaddingFreeCollator`` subclass (the class) that records the ``idx`` of every batch it collates and
    keeps that column through the Trainer's column removal: ``collator = recording_collator(); collator.batches``."""
    from dataclasses import dataclass, field

    from packing_hf import PaddingFreeCollator

    @dataclass
    class RecordingCollator(PaddingFreeCollator):
        batches: list = field(default_factory=list, init=False, repr=False)
        drop_keys: tuple = ("idx",)  # recorded, not collated
        input_columns = (*PaddingFreeCollator.input_columns, "idx")

        def __call__(self, features, return_tensors=None):
            self.batches.append([int(f["idx"]) for f in features])
            return super().__call__(features, return_tensors)

    return RecordingCollator


def _right_padded_batch(rows: list[list[int]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch: attention_mask 0 and labels -100 on padding, labels = input_ids elsewhere."""
    longest = max(map(len, rows))
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for r, ids in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, : len(ids)] = torch.tensor(ids)
        attention_mask[r, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@pytest.fixture(scope="session")
def right_padded_batch():
    """``right_padded_batch(rows, pad_token_id=0)``: the padded reference batch of token-id lists."""
    return _right_padded_batch


def _assert_close(got, want, what: str, *, rel: float, terms=()) -> None:
    """``got`` equals ``want`` within ``rel`` times the magnitude of what ``want`` was computed from.

    A bound relative to ``want`` alone cannot hold where large terms cancel to a small result (a loss of
    mean-zero advantages, a reward margin, a KL, rewards of a policy still equal to its reference): float32
    rounds every term to ~1e-7 of its own size, so the result carries that absolute error whatever its own
    size, and its sign is the CPU's kernels' choice. The bound is ``rel x max(|want|, |terms|)`` (maxima over
    all elements; ``terms``: the magnitudes that were summed or cancelled, e.g. the chosen and rejected rewards
    of a margin): the resolution of the computation, orders of magnitude below the change a wrong sample
    boundary makes. Without ``terms`` it is ``rel`` relative to ``want`` (log-probs, gradients as a vector);
    a ``want`` of exact zeros then needs exact zeros.
    """
    got = torch.as_tensor(got, dtype=torch.float64).detach()
    want = torch.as_tensor(want, dtype=torch.float64).detach()
    scale = max([float(want.abs().max()), *(float(torch.as_tensor(t).abs().max()) for t in terms)])
    err = float((got - want).abs().max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel} x {scale:.3g} (got {got}, want {want})"


@pytest.fixture(scope="session")
def assert_close():
    """``assert_close(got, want, what, rel=..., terms=())``: equality to the resolution of the computation,
    ``rel x max(|want|, |terms|)``; pass as ``terms`` the magnitudes a near-zero value was computed from."""
    return _assert_close


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: extra intra-op threads only add overhead and fight the other test workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
