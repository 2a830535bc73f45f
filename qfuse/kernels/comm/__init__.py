"""Kernels that talk between GPUs: tensor parallel's one-shot all-reduce of decode rows
over NVLink (`p2p_allreduce`). Only `qfuse.parallel.comm` calls it; it imports only
`common/`.
"""
