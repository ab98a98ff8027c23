"""Grouped-query attention without repeated keys and values: a decode step's query heads packed.

Hugging Face's GQA models call SDPA on keys and values repeated per query head (`repeat_kv`)
whenever there is a mask (every `generate()` step with a static cache), and Inductor copies the
repeats. Attention is per query row, so the `n` query heads of a key/value head can be one head
of `n * s` rows (query `[b, kv * n, s, d]` -> `[b, kv, n * s, d]`, the mask repeated alike, the
output reshaped back): the same numbers, the keys read once. In inference (no gradient, no
dropout) the packed call becomes `ditron.decode_attention`, as SDPA over few packed programs is
slow at small batches; elsewhere it stays SDPA, packed.

A call is rewritten only where every fact is known: keys and values repeat `[b, kv, L, d]`
tensors by one factor, the call is not causal (a causal row depends on its index), `enable_gqa`
is off, shapes are static, and `n * s` <= MAX_PACKED_ROWS (decode; in prefill the repeated mask
would be as large as the keys).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

from .. import ops  # noqa: F401 - defines torch.ops.ditron.*, which the rewrite inserts
from .causal_mask import SDPA, call_arg, example_shape, set_call_arg, traced_value

QUERY, KEY, VALUE, MASK, DROPOUT, CAUSAL, SCALE, GQA = 0, 1, 2, 3, 4, 5, 6, 7
# what a packed call became: the decode attention template's op (inference), or SDPA itself
DECODE_ATTENTION, SDPA_PACKED = "ditron.decode_attention", "SDPA"
# Packed query rows (n * s) at most: the mask is copied n times, and beyond a few rows
# per head the keys' re-reads stop mattering next to the attention's own work.
MAX_PACKED_ROWS = 64


@dataclasses.dataclass(frozen=True)
class PackSite:
    node: str  # the SDPA call
    group: int  # query heads per key/value head (0: unknown)
    became: str  # DECODE_ATTENTION or SDPA_PACKED where packed, "" where kept
    reason: str

    @property
    def packed(self) -> bool:
        return bool(self.became)

    def describe(self) -> str:
        if self.packed:
            return (f"attention {self.node}: {self.group} query heads per key/value head "
                    f"packed as rows, keys and values not repeated -> {self.became}")
        return f"attention {self.node}: kept: {self.reason}"


def pack_grouped_queries(gm: GraphModule) -> list[PackSite]:
    """Pack (in place) the SDPA calls of `gm` on repeated keys and values; a PackSite each."""
    sites, repeats = [], []
    try:
        for sdpa in [n for n in gm.graph.nodes
                     if n.op == "call_function" and n.target in SDPA]:
            key = _repeat(call_arg(sdpa, KEY, "key"))
            value = _repeat(call_arg(sdpa, VALUE, "value"))
            if key is None:
                continue
            reason, became = _why_not(sdpa, key, value), ""
            if not reason:
                repeats += [call_arg(sdpa, KEY, "key"), call_arg(sdpa, VALUE, "value")]
                became = _pack(sdpa, key[0], value[0], key[1])
            sites.append(PackSite(sdpa.name, key[1], became, reason))
    finally:  # each call packed leaves a valid graph: keep those, even after a failure
        if repeats:
            for node in dict.fromkeys(repeats):
                _erase_unused(node)
            gm.graph.lint()
            gm.recompile()
    return sites


def _erase_unused(reshape: Node) -> None:
    """A repeat's reshape, expand and index, those that nothing reads any more."""
    expand = reshape.args[0]
    for node in (reshape, expand, expand.args[0]):
        if node.users or getattr(node, "_erased", False):  # read elsewhere, or gone already
            return
        node.graph.erase_node(node)


def _repeat(node: Any) -> Optional[tuple[Node, int]]:
    """(x, n) where `node` is `x[:, :, None].expand(b, kv, n, L, d).reshape(b, kv * n, L, d)`
    (`repeat_kv`; or x.unsqueeze(2) for the index), else None."""
    if not (isinstance(node, Node) and _is_method(node, "reshape", "view")):
        return None
    expand = node.args[0]
    if not (isinstance(expand, Node) and _is_method(expand, "expand")):
        return None
    inserted = expand.args[0]
    source = _with_dim2_inserted(inserted)
    shapes = [example_shape(n) for n in (node, expand, source)]
    if source is None or None in shapes:
        return None
    out, expanded, base = shapes
    if len(base) != 4 or len(expanded) != 5 or len(out) != 4:
        return None
    batch, kv, length, dim = base
    n = expanded[2]
    if expanded != [batch, kv, n, length, dim] or out != [batch, kv * n, length, dim]:
        return None
    return source, n


