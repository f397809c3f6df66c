"""Every Triton kernel (the HAL's and the engine's) compiles for an NVIDIA (sm_90, 32-lane warps)
and an AMD (gfx942, 64-lane wavefronts) target, without a GPU.

The interpreter that runs the other kernel tests checks index math only; it accepts code the
compiler would reject. Compiling ahead of time through ``triton.compile`` needs no device, only
the backends bundled with Triton. The compile runs in a child process because this session's
kernel modules were imported in interpreter mode. The NVIDIA build of the KV kernels must move
rows with 128-bit loads and stores when a row's length is a multiple of 16 elements, as it is at
runtime, where Triton marks such integer arguments divisible by 16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

I64P, BF16P, F32P, U8P = "*i64", "*bf16", "*fp32", "*u8"
# kernel module, kernel, runtime-int arguments' types, constexprs, warps
KERNELS = {
    "alloc_extend": ("triton.alloc", "alloc_extend_kernel",
                     dict(prefix_ptr=I64P, seq_ptr=I64P, last_ptr=I64P, free_ptr=I64P, out_ptr=I64P, B="i32",
                          num_free="i32", num_out="i32", page_size="i32"), dict(BLOCK_B=256, BLOCK_T=64), 4),
    "assign_req_to_token": ("triton.alloc", "assign_req_to_token_kernel",
                            dict(table_ptr=I64P, rows_ptr=I64P, start_ptr=I64P, end_ptr=I64P, locs_ptr=I64P,
                                 num_rows="i32", row_len="i32", num_locs="i32"), dict(BLOCK_B=256, BLOCK_T=32), 4),
    "gather_cache_locs": ("triton.alloc", "gather_cache_locs_kernel",
                          dict(table_ptr=I64P, rows_ptr=I64P, start_ptr=I64P, end_ptr=I64P, out_ptr=I64P, B="i32",
                               num_rows="i32", row_len="i32", num_out="i32"), dict(BLOCK_B=256, BLOCK_T=32), 4),
    "accepted_kv_moves": ("triton.kv", "accepted_kv_moves_kernel",
                          dict(out_cache_loc=I64P, accept_ptr=I64P, table_ptr=I64P, rows_ptr=I64P, seq_ptr=I64P,
                               src_ptr=I64P, dst_ptr=I64P, B="i32", D="i32", num_rows="i32", row_len="i32"),
                          dict(ROWS=64, BLOCK_D=16), 4),
    "store_kv": ("triton.kv", "store_kv_kernel",
                 dict(k_cache=BF16P, v_cache=BF16P, locs_ptr=I64P, k_ptr=BF16P, v_ptr=BF16P, N="i32",
                      num_slots="i32", row_len="i32"), dict(ROWS=32, BLOCK_C=256), 4),
}
MOVE_ARGS = dict(k_cache=BF16P, v_cache=BF16P, src_ptr=I64P, dst_ptr=I64P, scratch_ptr=BF16P, N="i32",
                 num_slots="i32", row_len="i32", layer_stride="i64", num_col_blocks="i32")
KERNELS["move_kv registers"] = ("triton.kv", "move_kv_kernel", MOVE_ARGS,
                                dict(BLOCK_C=64, PAIR_TILE=512, USE_SCRATCH=False), 16)
KERNELS["move_kv scratch"] = ("triton.kv", "move_kv_kernel", MOVE_ARGS, dict(BLOCK_C=64, PAIR_TILE=512, USE_SCRATCH=True), 16)
ATTENTION_ARGS = dict(q_ptr=BF16P, k_ptr=BF16P, v_ptr=BF16P, out_ptr=BF16P, mid_o_ptr=F32P, mid_m_ptr=F32P,
                      mid_w_ptr=F32P, fold_m_ptr=F32P, fold_w_ptr=F32P, fold_o_ptr=F32P,
                      req_to_token_ptr=I64P, req_pool_ptr=I64P, kv_lens_ptr=I64P, q_lens_ptr=I64P, q_start_ptr=I64P,
                      tile_req_ptr=I64P, tile_q0_ptr=I64P, tree_mask_ptr=U8P, path_ptr=I64P, B="i32", R="i32", M="i32", S="i32",
                      N="i32", stride_slot="i32", sm_scale_log2="fp32", chunk="i32", SPLITS="i32")
# (Hq, H, d, tree D, BLOCK_Q, BLOCK_M, BLOCK_N, split, path, part, fold, dtype): SmolLM2 and Llama-8B
# heads; decode, tree verify (also along each node's path: the batch-invariant mode, whose splits a
# program may fold as it walks them, the shared prefix first), prefill; float32 (IEEE products, the
# conformance suite's) with a 64-node tree.
ATTENTION_CASES = {
    "decode split, 9/3x64": (9, 3, 64, 0, 5, 16, 64, True, False, 0, False, BF16P),
    "decode folded, 9/3x64": (9, 3, 64, 0, 5, 16, 128, True, False, 0, True, BF16P),
    "tree 16, 9/3x64": (9, 3, 64, 16, 21, 64, 128, False, False, 0, False, BF16P),
    "tree 16 on paths, 9/3x64": (9, 3, 64, 16, 1, 64, 32, True, True, 2, False, BF16P),
    "shared prefix folded, 9/3x64": (9, 3, 64, 0, 5, 16, 128, True, False, 1, True, BF16P),
    "tree 16 on paths folded, 9/3x64": (9, 3, 64, 16, 1, 16, 128, True, True, 2, True, BF16P),
    "decode split, 32/8x128": (32, 8, 128, 0, 4, 16, 32, True, False, 0, False, BF16P),
    "tree 8, 32/8x128": (32, 8, 128, 8, 8, 32, 32, True, False, 0, False, BF16P),
    "tree 64 float32, 8/2x64": (8, 2, 64, 64, 16, 64, 64, True, False, 0, False, F32P),
}
for name, (Hq, H, d, T, BQ, BM, BN, split, path, part, fold, dtype) in ATTENTION_CASES.items():
    KERNELS[f"attention {name}"] = ("triton.attention", "attention_kernel",
                                    dict(ATTENTION_ARGS, q_ptr=dtype, k_ptr=dtype, v_ptr=dtype, out_ptr=dtype),
                                    dict(Hq=Hq, H=H, HEAD_DIM=d, TREE_D=T, BLOCK_Q=BQ, BLOCK_M=BM, BLOCK_N=BN,
                                         BLOCK_D=d, SPLIT=split, EVEN=not path, PATH=path, PART=part, FOLD=fold,
                                         IEEE=dtype == F32P, UPCAST=False, PDL=False), 4)
KERNELS["attention plan"] = ("triton.attention", "plan_kernel",
                             dict(q_lens_ptr=I64P, q_lens_out=I64P, q_start_out=I64P, tile_req_out=I64P,
                                  tile_q0_out=I64P, B="i32", count="i32"), dict(BLOCK_Q=5, BLOCK_B=16, BLOCK_T=32), 4)
KERNELS["attention merge"] = ("triton.attention", "merge_kernel",
                              dict(mid_o_ptr=F32P, mid_m_ptr=F32P, mid_w_ptr=F32P, out_ptr=BF16P, ROWS="i32",
                                   SPLITS="i32"),
                              dict(HEAD_DIM=64, BLOCK_R=8, BLOCK_S=16, BLOCK_D=64, SKIP_EMPTY=True, PDL=False), 4)
KERNELS["rms_norm"] = ("gpu.norm", "rms_norm_kernel", dict(x_ptr=BF16P, delta_ptr=BF16P, weight_ptr=BF16P,
                                                              out_ptr=BF16P, hidden="i32", eps="fp32"),
                       dict(ADD=True, BLOCK=1024, PDL=False), 4)
KERNELS["rotary_store"] = ("gpu.rotary", "rotary_store_kernel",
                           dict(qkv_ptr=BF16P, pos_ptr=I64P, cos_sin_ptr=F32P, q_ptr=BF16P, k_ptr=BF16P, v_ptr=BF16P,
                                loc_ptr=I64P, max_pos="i32", num_slots="i32"),
                           dict(HQ=9, H=3, HEAD_DIM=64, BLOCK_H=16, HALF=32, PDL=False), 4)
KERNELS["block_argmax"] = ("gpu.argmax", "block_argmax_kernel", dict(x_ptr=BF16P, best_ptr=F32P, index_ptr="*i32",
                                                                    V="i32"), dict(BLOCK=4096, PDL=False), 8)
KERNELS["row_argmax"] = ("gpu.argmax", "row_argmax_kernel", dict(best_ptr=F32P, index_ptr="*i32", out_ptr=I64P,
                                                                blocks="i32", V="i32"), dict(BLOCK_B=32, PDL=False), 1)
KERNELS["swiglu"] = ("gpu.swiglu", "swiglu_kernel", dict(x_ptr=BF16P, out_ptr=BF16P, inter="i32"),
                     dict(BLOCK=1024, PDL=False), 4)
LINEAR_ARGS = dict(x_ptr=BF16P, w_ptr=BF16P, out_ptr=BF16P, part_ptr=F32P, count_ptr="*i32", M="i32", N="i32",
                   K="i32", K_SPLIT="i32", eps="fp32", q_ptr=BF16P, k_ptr=BF16P, v_ptr=BF16P, pos_ptr=I64P,
                   table_ptr=F32P, loc_ptr=I64P, max_pos="i32", num_slots="i32")
# (norm, glu, add, rope, K splits): the projections' kinds (rope: the QKV product that rotates and
# stores K/V, SmolLM2's heads), and split reductions with each epilogue.
for norm, glu, add, rope, split in ((False, False, False, False, 1), (True, False, False, False, 1),
                                    (True, True, False, False, 1), (False, False, True, False, 1),
                                    (True, False, False, True, 1), (True, False, False, False, 4),
                                    (True, True, False, False, 2), (False, False, True, False, 8),
                                    (True, False, False, True, 4)):
    KERNELS[f"fused_linear norm {norm} glu {glu} add {add} rope {rope} split {split}"] = (
        "gpu.matmul", "linear_kernel", LINEAR_ARGS,
        dict(NORM=norm, GLU=glu, ADD=add, ROPE=rope, HQ=9, H=3, HEAD_DIM=64, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256,
             SPLIT=split, NORM_BLOCK=1024, IEEE=False, UPCAST=False, PDL=False), 4)
# One row: Triton passes an integer argument of 1 as a constant.
KERNELS["fused_linear split 4 one row"] = (
    "gpu.matmul", "linear_kernel", {k: v for k, v in LINEAR_ARGS.items() if k != "M"},
    dict(M=1, NORM=True, GLU=True, ADD=False, ROPE=False, HQ=1, H=1, HEAD_DIM=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256,
         SPLIT=4, NORM_BLOCK=1024, IEEE=False, UPCAST=False, PDL=False), 4)
for live in (False, True):
    KERNELS[f"lookup live {live}"] = (
        "gpu.lookup", "lookup_kernel",
        dict(table_ptr=I64P, rows_ptr=I64P, tokens_ptr=I64P, lens_ptr=I64P, seq_lens_ptr=I64P, live_ptr=I64P,
             out_ptr=I64P, W="i32", stride="i32", n="i32"),
        dict(MAX_NGRAM=8, MIN_NGRAM=1, BLOCK=512, BLOCK_S=16, BLOCK_N=16, HAS_LIVE=live), 4)
DIVISIBLE_BY_16 = {"row_len", "layer_stride"}
TARGETS = {"sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}


def compile_all(target_name: str) -> dict:
    """Compile every kernel of ``KERNELS`` for ``target_name``; per kernel, the counts of 128-bit
    global loads and stores and of grid-dependency waits in the NVIDIA assembly (None for another
    target). On NVIDIA a kernel that takes ``PDL`` compiles once more with it on, as ``"NAME pdl"``."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, lanes = TARGETS[target_name]
    target = GPUTarget(backend, arch, lanes)
    out = {}
    builds = [(name, *spec) for name, spec in KERNELS.items()]
    if backend == "cuda":
        builds += [(f"{name} pdl", module, kernel, args, dict(constexprs, PDL=True), warps)
                   for name, (module, kernel, args, constexprs, warps) in KERNELS.items() if "PDL" in constexprs]
    for name, module, kernel, args, constexprs, warps in builds:
        fn = getattr(importlib.import_module(f"ngram_hal.kernels.{module}"), kernel)
        names = fn.arg_names
        signature = {n: args.get(n, "constexpr") for n in names}
        constants = {(names.index(k),): v for k, v in constexprs.items()}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if args.get(n, "").startswith("*") or n in DIVISIBLE_BY_16}
        compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=target,
                                  options={"num_warps": max(1, warps * 32 // lanes)})
        ptx = compiled.asm.get("ptx")
        out[name] = None if ptx is None else {"v4_loads": ptx.count("ld.global.v4"),
                                              "v4_stores": ptx.count("st.global.v4"),
                                              "waits": ptx.count("griddepcontrol.wait")}
    return out


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_kernels_compile(target):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_triton_compile as t; "
            "print(json.dumps(t.compile_all(sys.argv[2])))")
    run = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), target], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    with_pdl = {f"{name} pdl" for name, spec in KERNELS.items() if "PDL" in spec[3]} if target == "sm_90" else set()
    assert set(results) == set(KERNELS) | with_pdl
    if target == "sm_90":
        for name in ("store_kv", "move_kv registers", "move_kv scratch"):
            assert results[name]["v4_loads"] > 0 and results[name]["v4_stores"] > 0, (name, results[name])
        # A kernel launched early waits for its predecessor; without PDL it holds no wait.
        assert len(with_pdl) >= 12
        for name in with_pdl:
            assert results[name]["waits"] >= 1 and results[name.removesuffix(" pdl")]["waits"] == 0, name
