"""What kernels of every subject use inside them, and nothing of any one op: MLX codes to
floats or mma operands (`codes`), rounding where compat rounds (`rounding`), float32
math bit for bit with PyTorch's CUDA kernels (`precise_math`), programmatic dependent
launch (`pdl`), where a KV token lives in a slotted or paged cache (`paging`), the
counters whose last arriving program runs an epilogue over a whole unit (`units`) and
the optional Gluon names of the Hopper kernels (`gluon_hopper`). These modules import no
other kernel module, so every subject may build on them.
"""
