"""``packing-hf verify``: check one model, one architecture or the whole registry, and format the table.

>>> verify_main(["--model-type", "qwen2", "--no-grads"])  # doctest: +ELLIPSIS
qwen2 / sdpa, samples [7, 12, 5]: max |diff| logits ...: exact
0
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ..architectures.prepare import prepare_model_for_packing
from ..architectures.sweep import IMPLEMENTATIONS, ArchitectureResult, describe_error, sweep_architecture
from ..architectures.tiny import build_tiny_model
from ..attention import ATTENTION_NAME
from ..registry import iter_sweep, support
from ..verify import DEFAULT_LENGTHS, DEFAULT_TOLERANCE, check_packing
from .checks import check_attn_implementation, check_model_type

__all__ = ["format_table", "result_dict", "verify_main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packing-hf verify",
        description="Check that packed rows give the same logits and gradients as every sample alone.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--model-type", help="an architecture (e.g. llama): checked on a tiny from_config model"
    )
    target.add_argument("--model", help="a local model folder: checked as is (fp32 recommended)")
    target.add_argument(
        "--all", action="store_true", help="sweep every registered architecture, print the table"
    )
    parser.add_argument(
        "--attn-implementation",
        default="sdpa",
        help="eager, sdpa, packing_hf or packing_hf_varlen (packing_hf's varlen attention), "
        "flash_attention_2, ... (default: sdpa)",
    )
    parser.add_argument(
        "--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="sample lengths, e.g. 7,12,5"
    )
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--no-grads", action="store_true", help="compare logits only")
    parser.add_argument("--stock", action="store_true", help="do not apply prepare_model_for_packing first")
    parser.add_argument("--json", action="store_true", help="print the report(s) as JSON")
    return parser


def verify_main(argv: Sequence[str] | None = None) -> int:
    """``packing-hf verify``: exit status 0 when packing is exact, 1 on a leak or refusal, 2 on bad usage."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
    except ValueError:
        return _usage_error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if not lengths or min(lengths) < 1:
        return _usage_error(f"--lengths must be positive sample lengths (e.g. 7,12,5), got {args.lengths!r}")
    if args.tolerance <= 0:
        return _usage_error(f"--tolerance must be > 0, got {args.tolerance}")
    if args.all:
        results = []
        entries = list(iter_sweep())
        for number, entry in enumerate(entries, start=1):
            _status(f"checking {entry.model_type} ({number}/{len(entries)})")
            results.extend(sweep_architecture(entry.model_type, lengths=lengths, gradients=not args.no_grads))
        if args.json:
            print(json.dumps([result_dict(r) for r in results], indent=1))
        else:
            print(format_table(results))
        return 0

    try:
        implementation = check_attn_implementation(args.attn_implementation)
        if args.model_type is not None:
            check_model_type(args.model_type)
    except ValueError as error:
        return _usage_error(str(error))
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        return _usage_error(
            f"--model {args.model}: no model folder there (no config.json); pass a folder written by "
            "save_pretrained, or --model-type for a tiny model of an architecture"
        )
    if args.model_type is not None:
        _status(f"building a tiny {args.model_type} model ({implementation})")
        try:
            model = build_tiny_model(args.model_type, implementation)
        except (ValueError, KeyError) as exc:
            print(
                f"cannot build a tiny {args.model_type} model with {implementation}: {describe_error(exc)}",
                file=sys.stderr,
            )
            return 2
    else:
        from transformers import AutoModelForCausalLM

        _status(f"loading {args.model} ({implementation}, fp32)")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                args.model, attn_implementation=implementation, dtype=torch.float32
            ).eval()
        except (OSError, ValueError) as error:
            return _usage_error(f"cannot load --model {args.model}: {str(error).splitlines()[0]}")
    handle = None
    if not args.stock:
        _status("preparing the model for packing (per-model fixes, or a refusal with its reason)")
        try:
            handle = prepare_model_for_packing(model)
        except ValueError as exc:
            print(f"refused: {exc}")
            return 1
    _status(
        f"checking samples of {', '.join(map(str, lengths))} tokens packed in one row against each alone"
        + (" (logits and gradients)" if not args.no_grads else " (logits)")
    )
    try:
        report = check_packing(model, lengths, gradients=not args.no_grads, tolerance=args.tolerance)
    finally:
        if handle is not None:
            handle.revert()
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.summary())
    return 1 if report.leaked else 0


def _status(message: str) -> None:
    """A status line on stderr (stdout keeps the result, e.g. ``--json``), before every phase that takes time."""
    print(f"[packing-hf] {message}", file=sys.stderr, flush=True)


def _usage_error(message: str) -> int:
    print(f"packing-hf verify: error: {message}", file=sys.stderr)
    return 2


def result_dict(result: ArchitectureResult) -> dict:
    """One sweep result as a JSON-ready dict (verdict, both reports, why unsupported or refused)."""
    return {
        "model_type": result.model_type,
        "implementation": result.implementation,
        "verdict": result.verdict,
        "stock": result.stock.to_dict() if result.stock else None,
        "prepared": result.prepared.to_dict() if result.prepared else None,
        "unsupported": result.unsupported,
        "refused": result.refused,
    }


def _refused_by_attention(result: ArchitectureResult) -> str | None:
    """The reason packing_hf's attention gave when it refused the unprepared model at its first forward."""
    return result.stock.refusal if result.stock is not None else None


def _cell(result: ArchitectureResult) -> str:
    verdict = result.verdict
    if verdict == "n/a":
        return "n/a"
    if verdict == "refused" and _refused_by_attention(result) is not None:
        return "refused (by the attention itself)"  # no silent leak even without prepare_model_for_packing
    stock = result.stock
    leak = ""
    if stock is not None and stock.leaked:
        leak = "error" if stock.error else f"{max(stock.max_logits_diff, stock.max_grads_diff or 0.0):.0e}"
    if verdict == "exact":
        return "exact"
    if verdict == "fixed":
        return f"leaks ({leak}) → **exact**"
    if verdict == "refused":
        return f"leaks ({leak}) → refused" if leak else "exact → refused"
    return f"**LEAK** ({leak})"


def format_table(results: Sequence[ArchitectureResult]) -> str:
    """Markdown table of sweep results: one row per architecture, one column per implementation.

    A cell reads ``stock → prepared``: ``exact`` (stock already exact), ``leaks (max diff) → exact``
    (fixed by packing_hf), ``... → refused`` (prepare_model_for_packing raises), ``n/a`` (transformers does
    not offer that implementation for the architecture).
    """
    by_type: dict[str, dict[str, ArchitectureResult]] = {}
    for result in results:
        by_type.setdefault(result.model_type, {})[result.implementation] = result
    implementations = [i for i in IMPLEMENTATIONS if any(i in row for row in by_type.values())]
    lines = [
        "| architecture | status | " + " | ".join(implementations) + " | why |",
        "|---|---|" + "---|" * len(implementations) + "---|",
    ]
    for model_type in sorted(by_type):
        entry = support(model_type)
        row = by_type[model_type]
        cells = [_cell(row[i]) if i in row else "" for i in implementations]
        why = entry.reason
        attention_reason = _refused_by_attention(row["packing_hf"]) if "packing_hf" in row else None
        if not why and attention_reason:  # exact on eager/sdpa, refused by the varlen attention (llama4)
            why = f"{ATTENTION_NAME}: {attention_reason}"
        lines.append(f"| {model_type} | {entry.status} | " + " | ".join(cells) + f" | {why} |")
    return "\n".join(lines)
