"""The loss contract on 2 and 3 processes (torchrun, gloo on CPU): the DDP-averaged gradient of one optimizer
step over the whole data set, and the logged ``loss``, equal the single-process padded reference (1e-6
relative) for every ``loss_normalization``, with and without ``loss_weights``; also on a stream, where the
ranks that run out first train on padding batches. A step without targets trains nothing (zero gradients, the
loss 0). The harness is ``_loss_worker.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_loss_worker.py")
LAUNCH_TIMEOUT_S = 240

pytestmark = pytest.mark.distributed


# single-process padded references, shared by both process counts: {(normalization, weighted): (grads, loss)}
_REFERENCES: dict = {}


@pytest.mark.parametrize("nproc", [2, 3])
def test_loss_is_the_same_on_2_and_3_processes(nproc, tmp_path, launch, torchrun_command, load_worker):
    worker = load_worker(WORKER)
    launch([*torchrun_command(nproc), str(WORKER), str(tmp_path)], LAUNCH_TIMEOUT_S, f"{nproc}-process run")
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["world_size"] == nproc
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        checked = 0
        for weighted in (False, True):
            samples = worker.make_samples(weighted)
            for normalization in worker.NORMALIZATIONS:
                key = f"{normalization}-{'weighted' if weighted else 'plain'}"
                if (normalization, weighted) not in _REFERENCES:
                    # full logits (chunked_loss=False); the ranks train with the chunked LM head
                    _REFERENCES[normalization, weighted] = worker.one_step(
                        str(tmp_path / "ref"), samples, normalization, chunked_loss=False
                    )
                ref_grads, ref_loss = _REFERENCES[normalization, weighted]
                for name in (key, key + "-stream"):
                    if name not in record["results"]:
                        continue
                    got = record["results"][name]
                    grads = {n: torch.tensor(v, dtype=torch.float64) for n, v in got["grads"].items()}
                    assert worker.relative_difference(grads, ref_grads) < worker.RELATIVE_TOLERANCE, name
                    assert got["loss"] == pytest.approx(ref_loss, rel=worker.RELATIVE_TOLERANCE), name
                    checked += 1
        assert checked == 7
        # prefix trees (share_prefixes): the same contract, against the padded samples on one process
        tree_grads, tree_loss = worker.one_step(
            str(tmp_path / "ref-tree"), worker.make_tree_samples(), "sample", chunked_loss=False
        )
        got = record["results"]["sample-tree"]
        grads = {n: torch.tensor(v, dtype=torch.float64) for n, v in got["grads"].items()}
        assert worker.relative_difference(grads, tree_grads) < worker.RELATIVE_TOLERANCE
        assert got["loss"] == pytest.approx(tree_loss, rel=worker.RELATIVE_TOLERANCE)
        # a step without targets on any rank: zero gradients (not NaN: 0 * the inf of 0/0), the loss 0
        untrained = record["results"]["untrained"]
        assert untrained["grads"] and untrained["loss"] == 0.0
        for name, grad in untrained["grads"].items():
            grad = torch.tensor(grad)
            assert not grad.any(), (
                f"{name}: a step without targets has {int((grad != 0).sum())} non-zero gradient entries "
                f"({int(grad.isnan().sum())} NaN)"
            )
    finally:
        torch.set_num_threads(threads)
