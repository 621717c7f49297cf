"""Issue 40, item 3: ``peft:`` trains and saves an adapter for every trainer of ``packing-hf train``, and the
adapter reloads on its own.

Each trainer runs one step through the command line (``packing_hf.app.cli.main``) on a tiny model built from
config with a LoRA block. The trained model is captured when the job saves it; the test then checks that the
output folder holds an adapter (and no full model), that only the adapter's weights moved, and that
``AutoPeftModelFor*.from_pretrained(output_dir)`` (the base found through ``base_model_name_or_path``) gives
the trained model's logits, while the base alone does not (the negative control).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from packing_hf.app.cli import main
from packing_hf.app.config import TRAINERS, ModelArguments
from packing_hf.app.modeling import BASE_MODEL_DIR, load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
LORA = '{"r": 4, "target_modules": ["q_proj", "v_proj"]}'
INPUT_IDS = torch.tensor([[1, 17, 230, 4021, 88, 9, 512, 77]])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def overrides(data_dir: Path, out: Path, trainer: str) -> list[str]:
    """One step of ``trainer`` on a model smaller than the configs' (shared by every trainer)."""
    args = [
        f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
        "gguf_file=null",
        "gguf_package=null",
        f"model_config={json.dumps(SMALL)}",
        "num_samples=4",
        "max_steps=1",
        "learning_rate=1e-2",
        f"output_dir={out}",
        "disable_tqdm=true",
        f"peft={LORA}",
    ]
    if trainer in ("trainer", "sft"):
        args += [f"trainer={trainer}", "max_length=384", "max_tokens_per_batch=768"]
        if trainer == "trainer":
            args += ["baseline_batches=0", "eval_num_samples=1"]
    elif trainer in ("grpo", "rloo"):
        args += ["per_device_train_batch_size=2", "num_generations=2", "max_completion_length=8"]
    else:
        args += ["max_length=384", f"per_device_train_batch_size={2 if trainer == 'kto' else 1}"]
    return args


def config_of(trainer: str) -> str:
    return str(
        ROOT / "configs" / ("tiny_cpu.yaml" if trainer in ("trainer", "sft") else f"tiny_{trainer}.yaml")
    )


def base_name(name: str) -> str | None:
    """The base model's name of a ``PeftModel`` parameter; None for the adapter's own weights."""
    if "lora_" in name or "modules_to_save" in name:
        return None
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer", "").replace(".original_module", "")


@pytest.fixture
def captured(monkeypatch):
    """The model as the job saves it: its parameters and its logits on ``INPUT_IDS``."""
    import transformers

    seen: dict = {}
    save_model = transformers.Trainer.save_model

    def capture(self, output_dir=None, _internal_call=False):
        model = self.model
        was_training = model.training
        model.eval()
        with torch.no_grad():
            seen["logits"] = model(input_ids=INPUT_IDS).logits.clone()
        model.train(was_training)
        seen["parameters"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return save_model(self, output_dir, _internal_call)

    monkeypatch.setattr(transformers.Trainer, "save_model", capture)
    return seen


@pytest.mark.parametrize("trainer", TRAINERS)
def test_lora_from_the_cli_saves_an_adapter_that_reloads(trainer, data_dir, tmp_path, captured, capsys):
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification

    out = tmp_path / "out"
    status = main(["train", config_of(trainer), *overrides(data_dir, out, trainer)])
    printed = capsys.readouterr()
    assert status == 0, printed.err[-3000:] + printed.out[-3000:]

    # an adapter, no full model; its base named absolutely and saved beside it (a model built from config)
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str((out / BASE_MODEL_DIR).resolve()) and (Path(base) / "config.json").is_file()
    assert "trained (adapter)" in json.loads((out / "packing_summary.json").read_text())["model"]

    # only the adapter moved: every base weight is the model's before training
    head = "score" if trainer == "reward" else "causal"
    tokenizer = load_tokenizer(ModelArguments(tokenizer_name_or_path=str(data_dir / "smollm2_tokenizer")))
    initial = load_model(
        ModelArguments(model_type="llama", model_config=SMALL), tokenizer, seed=0, head=head
    ).state_dict()
    moved = []
    for name, value in captured["parameters"].items():
        if base_name(name) is None:
            moved.append(name)
        else:
            torch.testing.assert_close(value, initial[base_name(name)], rtol=0, atol=0, msg=name)
    assert any("lora_B" in name and captured["parameters"][name].abs().max() > 0 for name in moved)

    # the saved adapter alone reloads into the trained model; the base alone is another model
    auto = AutoPeftModelForSequenceClassification if trainer == "reward" else AutoPeftModelForCausalLM
    reloaded = auto.from_pretrained(str(out)).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=INPUT_IDS).logits
        with reloaded.disable_adapter():
            base_logits = reloaded(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(logits, captured["logits"], rtol=1e-5, atol=1e-5)
    assert (base_logits - captured["logits"]).abs().max() > 1e-4


def test_an_adapter_of_a_model_loaded_from_a_folder_names_the_folder(data_dir, tmp_path, captured):
    """A model loaded by path: the adapter names that folder (absolute), and no base weights are copied."""
    from peft import AutoPeftModelForCausalLM

    tokenizer = load_tokenizer(ModelArguments(tokenizer_name_or_path=str(data_dir / "smollm2_tokenizer")))
    folder = tmp_path / "my_model"
    load_model(ModelArguments(model_type="llama", model_config=SMALL), tokenizer, seed=0).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    args = [a for a in overrides(data_dir, out, "trainer") if not a.startswith(("model_config", "tokenizer"))]
    assert main(["train", config_of("trainer"), f"model={folder}", *args]) == 0
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(folder.resolve()) and not (out / BASE_MODEL_DIR).exists()
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=INPUT_IDS).logits, captured["logits"], rtol=1e-5, atol=1e-5
        )
