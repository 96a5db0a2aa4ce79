"""Numerical kernels, each in its module: `loss` (the chunked loss head: cross-entropy and log-probs without the
N x V logits), `optim` (the optimizers, BF16AdamW with stochastic rounding), `noise` (counter-based random bits),
`inductor_bitcast` (vectorised bitcasts while BF16AdamW's compiled step runs), `measure` (the peak memory a step
really takes: live tensors on a CPU, the allocator on a GPU)."""
