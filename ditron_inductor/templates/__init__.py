"""Core level: the Triton tile programs of the fused ops.

- `flags`: the flag protocol (flags hold epochs; wait with acquire, raise with release, peer
  pointers from a table; the flag layout and error codes) and the tiny kernels built from it.
- `schedule`: the Task's cross-rank schedule (ring order, all-reduce block ownership).
- `ag_gemm`: the persistent GEMM tile loop whose tiles wait on per-chunk flags (all-gather).
- `transfer`: the all-gather's pull of the peers' chunks by a few SMs.
- `reduce`: the sum of the received partials of the copy-engine reduce-scatter.
- `gemm_ready`: the persistent GEMM that raises a flag per finished row chunk, and
  `reduce_scatter`: the pull and sum beside it.
- `all_reduce_push`, `all_reduce_lamport` (and `all_reduce`, what they share): GEMM + all-reduce.

Importing this package imports triton; only `ditron_inductor.runtime` does, lazily.
"""
