"""The tokenized dataset of ``packing-hf train``, cached by content: a second run on the same records, tokenizer
and settings loads it instead of tokenizing again.

The key is the SHA-256 of everything the tokens depend on: every checked record (after normalisation), the
tokenizer (its vocabulary and rules, special tokens, chat template), the settings (``max_length``,
``overflow``, ``prompt_format``, ``completion_only_loss``) and the code that renders and tokenizes (the source
of ``render.py``, ``data.py`` and ``records.py``). A change to any of them is a new key; nothing is reused on
a guess. The cache lives in ``<cache_dir>/tokenized/<key>`` (``$PACKING_HF_CACHE``, else
``~/.cache/packing_hf``); a run that cannot write there tokenizes as before. Under a launcher only the main
process writes it (``write=True``); the others read it once written, or tokenize in memory.

>>> len(settings_key({"max_length": 512}))
64
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .data import PreparedDataset
from .modeling import cache_dir
from .records import RecordSet

__all__ = ["cached_prepare", "settings_key"]

logger = logging.getLogger(__name__)
_CODE = ("render.py", "data.py", "records.py")
_META = "packing_hf_prepared.json"


def settings_key(settings: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a JSON mapping, keys sorted."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = [
        getattr(tokenizer, "chat_template", None),
        tokenizer.special_tokens_map,
        type(tokenizer).__name__,
    ]
    return hashlib.sha256((rules + json.dumps(extra, sort_keys=True, default=str)).encode()).hexdigest()


def _key(records: RecordSet, tokenizer, settings: Mapping[str, Any]) -> str:
    digest = hashlib.sha256()
    for record in records.records:
        digest.update(json.dumps(dataclasses.asdict(record), sort_keys=True, default=str).encode())
        digest.update(b"\n")
    here = Path(__file__).resolve().parent
    code = [hashlib.sha256((here / name).read_bytes()).hexdigest() for name in _CODE]
    return settings_key(
        {
            "records": digest.hexdigest(),
            "tokenizer": _tokenizer_fingerprint(tokenizer),
            "code": code,
            **settings,
        }
    )


def cached_prepare(
    records: RecordSet,
    tokenizer,
    settings: Mapping[str, Any],
    prepare: Callable[[], PreparedDataset],
    *,
    write: bool = True,
) -> tuple[PreparedDataset, str | None]:
    """``prepare()``'s result, from the cache when the same records, tokenizer and ``settings`` were prepared
    before: ``(prepared, the cache folder it came from or None)``. A fresh result is stored for the next run
    when ``write`` (False: the other processes of a launch, so that a cache folder never has two writers)."""
    import datasets

    try:
        folder = cache_dir() / "tokenized" / _key(records, tokenizer, settings)[:32]
    except (OSError, TypeError, ValueError) as error:  # an unusual tokenizer or record: just tokenize
        logger.info("tokenized-dataset cache not used (%s)", error)
        return prepare(), None
    meta = folder / _META
    if meta.is_file():
        fields = json.loads(meta.read_text())
        dataset = datasets.load_from_disk(str(folder))
        return PreparedDataset(dataset=dataset, records=records, **fields), str(folder)
    prepared = prepare()
    if not write:
        return prepared, None
    try:
        partial = folder.with_name(folder.name + ".partial")
        prepared.dataset.save_to_disk(str(partial))
        fields = {
            name: getattr(prepared, name)
            for name in ("record_format", "prompt_format", "num_truncated", "num_dropped", "num_untrained")
        }
        (partial / _META).write_text(json.dumps(fields))
        if folder.exists():  # another run stored it meanwhile: theirs is the same
            import shutil

            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.replace(folder)
    except OSError as error:
        logger.warning("could not cache the tokenized dataset in %s (%s)", folder, error)
    return prepared, None
