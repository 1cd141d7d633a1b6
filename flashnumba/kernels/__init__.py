"""The kernels: device code and the factories that specialise it, nothing above them.

Read them in this order (the README's reading order, module by module); each step builds on the ones before it,
except that steps 1 to 3 already call a warp shuffle of :mod:`.ptx` and the dropout stream of :mod:`.philox`, both
drawn at step 4:

1. :mod:`.common` who sees whom (causal, window, varlen), the score modifications, the dropout stream, a user's
   score_mod and mask_mod (with :mod:`.score_math`, what a score_mod may call: the softcap's tanh);
2. :mod:`.simt_forward` FlashAttention-2 Algorithm 1 on CUDA cores: v1 (a thread per query row), v2 and v3
   (register tiles);
3. :mod:`.simt_backward` Algorithm 2 on CUDA cores (D_i preprocess, dK/dV and dQ kernels);
4. :mod:`.ptx` the tensor-core instructions (``mma.sync``, ``ldmatrix``, ``cp.async``) with their simulator
   stand-ins, and :mod:`.bf16` / :mod:`.philox`;
5. :mod:`.mma_tiles` one warp's tile operations: row loads, A fragments, the two matrix products;
6. :mod:`.mma_forward` Algorithm 1 on tensor cores; 7. :mod:`.mma_backward` Algorithm 2 on tensor cores;
8. :mod:`.mma_tf32` float32 on tensor cores (TF32 and 3xTF32), and :mod:`.mma_tf32_backward` its backward;
9. :mod:`.mma_decode` decoding against a KV cache (split-KV), and :mod:`.block_mask` the tiles a block mask lets the
   kernels skip;
10. :mod:`.ptx_hopper` Hopper's instructions (``wgmma``, mbarriers, bulk and tensor-map copies) with their stand-ins,
    :mod:`.wgmma_forward` and :mod:`.wgmma_backward` Algorithms 1 and 2 on them (a producer warpgroup, consumers
    taking turns), and :mod:`.wgmma_tf32` / :mod:`.wgmma_tf32_backward` float32's 3xTF32 forward and backward on
    them (opt-in: ``config.hopper_3xtf32``).

Which kernel runs with which tiles on a given GPU is decided above this package, in :mod:`flashnumba.tiling` and
:mod:`flashnumba.planner`; launching is :mod:`flashnumba._launch`. Nothing here imports those.
"""
