"""Core level: the Triton tile programs of the fused ops (importing it imports triton; only
`ditron_inductor.runtime` does, lazily).

- `flags`: the flag protocol (epochs, acquire waits, release writes, the flag layout, error codes).
- `schedule`: the Task's cross-rank schedule; `ag_gemm`: the GEMM whose tiles wait on per-chunk
  flags (all-gather); `transfer`: the all-gather's local copies; `reduce`: the sums of received
  partials (reduce-scatter, copy-engine all-reduce); `gemm_ready`: the GEMM that raises a flag
  per finished row chunk; `all_reduce_push`, `all_reduce_lamport`, `all_reduce`: GEMM + all-reduce;
  `grouped_gemm`, `moe_routes`: the MoE ops; `gemv`, `decode_attention`: decode.
"""
