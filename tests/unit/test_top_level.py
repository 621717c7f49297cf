"""The top level of packing_hf: names that moved out of it in earlier versions still answer, for one release,
with a FutureWarning that names their new module (the list is every name an earlier ``packing_hf/__init__.py``
exported and today's does not)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import packing_hf

# every name an earlier top level exported (git history of packing_hf/__init__.py), and where it lives now
MOVED = {
    "lengths_to_cu_seqlens": "packing_hf.varlen",
    "cu_seqlens_to_lengths": "packing_hf.varlen",
    "lengths_to_position_ids": "packing_hf.varlen",
    "lengths_to_seq_idx": "packing_hf.varlen",
    "cu_seqlens_to_position_ids": "packing_hf.varlen",
    "cu_seqlens_to_seq_idx": "packing_hf.varlen",
    "position_ids_to_cu_seqlens": "packing_hf.varlen",
    "seq_lengths_to_cu_seqlens": "packing_hf.varlen",
    "max_length_from_cu_seqlens": "packing_hf.varlen",
    "shared_prefix_position_ids": "packing_hf.shared_prefix",
    "shared_prefix_plan": "packing_hf.shared_prefix",
    "check_prefix_seq_idx": "packing_hf.shared_prefix",
    "pack_sequences": "packing_hf.fixed",
    "concatenate_and_pack": "packing_hf.fixed",
    "pack_rollouts": "packing_hf.rollouts",
    "unpack_rollouts": "packing_hf.rollouts",
    "available_backends": "packing_hf.attention",
    "select_backend": "packing_hf.attention",
    "patch_flash_attention": "packing_hf.attention",
    "unpatch_flash_attention": "packing_hf.attention",
    "flash_attention_patched": "packing_hf.attention",
    "shared_prefix_attention": "packing_hf.attention",
    "shard_packed_batch": "packing_hf.attention.sequence_parallel",
    "sequence_parallel_loss": "packing_hf.shard_loss",
    "sequence_parallel_groups": "packing_hf.attention.sequence_parallel",
    "shard_loss_counts": "packing_hf.shard_loss",
    "check_sequence_parallel_model": "packing_hf.attention.sequence_parallel",
    "PackingPreparation": "packing_hf.architectures",
    "tiny_config": "packing_hf.architectures",
}


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_forwards_to_its_new_module_with_a_warning_naming_it(name, monkeypatch):
    home = MOVED[name]
    monkeypatch.setattr(packing_hf, "_TOLD", set())  # as in a fresh process
    with pytest.warns(FutureWarning) as caught:
        value = getattr(packing_hf, name)
    assert value is getattr(importlib.import_module(home), name)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"packing_hf.{name} moved to {home}" in message and f"from {home} import {name}" in message
    assert caught[0].filename == __file__  # the warning points at the line that read the old name
    assert name not in packing_hf.__all__ and name not in dir(packing_hf)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert getattr(packing_hf, name) is value  # told once per process


def test_the_moved_list_is_the_package_s_and_current_names_do_not_warn():
    assert {name: f"packing_hf.{module}" for name, module in packing_hf._MOVED.items()} == MOVED
    assert not set(MOVED) & set(packing_hf.__all__)  # a current name is never forwarded
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert packing_hf.PaddingFreeCollator.__module__ == "packing_hf.collator"
    with pytest.raises(AttributeError, match="has no attribute 'pack_sequence'"):
        packing_hf.pack_sequence  # noqa: B018 (a typo is not a moved name)


def test_from_import_of_moved_names_works_and_warns_once_each():
    """`from packing_hf import x` (where an AttributeError would become a bare "cannot import name"), in a fresh
    interpreter: the old import keeps working and says where to import from, once."""
    code = "from packing_hf import pack_sequences, tiny_config\nprint(pack_sequences.__module__, tiny_config.__module__)"
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["packing_hf.fixed", "packing_hf.architectures.tiny"]
    assert done.stderr.count("FutureWarning") == 2, done.stderr
    assert "from packing_hf.fixed import pack_sequences" in done.stderr
