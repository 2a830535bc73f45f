"""`qfuse bench train`: one training step of the default model, fused against spelled-out.

Times a full step (forward, backward, AdamW) of the default `qfuse train`
architecture on random token batches, with the fused differentiable GeGLU and
with it switched off (QFUSE_GATED_ACT=0, the spelled-out path), and records
each one's peak memory. If `train_record.json` (written by
`qfuse train --record`) is in the output folder, its loss curve is plotted
into train.png and its saved checkpoint's validation loss copied into train.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import levers
from ..models import Decoder, ModelConfig
from ..train import TrainSettings, hf_config, init_weights
from . import common


def time_step(settings: TrainSettings, fused: bool, steps: int = 10) -> dict:
    with levers.setting("QFUSE_GATED_ACT", "1" if fused else "0"):
        torch.cuda.empty_cache()
        model = Decoder(ModelConfig.from_dict(hf_config(settings)))
        init_weights(model, 0)
        model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randint(0, settings.vocab_size, (settings.batch_size, settings.seq_len + 1),
                          device="cuda", generator=g)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in range(3):  # warm-up: kernel compilation, optimizer state
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        result = {"step_ms": start.elapsed_time(end) / steps,
                  "peak_MB": torch.cuda.max_memory_allocated() / 2**20}
        # GPU time against step time: when the step takes much longer than the GPU is
        # busy, the host (Python, launches) bounds it.
        result.update(common.gpu_profile(step))
        return result


def plot_record(record: dict, path: str) -> None:
    plt = common.pyplot(path)
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*record["train_loss"]), lw=0.8, label="train")
    ax.plot(*zip(*record["val_loss"]), marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"qfuse train: {record['parameters'] / 1e6:.1f}M parameters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(out_dir: str = "bench/results", quick: bool = False) -> int:
    settings = TrainSettings()
    result = {"meta": common.metadata(), "settings": settings.__dict__,
              "fused": time_step(settings, True, 3 if quick else 10),
              "spelled_out": time_step(settings, False, 3 if quick else 10)}
    # The record `qfuse train --record` wrote: beside the results, or where the repo keeps it.
    record_path = next((p for p in (Path(out_dir) / "train_record.json",
                                    Path("bench/results/train_record.json")) if p.exists()),
                       Path(out_dir) / "train_record.json")
    if record_path.exists():
        record = json.loads(record_path.read_text())
        result["validation_loss"] = record["best_val_loss"]  # of the saved checkpoint
        result["validation_loss_step"] = record["best_step"] + 1
        result["training_seconds"] = record.get("seconds")
        plot_record(record, str(Path(out_dir) / "train.png"))
    common.write_results(out_dir, "train", result)
    for key in ("fused", "spelled_out"):
        r = result[key]
        print(f"{key:>12}: {r['step_ms']:.1f} ms/step (GPU busy {r['gpu_ms_per_step']:.1f} ms), "
              f"peak {r['peak_MB']:.0f} MB")
        for k in r["top_kernels"]:
            print(f"{'':>14}{k['ms_per_step']:8.2f} ms  {k['calls_per_step']:6.0f}x  {k['name']}")
    return 0
