"""Triton kernels, one op per file, each with its launcher and `unsupported_reason`.

Pieces several kernels share have files of their own: `splitk` (the quantized
products' launch plumbing and split-K reduction), `codes` (reading packed codes),
`fragments` (weights repacked in mma order), `rounding`, `precise_math` and `pdl`.
Importing a kernel module needs Triton; `qfuse.ops` imports them lazily so the
package runs without Triton (compat tier only).
"""
