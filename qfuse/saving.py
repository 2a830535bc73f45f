"""Write a state dict as safetensors, sharded when it is large (HF's index layout).

One file when everything fits in ``max_shard_bytes``; otherwise
`model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json`
(`metadata.total_size` and a `weight_map` from tensor name to file), which
qfuse's loader, transformers and mlx-lm all read. The default model bundled in
the package is sharded this way to keep every file under 16 MB.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_safetensors(state: dict[str, torch.Tensor], dst: str | Path,
                     max_shard_bytes: int | None = None, metadata: dict | None = None) -> list[Path]:
    """Save ``state`` into folder ``dst``; returns the files written. Tensors are
    kept whole and in name order, so a shard exceeds the limit only when a single
    tensor does."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in sorted(state.items())}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    # Stale files from an earlier save would be picked up by a glob-based loader.
    for old in list(dst.glob("model*.safetensors")) + [dst / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        path = dst / "model.safetensors"
        save_file(shards[0], str(path), metadata=metadata)
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        path = dst / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata=metadata)
        paths.append(path)
        weight_map.update({name: path.name for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return paths
