"""Streaming packing: coverage, fill on real lengths, random composition, bounded memory, exact resume,
reader (JSON Lines / Parquet / datasets, sharding, skipping) and bad input named by its position."""

from __future__ import annotations

import json
from itertools import chain, islice

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf import PaddingFreeCollator, _binpack
from packing_hf.streaming import PackedStream, StreamPacker, TokenizedStream, read_stream


def samples(lengths, start_id: int = 1) -> list[dict]:
    """One sample per length; ``idx`` identifies it, ``input_ids`` are ``idx`` repeated (any ids do)."""
    return [{"input_ids": [start_id + i] * int(n), "idx": i} for i, n in enumerate(lengths)]


def ids(batches) -> list[list[int]]:
    return [[s["idx"] for s in b] for b in batches]


def tokens(batch, column: str = "input_ids") -> int:
    return sum(len(s[column]) for s in batch)


@pytest.fixture(scope="module")
def gsm8k_lengths(tokenizer, gsm8k_rows) -> np.ndarray:
    """Token lengths of all 7,473 GSM8K train rows (question + answer + EOS, SmolLM2 tokenizer)."""
    rows = gsm8k_rows(10_000)
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}{tokenizer.eos_token}" for r in rows]
    return np.array([len(x) for x in tokenizer(texts)["input_ids"]], dtype=np.int64)


def run_lengths(lengths, budget, **kwargs) -> list[list[int]]:
    """Pack lengths through StreamPacker; batches as lists of lengths."""
    packer = StreamPacker(budget, **kwargs)
    out = []
    for n in lengths.tolist():
        packer.push({"input_ids": range(n)})
        out += [[len(s["input_ids"]) for s in b] for b in packer.drain()]
    packer.finish()
    return out + [[len(s["input_ids"]) for s in b] for b in packer.drain()], packer


# ---- coverage, budget, fill, composition, memory -------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=120),
    budget=st.integers(30, 90),
    buffer_size=st.integers(1, 40),
    open_batches=st.integers(1, 6),
    seed=st.integers(0, 2**31),
)
def test_every_sample_exactly_once_within_budget(lengths, budget, buffer_size, open_batches, seed):
    stream = PackedStream(
        samples(lengths), budget, buffer_size=buffer_size, open_batches=open_batches, seed=seed
    )
    for _ in range(2):  # two passes: each complete on its own
        batches = list(stream)
        assert sorted(i for b in ids(batches) for i in b) == list(range(len(lengths)))
        assert all(0 < tokens(b) <= budget for b in batches)
    assert stream.epoch == 2


def test_passes_differ_and_repeat_with_the_seed():
    data = samples(np.random.default_rng(0).integers(1, 40, 300))
    first = PackedStream(data, 100, buffer_size=64, seed=3)
    again = PackedStream(data, 100, buffer_size=64, seed=3)
    pass0, pass1 = ids(first), ids(first)
    assert pass0 != pass1  # each pass draws anew
    assert ids(again) == pass0 and ids(again) == pass1


def test_fill_on_gsm8k_at_4096(gsm8k_lengths):
    budget = 4096
    batches, packer = run_lengths(gsm8k_lengths, budget, buffer_size=2048, open_batches=32, seed=0)
    fill = packer.stats()["fill"]
    assert fill >= 0.98, fill
    assert sorted(n for b in batches for n in b) == sorted(gsm8k_lengths.tolist())
    # the tail is packed as tightly as the offline packer would: within 1% (+1) of the L2 lower bound
    bound = _binpack.lower_bound_l2(gsm8k_lengths, budget)
    assert len(batches) <= bound * 1.01 + 1, (len(batches), bound)
    assert len(batches) < _binpack.pack_next_fit(gsm8k_lengths, budget).num_bins


