"""`torchrun --nproc-per-node N -m qfuse gate ...`: the model-level gate at tensor parallel N.

Every rank runs the ordinary gate (`compat_gate.run_gate`) on its shard of the model, in
lockstep (no driver: the gate's calls are the same on every rank, so the collectives
inside the model meet; the logits and per-layer hidden states are whole on every rank,
gathered and all-reduced). The tier under test runs at TP=N against the compat tier at
TP=N, and its teacher-forced argmax is also compared with the golden file, whose
trajectories the compat tier wrote at TP=1: ``golden_agreement`` in the JSON report,
printed as `TP=N fast vs TP=1 golden`. Rank 0 prints and writes; the others are silent.

Writing a golden file or measuring the quantization cost stays single-process: a golden
file is a TP=1 artifact. So does the float32 oracle `qfuse gate` judges the fast tier
against (`oracle_gate.run_oracle_gate`): here the fast tier is still judged against
compat at TP=N, at least 63/64 agreement and a mean KL within `compat_gate.KL_FLOOR`.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from .. import levers
from ..errors import UserError
from ..gates import command, compat_gate, golden_io, measures
from .comm import init, shutdown
from .runtime import check_tp_flag, rank_device
from .sharding import RankShard, check_world
from .stopping import QuietStop, agree_on_failure, attempt, finish, raise_after_shutdown


def run_gate_tp(args) -> int:
    """`qfuse gate` on every rank of a torchrun job (args as the CLI parsed them)."""
    from ..loading import check_checkpoint, quant_spec

    world = check_tp_flag(None)
    if args.make_golden or args.quantization_cost or args.dense is not None:
        raise UserError("--make-golden and --quantization-cost (--dense) run in one process "
                        "(a golden file is made at TP=1); run them without torchrun")
    config = check_checkpoint(args.model)
    command.check_report_path(args.json)  # before the gate runs, not after
    check_world(config, world, quant_spec(config))
    device = rank_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    comm = init(device, timeout_s=900.0)
    rank0 = comm.rank == 0
    golden_path = Path(args.golden) if args.golden else Path(args.model) / "golden.json"
    quiet = open(os.devnull, "w")  # noqa: SIM115 -- closed in the finally below
    try:
        # Loading may fail on one rank alone (its shard): all ranks agree before the
        # first collective, so that none waits in it for a rank that left.
        loaded, error = attempt(lambda: _load(args, golden_path, dtype, device, comm))
        agree_on_failure(comm, error)
        golden, model = loaded
        with contextlib.redirect_stdout(quiet) if not rank0 else contextlib.nullcontext():
            rows = compat_gate.run_gate(model, golden, args.tier, args.kv_bits, args.kv_group_size,
                                        progress=rank0)
            # The tier under test against the golden continuation (TP=1 compat).
            same = total = 0
            with levers.use_tier(args.tier):
                for t in golden["trajectories"]:
                    logits, _ = measures.teacher_forced(model, t["prompt_ids"], t["continuation"],
                                                        args.kv_bits, args.kv_group_size)
                    target = torch.tensor(t["continuation"], device=logits.device)
                    same += int((logits.argmax(-1) == target).sum())
                    total += len(target)
        code = _report(args, rows, world, device, golden_path, same, total) if rank0 else 0
    except QuietStop as q:
        finish(q.code, clean=shutdown())  # rank 0 reports why
        return q.code
    except BaseException as e:  # noqa: BLE001 -- re-raised after the teardown
        raise_after_shutdown(comm, e)
    finally:
        quiet.close()
    finish(code, clean=shutdown())
    return code


def _load(args, golden_path: Path, dtype, device, comm):
    """The golden file and this rank's shard of the model."""
    from ..loading import load_model

    if not golden_path.exists():
        raise UserError(f"no golden file at {golden_path}; `qfuse gate --make-golden` "
                        "(one process) writes one")
    golden = golden_io.load_golden(golden_path)
    model = load_model(args.model, dtype=dtype, device=device, progress=comm.rank == 0,
                       shard=RankShard(comm))
    return golden, model


def _report(args, rows, world, device, golden_path, same, total) -> int:
    """Rank 0: print the gate's verdict, write its JSON; the exit code."""
    limit = compat_gate.KL_FLOOR
    result = compat_gate.verdict(rows, args.tier, limit)
    print(compat_gate.report(rows))
    print(compat_gate.verdict_line(rows, args.tier, str(device), limit))
    print(f"TP={world} {args.tier} vs TP=1 golden ({golden_path.name}): {same}/{total} "
          "teacher-forced argmax agree")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"tier": args.tier, "device": str(device), "tp": world, "verdict": result,
             "pass": result == "PASS", "kl_limit": limit,
             "kernels_run": measures.kernels_run(rows), "golden_agreement": [same, total],
             "rows": compat_gate.rows_as_dicts(rows)}, indent=2) + "\n")
    return {"PASS": 0, "FAIL": 1}.get(result, 3)
