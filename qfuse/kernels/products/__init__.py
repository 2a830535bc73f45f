"""y = residual + x·dequant(W)ᵀ + bias over quantized weights, and the MLP built on it:
the weight forms the kernels read (MLX words, or 4-bit weights repacked once into mma
fragment order: `fragments`, back to words by `fragment_words`), the product kernels by
rows and GPU (`qmatmul_mma`, `qmatmul_ring`, `qmatmul_wgmma`, `qmatmul_tc`, and the
dispatch and CUDA-core GEMV in `qmatmul`), the fused MLP (`fused_mlp`), and the split-K
workspace and semaphores they share (`splitk`). Each launcher says what it refuses in
`unsupported_reason`; `qfuse.choose` picks among them. Imports `common/` and, for the
MLP's activation, `pointwise/`.
"""
