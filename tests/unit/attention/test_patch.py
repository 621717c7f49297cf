"""patch/unpatch of _flash_attention_forward restores exactly; importing packing_hf changes nothing."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import types

import pytest
import transformers.integrations.flash_attention as fa_integration
import transformers.modeling_flash_attention_utils as fa_utils

from packing_hf.attention import (
    flash_attention_patched,
    patch_flash_attention,
    unpatch_flash_attention,
)
from packing_hf.attention.patch import flash_attention_patched_now

ORIGINAL = fa_utils._flash_attention_forward


@pytest.fixture(autouse=True)
def _always_unpatched():
    unpatch_flash_attention()
    yield
    unpatch_flash_attention()
    assert fa_utils._flash_attention_forward is ORIGINAL


def holders(obj) -> list[str]:
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if module is not None and getattr(module, "__dict__", {}).get("_flash_attention_forward") is obj
    )


def test_patch_replaces_every_by_name_copy_and_unpatch_restores_the_same_object():
    before = holders(ORIGINAL)
    assert "transformers.integrations.flash_attention" in before
    patch_flash_attention()
    assert fa_utils._flash_attention_forward is not ORIGINAL
    assert fa_integration._flash_attention_forward is fa_utils._flash_attention_forward
    assert holders(ORIGINAL) == []
    assert holders(fa_utils._flash_attention_forward) == before
    unpatch_flash_attention()
    assert fa_utils._flash_attention_forward is ORIGINAL
    assert fa_integration._flash_attention_forward is ORIGINAL
    assert holders(ORIGINAL) == before


def test_second_patch_and_second_unpatch_are_no_ops():
    patch_flash_attention()
    patched = fa_utils._flash_attention_forward
    patch_flash_attention()
    assert fa_utils._flash_attention_forward is patched
    unpatch_flash_attention()
    unpatch_flash_attention()
    assert fa_utils._flash_attention_forward is ORIGINAL


def test_module_imported_while_patched_is_restored(monkeypatch):
    patch_flash_attention()
    late = types.ModuleType("transformers.models.late_import_for_test")
    late._flash_attention_forward = fa_utils._flash_attention_forward  # what `from ... import` would bind now
    monkeypatch.setitem(sys.modules, late.__name__, late)
    unpatch_flash_attention()
    assert late._flash_attention_forward is ORIGINAL


def test_context_manager_restores_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with flash_attention_patched():
            assert flash_attention_patched_now()
            raise RuntimeError("boom")
    assert not flash_attention_patched_now()
    assert fa_utils._flash_attention_forward is ORIGINAL


def test_context_manager_inside_an_active_patch_keeps_it():
    patch_flash_attention()
    patched = fa_utils._flash_attention_forward
    with flash_attention_patched(backend="reference"):
        pass
    assert fa_utils._flash_attention_forward is patched


def test_unknown_backend_is_refused_without_patching():
    with pytest.raises(ValueError, match="unknown attention backend"):
        patch_flash_attention(backend="nope")
    assert fa_utils._flash_attention_forward is ORIGINAL


def test_importing_packing_hf_patches_nothing_and_reading_the_name_only_registers_it():
    """In a fresh interpreter: snapshot transformers' objects, import packing_hf (all names), compare. Reading
    ATTENTION_NAME adds exactly that key to the two registries (what makes attn_implementation=... work);
    nothing is replaced."""
    script = textwrap.dedent(
        """
        import sys
        import transformers.integrations.flash_attention as fai
        import transformers.modeling_flash_attention_utils as fau
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        def snapshot():
            return (
                fau._flash_attention_forward,
                fai._flash_attention_forward,
                dict(AttentionInterface._global_mapping),
                dict(AttentionMaskInterface._global_mapping),
            )

        before = snapshot()
        import packing_hf
        import packing_hf.attention
        names = [n for n in dir(packing_hf.attention) if n in ("varlen_attention", "register_attention",
                 "patch_flash_attention", "flash_attention_patched", "select_backend")]
        for name in names:  # the top level names the first two, packing_hf.attention all five
            getattr(packing_hf if name in packing_hf.__all__ else packing_hf.attention, name)
        middle = snapshot()
        assert before[0] is middle[0] and before[1] is middle[1], "flash forward replaced at import"
        assert before[2] == middle[2], "AttentionInterface changed at import"
        assert before[3] == middle[3], "AttentionMaskInterface changed at import"
        name = packing_hf.ATTENTION_NAME
        after = snapshot()
        assert before[0] is after[0] and before[1] is after[1], "flash forward replaced"
        for registry_before, registry_after in ((before[2], after[2]), (before[3], after[3])):
            assert set(registry_after) - set(registry_before) == {name}
            assert all(registry_after[k] is v for k, v in registry_before.items()), "an entry was replaced"
        # and the name works right away
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=packing_hf.ATTENTION_NAME)
        print(model.config._attn_implementation, len(names))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "packing_hf_varlen 5"


def test_patched_function_accepts_every_argument_of_the_original():
    from packing_hf.attention.patch import _patched_flash_attention_forward

    original = inspect.signature(ORIGINAL).parameters
    patched = inspect.signature(_patched_flash_attention_forward).parameters
    assert list(patched) == list(original)
    for name, param in original.items():
        assert patched[name].default == param.default, name