def test_batch_composition_is_random(gsm8k_lengths):
    """The spread of batch mean lengths is that of random batches, not of a length-sorted packing."""
    budget = 4096
    lengths = gsm8k_lengths

    def spread(batches) -> float:
        return float(np.std([np.mean(b) for b in batches]))

    ours, random = [], []
    for seed in range(3):
        batches, _ = run_lengths(lengths, budget, buffer_size=2048, open_batches=32, seed=seed)
        ours.append(spread(batches))
        order = lengths[np.random.default_rng(seed).permutation(lengths.size)]
        random.append(spread([order[b] for b in _binpack.pack_next_fit(order, budget).bins()]))
    sorted_packing = _binpack.pack_best_fit_decreasing(lengths, budget)
    sorted_spread = spread([lengths[b] for b in sorted_packing.bins()])
    assert np.mean(ours) <= 1.2 * np.mean(random), (ours, random)
    assert sorted_spread > 3 * np.mean(random)  # the measure does tell sorted batches apart


def test_memory_is_bounded_by_the_buffer_not_the_stream():
    budget, buffer_size, open_batches = 64, 100, 4

    def peak(n: int) -> int:
        lengths = np.random.default_rng(1).integers(1, 20, n)
        stream = PackedStream(
            lambda: ({"input_ids": [1] * int(k)} for k in lengths),
            budget,
            buffer_size=buffer_size,
            open_batches=open_batches,
        )
        count = sum(len(b) for b in stream)
        assert count == n
        return stream.stats()["peak_buffered_samples"]

    small, large = peak(2_000), peak(40_000)
    # the buffer plus open batches (at most `budget` one-token samples each): independent of n
    assert large <= buffer_size + open_batches * budget
    assert large <= small + open_batches * budget // 2


# ---- resume ---------------------------------------------------------------------------------------


def _flat(stream: PackedStream, passes: int):
    """The batches of several passes, as a training loop over epochs sees them."""
    return chain.from_iterable(iter(stream) for _ in range(passes))


@pytest.mark.parametrize("lag", [0, 3])
def test_resume_is_exact_at_every_kind_of_cut(lag):
    data = samples(np.random.default_rng(5).integers(1, 50, 400))
    kwargs = dict(max_tokens_per_batch=120, buffer_size=50, open_batches=4, seed=11, history=8)
    full = ids(_flat(PackedStream(data, **kwargs), 2))
    per_pass = len(full) // 2
    cuts = [0, 1, 17, per_pass - 1, per_pass, per_pass + 2, 2 * per_pass - 1]
    for cut in cuts:
        first = PackedStream(data, **kwargs)
        loop = _flat(first, 2)
        fetched = list(islice(loop, min(cut + lag, len(full))))  # the loader ran ahead of the training loop
        state = json.loads(json.dumps(first.state_dict(batches_consumed=cut)))
        resumed = PackedStream(data, **kwargs)
        resumed.load_state_dict(state)
        passes_left = 2 - state["epoch"]
        rest = ids(_flat(resumed, passes_left))
        assert ids(fetched[:cut]) + rest == full, f"cut {cut}, lag {lag}"


def test_resume_from_files_skips_without_retokenizing(tmp_path, tokenizer, gsm8k_rows):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({**r, "idx": i}) + "\n" for i, r in enumerate(gsm8k_rows(120))))
    calls = []

    def tokenize(records):
        calls.append(len(records))
        return tokenizer([r["question"] + r["answer"] for r in records])

    def make():
        source = read_stream(path, tokenize=tokenize, batch_size=16, keep_columns=["idx"])
        return PackedStream(source, 1024, buffer_size=20, open_batches=4, seed=2)

    full = ids(make())
    first = make()
    it = iter(first)
    head = ids(islice(it, 5))
    state = first.state_dict()
    calls.clear()
    resumed = make()
    resumed.load_state_dict(state)
    assert head + ids(resumed) == full
    # only the records not read before the cut were tokenized again
    assert sum(calls) == 120 - state["records"]


