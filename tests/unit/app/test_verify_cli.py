"""``packing-hf verify``: exit codes and output on tiny architectures and on a saved model."""

from __future__ import annotations

import pytest

from packing_hf.app.verify import verify_main
from packing_hf.architectures import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cli_exit_codes(capsys):
    assert (
        verify_main(["--model-type", "opt", "--attn-implementation", "eager", "--stock", "--no-grads"]) == 1
    )
    assert "LEAK" in capsys.readouterr().out
    assert verify_main(["--model-type", "opt", "--attn-implementation", "eager", "--no-grads"]) == 0
    assert "exact" in capsys.readouterr().out
    assert verify_main(["--model-type", "deepseek_v32", "--no-grads"]) == 1  # refused by the registry
    assert "refused: deepseek_v32" in capsys.readouterr().out
    assert verify_main(["--model-type", "bloom", "--attn-implementation", "sdpa"]) == 2
    assert verify_main(["--model-type", "llama", "--lengths", "3,x"]) == 2


def test_cli_on_a_saved_model(tmp_path, capsys):
    build_tiny_model("llama", "eager").save_pretrained(tmp_path)
    assert verify_main(["--model", str(tmp_path), "--no-grads", "--json"]) == 0
    assert '"leaked": false' in capsys.readouterr().out


def test_every_phase_announces_itself_on_stderr_and_stdout_stays_the_result(tmp_path, capsys):
    build_tiny_model("llama", "eager").save_pretrained(tmp_path)
    assert verify_main(["--model", str(tmp_path), "--no-grads", "--json"]) == 0
    captured = capsys.readouterr()
    phases = [f"loading {tmp_path}", "preparing the model for packing", "checking samples of 7, 12, 5 tokens"]
    positions = [captured.err.find(phase) for phase in phases]
    assert -1 not in positions and positions == sorted(positions), captured.err
    assert captured.out.lstrip().startswith("{")  # --json: nothing but the report on stdout


def test_cli_on_a_multimodal_wrapper(capsys):
    # Qwen2-VL's wrapper class: stock sdpa leaks (mRoPE positions, mask built without them); prepared, exact
    assert (
        verify_main(["--model-type", "qwen2_vl", "--attn-implementation", "sdpa", "--stock", "--no-grads"])
        == 1
    )
    assert "LEAK" in capsys.readouterr().out
    assert verify_main(["--model-type", "qwen2_vl", "--attn-implementation", "sdpa"]) == 0
    assert "exact" in capsys.readouterr().out
    assert verify_main(["--model-type", "paligemma", "--no-grads"]) == 1  # bidirectional language model
    assert (
        "refused: paligemma (language model gemma): its attention is bidirectional" in capsys.readouterr().out
    )
