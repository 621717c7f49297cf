"""``accelerate launch`` with sequence parallelism from its own configuration: an accelerate config file whose
``parallelism_config`` block says ``sp_size: 2``, 2 CPU processes (the torchrun-based launcher, gloo with
``use_cpu=True``), ``packing_hf.Trainer`` given no ``sp_size`` (``_accelerate_launch_worker.py``).

The run is laid out as one replica of an SP group of 2 (``ddp, 2 processes (dp 1 x sp 2)``); both processes train
every sample once in the epoch, on the same packed row at every step (the row cut over the two); every logged
loss equals the same Trainer's on one process (which is what ``torchrun`` with ``sp_size=2`` in the arguments gives:
``test_sequence_parallel_multiprocess.py``). The launcher's command line, read by packing_hf from the parent
process, is the one the test ran: what the refusals of ``packing_hf/integrations/launcher.py`` check against
(those are tested in ``tests/integration/integrations/test_launcher.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_accelerate_launch_worker.py")
LAUNCH_TIMEOUT_S = 240

pytestmark = pytest.mark.distributed


def test_accelerate_launch_config_file_sets_sequence_parallelism(tmp_path, launch, free_port, load_worker):
    worker = load_worker(WORKER)
    config = tmp_path / "accelerate_sp2.yaml"
    config.write_text(worker.ACCELERATE_CONFIG)
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    launch([*command, str(WORKER), str(out)], LAUNCH_TIMEOUT_S, "accelerate launch of 2 processes, sp 2")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]

    for rank in ranks:
        # the size came from the launcher: its config file's block, through the environment
        assert rank["environment"]["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
        assert rank["environment"]["PARALLELISM_CONFIG_SP_SIZE"] == "2"
        assert rank["plan"] == "ddp, 2 processes (dp 1 x sp 2)"
        assert rank["launcher"][:2] == ["--config_file", str(config)]
    # one SP group: both processes hold the same row at every step, every sample once in the epoch
    assert ranks[0]["seen"] == ranks[1]["seen"] and len(ranks[0]["seen"]) > 1
    assert sorted(i for step in ranks[0]["seen"] for i in step) == list(range(worker.NUM_SAMPLES))

    alone = worker.train(str(tmp_path / "alone"))
    assert alone["plan"] == "none, 1 process"
    assert alone["seen"] == ranks[0]["seen"]  # the one-process plan: the same rows
    for rank in ranks:
        assert rank["losses"] == pytest.approx(alone["losses"], rel=1e-5)