def test_state_of_another_configuration_is_refused():
    data = samples([3, 4, 5])
    state = PackedStream(data, 10).state_dict()
    with pytest.raises(ValueError, match="max_tokens_per_batch: saved 10, now 12"):
        PackedStream(data, 12).load_state_dict(state)
    with pytest.raises(ValueError, match="source: saved"):
        PackedStream(samples([3, 4]), 10).load_state_dict(state)
    stream = PackedStream(samples([6, 6, 6]), 10, history=2)
    assert len(list(stream)) == 3
    with pytest.raises(ValueError, match="can go back 2"):
        stream.state_dict(batches_consumed=0)


# ---- overflow and bad input -----------------------------------------------------------------------


def test_overflow_policies_are_counted_and_keep_tokens():
    lengths = [5, 23, 7, 10]
    for policy, kept in (("truncate", 5 + 10 + 7 + 10), ("split", 45), ("drop", 22)):
        stream = PackedStream(samples(lengths), 10, overflow=policy, buffer_size=2)
        batches = list(stream)
        stats = stream.stats()
        assert sum(tokens(b) for b in batches) == stats["tokens"] == kept
        assert all(tokens(b) <= 10 for b in batches)
        assert {
            "truncate": stats["truncated_tokens"],
            "split": stats["split_pieces"],
            "drop": stats["overflow_dropped_samples"],
        }[policy] == {"truncate": 13, "split": 3, "drop": 1}[policy]


def test_an_unknown_overflow_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="'skip' is not an overflow policy"):
        StreamPacker(10, overflow="skip")
    with pytest.raises(ValueError, match="'pad' is not an overflow policy"):
        StreamPacker(10, overflow="pad")


def test_labels_and_masks_are_cut_with_the_ids():
    sample = {
        "input_ids": list(range(1, 8)),
        "labels": list(range(11, 18)),
        "completion_mask": [1] * 7,
        "tag": "x",
    }
    batches = list(PackedStream([sample], 3, overflow="split"))
    pieces = sorted((s for b in batches for s in b), key=lambda s: s["input_ids"][0])
    assert [p["labels"] for p in pieces] == [[11, 12, 13], [14, 15, 16], [17]]
    assert all(p["tag"] == "x" and len(p["completion_mask"]) == len(p["input_ids"]) for p in pieces)


def test_bad_records_are_named_by_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"input_ids": [1, 2, 3]})
    path.write_text(f"{good}\n{good}\n{{not json\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:3: malformed JSON"):
        list(PackedStream(str(path), 10))
    path.write_text(f"{good}\n\n{json.dumps({'input_ids': [1] * 20})}\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:3: sample 1 has 20 tokens > max_tokens_per_batch=10"):
        list(PackedStream(str(path), 10))
    path.write_text(f"{good}\n{json.dumps({'input_ids': []})}\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:2: sample 1: 'input_ids' is empty"):
        list(PackedStream(str(path), 10))
    path.write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:2: expected a JSON object"):
        list(PackedStream(str(path), 10))
    with pytest.raises(ValueError, match=r"sample 1: sample 1 has no 'input_ids'"):
        list(PackedStream([{"input_ids": [1]}, {"text": "a"}], 10))


