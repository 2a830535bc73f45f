"""Triton kernels, one op per file, each with its launcher.

Importing a kernel module needs Triton; `qfuse.ops` imports them lazily so the
package runs without Triton (compat tier only).
"""
