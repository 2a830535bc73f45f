"""The Gluon names the Hopper kernels use (`qmatmul_ring`, `qmatmul_wgmma`,
`decode_attention_ws`), imported in one place: Gluon is
optional, so this module imports on CPU-only or older Triton installs too, with
``gluon`` None and ``GLUON_ERROR`` saying why (each kernel's `unsupported_reason`
reports it)."""

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        mma_v2,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra import libdevice
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    GLUON_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means "no Gluon here"
    gluon = gl = fence_async_shared = mbarrier = mma_v2 = tma = None
    warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = libdevice = None
    gdc_launch_dependents = gdc_wait = None
    GLUON_ERROR = f"{type(e).__name__}: {e}"
