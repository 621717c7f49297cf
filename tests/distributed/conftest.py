"""What the 2-process tests share: launching a worker script on 2 CPU processes (gloo) and loading it.

Fixtures, not importable helpers: under --import-mode=importlib test modules cannot import a conftest.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import pytest
from filelock import FileLock  # a dependency of torch, transformers and datasets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """``free_port()``: a TCP port on 127.0.0.1 nobody listens on (for the rendezvous)."""
    return _free_port


@pytest.fixture(scope="session")
def launch() -> Callable[..., None]:
    """``launch(command, timeout, what, **env)``: run a launcher command to completion, one thread per process;
    a hang (past ``timeout`` seconds) or a non-zero exit fails the test with the end of its output."""

    def run(command: Sequence[str], timeout: float, what: str = "2-process run", **extra_env: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.update(extra_env)
        env.pop("PYTEST_XDIST_WORKER", None)  # the workers are not pytest workers
        try:
            proc = subprocess.run(list(command), env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{what} did not finish in {timeout}s (hang?):\n{(exc.stderr or '')[-3000:]}")
        assert proc.returncode == 0, (
            f"launcher failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )

    return run


@pytest.fixture(scope="session")
def torchrun_command() -> Callable[[], list[str]]:
    """``torchrun_command(nproc=2)``: ``python -m torch.distributed.run`` for ``nproc`` local processes on a free port."""
    return lambda nproc=2: [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
    ]  # fmt: skip


@pytest.fixture(scope="session")
def load_worker() -> Callable[[Path], ModuleType]:
    """``load_worker(path)``: a worker script imported as a module (for its constants and reference code)."""

    def load(path: Path) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"packing_hf_{path.stem.strip('_')}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def run_once(tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """``run_once(name, run)``: the folder in which ``run(folder)`` ran exactly once in this test session.

    A module whose tests all read one launch keeps it in a module fixture. ``make test`` (``--dist loadfile``)
    runs a module's tests on one worker; under another distribution pytest-xdist may hand them to different
    workers, and each worker would launch it again (``xdist_group`` does not help: with pytest 9 its group
    suffix no longer reaches the node ids). So the first worker to ask runs it under a file lock in the
    session's shared temporary folder; the others wait and read its files. A run that fails leaves no result,
    and the next worker to ask runs it again (and fails the same way)."""
    base = tmp_path_factory.getbasetemp()
    # under xdist every worker's basetemp is popen-gwN inside the session's folder; without it, basetemp is
    # the session's folder itself (its parent holds earlier sessions' folders)
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(name: str, run: Callable[[Path], None]) -> Path:
        folder, done = root / f"run-once-{name}", root / f"run-once-{name}.done"
        with FileLock(str(root / f"run-once-{name}.lock")):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a failed run left
                folder.mkdir()
                run(folder)
                done.touch()
        return folder

    return get
