"""qfuse: fused Triton kernels and a lean runtime for quantized LLM decoding.

Layers, lowest first: quant (MLX affine format) → reference (compat tier) →
kernels (Triton) → ops (dispatch by tier) → runtime. See DESIGN.md.
"""

__version__ = "0.1.0"
