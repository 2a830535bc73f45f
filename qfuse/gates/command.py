"""`qfuse gate` (`gate_command`): every mistake named before anything loads (the model
folder, the report's path, the golden file or where it may be written, the quantization
cost's dense source: `check_report_path`, `check_cost_source`), then the gate of the
tier asked for (exact: against compat; fast: against the oracle), the quantization cost
on request, the report and the verdict; exit 0 PASS, 1 FAIL, 3 NOT TESTED.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError
from .compat_gate import report, rows_as_dicts, run_gate, verdict, verdict_line
from .golden_io import check_golden_destination, load_golden, make_golden, save_golden
from .measures import kernels_run
from .oracle_gate import (
    RULE,
    oracle_report,
    oracle_rows_as_dicts,
    oracle_verdict,
    oracle_verdict_line,
    run_oracle_gate,
)
from .quant_cost import cost_report, quantization_cost


def check_report_path(path: str | Path | None, flag: str = "--json") -> None:
    """UserError unless the report file ``path`` (None: none asked for) can be written
    once the gate has run: not a folder, in a folder that exists."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; name a file in it (e.g. {path / 'gate.json'})")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: folder {path.parent} does not exist")


# Fields two configs must share for one checkpoint to be the dense source of the other.
_SAME_MODEL = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")


def check_cost_source(config, model_dir: str | Path, dense: str | Path | None) -> None:
    """UserError, before anything loads, unless the quantization cost has a dense source:
    ``dense`` (`--dense DIR`: an unquantized checkpoint of the same model), or, without
    one, the model itself being dense."""
    from ..loading import check_checkpoint

    if dense is None:
        if config.quantization:
            bits = config.quantization.get("bits", "?")
            raise UserError(f"--quantization-cost needs the dense model: {model_dir} holds "
                            f"{bits}-bit weights; pass --dense DIR, the unquantized "
                            "checkpoint it was made from")
        return
    if not config.quantization:
        raise UserError(f"--dense names the dense source of a quantized model, and {model_dir} "
                        "is dense: its quantization is measured against itself (drop --dense)")
    try:
        dense_config = check_checkpoint(dense, tokenizer=False)
    except UserError as e:
        raise UserError(f"--dense {dense}: {e}") from None
    if dense_config.quantization:
        raise UserError(f"--dense {dense} holds quantized weights; name the unquantized "
                        "checkpoint")
    for name in _SAME_MODEL:
        here, there = getattr(config, name, None), getattr(dense_config, name, None)
        if here != there:
            raise UserError(f"--dense {dense} is another model than {model_dir}: {name} "
                            f"{there} there, {here} here")


def gate_command(load: Callable[[], tuple], model_dir: str | Path, *, golden: str | None = None,
                 write_golden: bool = False, tier_name: str = "fast", n_tokens: int = 64,
                 kv_bits: int = 0, kv_group_size: int = 64, json_path: str | None = None,
                 with_quantization_cost: bool = False, dense: str | Path | None = None,
                 load_dense: Callable[[], object] | None = None) -> int:
    """`qfuse gate`: print the report and the verdict; 0 PASS, 1 FAIL, 3 NOT TESTED.

    The fast tier is judged against the oracle (`run_oracle_gate`), the exact tier
    bitwise against compat along the golden trajectories (`run_gate`). The model folder
    is checked first (a missing folder is the mistake to name, not the golden file it
    would hold), then the report's path, the golden file (that it is one, or with
    write_golden that it may be written: `save_golden`) and with the quantization cost
    its dense source (`check_cost_source`; ``dense`` is `--dense DIR`, loaded by
    ``load_dense``), then load() gives (model, tokenizer), so every mistake is reported
    before loading. The golden file (default MODEL/golden.json) is written only with
    write_golden (`--make-golden`); without one, UserError says how to make it."""
    from ..loading import check_checkpoint

    config = check_checkpoint(model_dir)
    golden_path = Path(golden) if golden else Path(model_dir) / "golden.json"
    check_report_path(json_path)
    if write_golden:
        check_golden_destination(golden_path)
    elif not golden_path.exists():
        raise UserError(f"no golden file at {golden_path}; `qfuse gate --make-golden` writes "
                        "one from this model's compat tier on this device")
    else:
        trajectories = load_golden(golden_path, config.vocab_size)
    if with_quantization_cost:
        check_cost_source(config, model_dir, dense)
    model, tokenizer = load()
    if write_golden:
        trajectories = make_golden(model, tokenizer, n_tokens=n_tokens)
        save_golden(trajectories, golden_path)
        print(f"wrote golden trajectories ({n_tokens} tokens per prompt) to {golden_path}")
    device = str(model.model.norm.weight.device)
    if tier_name == "exact":
        rows = run_gate(model, trajectories, tier_name, kv_bits, kv_group_size)
        print(report(rows))
        result, line = verdict(rows, tier_name), verdict_line(rows, tier_name, device)
        extra = {"rows": rows_as_dicts(rows)}
    else:
        rows = run_oracle_gate(model, trajectories, kv_bits, kv_group_size)
        print(oracle_report(rows))
        result, line = oracle_verdict(rows), oracle_verdict_line(rows, device)
        extra = {"rule": RULE, "rows": oracle_rows_as_dicts(rows)}
    cost = None
    if with_quantization_cost:
        if dense is None:  # check_cost_source: the model itself is dense
            cost = quantization_cost(model, trajectories, kv_group_size=kv_group_size)
        else:
            cost = quantization_cost(load_dense(), trajectories, quantized=model,
                                     kv_group_size=kv_group_size)
        print("\nquantization cost (the oracle: quantized against dense, float32):")
        print(cost_report(cost))
    print(line)
    if json_path:
        Path(json_path).write_text(json.dumps(
            {"tier": tier_name, "device": device, "verdict": result, "pass": result == "PASS",
             "kernels_run": kernels_run(rows), **extra, "quantization_cost": cost},
            indent=2) + "\n")
    return {"PASS": 0, "FAIL": 1}.get(result, 3)
