"""check_architecture (cached, refuses with the reason) and the sweep behind the architecture table."""

from __future__ import annotations

import pytest

from packing_hf.app.verify import format_table
from packing_hf.architectures.sweep import check_architecture, clear_architecture_cache, sweep_architecture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_check_architecture_is_cached_and_refuses_with_the_reason():
    clear_architecture_cache()
    first = check_architecture("qwen2", "eager")
    assert check_architecture("qwen2", "eager") is first and not first.leaked
    refused = check_architecture("deepseek_v32", "eager")
    assert refused.leaked and "deepseek_v32: the DSA indexer" in refused.error
    assert not check_architecture("jamba", "eager").leaked  # prepared: its Mamba layers run per sample
    assert check_architecture("opt", "eager", prepare=False).leaked
    assert not check_architecture("opt", "eager").leaked


def test_the_table_is_built_from_sweep_results():
    table = format_table(sweep_architecture("opt", ["eager"], gradients=False))
    header, rule, row = table.splitlines()
    assert header.startswith("| architecture | status | eager |")
    assert row.startswith("| opt | mask | leaks (") and "→ **exact**" in row
