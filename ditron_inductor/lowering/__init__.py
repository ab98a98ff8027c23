"""Lowering: find collective + matmul subgraphs in Inductor's post-grad graph (`match`), rewrite
each chosen one into a single ditron op call (`rewrite`); `graph_pass` ties them to the scheduler
and the logs."""
