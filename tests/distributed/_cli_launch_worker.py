"""``python -m packing_hf.app.cli ARGS...`` on one process of a launch, once per phase, recording every file this
process writes.

Usage (under torchrun): ``_cli_launch_worker.py PHASES.json``, a list of phases, each ``{"dir": WRITES_DIR, "roots":
[ROOT, ...], "argv": ARGS, "env": {NAME: VALUE}}``, run in order in this process (one launch, one process group, for
several runs of the command: its cost is the interpreter and the imports, once). For each phase the environment is
the launch's with ``env`` (what an earlier run set in it, as transformers' ``ACCELERATE_USE_DEEPSPEED``, is
gone), this process's output goes to ``WRITES_DIR/output-rank<R>.txt`` (R from ``RANK``), an audit
hook notes each file opened for writing, folder made, renamed or removed under the ROOTs (``open``, ``os.mkdir``,
``os.rename`` / ``os.replace``, ``os.remove``, ``os.rmdir``), one per line, in ``WRITES_DIR/writes-rank<R>.txt``, and
the command line runs as ``packing-hf ARGS`` does. The process group the first run starts is kept for the next ones
(closed after the last), and the DeepSpeed config a run registered with transformers is dropped after it. The exit
status is the first failing phase's (the later phases do not run), else 0.
Writes from native code that bypass Python's ``open`` (safetensors, pyarrow's data files) are not seen; the
folders they write into are (``save_to_disk`` and ``save_pretrained`` make and rename them through Python).

For the engine layouts: with ``DS_ACCELERATOR=cpu`` DeepSpeed's shared-memory all-reduce is not JIT-built (as in
``_deepspeed_worker.py``), ``PACKING_HF_TEST_FSDP_ON_CPU=1`` installs ``_fsdp_worker.py``'s CPU stand-in for
accelerate's FSDP device gate (it acts only where an FSDP plugin is given), and ``PACKING_HF_TEST_WEIGHTS=PATH`` (read
when the phase runs) records the job's parameters (gathered whole here, not by the save) before its eval and before
its save, with its eval samples (:func:`_record_weights`).
"""

from __future__ import annotations

import gc
import json
import os
import sys

_WRITE_MODES = ("w", "a", "x", "+")


class _Watch:
    """The audit hook of the phases: every write under the current phase's roots, in its log."""

    def __init__(self) -> None:
        self.roots: list[str] = []
        self.log = None
        sys.addaudithook(self.hook)

    def phase(self, roots: list[str], log_path: str) -> None:
        if self.log is not None:
            self.log.close()
        self.roots = [os.path.realpath(root) for root in roots]
        self.log = open(log_path, "w", buffering=1)  # noqa: SIM115 - open for the phase

    def inside(self, path) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None
        return real if any(real == root or real.startswith(root + os.sep) for root in self.roots) else None

    def hook(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (
                any(m in mode for m in _WRITE_MODES)
                if isinstance(mode, str)
                else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            )
            where = self.inside(path) if writing else None
        elif event in ("os.mkdir", "os.remove", "os.rmdir"):
            where = self.inside(args[0])
        elif event == "os.rename":
            where = self.inside(args[1])
        else:
            return
        if where is not None and self.log is not None and not self.log.closed:
            self.log.write(f"{event} {where}\n")


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
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in params.items()
        }


def _record_weights() -> None:
    """The job's parameters when the eval before training starts and when the save starts (the trained ones), and its
    eval samples, saved by the main process in ``$PACKING_HF_TEST_WEIGHTS`` (``torch.save``), where it is set."""
    import torch

    from packing_hf.app.train import TrainJob

    recorded = {}
    eval_before, save = TrainJob.eval_before, TrainJob.save

    def before(job):
        if not os.environ.get("PACKING_HF_TEST_WEIGHTS"):
            return eval_before(job)
        recorded["initial"] = _whole(job.trainer.model)
        recorded["eval_samples"] = job.eval_samples
        return eval_before(job)

    def saving(job):
        if not os.environ.get("PACKING_HF_TEST_WEIGHTS"):
            return save(job)
        recorded["trained"] = _whole(job.trainer.model)
        if job.main:
            torch.save(recorded, os.environ["PACKING_HF_TEST_WEIGHTS"])
        return save(job)

    TrainJob.eval_before, TrainJob.save = before, saving


def _run_phases(phases: list[dict]) -> int:
    """Each phase's command in this process (see the module docstring); the first failing status, else 0."""
    from packing_hf.app import cli, processes

    close_process_group = processes.close_process_group
    processes.close_process_group = lambda: None  # the group is kept for the next phase
    watch, rank = _Watch(), os.environ.get("RANK", "0")
    launch_env = dict(os.environ)
    status = 0
    for phase in phases:
        # the launch's environment and the phase's: what a run set (transformers: ACCELERATE_USE_DEEPSPEED) goes
        os.environ.clear()
        os.environ.update(launch_env, **phase["env"])
        watch.phase(phase["roots"], os.path.join(phase["dir"], f"writes-rank{rank}.txt"))
        sys.stdout.flush(), sys.stderr.flush()
        with open(os.path.join(phase["dir"], f"output-rank{rank}.txt"), "w") as output:
            os.dup2(output.fileno(), 1), os.dup2(output.fileno(), 2)
            try:
                status = cli.main(["train", *phase["argv"]])
            finally:
                sys.stdout.flush(), sys.stderr.flush()
        if "transformers.integrations.deepspeed" in sys.modules:
            sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()
        gc.collect()
        if status:
            break
    close_process_group()
    return status


if __name__ == "__main__":
    with open(sys.argv[1]) as plan:
        phases = json.load(plan)
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        import importlib

        # as _deepspeed_worker.py: no JIT build of DeepSpeed's shared-memory all-reduce, gloo reduces
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if os.environ.get("PACKING_HF_TEST_FSDP_ON_CPU"):
        from _fsdp_worker import accelerate_fsdp_on_cpu  # this script's folder is on sys.path

        accelerate_fsdp_on_cpu()
    _record_weights()
    sys.exit(_run_phases(phases))
