"""Ops that read one row at a time and write it back, each in one launch and rounding where
the spelled-out path rounds: RMSNorm and a decoder layer's residual joint (`rms_norm`),
rotary embedding (`rope`), and the gated activation act(a)·b with its backward
(`gated_act`, whose float32 activation the fused MLP reuses). They import only `common/`.
"""