def test_tokenized_records_are_named_not_the_end_of_their_tokenizer_batch(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    lines = [{"text": "hello world"}, {"text": "a b c"}, {"text": ""}, {"text": "more"}, {"text": "end"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    source = read_stream(path, tokenizer, batch_size=4)
    with pytest.raises(ValueError, match=r"d\.jsonl:3: sample 2: 'input_ids' is empty"):
        list(PackedStream(source, 64))
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "hello"}) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2: no 'text' field.*set text_column"):
        list(read_stream(path, tokenizer))


def test_one_shot_iterators_workers_and_missing_process_group_are_refused(monkeypatch):
    with pytest.raises(TypeError, match="one-shot iterator"):
        PackedStream(iter(samples([1, 2])), 10)
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        list(PackedStream(samples([1, 2]), 10, num_replicas=2, rank=0))
    # inside a DataLoader worker (get_worker_info() is set there; faked to spare a worker process)
    from packing_hf.streaming import stream as stream_module

    monkeypatch.setattr(stream_module, "get_worker_info", lambda: object())
    with pytest.raises(RuntimeError, match="num_workers=0"):
        list(PackedStream(samples([1, 2]), 10))


def test_dataloader_with_the_collator():
    data = samples([3, 5, 2, 7, 4, 6])
    loader = torch.utils.data.DataLoader(
        PackedStream(data, 12, seed=1), batch_size=None, collate_fn=PaddingFreeCollator(drop_keys=("idx",))
    )
    batches = list(loader)
    assert sum(b["input_ids"].shape[1] for b in batches) == 27
    for b in batches:
        assert b["input_ids"].shape[1] <= 12 and b["cu_seq_lens_q"].dtype == torch.int32


# ---- reader ---------------------------------------------------------------------------------------


def test_reader_tokenizes_jsonl_and_parquet_like_the_tokenizer(tmp_path, tokenizer, gsm8k_rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = gsm8k_rows(40)
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows[:25]))
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(rows[25:]), parquet, row_group_size=4)

    def fmt(r):
        return f"Question: {r['question']}\nAnswer: {r['answer']}{tokenizer.eos_token}"

    expected = tokenizer([fmt(r) for r in rows])["input_ids"]
    stream = read_stream([jsonl, parquet], tokenizer, formatting_func=fmt, batch_size=7)
    got = [s["input_ids"] for s in stream]
    assert got == expected
    assert stream.where().endswith("b.parquet: row 15")  # rows counted from 1, as lines
    # two ranks: disjoint, together everything; any start skips exactly that many of the shard's records
    for n in (2, 3):
        shards = [[s["input_ids"] for s in stream.shard(n, r).iterate()] for r in range(n)]
        assert [shards[k % n][k // n] for k in range(40)] == expected
        for start in (0, 5, 9):
            assert [s["input_ids"] for s in stream.shard(n, 1).iterate(start)] == shards[1][start:]


def test_reader_shards_a_datasets_iterable_dataset():
    import datasets

    data = datasets.Dataset.from_list(samples(range(1, 31))).to_iterable_dataset(num_shards=3)
    seen = []
    for rank in range(2):
        stream = PackedStream(data, 40, num_replicas=1, rank=0)
        stream.source = TokenizedStream(data).shard(2, rank)  # what rank r of 2 reads
        seen.append([s["idx"] for b in stream for s in b])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(30))
    resumed = [s["idx"] for s in TokenizedStream(data).shard(2, 1).iterate(start=4)]
    assert resumed == [s["idx"] for s in TokenizedStream(data).shard(2, 1).iterate()][4:]


def _jsonl(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"input_ids": t}) + "\n" for t in texts))
    return path


def test_resuming_on_other_data_is_refused_for_every_kind_of_source(tmp_path):
    """Same sizes and lengths, other tokens: the fingerprint tells them apart (it named only file sizes, list
    lengths and ``datasets.IterableDataset(json, shards=1)`` before)."""
    import datasets

    one = _jsonl(tmp_path / "a" / "train.jsonl", [[1, 2, 3], [4, 5]])
    other = _jsonl(tmp_path / "b" / "train.jsonl", [[7, 2, 3], [4, 5]])
    assert one.stat().st_size == other.stat().st_size

    def streamed(path):
        return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)

    for make_a, make_b in [
        (lambda: str(one), lambda: str(other)),  # files: same name and size
        (lambda: streamed(one), lambda: streamed(other)),  # datasets streams of JSON files
        (lambda: samples([3, 2]), lambda: samples([3, 2], start_id=9)),  # lists of the same length
    ]:
        state = PackedStream(make_a(), 8).state_dict()
        PackedStream(make_a(), 8).load_state_dict(state)  # the same data resumes
        with pytest.raises(ValueError, match="source: saved"):
            PackedStream(make_b(), 8).load_state_dict(state)
