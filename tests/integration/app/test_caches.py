"""The first minutes: what a second run does not do again (the GGUF conversion, `train --help`'s imports)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from packing_hf.app import cli, modeling, train
from packing_hf.app.config import load_train_config
from packing_hf.app.records import read_records
from packing_hf.architectures.tiny import build_tiny_model


def test_a_gguf_file_is_converted_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKING_HF_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "package"
    folder.mkdir()
    gguf = folder / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in: the cache key is the file's content")
    conversions = []

    class Auto:  # transformers' GGUF reader on a real tiny model; cached folders load as usual
        @staticmethod
        def from_pretrained(path, gguf_file=None, **kwargs):
            if gguf_file is None:
                return AutoModelForCausalLM.from_pretrained(path, **kwargs)
            conversions.append(gguf_file)
            return build_tiny_model("llama")

    first = modeling._load_gguf(Auto, str(folder), "model.gguf", "causal", {"dtype": torch.float32})
    second = modeling._load_gguf(Auto, str(folder), "model.gguf", "causal", {"dtype": torch.float32})
    assert conversions == ["model.gguf"]  # the second run loaded the cached conversion
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    gguf.write_bytes(b"another file under the same name")  # new content: converted again
    modeling._load_gguf(Auto, str(folder), "model.gguf", "causal", {"dtype": torch.float32})
    assert conversions == ["model.gguf", "model.gguf"]


def test_train_help_is_rendered_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PACKING_HF_CACHE", str(tmp_path))
    assert cli.main(["train", "--help"]) == 0
    first = capsys.readouterr().out
    cached = list(tmp_path.glob("train_help-*.txt"))
    assert len(cached) == 1 and cached[0].read_text() + "\n" == first
    monkeypatch.setattr(cli, "_train_help", lambda every=False: "rendered again")
    assert cli.main(["train", "--help"]) == 0
    assert capsys.readouterr().out == first  # from the cache
    assert "~20%%" not in first and "trainer (default 'trainer')" in first and "peft (default None)" in first


def test_the_tokenized_dataset_is_reused_for_the_same_records_tokenizer_and_settings(
    tmp_path, monkeypatch, tokenizer
):
    monkeypatch.setenv("PACKING_HF_CACHE", str(tmp_path))
    cfg = load_train_config({"model_type": "llama", "max_length": 1024})
    records = read_records("embedded", limit=6)
    said: list[str] = []
    first = train._prepare(cfg, records, tokenizer, "Tokenizing", said.append)
    assert not said
    second = train._prepare(cfg, records, tokenizer, "Tokenizing", said.append)
    assert len(said) == 1 and "loaded from the tokenized-dataset cache" in said[0]
    assert second.dataset["input_ids"] == first.dataset["input_ids"]
    assert second.dataset["labels"] == first.dataset["labels"]
    assert (second.prompt_format, second.num_truncated) == (first.prompt_format, first.num_truncated)
    # other settings or other records: tokenized again, never a stale reuse
    cfg.data.completion_only_loss = False
    third = train._prepare(cfg, records, tokenizer, "Tokenizing", said.append)
    assert len(said) == 1 and third.dataset["labels"] != first.dataset["labels"]
    train._prepare(cfg, read_records("embedded", limit=5), tokenizer, "Tokenizing", said.append)
    assert len(said) == 1
