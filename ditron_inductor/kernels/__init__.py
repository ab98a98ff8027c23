"""Core level: the Triton tile programs of the fused ops.

- `flags`: the flag protocol (flags hold epochs; wait with acquire, raise with release, peer
  pointers from a table; the flag layout and error codes) and the tiny kernels built from it.
- `ag_gemm`: the persistent all-gather+GEMM tile loop that waits on per-chunk flags.
- `reduce`: the reduction of the partial sums of GEMM+reduce-scatter.

Importing this package imports triton; only `ditron_inductor.runtime` does, lazily.
"""
