"""Functions `python -m tools.cross_compile --function tests/tools/cross_compile_cases.py:NAME` [--sm SM] compiles
for the faked GPU (SM90 by default): each returns (fn, args), built on that device (fake tensors,
shapes only).
Used by tests/tools/test_tools_cross_compile.py."""
import torch

from perf.fp8 import E4M3, scaled_mm

SLOTS = 12  # record #360: the MLP bank's slots, one scale each in a [12] buffer (perf/kernels/mlp.py)


def _operands():
    """a (T, D) e4m3 row-major; w (H, D) e4m3, used as its transpose (D, H): column-major, as the MLP's
    weight caches and cuBLASLt have it (graph inputs are whole tensors: see tools/cross_compile.py)."""
    return torch.zeros(256, 128, dtype=E4M3), torch.zeros(512, 128, dtype=E4M3), torch.ones(SLOTS), torch.ones(SLOTS)


def raw_scaled_mm_slot_view():
    """torch._scaled_mm with 0-D views of [12] per-slot buffers as its scales, the way the MLP took
    them before fp8 GEMMs became an opaque op: inductor's SM90 lowering reshapes each scale to
    [1, 1] and fails on the view ("12 != 1")."""
    def fn(a, w, scale_a, scale_b):
        return torch._scaled_mm(a, w.t(), scale_a=scale_a[3], scale_b=scale_b[5], out_dtype=torch.bfloat16)
    return fn, _operands()


def mlp_scaled_mm_slot_view():
    """The same GEMM through perf.fp8.scaled_mm, with the scales the MLP passes: a slot's view, and a
    slot's view times the post-λ (the fold)."""
    def fn(a, w, scale_a, scale_b, post_lambda):
        return scaled_mm(a, w.t(), scale_a[3], scale_b[5] * post_lambda, torch.bfloat16, True)
    return fn, (*_operands(), torch.ones((), dtype=torch.float32))


def _flex_case(training: bool):
    from perf.attention_backends import flex_varlen_attention

    def fn(q, k, v, cu_seqlens):
        return flex_varlen_attention(q, k, v, cu_seqlens, window=384, softmax_scale=0.12, paired=True)

    T = 1024  # a multiple of flex's 128-position tile, as the run's micro-batches are
    q, k = (torch.zeros(T, 6, 64, dtype=torch.bfloat16, requires_grad=training) for _ in range(2))
    v = torch.zeros(T, 6, 128, dtype=torch.bfloat16, requires_grad=training)
    return fn, (q, k, v, torch.zeros(8, dtype=torch.int32))


def flex_attention_recipe_widths():
    """flex attention, what SM89 and SM80 run for FA3 (perf.backend.detect), at record #360's widths
    on its paired-head layers (6 heads, d_qk 64, d_v 128; [2T, 3, d] streams), forward and backward:
    its Triton templates pick their tiles by the GPU's capability and shared memory."""
    return _flex_case(training=True)


def flex_attention_validation():
    """The same attention in an inference graph, as a validation forward runs it: the mask's segment
    ids captured as a computed tensor failed to lower here (perf/attention_backends.py
    `_segment_ids_op`)."""
    return _flex_case(training=False)


def up_relu2_fp8_record_tile():
    """The fp8 MLP's up-projection kernel at record #360's tile (perf/kernels/mlp.py TILES["cuda_fp8"],
    3 stages: 176 KiB of shared memory per block for sm_90, 128 KiB for sm_89): over an L40S's 99 KiB,
    so inductor recompiles it with one stage, as at its first launch on such a GPU."""
    from perf.fp8 import E4M3
    from perf.kernels.mlp import up_relu2_fp8_triton

    def fn(x8, w1_8, s_x, s_w1, s_post, post_amax):
        return up_relu2_fp8_triton(x8, w1_8, s_x, s_w1, s_post, post_amax, torch.bfloat16)

    scales = (torch.ones((), dtype=torch.float32) for _ in range(4))
    return fn, (torch.zeros(256, 128, dtype=E4M3), torch.zeros(512, 128, dtype=E4M3), *scales)


