"""Fused decode steps: a decoder layer's decode step as five launches, each a product with
the work that follows it fused into its epilogue (plain Triton, so each also runs under
the CPU interpreter).

Per layer: the Q/K/V product with the q/k norms, RoPE and the KV append (`qkv_step`);
the attention (`kernels.attention`); the O product with the residual joint and the next
RMSNorm (`joint_step`); the gate/up product with the gated activation
(`kernels.products.fused_mlp`); the down product with the residual joint and the next
layer's RMSNorm (`joint_step` again). An epilogue that needs more of the output than one
program computes (a head, a whole row) runs in the last program to finish that unit
(`kernels.common.units`).
"""
