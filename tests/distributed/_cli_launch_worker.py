"""``python -m packing_hf.app.cli ARGS...`` on one process of a launch, recording every file this process writes.

Usage (under torchrun): ``_cli_launch_worker.py WRITES_DIR ROOT[:ROOT...] ARGS...``. An audit hook notes each
file opened for writing, folder made, renamed or removed under the ROOTs (``open``, ``os.mkdir``,
``os.rename`` / ``os.replace``, ``os.remove``, ``os.rmdir``), one per line, in ``WRITES_DIR/writes-rank<R>.txt``
(R from ``RANK``); the command line then runs as ``python -m`` runs it, and its exit status is the process's.
Writes from native code that bypass Python's ``open`` (safetensors, pyarrow's data files) are not seen; the
folders they write into are (``save_to_disk`` and ``save_pretrained`` make and rename them through Python).

For the engine layouts: with ``DS_ACCELERATOR=cpu`` DeepSpeed's shared-memory all-reduce is not JIT-built (as in
``_deepspeed_worker.py``), ``PACKING_HF_TEST_FSDP_ON_CPU=1`` installs ``_fsdp_worker.py``'s CPU stand-in for
accelerate's FSDP device gate, and ``PACKING_HF_TEST_WEIGHTS=PATH`` records the job's parameters (gathered whole
here, not by the save) before its eval and before its save, with its eval samples (:func:`_record_weights`).
"""

from __future__ import annotations

import os
import runpy
import sys

_WRITE_MODES = ("w", "a", "x", "+")


def _watch(roots: list[str], log_path: str) -> None:
    roots = [os.path.realpath(root) for root in roots]
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 - open for the life of the process

    def inside(path) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None
        return real if any(real == root or real.startswith(root + os.sep) for root in roots) else None

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (
                any(m in mode for m in _WRITE_MODES)
                if isinstance(mode, str)
                else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            )
            where = inside(path) if writing else None
        elif event in ("os.mkdir", "os.remove", "os.rmdir"):
            where = inside(args[0])
        elif event == "os.rename":
            where = inside(args[1])
        else:
            return
        if where is not None and not log.closed:
            log.write(f"{event} {where}\n")

    sys.addaudithook(hook)


def _whole(model) -> dict:
    """Every parameter of ``model`` whole, on every process (collective under ZeRO-3 and FSDP2): gathered here, not
    by the save's own code (ZeRO-3: ``GatheredParameters``, FSDP2: ``DTensor.full_tensor()``)."""
    import contextlib

    import torch

    params = dict(model.named_parameters())
    context = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        context = deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None)
    with context, torch.no_grad():
        return {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for name, p in params.items()
        }


def _record_weights(path: str) -> None:
    """The job's parameters when the eval before training starts and when the save starts (the trained ones), and its
    eval samples, saved by the main process in ``path`` (``torch.save``)."""
    import torch

    from packing_hf.app.train import TrainJob

    recorded = {}
    eval_before, save = TrainJob.eval_before, TrainJob.save

    def before(job):
        recorded["initial"] = _whole(job.trainer.model)
        recorded["eval_samples"] = job.eval_samples
        return eval_before(job)

    def saving(job):
        recorded["trained"] = _whole(job.trainer.model)
        if job.main:
            torch.save(recorded, path)
        return save(job)

    TrainJob.eval_before, TrainJob.save = before, saving


if __name__ == "__main__":
    writes_dir, roots, *argv = sys.argv[1:]
    _watch(roots.split(":"), os.path.join(writes_dir, f"writes-rank{os.environ.get('RANK', '0')}.txt"))
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        import importlib

        # as _deepspeed_worker.py: no JIT build of DeepSpeed's shared-memory all-reduce, gloo reduces
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if os.environ.get("PACKING_HF_TEST_FSDP_ON_CPU"):
        from _fsdp_worker import accelerate_fsdp_on_cpu  # this script's folder is on sys.path

        accelerate_fsdp_on_cpu()
    if os.environ.get("PACKING_HF_TEST_WEIGHTS"):
        _record_weights(os.environ["PACKING_HF_TEST_WEIGHTS"])
    sys.argv = ["packing-hf", *argv]
    runpy.run_module("packing_hf.app.cli", run_name="__main__", alter_sys=True)
