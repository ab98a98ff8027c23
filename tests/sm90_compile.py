"""Compile the Triton kernels for Hopper (sm_90) without a GPU: the front end's checks
(constexpr globals, types, shapes) and the back end down to a cubin, as the GPU machine would.
Run in its own process (test_kernels_compile.py): the interpreter tests switch Triton's JIT to
interpretation for the whole process.

    python -m tests.sm90_compile    # prints one line per kernel variant
    python -m tests.sm90_compile --ptx DIR    # and writes each variant's PTX

A refactor of the kernels that should not change the generated code is checked by writing the
PTX before and after it and comparing the two folders (`--compare BEFORE AFTER`: the PTX with
its debug line information left out).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ditron_inductor.runtime import moe_routes as runtime_routes  # noqa: E402
from ditron_inductor.templates import (  # noqa: E402
    ag_gemm,
    all_reduce_lamport,
    all_reduce_push,
    decode_attention,
    flags,
    gemv,
    gemm_ready,
    grouped_gemm,
    moe_routes,
    reduce,
    transfer,
)

HOPPER = GPUTarget("cuda", 90, 32)

_AR_ARGS = dict(data_table="*i64", flag_table="*i64", flags_ptr="*i32", epoch_ptr="*i32",
                arrive_ptr="*i32", err_ptr="*i32", h_ptr="*bf16", y_ptr="*bf16",
                res_ptr="*bf16", w_ptr="*bf16", M="i32", N="i32", eps="fp32", rank="i32",
                limit="i32", rows_per_chunk="i32", push_progs="i32", slots="i32",
                stride="i32")


def variants():
    """(kernel, argument types, constexprs, num_warps) for every variant worth compiling."""
    # every switch of the all-reduce kernels on 8 ranks; on 2 and 3 ranks (the smallest world,
    # and one that is no power of two) the residual + norm switches alone, since the other
    # switches' code does not depend on the world size
    combos = ((True, True, False), (False, True, True), (False, False, False))
    for world in (2, 3, 8):
        for res, norm, w_fp32 in combos if world == 8 else combos[:1]:
            push = dict(HAS_RES=res, NORM=norm, W_FP32=w_fp32, BLOCK=1024, BLOCK_N=4096,
                        SEND=True, REDUCE=True, NORMALISE=True,
                        **flags.world_constants(world))
            for chunked in (False, True):
                yield (all_reduce_push.push_kernel, _AR_ARGS,
                       dict(push, CHUNKED=chunked, COPY=True, ROW_BLOCK=0), 4)
            # the norm of whole rows (4096 of them: BLOCK 16384) in the copy-out, and (not
            # CHUNKED) in REDUCE too, for my own blocks
            for chunked in (True, False) if norm else ():
                yield (all_reduce_push.push_kernel, _AR_ARGS,
                       dict(push, BLOCK=16384, CHUNKED=chunked, COPY=True, ROW_BLOCK=4096), 32)
            no_rows = dict(push, ROW_BLOCK=0)
            yield all_reduce_push.push_all_kernel, _AR_ARGS, no_rows, 4
            yield all_reduce_lamport.lamport_kernel, _AR_ARGS, dict(no_rows, COPY=True), 4
            yield all_reduce_lamport.lamport_all_kernel, _AR_ARGS, no_rows, 4
            # the decode kernels with a row of 4096 a block (runtime decode_grid: 8 warps)
            rows = dict(push, BLOCK=4096, ROW_BLOCK=4096)
            for kernel, extra in ((all_reduce_push.push_all_kernel, {}),
                                  (all_reduce_lamport.lamport_kernel, dict(COPY=True)),
                                  (all_reduce_lamport.lamport_all_kernel, {})):
                if norm:
                    yield kernel, _AR_ARGS, dict(rows, **extra), 8
    # the GEMM beside push (TMA loads, B as given or as B^T)
    for b_trans in (False, True):
        yield (gemm_ready.gemm_ready_kernel,
               dict(a_desc="tensordesc<bf16[128,64]>",
                    b_desc=f"tensordesc<bf16[{'256,64' if b_trans else '64,256'}]>",
                    c_ptr="*bf16", bias_ptr="*bf16", flags_ptr="*i32", counts_ptr="*i32",
                    epoch_ptr="*i32", M="i32", N="i32", K="i32"),
               dict(HAS_BIAS=True, B_TRANS=b_trans, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                    GROUP_M=2, NUM_PROGS=100), 8)
    # the all-gather's GEMM (pointers, and TMA with B as given or as B^T) and its local copies
    ag_dynamic = dict(M="i32", N="i32", K="i32", rows_per_chunk="i32", first_row="i32",
                      epoch="i32", limit="i32", bias_ptr="*bf16", flag_ptr="*i32", err_ptr="*i32")
    tiles = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, NUM_PROGS=132)
    yield (ag_gemm.ag_gemm_kernel,
           dict(ag_dynamic, a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", stride_am="i32",
                stride_ak="i32", stride_bk="i32", stride_bn="i32", stride_cm="i32",
                stride_cn="i32"),
           dict(tiles, HAS_BIAS=True, WAIT=True), 8)
    for b_trans in (False, True):
        yield (ag_gemm.ag_gemm_tma_kernel,
               dict(ag_dynamic, a_desc="tensordesc<bf16[128,64]>",
                    b_desc=f"tensordesc<bf16[{'128,64' if b_trans else '64,128'}]>",
                    c_desc="tensordesc<bf16[128,128]>"),
               dict(tiles, HAS_BIAS=True, WAIT=True, B_TRANS=b_trans), 8)
    yield (transfer.copy_twice_kernel,
           dict(src_ptr="*i32", dst_a_ptr="*i32", dst_b_ptr="*i32", words="i32"),
           dict(BLOCK=4096), 8)
    yield (reduce.reduce_slots_kernel,
           dict(src_ptr="*bf16", out_ptr="*bf16", n="i32", slot_stride="i32", world="i32",
                scale="fp32"), dict(BLOCK=4096), 8)
    # the copy-engine all-reduce's sum + residual + norm: rows of 4096 two a program, of 16384
    # one (runtime/all_reduce.py, SUM_NORM_ELEMENTS), on 2 and 3 ranks, both norm roundings;
    # the two-shot's: the sum of my slice on 4 ranks, then the pass over the gathered sums (one
    # slot) adding my residual and normalising, both roundings
    sum_norm = [(world, rows, block_n, res, norm, w_fp32)
                for world, rows, block_n in ((2, 2, 4096), (3, 1, 16384))
                for res, norm, w_fp32 in ((True, True, False), (False, True, True),
                                          (False, False, False))]
    sum_norm += [(4, 2, 4096, False, False, False), (1, 2, 4096, True, True, False),
                 (1, 2, 4096, True, True, True)]
    for world, rows, block_n, res, norm, w_fp32 in sum_norm:
        yield (reduce.sum_slots_norm_kernel,
               dict(slots_ptr="*bf16", slot_stride="i32", h_ptr="*bf16", y_ptr="*bf16",
                    res_ptr="*bf16", w_ptr="*bf16", M="i32", N="i32", eps="fp32"),
               dict(WORLD=world, HAS_RES=res, NORM=norm, W_FP32=w_fp32, ROWS=rows,
                    BLOCK_N=block_n), 16)
    # the MoE grouped GEMM: the dispatch's (gather + rows output), plain, the combine's scatter,
    # its accumulation with the routing weight (fp32 C), the tiles waiting on arrival counters
    moe_args = dict(a_ptr="*bf16", a_desc="*bf16", a_index_ptr="*i64", b_ptr="*bf16",
                    offsets_ptr="*i32", c_ptr="*bf16", c_index_ptr="*i64", scale_ptr="*fp32",
                    rows_out_ptr="*bf16",
                    count_ptr="*i32", expect_ptr="*i32", err_ptr="*i32", M="i32", N="i32",
                    K="i32", E="i32", stride_am="i32", stride_ak="i32", stride_be="i32",
                    stride_bk="i32", stride_bn="i32", stride_cm="i32", stride_cn="i32",
                    limit="i32")
    moe_tiles = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, E_P2=32, NUM_PROGS=132, GROUP_M=8,
                     B_DESC=0, A_DESC=False, PROXY_FENCE=False)
    for gather, scatter, scale, wait in ((True, False, False, False), (False, False, False, False),
                                         (False, True, False, False), (False, True, True, False),
                                         (False, False, False, True)):
        yield (grouped_gemm.grouped_gemm_kernel,
               dict(moe_args, c_ptr="*fp32" if scale else "*bf16"),
               dict(moe_tiles, GATHER=gather, WRITE_ROWS=gather, SCATTER=scatter, SCALE=scale,
                    ACCUMULATE=scale, WAIT=wait), 8)
    for b_desc, block in ((1, "64,128"), (2, "128,64")):  # the weights through TMA
        yield (grouped_gemm.grouped_gemm_kernel,
               dict(moe_args, b_ptr=f"tensordesc<bf16[{block}]>"),
               dict(moe_tiles, GATHER=True, WRITE_ROWS=True, SCATTER=False, SCALE=False,
                    ACCUMULATE=False, WAIT=False) | dict(B_DESC=b_desc), 8)
    # the rows through TMA (tma_a): plain with TMA weights, the combine's accumulation, the
    # tiles waiting on their counters (with the proxy fence)
    rows_desc = "tensordesc<bf16[128,64]>"
    for gather_free in (dict(B_DESC=1, SCATTER=False, SCALE=False, WAIT=False),
                        dict(SCATTER=True, SCALE=True, WAIT=False),
                        dict(SCATTER=False, SCALE=False, WAIT=True, PROXY_FENCE=True)):
        yield (grouped_gemm.grouped_gemm_kernel,
               dict(moe_args, a_desc=rows_desc, c_ptr="*fp32" if gather_free["SCALE"] else "*bf16",
                    b_ptr="tensordesc<bf16[64,128]>" if gather_free.get("B_DESC") else "*bf16"),
               dict(moe_tiles, GATHER=False, WRITE_ROWS=gather_free["WAIT"],
                    ACCUMULATE=gather_free["SCALE"], A_DESC=True) | gather_free, 8)
    # the small-expert tile (policy.SMALL_EXPERT_TILE): the waiting dispatch GEMM, 4 warps
    yield (grouped_gemm.grouped_gemm_kernel,
           dict(moe_args, a_desc="tensordesc<bf16[64,64]>", b_ptr="tensordesc<bf16[64,256]>"),
           dict(moe_tiles, BLOCK_M=64, BLOCK_N=256, GATHER=False, WRITE_ROWS=True, SCATTER=False,
                SCALE=False, ACCUMULATE=False, WAIT=True, PROXY_FENCE=True, A_DESC=True,
                B_DESC=1), 4)
    yield from moe_route_variants()
    yield from decode_variants()
    for limit in ("i32", "i64"):  # a bound in ns past 2^31 (2.1 s) comes as an int64
        yield (flags.wait_flags_kernel,
               dict(flag_ptr="*i32", first="i32", count="i32", epoch="i32", limit=limit,
                    err_ptr="*i32"), {}, 1)
        # the MoE waits: READY (an epoch) after the signals, ARRIVED (counts taken)
        for take, signal in ((False, True), (True, False)):
            yield (flags.wait_words_kernel,
                   dict(flag_ptr="*i32", first="i32", mask="i32", want="i32", wants_ptr="*i32",
                        limit=limit, err_ptr="*i32",
                        signal_ptr="*i64" if signal else "*i32", signal_mask="i32",
                        signal_value="i32"), dict(WORDS=8, TAKE=take, SIGNAL=signal), 1)
        # the dispatch's wait for every tile before its library GEMMs
        yield (grouped_gemm.wait_tiles_kernel,
               dict(count_ptr="*i32", expect_ptr="*i32", tiles="i32", limit=limit,
                    err_ptr="*i32"), dict(BLOCK=1024, PROXY_FENCE=True), 1)


def moe_route_variants():
    """The MoE routes (templates/moe_routes.py): the dispatch's publish (with and without an
    index), the put kernel of the dispatch and of the combine, at 2 and 8 ranks (the 3-rank
    world of the interpreter tests as well)."""
    table = dict(table_table="*i64", rank="i32", capacity="i32")
    # with an index, the READY handshake in its last program (the dispatch's step 2)
    for has_index, signal in ((True, True), (False, False)):
        yield (moe_routes.publish_routes_kernel,
               dict(table_ptr="*i32", row_index_ptr="*i64", offsets_ptr="*i32",
                    expect_ptr="*i32", received="i32", capacity="i32", E="i32",
                    done_ptr="*i32", signal_ptr="*i64" if signal else "*i32",
                    signal_mask="i32", epoch="i32", flag_ptr="*i32", wait_mask="i32",
                    limit="i64", err_ptr="*i32"),
               dict(BLOCK=128, BLOCK_M=128, E_P2=32, WORLD=8, HAS_INDEX=has_index,
                    SIGNAL=signal, WORDS=8 if signal else 1), 4)
    # the waits in the put's launch: none, the dispatch's tiles (before a library GEMM), the
    # combine's ARRIVED words
    waits = {moe_routes.NO_WAIT: dict(wait_ptr="*i64", wants_ptr="*i64", err_ptr="*i64"),
             moe_routes.WAIT_TILES: dict(wait_ptr="*i32", wants_ptr="*i32", err_ptr="*i32"),
             moe_routes.WAIT_WORDS: dict(wait_ptr="*i32", wants_ptr="*i32", err_ptr="*i32")}
    for world, expert_major, has_index, wait in (
            (2, True, False, moe_routes.NO_WAIT), (8, True, False, moe_routes.WAIT_TILES),
            (3, False, False, moe_routes.NO_WAIT), (8, False, True, moe_routes.WAIT_WORDS)):
        yield (moe_routes.put_rows_kernel,
               dict(x_ptr="*bf16", send_index_ptr="*i64" if has_index else "*bf16",
                    data_table="*i64", count_table="*i64", rows="i32", K="i32", **table,
                    wait_first="i32", wait_count="i32", limit="i64", **waits[wait]),
               dict(BLOCK_R=runtime_routes.PUT_ROWS, BLOCK_K=runtime_routes.PUT_BLOCK_K,
                    WORLD=world, WORLD_P2=1 << (world - 1).bit_length(),
                    EXPERT_MAJOR=expert_major, HAS_INDEX=has_index, WAIT=wait,
                    WAIT_BLOCK=1024 if wait == moe_routes.WAIT_TILES else 1,
                    PROXY_FENCE=wait == moe_routes.WAIT_TILES), runtime_routes.PUT_WARPS)


def decode_variants():
    """The decode GEMM (one row, the narrow configs, rows; the group of 3) and the decode
    attention (bf16 with each mask kind, fp32 with IEEE dots; 4 and 64 packed rows)."""
    mm = dict(a_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", K="i32",
              stride_am="i32", stride_ak="i32", stride_bk="i32", stride_bn="i32",
              stride_om="i32", stride_on="i32")
    for block_m, block_n, block_k, warps in ((1, 8, 1024, 8), (1, 4, 2048, 16), (1, 8, 2048, 16),
                                             (16, 32, 512, 4)):
        yield (gemv.gemv_kernel, mm, dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k),
               warps)
    group = dict(a_ptr="*bf16", **{f"{p}{i}_ptr": "*bf16" for p in ("b", "out") for i in range(3)},
                 **{name: "i32" for name in ("M", "N0", "N1", "N2", "K", "programs0",
                                             "programs1", "stride_am", "stride_ak",
                                             "stride_b0k", "stride_b0n", "stride_b1k",
                                             "stride_b1n", "stride_b2k", "stride_b2n",
                                             "stride_o0m", "stride_o1m", "stride_o2m")})
    yield (gemv.gemv_group_kernel, group, dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024), 8)
    split = decode_attention.decode_attention_split_kernel
    for dtype, mask, precision, block_r in (("bf16", "i1", "tf32", 16),
                                            ("bf16", "bf16", "tf32", 64),
                                            ("bf16", None, "tf32", 16), ("fp32", "i1", "ieee", 16)):
        types = dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", v_ptr=f"*{dtype}",
                     mask_ptr=f"*{mask or dtype}", part_ptr="*fp32", max_ptr="*fp32",
                     sum_ptr="*fp32", scale="fp32",
                     **{name: "i32" for name in split.arg_names
                        if name in ("KV", "R", "L", "keys_per_split") or name[:2] in
                        ("sq", "sk", "sv", "sm")})
        yield (split, types, dict(HAS_MASK=mask is not None, BOOL_MASK=mask == "i1",
                                  PRECISION=precision, BLOCK_R=block_r, BLOCK_L=64, D=128), 4)
    combine = decode_attention.decode_attention_combine_kernel
    yield (combine, dict(part_ptr="*fp32", max_ptr="*fp32", sum_ptr="*fp32", out_ptr="*bf16",
                         KV="i32", R="i32", splits="i32", so_b="i32", so_h="i32", so_r="i32"),
           dict(BLOCK_R=16, BLOCK_S=32, D=128), 4)


def compile_for_hopper(fn, arg_types, constexprs, num_warps,
                       divisible=("N", "K", "slots", "stride")):
    """As the JIT compiles it for arguments like the runtime's: every pointer 16-byte aligned
    (torch allocations and symmetric buffers are), and the specialised integers named in
    `divisible` multiples of 16."""
    signature = {name: "constexpr" if name in constexprs else arg_types[name]
                 for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name].startswith("*") or (name in divisible
                                                   and name not in fn.do_not_specialize)}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=HOPPER, options=dict(num_warps=num_warps))


def code_lines(ptx: str) -> list[str]:
    """The PTX without what names places in the source: .loc/.file directives, the debug
    sections and the labels only they refer to ($L__tmp: where an inlined call starts or ends)."""
    text = re.sub(r"^\s*\.section\s+\.debug.*?^\s*}", "", ptx, flags=re.S | re.M)
    return [line for line in text.splitlines()
            if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp\d+:|$)", line)]


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
    """Print the variants whose code differs between two --ptx folders; return their count."""
    names = sorted({p.name for p in before.glob("*.ptx")} | {p.name for p in after.glob("*.ptx")})
    differ = [n for n in names if not ((before / n).exists() and (after / n).exists())
              or code_lines((before / n).read_text()) != code_lines((after / n).read_text())]
    for name in differ:
        print(f"differs {name}")
    print(f"{len(names) - len(differ)} of {len(names)} variants identical")
    return len(differ)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ptx", type=pathlib.Path, help="write each variant's PTX here")
    parser.add_argument("--compare", nargs=2, type=pathlib.Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        raise SystemExit(1 if compare(*args.compare) else 0)
    for i, (fn, types, consts, warps) in enumerate(variants()):
        kernel = compile_for_hopper(fn, types, consts, warps)
        assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
        if args.ptx:
            args.ptx.mkdir(parents=True, exist_ok=True)
            (args.ptx / f"{i:03d}_{fn.__name__}.ptx").write_text(kernel.asm["ptx"])
        print(f"ok {fn.__name__} {consts}", flush=True)


if __name__ == "__main__":
    main()
