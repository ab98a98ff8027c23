"""The patterns the pass rewrites, by the name of the ditron op each becomes; the lowest layer,
as config.py validates `ditron.patterns` against them and a Task's op is one of them.
"""

ALL_GATHER_MATMUL = "all_gather_matmul"
MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"
MATMUL_ALL_REDUCE = "matmul_all_reduce"
MATMUL_ALL_REDUCE_RMSNORM = "matmul_all_reduce_rmsnorm"
# a matmul whose output is gathered (colwise_gather_output layers, lm_head)
MATMUL_ALL_GATHER = "matmul_all_gather"
# the all-reduce (+ residual + RMSNorm) of what grouped GEMMs computed (the experts' weighted sum
# under a TP plan, their input gradient in backward): lowering/grouped_all_reduce.py
GROUPED_MM_ALL_REDUCE = "grouped_mm_all_reduce"
GROUPED_MM_ALL_REDUCE_RMSNORM = "grouped_mm_all_reduce_rmsnorm"
GROUPED_MM_ALL_REDUCE_PATTERNS = (GROUPED_MM_ALL_REDUCE, GROUPED_MM_ALL_REDUCE_RMSNORM)
ALL_REDUCE_PATTERNS = (MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM,
                       *GROUPED_MM_ALL_REDUCE_PATTERNS)
# expert parallelism (lowering/moe.py): dispatch -> grouped GEMMs, grouped GEMMs -> combine
ALL_TO_ALL_GROUPED_MM = "all_to_all_grouped_mm"
GROUPED_MM_ALL_TO_ALL = "grouped_mm_all_to_all"
MOE_PATTERNS = (ALL_TO_ALL_GROUPED_MM, GROUPED_MM_ALL_TO_ALL)
# FP8: the same collectives around torch._scaled_mm (torchao's float8 tensor parallelism)
ALL_GATHER_SCALED_MM = "all_gather_scaled_mm"
SCALED_MM_REDUCE_SCATTER = "scaled_mm_reduce_scatter"
SCALED_MM_ALL_REDUCE = "scaled_mm_all_reduce"
SCALED_MM_PATTERNS = (ALL_GATHER_SCALED_MM, SCALED_MM_REDUCE_SCATTER, SCALED_MM_ALL_REDUCE)
PATTERNS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE,
            MATMUL_ALL_REDUCE_RMSNORM, MATMUL_ALL_GATHER) + GROUPED_MM_ALL_REDUCE_PATTERNS + (
                MOE_PATTERNS + SCALED_MM_PATTERNS)
REDUCE_SCATTER_PATTERNS = (MATMUL_REDUCE_SCATTER, SCALED_MM_REDUCE_SCATTER)
