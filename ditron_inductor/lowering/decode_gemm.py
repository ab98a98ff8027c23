"""One-row matmuls (a decode step at batch 1) -> ditron.decode_mm, the decode GEMM template.

Runs on the post-grad graph after the collective rewrites (which take the matmuls they fuse
first; a fused all-reduce's own one-row GEMM takes the template through its plan), where the
option `ditron.decode_gemm` is on. Which products qualify, and why only one-row ones, is
scheduler/decode_gemm.py's to say: `mm_not_rewritten`.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .. import ops  # noqa: F401 - defines torch.ops.ditron.*, which the rewrite inserts
from ..scheduler.decode_gemm import mm_not_rewritten


def rewrite_decode_mms(graph: Graph) -> list[str]:
    """Replace each qualifying `aten.mm` of `graph` by `ditron.decode_mm` (in place); the names
    of the nodes replaced."""
    replaced = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.mm.default:
            continue
        a, b = node.args
        if not (isinstance(a, Node) and isinstance(b, Node)):
            continue
        a_val, b_val = a.meta.get("val"), b.meta.get("val")
        if not (isinstance(a_val, torch.Tensor) and isinstance(b_val, torch.Tensor)):
            continue
        if mm_not_rewritten(a_val, b_val) is not None:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.ditron.decode_mm.default, (a, b))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced.append(node.name)
    return replaced
