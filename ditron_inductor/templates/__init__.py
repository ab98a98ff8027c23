"""Core level: the Triton tile programs of the fused ops.

- `comm`: communication primitives (wait on a flag with acquire, notify with release, peer
  pointers from a table) and the tiny kernels built from them.
- `ag_gemm`: the persistent all-gather+GEMM tile loop that waits on per-chunk flags.
- `reduce`: the reduction of the partial sums of GEMM+reduce-scatter.

Importing this package imports triton; only `ditron_inductor.runtime` does, lazily.
"""
