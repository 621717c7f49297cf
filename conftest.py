"""Root conftest: where the shared real data lives, for the tests and for the doctests in packing_hf/.

The data folder is ``../shared/data`` next to the project root. A clone made elsewhere (CI's clean clone
in a temporary folder) finds it at this workplace's fixed location instead; ``PACKING_HF_DATA`` overrides
both. The resolved folder is exported as ``PACKING_HF_DATA`` (tests/conftest.py reads it) and given to
doctests as ``SHARED_DATA``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_CANDIDATES = (Path(__file__).resolve().parent.parent / "shared" / "data", Path("/work/shared/data"))


def _shared_data_dir() -> Path:
    if "PACKING_HF_DATA" in os.environ:
        return Path(os.environ["PACKING_HF_DATA"])
    return next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])


os.environ["PACKING_HF_DATA"] = str(_shared_data_dir())


def _no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# DeepSpeed (a test extra) is imported by accelerate whenever a model is unwrapped (save_pretrained, the Trainer),
# and on a machine where it detects no accelerator it says so at import, on stdout, which outputs compared in tests
# and doctests would then start with. Naming its CPU accelerator is what the DeepSpeed tests do anyway.
if _no_gpu():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(autouse=True)
def _shared_data_in_doctests(doctest_namespace):
    doctest_namespace["SHARED_DATA"] = Path(os.environ["PACKING_HF_DATA"])