def _with_dim2_inserted(node: Any) -> Optional[Node]:
    """x where `node` is `x[:, :, None]` (any trailing full slices) or `x.unsqueeze(2)`."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem:
        source, index = node.args
        full = slice(None, None, None)
        if (isinstance(index, tuple) and index[:3] == (full, full, None)
                and all(i == full or i is Ellipsis for i in index[3:])):
            return source if isinstance(source, Node) else None
        return None
    if _is_method(node, "unsqueeze") or (node.op == "call_function"
                                         and node.target is torch.unsqueeze):
        dim = call_arg(node, 1, "dim")
        return node.args[0] if dim == 2 and isinstance(node.args[0], Node) else None
    return None


def _is_method(node: Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def _why_not(sdpa: Node, key: tuple[Node, int], value: Optional[tuple[Node, int]]) -> str:
    """Why this call keeps its repeats ("" where it can be packed)."""
    if value is None or value[1] != key[1]:
        return "the values are not repeated as the keys are"
    if call_arg(sdpa, CAUSAL, "is_causal"):
        return "is_causal=True (packed rows would change which keys a row sees)"
    if call_arg(sdpa, GQA, "enable_gqa"):
        return "enable_gqa=True already"
    query, keys = example_shape(call_arg(sdpa, QUERY, "query")), example_shape(key[0])
    mask = call_arg(sdpa, MASK, "attn_mask")
    mask_shape = example_shape(mask) if isinstance(mask, Node) else []
    if query is None or keys is None or mask_shape is None:
        return "the shapes of query, keys or mask are not known"
    if not all(isinstance(d, int) for d in (*query, *keys, *mask_shape)):
        return "dynamic shapes"
    if _fake_subclass(sdpa):
        return "tensor subclasses (DTensor) in the call"
    n = key[1]
    if len(query) != 4 or query[0] != keys[0] or query[1] != keys[1] * n:
        return f"query [{'x'.join(map(str, query))}] is not {n} heads per key/value head"
    if n * query[2] > MAX_PACKED_ROWS:
        return (f"{n} x {query[2]} packed query rows, over the {MAX_PACKED_ROWS} this rewrite "
                f"takes (prefill: the mask would be copied {n} times)")
    return ""


def _fake_subclass(sdpa: Node) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    values = [traced_value(n) for n in sdpa.all_input_nodes]
    return any(is_traceable_wrapper_subclass(v) for v in values if isinstance(v, torch.Tensor))


def _pack(sdpa: Node, key: Node, value: Node, n: int) -> str:
    """sdpa(q, repeat(k), repeat(v), mask) -> attention(packed q, k, v, packed mask), unpacked:
    ditron.decode_attention in inference without dropout, else the same SDPA call; says which."""
    query = call_arg(sdpa, QUERY, "query")
    batch, heads, rows, dim = example_shape(query)
    kv = heads // n
    mask = call_arg(sdpa, MASK, "attn_mask")
    graph = sdpa.graph
    with graph.inserting_before(sdpa):
        packed_query = graph.call_method("reshape", (query, batch, kv, n * rows, dim))
        packed_mask = _packed_mask(graph, mask, n, heads, rows) if isinstance(mask, Node) \
            else mask
        scale = call_arg(sdpa, SCALE, "scale")
        if (_inference(sdpa) and not call_arg(sdpa, DROPOUT, "dropout_p")
                and (scale is None or isinstance(scale, (int, float)))):
            attention = graph.call_function(
                torch.ops.ditron.decode_attention.default,
                (packed_query, key, value, packed_mask,
                 float(scale) if scale is not None else dim ** -0.5))
        else:
            attention = sdpa
    if attention is sdpa:
        for index, name, new in ((QUERY, "query", packed_query), (KEY, "key", key),
                                 (VALUE, "value", value), (MASK, "attn_mask", packed_mask)):
            set_call_arg(sdpa, index, name, new)
    with graph.inserting_after(attention):
        unpacked = graph.call_method("reshape", (attention, batch, heads, rows, dim))
    sdpa.replace_all_uses_with(unpacked, delete_user_cb=lambda user: user is not unpacked)
    if attention is not sdpa:
        graph.erase_node(sdpa)
    _example_values(packed_query, unpacked)
    return DECODE_ATTENTION if attention is not sdpa else SDPA_PACKED


def _inference(sdpa: Node) -> bool:
    """No input of the call needs a gradient (dynamo's fake values say so)."""
    values = [traced_value(n) for n in sdpa.all_input_nodes]
    return all(isinstance(v, torch.Tensor) and not v.requires_grad for v in values)


def _example_values(first: Node, last: Node) -> None:
    """Each node's `example_value` from `first` to `last` recomputed, for the passes after."""
    query = first.args[0].meta.get("example_value")
    fake_mode = getattr(query, "fake_mode", None)  # the mode dynamo traced the graph in
    node = first
    while True:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                             lambda n: n.meta.get("example_value"))
        if fake_mode is None:  # no fake values to compute from: none rather than a stale one
            node.meta.pop("example_value", None)
        elif node.op == "call_method":
            with fake_mode:
                node.meta["example_value"] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            with fake_mode:
                node.meta["example_value"] = node.target(*args, **kwargs)
        if node is last:
            return
        node = node.next


def _packed_mask(graph: torch.fx.Graph, mask: Node, n: int, heads: int, rows: int) -> Node:
    """`mask`, as SDPA broadcasts it to `[mb, 1 or heads, rows, L]`, over the packed rows
    `[mb, 1 or kv, n * rows, L]` (packed head k's row r * rows + i: head k * n + r's row i)."""
    shape = example_shape(mask)
    while len(shape) < 4:  # SDPA broadcasts from the right
        mask = graph.call_method("unsqueeze", (mask, 0))
        shape = [1, *shape]
    mb, mh, _, length = shape
    mask = graph.call_method("expand", (mask, mb, mh, rows, length))  # a row per query row
    if mh == 1:
        mask = graph.call_method("unsqueeze", (mask, 2))
        mask = graph.call_method("expand", (mask, mb, 1, n, rows, length))
        return graph.call_method("reshape", (mask, mb, 1, n * rows, length))
    return graph.call_method("reshape", (mask, mb, heads // n, n * rows, length))
