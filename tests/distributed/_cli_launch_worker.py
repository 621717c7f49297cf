"""``python -m packing_hf.app.cli ARGS...`` on one process of a launch, recording every file this process writes.

Usage (under torchrun): ``_cli_launch_worker.py WRITES_DIR ROOT[:ROOT...] ARGS...``. An audit hook notes each
file opened for writing, folder made, renamed or removed under the ROOTs (``open``, ``os.mkdir``,
``os.rename`` / ``os.replace``, ``os.remove``, ``os.rmdir``), one per line, in ``WRITES_DIR/writes-rank<R>.txt``
(R from ``RANK``); the command line then runs as ``python -m`` runs it, and its exit status is the process's.
Writes from native code that bypass Python's ``open`` (safetensors, pyarrow's data files) are not seen; the
folders they write into are (``save_to_disk`` and ``save_pretrained`` make and rename them through Python).
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


if __name__ == "__main__":
    writes_dir, roots, *argv = sys.argv[1:]
    _watch(roots.split(":"), os.path.join(writes_dir, f"writes-rank{os.environ.get('RANK', '0')}.txt"))
    sys.argv = ["packing-hf", *argv]
    runpy.run_module("packing_hf.app.cli", run_name="__main__", alter_sys=True)
