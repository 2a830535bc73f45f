"""A quantized Linear's weight view: one QuantizedTensor while the buffers are unchanged, so
kernels can keep the layouts they derive from it (fragment order) across decode steps."""

from qfuse.models.decoder import Linear


def test_quantized_linear_keeps_one_weight_view():
    lin = Linear(64, 16, False, group_size=64, bits=4)
    first = lin.quantized()
    assert lin.quantized() is first
    probe = first.derived("probe", lambda w: object())
    assert lin.quantized().derived("probe", lambda w: None) is probe  # kept, not rebuilt
    lin.scales.add_(1.0)  # an in-place write (a checkpoint load) makes a new view
    assert lin.quantized() is not first
    assert lin.quantized().derived("probe", lambda w: None) is None  # built afresh
