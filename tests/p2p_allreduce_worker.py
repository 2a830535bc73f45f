"""Run under torchrun (2+ GPUs) by test_p2p_allreduce.py: the p2p all-reduce against
the exact float32 sum over ranks in rank order, eager and in replayed CUDA graphs, for
several shapes and dtypes; prints one line per failure and exits 1 if any."""

import sys

import torch

from qfuse.parallel.comm import init, shutdown


def rows(device, shape, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def main() -> int:
    device = torch.device("cuda", int(__import__("os").environ["LOCAL_RANK"]))
    comm = init(device, timeout_s=120.0, allreduce="p2p")
    failures = []
    shapes = [(1, 3840), (3, 3840), (8, 8192), (64, 3840), (2, 1, 4104), (5, 16384)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for i, shape in enumerate(shapes):
            parts = [rows(device, shape, dtype, 100 * i + r) for r in range(comm.world)]
            want = sum(p.float() for p in parts).to(dtype)
            for call in range(3):  # consecutive calls alternate the receive halves
                got = comm.all_reduce(parts[comm.rank])
                if not torch.equal(got, want):
                    failures.append(f"eager {dtype} {shape} call {call}: max diff "
                                    f"{(got.float() - want.float()).abs().max().item()}")
    # graphs: 5 calls captured, replayed 7 times, with eager calls between replays
    x = [rows(device, (4, 3840), torch.bfloat16, 7 + r) for r in range(comm.world)]
    want = sum(p.float() for p in x).bfloat16()
    src = x[comm.rank].clone()
    comm.all_reduce(src)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [comm.all_reduce(src) for _ in range(5)]
    for replay in range(7):
        graph.replay()
        extra = comm.all_reduce(src) if replay % 2 else want
        torch.cuda.synchronize()
        for j, out in enumerate(outs + [extra]):
            if not torch.equal(out, want):
                failures.append(f"graph replay {replay} output {j} differs")
    for line in failures:
        print(f"rank {comm.rank}: {line}", flush=True)
    comm.barrier("the end")
    shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
