"""Core level: the Triton tile programs of the fused ops, the flag protocol (`flags`) first, each
module saying what it holds (importing it imports triton; only `ditron_inductor.runtime` does,
lazily).
"""
