"""Every Triton kernel, at every GPU launch configuration, compiles for SM90 (H100/H200) without a GPU.

The interpreter accepts code the compiler rejects (and the reverse), so CI also runs Triton's real
compiler down to a cubin for the Hopper target. It runs in a subprocess because the test process
imported the kernels under TRITON_INTERPRET=1, which makes @triton.jit build interpreter functions.
The MLP GEMM kernels and CPLM's pointer kernels compile as a launch at record shapes specializes them
(16-byte aligned pointers and sizes, unit inner strides): only then does Triton pipeline their loads,
and the pipelined buffers must fit H100 shared memory.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

COMPILE_ALL = r'''
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton.backends.nvidia  # noqa: F401  (ships ptxas)
except ImportError as exc:
    print(f"SKIP: no Triton NVIDIA backend: {exc}")
    sys.exit(0)
import triton.language as tl
from perf.kernels import (copy_pointer, cross_entropy, mlp, ngram_embed, qkv_rope, symmetric_matmul, transpose,
                          value_embed, windowed_backward)

LAUNCH_OPTIONS = ("num_warps", "num_stages")
H100_SHARED_MEMORY = 232448  # bytes per block (227 KiB)


def compile_sm90(kernel, pointers, constexprs, tiles, unit_args=None):
    """unit_args: compile as a launch with aligned tensors specializes (these ints are 1, others % 16 == 0;
    () for none equal to 1)."""
    options = {k: v for k, v in tiles.items() if k in LAUNCH_OPTIONS}
    constexprs = {**constexprs, **{k: v for k, v in tiles.items() if k not in LAUNCH_OPTIONS}}
    signature, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif unit_args is not None and p.name in unit_args:
            signature[p.name], constexprs[p.name] = "constexpr", 1
        elif p.name.endswith("_ptr"):
            signature[p.name] = pointers.get(p.name, "*fp32")
        else:
            signature[p.name] = "fp32" if p.name in ("alpha", "beta") else "i32"
        if unit_args is not None and signature[p.name] != "constexpr":
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"], kernel
    assert compiled.metadata.shared <= H100_SHARED_MEMORY, (kernel.__name__, compiled.metadata.shared)
    if unit_args is not None:  # the operand loads are software-pipelined (asynchronous copies)
        assert "cp.async" in compiled.asm["ptx"], kernel.__name__
    print("compiled", kernel.__name__, constexprs, options, "shared", compiled.metadata.shared)


def gpu_configs(tiles):
    return [v for k, v in tiles.items() if k.startswith("cuda")]


for tiles in gpu_configs(symmetric_matmul.TILES):
    for add_input in (False, True):
        compile_sm90(symmetric_matmul._gram_kernel, dict(y_ptr="*bf16", a_ptr="*bf16", out_ptr="*bf16"),
                     dict(ADD_INPUT=add_input, UPCAST_DOT=False), tiles)
for tiles in gpu_configs(transpose.TILES):
    for dst in ("*bf16", "*fp32"):
        for accumulate in (False, True):
            compile_sm90(transpose._transpose_kernel, dict(src_ptr="*bf16", dst_ptr=dst), dict(ACCUMULATE=accumulate), tiles)
for tiles in gpu_configs(value_embed.GATHER_TILES):
    for ids in ("*i32", "*i64"):
        compile_sm90(value_embed._gather_rows_kernel, dict(table_ptr="*bf16", ids_ptr=ids, out_ptr="*bf16"), {}, tiles)
for tiles in gpu_configs(value_embed.SCATTER_TILES):
    for ids in ("*i32", "*i64"):
        compile_sm90(value_embed._scatter_add_rows_kernel,
                     dict(dst_ptr="*fp16", grad_ptr="*bf16", sorted_ids_ptr=ids, order_ptr="*i64", run_end_ptr="*i64"), {}, tiles)
for tiles in gpu_configs(ngram_embed.TILES):
    compile_sm90(ngram_embed._ngram_forward_kernel,
                 dict(rows_ptr="*bf16", pool_ptr="*bf16", sign_rows_ptr="*i32", out_ptr="*bf16"), {}, tiles)
    compile_sm90(ngram_embed._ngram_backward_kernel,
                 dict(grad_ptr="*bf16", pool_ptr="*bf16", sign_rows_ptr="*i32", d_rows_ptr="*bf16"), {}, tiles)
softcap = dict(A=cross_entropy.SOFTCAP_A, B=cross_entropy.SOFTCAP_B, C=cross_entropy.SOFTCAP_C, NUM_MTP=3)
for tiles in gpu_configs(cross_entropy.TILES):
    for logits in ("*fp32", "*bf16", "*fp8e4nv"):
        for prefix in (False, True):
            # a compiled backward gets a zero lse gradient, not None: the record runs HAS_LSE_GRAD=True;
            # NUM_GATHER = 2 (CPLM's (y_t, <copy>) gathered z): the forward writes zg, the backward folds
            # grad_zg, with or without an lse gradient (with prefix only, to keep the count down)
            for write_grad, lse_grad in (((False, False), (True, False), (True, True)) if logits != "*fp8e4nv"
                                         else ((False, False),)):
                for gather in ((0, 2) if prefix else (0,)):
                    compile_sm90(cross_entropy._softcapped_ce_kernel,
                                 dict(logits_ptr=logits, targets_ptr="*i64", prefix_ptr="*i64", weights_ptr="*fp32",
                                      row_loss_ptr="*fp32", lse_ptr="*fp32", grad_ptr=logits if write_grad else "*fp32",
                                      gather_ptr="*i64"),
                                 dict(softcap, HAS_PREFIX=prefix, WRITE_GRAD=write_grad, HAS_LSE_GRAD=lse_grad,
                                      NUM_GATHER=gather), tiles)
    for prefix in (False, True):  # the e5m2 gradient reads e4m3 logits only: once per variant
        for lse_grad in (False, True):
            for gather in ((0, 2) if prefix else (0,)):
                compile_sm90(cross_entropy._softcapped_ce_grad_e5m2_kernel,
                             dict(logits_ptr="*fp8e4nv", targets_ptr="*i64", prefix_ptr="*i64", weights_ptr="*fp32",
                                  lse_ptr="*fp32", grad_out_ptr="*fp32", grad_scale_ptr="*fp32", out_ptr="*u8",
                                  gather_ptr="*i64"),
                             dict(softcap, E5M2_MAX=cross_entropy.E5M2_MAX, HAS_PREFIX=prefix, HAS_LSE_GRAD=lse_grad,
                                  NUM_GATHER=gather), tiles)
mlp_unit_strides = ("stride_xd", "stride_gd", "stride_wd")  # the fp8 caches and activations are row-major
for dtype in (tl.bfloat16, tl.float32):
    compile_sm90(mlp._up_relu2_fp8_kernel, dict(x8_ptr="*fp8e4nv", w1_ptr="*fp8e4nv", post8_ptr="*fp8e4nv",
                 post8_t_ptr="*fp8e4nv"), dict(PRE_DTYPE=dtype, INTERPRETER=False), mlp.TILES["cuda_fp8"], mlp_unit_strides)
    compile_sm90(mlp._dpre_fp8_kernel, dict(g8_ptr="*fp8e5", w2_ptr="*fp8e4nv", post8_ptr="*fp8e4nv", dpre8_ptr="*fp8e5",
                 dpre8_t_ptr="*fp8e5"), dict(DPRE_DTYPE=dtype, INTERPRETER=False), mlp.TILES["cuda_fp8"], mlp_unit_strides)
compile_sm90(mlp._up_relu2_bf16_kernel, dict(x_ptr="*bf16", w1_ptr="*bf16", post_ptr="*bf16"), dict(INTERPRETER=False),
             mlp.TILES["cuda_bf16"], mlp_unit_strides)
compile_sm90(qkv_rope._quantize_dual_kernel, dict(x_ptr="*bf16", x8_ptr="*fp8e4nv", x8_t_ptr="*fp8e4nv"),
             dict(INTERPRETER=False), qkv_rope.TILES["cuda_quantize"])
# the record's attention layer kinds (track_1_short/model/attention.py): (d_qk, d_v, paired, key offset)
for qk_dim, v_dim, paired, key_offset in ((64, 128, True, False), (64, 64, False, False), (128, 128, False, True)):
    rope = dict(NUM_HEADS=6, QK_DIM=qk_dim, ROTARY_DIM=64, EPS=qkv_rope.RMS_NORM_EPS, PAIRED=paired,
                KEY_OFFSET=key_offset, INTERPRETER=False, BLOCK_D=qk_dim)
    compile_sm90(qkv_rope._qk_norm_rope_kernel, dict(qk_ptr="*bf16", factor1_ptr="*bf16", factor2_ptr="*bf16",
                 q_ptr="*bf16", k_ptr="*bf16"), dict(rope, OUT_DTYPE=tl.bfloat16), qkv_rope.TILES["cuda_rope"])
    compile_sm90(qkv_rope._qkv_rope_backward_kernel, dict(grad_q_ptr="*bf16", grad_k_ptr="*bf16", grad_v_ptr="*bf16",
                 qk_ptr="*bf16", factor1_ptr="*bf16", factor2_ptr="*bf16", g8_ptr="*fp8e4nv", g8_t_ptr="*fp8e4nv"),
                 dict(rope, QK_DTYPE=tl.bfloat16, V_DIM=v_dim, BLOCK_V=v_dim), qkv_rope.TILES["cuda_rope_backward"])
# CPLM's pointer head (PR #379) at d = 128, specialized as a record launch is (aligned pointers, N and L
# multiples of 16: the key and query tiles' loads pipelined): bf16 q/k on the tensor cores (the record) and
# fp32 (UPCAST: IEEE dots, the GPU tests' other dtype and the most shared memory, ~115 KiB)
pointer_ints = dict(inputs_ptr="*i32", targets_ptr="*i64", doc_ptr="*i32", dstart_ptr="*i32", dend_ptr="*i32")
for tiles in gpu_configs(copy_pointer.TILES):
    for qk in ("*bf16", "*fp32"):
        pointer = dict(SCALE=128 ** -0.5, D=128, BLOCK_D=128, UPCAST=qk == "*fp32")
        compile_sm90(copy_pointer._copy_pointer_fwd_kernel, dict(pointer_ints, q_ptr=qk, k_ptr=qk), pointer, tiles, ())
        compile_sm90(copy_pointer._copy_pointer_dq_kernel, dict(pointer_ints, q_ptr=qk, k_ptr=qk, dq_ptr=qk),
                     pointer, tiles, ())
        compile_sm90(copy_pointer._copy_pointer_dk_kernel, dict(pointer_ints, q_ptr=qk, k_ptr=qk, dk_ptr=qk),
                     pointer, tiles, ())
# PR #371's restricted attention backward (perf/kernels/windowed_backward.py) at both record head shapes, each at
# its tiles (d_qk/d_v 64/128 on the paired layers: query tile 64; 64/64 on layers 1 and 8: 128), specialized as
# a record launch is (aligned pointers, n, window and strides multiples of 16), bf16 on the tensor cores (the
# record; fp32, the GPU tests' other dtype, took at most 198,144 bytes at these tiles with Triton 3.8)
window_ints = dict(lse_ptr="*fp32", delta_ptr="*fp32", seg_ptr="*i32", seg_start_ptr="*i32", seg_end_ptr="*i32",
                   head_windows_ptr="*i32")
for tiles_name, qk_dim, v_dim in (("cuda_dv128", 64, 128), ("cuda", 64, 64)):
    tiles = windowed_backward.TILES[tiles_name]
    heads = dict(SCALE=qk_dim ** -0.5, DQK=qk_dim, BLOCK_DQK=qk_dim, DV=v_dim, BLOCK_DV=v_dim, UPCAST=False)
    tensors = dict(window_ints, **{name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "d_out_ptr", "out_ptr",
                                                             "dq_ptr", "dk_ptr", "dv_ptr")})
    compile_sm90(windowed_backward._delta_kernel, tensors, dict(DV=v_dim, BLOCK_DV=v_dim),  # no loop to pipeline
                 {k: v for k, v in tiles.items() if k != "BLOCK_N"})
    compile_sm90(windowed_backward._dkdv_kernel, tensors, heads, tiles, ())
    compile_sm90(windowed_backward._dq_kernel, tensors, heads, tiles, ())
print("ALL COMPILED")
'''


@pytest.mark.triton
@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", COMPILE_ALL], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and "ALL COMPILED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
