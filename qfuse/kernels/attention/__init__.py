"""The KV cache's kernels: one decode token's attention over a 4/8-bit or dense cache,
slotted or paged (`decode_attention`, flash-decoding with fixed-size splits and a merge
in fixed order; `decode_attention_ws`, its warp-specialized Hopper split kernel writing
the same partials), and the append that quantizes a new token into the cache bit-exactly
as `quant.quantize` does (`kv_append`). Addresses come from `common.paging`, the one
rule for both cache layouts.
"""
