"""What one prefill pass does on the host, counted on the CPU: the Gemma 3 12B layer
structure (48 layers, 5 sliding : 1 full, 16 query / 8 KV heads, 4-bit g64 weights, a
4-bit KV cache) at narrow widths (hidden 256, head_dim 64, intermediate 512, vocabulary
1024), so the pass's own arithmetic is small beside its op count. A diagnostic for the
prefill's launches (NOTES "Serving" → "Prefill graphs"), not a `qfuse bench`:

    python bench/prefill_host.py [T [TIER [BITS]]]   # default: 512 compat 4
    TRITON_INTERPRET=1 python bench/prefill_host.py 64 fast 0   # fast tier, interpreter

BITS: the weights' (4: MLX-quantized g64, as the GPU run's; 0: dense, so that a product
is one op as the GPU's cuBLAS call is, not the reference's dequantization on the CPU).

Prints, for one prefill of one T-token prompt into a slotted cache (after a warm-up): the
aten ops the pass dispatches (all, and those that are not views: on a GPU each of those
is a kernel launch or a host copy) and their average a layer, the most frequent; the kernel
dispatches by kind (`levers.counters`: `ref:*` for the reference ops, kernel names for
Triton launches); the Python calls (cProfile); the wall time of the pass, median of 5
(compat: the CPU's arithmetic included, so an upper bound of the host's part); and the
same for the pass at the fixed shape of a padded prompt over one slot of a 4-slot cache
(`runtime.prefill_graphs.PaddedPrefill`), which is what a CUDA graph of it holds. Under
the interpreter (its kernels run in Python) one period of the layer pattern (6 layers)
is counted, neither profiled nor timed.
"""

import cProfile
import pstats
import statistics
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qfuse import levers
from qfuse.bench.e2e import GEMMA3_12B, random_model
from qfuse.runtime.cache import KVCache
from qfuse.runtime.prefill_graphs import PaddedPrefill

NARROW = {**GEMMA3_12B, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
          "query_pre_attn_scalar": 64, "vocab_size": 1024, "eos_token_id": []}


class Ops(TorchDispatchMode):
    """Counts the aten ops dispatched under it, views apart (no kernel, no copy)."""

    def __init__(self):
        super().__init__()
        self.ops, self.views = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and \
            not returns[0].alias_info.is_write
        if view:
            self.views += 1
        else:
            self.ops[func.__name__] += 1
        return out


def main(T: int = 512, tier: str = "compat", bits: int = 4) -> None:
    torch.manual_seed(0)
    interpreted = levers.interpreter_active()
    # Interpreted kernels run in Python: one period of the layer pattern (5 sliding, 1
    # full) is counted instead of eight, and neither profiled nor timed.
    raw = {**NARROW, "num_hidden_layers": 6} if interpreted else NARROW
    model = random_model(raw, bits, "cpu", torch.float32)
    cfg, L = model.config, cfg_layers(model)
    ids = torch.randint(3, NARROW["vocab_size"], (1, T))
    with levers.use_tier(tier), torch.no_grad():
        cache = KVCache(cfg, 1, T + 8, torch.float32, "cpu", 4, 64)

        def exact():
            model(ids, None, cache, logits="last")

        padded = PaddedPrefill(model, KVCache(cfg, 4, T + 8, torch.float32, "cpu", 4, 64), T)
        prompt = ids[0].tolist()

        def fixed():
            padded(prompt, 2)

        for name, run in (("exact-length pass (today's)", exact),
                          ("fixed-shape pass (padded, slot as a tensor)", fixed)):
            run()  # warm-up: plans chosen, tables made
            counted = Ops()
            levers.reset_counters()
            with counted:
                run()
            triton = levers.counters()
            calls, walls = None, []
            if not interpreted:
                prof = cProfile.Profile()
                prof.enable()
                run()
                prof.disable()
                calls = pstats.Stats(prof).total_calls
                for _ in range(5):
                    began = time.perf_counter()
                    run()
                    walls.append(time.perf_counter() - began)
            ops = sum(counted.ops.values())
            weights = f"{bits}-bit" if bits else "dense"
            print(f"== {name}: {T} tokens, tier {tier}, {weights} weights, {L} layers")
            print(f"  aten ops: {ops + counted.views} ({counted.views} views), "
                  f"{ops} not views: {ops / L:.1f} a layer on average")
            if calls is not None:
                print(f"  Python calls (cProfile): {calls}, {calls / L:.0f} a layer")
            if walls:
                ms = statistics.median(walls) * 1e3
                print(f"  wall per pass: {ms:.1f} ms (median of 5)")
            if triton:
                print(f"  kernel dispatches (levers.counters): {sum(triton.values())}: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(triton.items())))
            print("  most frequent ops: " + ", ".join(
                f"{k} {v}" for k, v in counted.ops.most_common(14)))


def cfg_layers(model) -> int:
    return model.config.num_hidden_layers


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512,
         sys.argv[2] if len(sys.argv) > 2 else "compat",
         int(sys.argv[3]) if len(sys.argv) > 3 else 4)