def doc_copy_matcher_and_copy_vector():
    """DocCopy (PR #378, model/doc_copy.py) at a smoke batch of 512 tokens: the matcher (hashes, prefix
    scans, the stable sort of 10·T int64 keys, scatters back) and the copy vector from its buckets."""
    from model.doc_copy import COPY_BUCKETS, copy_vector, doc_copy_features, hash_powers

    def fn(tokens, norm_map, pow_fwd, pow_bwd, copied, scale, bucket_embed, live):
        candidate, bucket = doc_copy_features(tokens, norm_map, pow_fwd, pow_bwd)
        return candidate, copy_vector(copied, bucket, scale, bucket_embed, live)

    T, D = 512, 96
    return fn, (torch.zeros(T, dtype=torch.int32), torch.arange(50304, dtype=torch.int32), *hash_powers(T),
                torch.zeros(T, D, dtype=torch.bfloat16), torch.zeros(COPY_BUCKETS), torch.zeros(COPY_BUCKETS, D),
                torch.ones(COPY_BUCKETS))


def cplm_head_and_mixture_loss():
    """CPLM (PR #379, model/cplm.py) at a smoke batch of 1,024 tokens, forward and backward: the pointer's
    projections and QK norm, its three Triton kernels (perf/kernels/copy_pointer.py, band 2048), and the fp8
    lm_head CE handing back lse and the gathered z of the target and `<copy>` columns (NUM_GATHER = 2) under
    the sampled softmax, the mixture NLL on top (model/loss.py training_loss); and the validation's mixture on
    the full softmax (band 8192) with its diagnostic sums added into a buffer (model/loss.py validation_loss),
    whose count was once a constant tensor built from a Python float: a host-to-device copy that the fake
    GPU refused (as it should: on a GPU it is a copy the validation would wait for)."""
    from model.cplm import COPY_BAND_VAL, COPY_DIM, COPY_TOKEN_ID, DIAGNOSTICS, copy_head
    from model.loss import training_loss, validation_loss

    def fn(h, bank, k_sink, gain, lm_head, inputs, targets, cu_seqlens, candidates, mtp, diagnostics):
        copy = copy_head(h, bank, k_sink, gain, inputs, targets, cu_seqlens, 2048)
        loss = training_loss(h, lm_head, targets, mtp, None, None, candidates, fp8=True, copy=copy)
        val_copy = copy_head(h, bank, k_sink, gain, inputs, targets, cu_seqlens, COPY_BAND_VAL)
        return loss, validation_loss(h, lm_head, targets, inputs, None, val_copy, diagnostics)

    T, D, P = 1024, 96, 1280
    leaf = dict(requires_grad=True)
    candidates = torch.cat([torch.arange(P - 1), torch.tensor([COPY_TOKEN_ID])])
    return fn, (torch.zeros(T, D, dtype=torch.bfloat16, **leaf), torch.zeros(2, COPY_DIM, D, dtype=torch.bfloat16, **leaf),
                torch.zeros(COPY_DIM, **leaf), torch.ones(1, **leaf), torch.zeros(D, 50304, dtype=torch.bfloat16, **leaf),
                torch.zeros(T, dtype=torch.int32), torch.zeros(T, dtype=torch.long),
                torch.tensor([0, 300, 700, T, T], dtype=torch.int32), candidates, torch.tensor([1.0, 0.5]),
                torch.zeros(len(DIAGNOSTICS)))


def restricted_attention_paired():
    """PR #371's mode 2 on a paired layer at record #360's widths (6 heads, d_qk 64, d_v 128; [2T, 3, d]
    streams, W = 384), forward and backward, as the model calls it on the fa3 backend: FA3's forward with its
    LSE and the restricted backward, two opaque custom ops (perf/windowed_backward.py) in the graph with the
    head table an input; the layout around them inductor's. (The Triton windowed backward's own cubins:
    tests/perf/test_perf_compile_sm90.py.)"""
    from perf.windowed_backward import restricted_backward_attention

    def fn(q, k, v, cu_seqlens, head_windows):
        return restricted_backward_attention(q, k, v, cu_seqlens, 384, 0.12, head_windows, paired=True,
                                             max_seqlen=1024)

    T = 1024
    q, k = (torch.zeros(T, 6, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.zeros(T, 6, 128, dtype=torch.bfloat16, requires_grad=True)
    return fn, (q, k, v, torch.zeros(8, dtype=torch.int32), torch.full((3,), -1, dtype=torch.int32))
