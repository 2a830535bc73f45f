"""Tensor-parallel decode over several processes on torch.distributed.

Each rank holds a Decoder of its own shapes: 1/N of the attention heads with their
KV heads (and so 1/N of the KV cache), 1/N of the MLP's intermediate size and of
the vocabulary. The single-GPU kernels run unchanged on each shard; what makes the
ranks one model is four re-classed modules (`layers`): the row-parallel products
(attention output, MLP) sum their partial outputs with an all-reduce, the
vocabulary-parallel embedding sums its masked lookups, and the head gathers its
logit columns.

    sharding.py  how each weight splits, the per-rank config, checks with clear errors
    layers.py    the four tensor-parallel module kinds and `parallelize`
    comm.py      collectives with timeouts and one-line errors; all-reduce through
                 qfuse's p2p kernel (default), symmetric memory or NCCL
    stopping.py  ranks that agree on an error (one rank's failure) and stop together
    runtime.py   torchrun setup, rank 0 driving `generation.generate`, the other ranks
                 following its calls
    serve.py     `qfuse serve` under torchrun: rank 0 serves over the same Leader
    gate.py      `qfuse gate` under torchrun: the model-level gate at TP=N
    bench.py     `qfuse bench e2e_tp`: decode tokens/s at TP=N against TP=1
"""
