"""Gates: proof that a tier says what the quantized model says, on a fixed prompt suite.

A golden file freezes a few prompts (their token ids) with the compat tier's greedy
continuation of each. The fast tier is judged against the oracle (`qfuse.oracle`): the
same quantized model, the same codes, scales, biases and KV quantization rule, computed
in float32 with no rounding to bf16. Per prompt, the oracle's greedy trajectory is
computed (as many tokens as the golden continuation holds), and compat and the fast
tier are run teacher-forced along it (prefill of the prompt, then one cached decode
step per token, so the decode kernels run) and compared with the oracle:

- argmax agreement with the oracle's next token, fast's and compat's;
- KL(oracle ‖ tier) per position, mean and max, fast's and compat's;
- per-layer hidden-state relative divergence from the oracle.

The fast tier passes a prompt when its agreement is at least compat's minus one token
per 64 positions, and its mean KL is at most 2 × compat's + 1e-4 (FlashAttention's
rule, a fast kernel's error at most twice the spelled-out path's in the same precision,
lifted to the model: `fast_kl_limit`, `agreement_floor`); a configuration passes when
every prompt does. Compat is thereby a yardstick of how far the bf16 arithmetic may
stray from the model, not the truth: a fast path closer to the quantized model than
compat (its products sum s·q + b in float32 where compat rounds each weight to bf16
first) passes, a bug does not. Fast against compat (agreement, KL) is reported beside,
as information. The exact tier's rule is unchanged: logits bitwise equal to compat's,
teacher-forced along the golden trajectory (`run_gate`, which the tensor-parallel gate
also uses, with its own limits against compat).

What the quantization itself costs (`quantization_cost`): the oracle of the quantized
model against the oracle of the dense one, along the dense oracle's trajectory; it
needs a dense source (the model itself when dense) and is reported, not a limit.

A gate is only as true as the kernels it ran: each row records the fused kernels
dispatched while the tier ran, and where none ran (a CPU without the Triton
interpreter falls back to the reference for every op) the verdict is NOT TESTED,
never PASS. The golden file is written only when asked (`write_golden=True`,
`qfuse gate --make-golden`), never as a side effect of a gate.

A module per idea, lowest first: `measures` (teacher forcing, KL, the kernels that ran,
the verdict's sentence) and `golden_io` (the golden file: made, written, read); the two
gates, `compat_gate` (exact, and the tensor-parallel gate) and `oracle_gate` (fast);
`quant_cost`; and `command`, `qfuse gate` over all of them.
"""
