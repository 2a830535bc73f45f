"""Triton kernels, one op per file, each with its launcher and `unsupported_reason`, in
subpackages by subject, lowest first:

- `common/`: what kernels of every subject use inside them: reading packed codes
  (`codes`), rounding as compat rounds (`rounding`), float32 math as PyTorch does it
  (`precise_math`), programmatic dependent launch (`pdl`), the KV address rule
  (`paging`), the counters of a unit's last program (`units`), the optional Gluon names
  (`gluon_hopper`).
- `pointwise/`: one row at a time: RMSNorm and the residual joint, RoPE, the gated
  activation.
- `comm/`: tensor parallel's all-reduce.
- `products/`: quantized matmuls and the MLP built on them, with their weight forms
  (`fragments`) and split-K plumbing (`splitk`).
- `attention/`: decode attention over the KV cache and the KV append.

A subpackage imports only `common/` and the ones before it in this list (the MLP's
activation comes from `pointwise/`). Importing a kernel module needs Triton; `qfuse.ops`
imports them lazily so the package runs without Triton (compat tier only).
"""
