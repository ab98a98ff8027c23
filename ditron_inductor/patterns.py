"""The patterns the pass rewrites, by the name of the ditron op each becomes.

The lowest layer that needs them: the options (config.py) validate `ditron.patterns` against
this list, and the Task (scheduler/task.py) names its op with it.
"""

ALL_GATHER_MATMUL = "all_gather_matmul"
MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"
MATMUL_ALL_REDUCE = "matmul_all_reduce"
MATMUL_ALL_REDUCE_RMSNORM = "matmul_all_reduce_rmsnorm"
PATTERNS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE,
            MATMUL_ALL_REDUCE_RMSNORM)
