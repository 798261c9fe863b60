"""The one script a lent H100/H200 runs: every registered check's parity and speed, in one table.

Each kernel check runs a fast-path kernel and its portable twin at record shapes, reports the
largest parity error against the check's tolerance, and times both with CUDA events (median of
repeats); the ratio is torch time / kernel time (> 1: the kernel is faster). The `gpu_tests` check
runs the pytest tests marked `gpu` (CI skips them). The table is printed with the device and
library versions in its header and written as results.json and results.md.

    python tools/gpu_check.py                      # on the GPU machine; must finish well under 8 minutes
    python tools/gpu_check.py --only transpose     # checks whose name starts with a prefix
    python tools/gpu_check.py --dry-run --out /tmp/check   # CPU, tiny shapes, Triton interpreter: the plumbing

`--out` defaults to $OUT when set, else tools/results/. The exit status is 1 if any parity fails.

Adding a check (a later kernel, a model step): write `def check_x(ctx: Context) -> list[Result]`
decorated with `@register("x")` in this file or in any module imported before `main()` runs. Use
`ctx.shape(record=..., tiny=...)` for sizes, `ctx.time_ms(fn)` for timings and `ctx.peak_mib(fn)`
for memory; the runner, the table and the files need no change.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# ------------------------------------------------------------------------------------------------
# Parity measure shared by the checks (and the tests)


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 atol: float = 0.0) -> float:
    """Largest |actual - expected| beyond `atol`, in units of `dtype`'s ulp at max(|actual|, |expected|).

    dtype defaults to expected's. A kernel that rounds (or, in Triton's interpreter, truncates) the
    same fp32 value as its twin lands within 1 ulp; `atol` absorbs the fp32 reordering error of
    sums that cancel to almost nothing, where ulps shrink without bound.
    """
    dtype = dtype or expected.dtype
    if actual.shape != expected.shape:
        raise ValueError(f"ulp_distance: shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    info = torch.finfo(dtype)
    magnitude = torch.maximum(a.abs(), e.abs()).clamp_min(info.tiny)
    _, exponent = torch.frexp(magnitude)  # magnitude = m·2^exponent with m in [0.5, 1)
    ulp = info.eps * torch.ldexp(torch.ones_like(magnitude), exponent - 1)
    excess = ((a - e).abs() - atol).clamp_min(0.0)
    return float((excess / ulp).max()) if excess.numel() else 0.0


# ------------------------------------------------------------------------------------------------
# Results, context and registry


@dataclass
class Result:
    check: str  # registry name
    case: str  # what was run, e.g. "xxt qk (6,256,768)"
    error: float  # parity error in `unit`
    tol: float
    unit: str  # "ulp" (of the output dtype) or "abs"
    kernel_ms: float | None = None
    torch_ms: float | None = None
    peak_mib: float | None = None
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.error <= self.tol

    @property
    def ratio(self) -> float | None:
        if self.kernel_ms is None or self.torch_ms is None or self.kernel_ms <= 0:
            return None
        return self.torch_ms / self.kernel_ms


@dataclass
class Context:
    device: torch.device
    dry_run: bool
    repeats: int = 20
    warmup: int = 3

    def shape(self, record, tiny):
        """The record shape on a GPU, the tiny one in a dry run."""
        return tiny if self.dry_run else record

    def time_ms(self, fn: Callable[[], object]) -> float:
        """Median milliseconds of fn(): CUDA events on a GPU, perf_counter on the CPU (dry run: one call, no
        warm-up call: its numbers only show the plumbing runs)."""
        repeats, warmup = (1, 0) if self.dry_run else (self.repeats, self.warmup)
        for _ in range(warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    def compare(self, check: str, case: str, error: float, tol: float, unit: str,
                kernel: Callable[[], object], baseline: Callable[[], object]) -> Result:
        """A result row for a parity error already measured, with the kernel and its torch baseline timed."""
        return Result(check, case, error, tol, unit, kernel_ms=self.time_ms(kernel), torch_ms=self.time_ms(baseline))

    def peak_mib(self, fn: Callable[[], object]) -> float | None:
        """Peak CUDA memory allocated while fn() runs, in MiB (None on the CPU)."""
        if self.device.type != "cuda":
            fn()
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) / 2**20


CheckFn = Callable[[Context], "list[Result]"]
CHECKS: dict[str, CheckFn] = {}


def register(name: str) -> Callable[[CheckFn], CheckFn]:
    def add(fn: CheckFn) -> CheckFn:
        if name in CHECKS:
            raise ValueError(f"gpu_check: a check named {name!r} is already registered")
        CHECKS[name] = fn
        return fn
    return add


# ------------------------------------------------------------------------------------------------
# Checks: the Triton kernels against their portable twins at record shapes


def _fp32_sum_slack(terms: float, magnitude: float) -> float:
    """Bound on how far two fp32 summation orders of `terms` terms can disagree; magnitude >= Σ|term|."""
    return terms * 2.0**-24 * magnitude


def _max_abs(x: torch.Tensor) -> float:
    return float(x.detach().float().abs().max())


@register("symmetric_matmul")
def check_symmetric_matmul(ctx: Context) -> list[Result]:
    from perf.kernels import symmetric_matmul as sm

    # per-rank ANVIL bank chunks (record #360: track_1_short/optim/anvil.py): (matrices, rows, cols)
    chunks = ctx.shape(record={"qk": (6, 256, 768), "vo": (2, 768, 768), "mlp": (3, 2816, 768)},
                       tiny={"qk": (2, 24, 40), "vo": (1, 40, 40), "mlp": (2, 72, 40)})
    b, c = -6.095026865488, 3.905234618423  # record #360 (track_1_short/optim/anvil.py): the first ANVIL map's (b, c)
    results = []
    for bank, shape in chunks.items():
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        X = torch.randn(shape, device=ctx.device, generator=gen)
        X = (X / (1.05 * X.norm(dim=(-2, -1), keepdim=True))).bfloat16()  # normalized as in ANVIL's step 3
        rows, cols = shape[1:]
        if rows > cols:  # the Gram the cascade takes: XᵀX for tall matrices, else XXᵀ
            name, kernel, twin, summed = "xtx", sm.xtx_triton, sm.xtx_portable, rows
        else:
            name, kernel, twin, summed = "xxt", sm.xxt_triton, sm.xxt_portable, cols
        A = twin(X)
        slack = _fp32_sum_slack(summed, summed * _max_abs(X) ** 2)
        results.append(ctx.compare("symmetric_matmul", f"{name} {bank} {tuple(shape)}",
                                   ulp_distance(kernel(X), A, atol=slack), 1.0, "ulp",
                                   lambda: kernel(X), lambda: twin(X)))
        m = A.shape[-1]
        slack = _fp32_sum_slack(m, m * abs(c) * _max_abs(A) ** 2 + abs(b) * _max_abs(A))
        error = ulp_distance(sm.poly_triton(A, b, c), sm.poly_portable(A, b, c), atol=slack)
        results.append(ctx.compare("symmetric_matmul", f"poly {bank} {tuple(A.shape)}", error, 1.0, "ulp",
                                   lambda: sm.poly_triton(A, b, c), lambda: sm.poly_portable(A, b, c)))
    return results


@register("transpose")
def check_transpose(ctx: Context) -> list[Result]:
    from perf.kernels import transpose as tr

    d, v = ctx.shape(record=(768, 50304), tiny=(40, 100))  # lm_head stored [768, V] (record #360's model/gpt.py)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    lm_head = torch.randn((d, v), device=ctx.device, generator=gen).bfloat16()
    embed = torch.empty((v, d), device=ctx.device, dtype=torch.bfloat16)
    tr.transpose_into_triton(embed, lm_head)
    copy_error = _max_abs(embed.float() - lm_head.T.float())
    results = [ctx.compare("transpose", f"transpose_into embed<-lm_head ({v},{d})", copy_error, 0.0, "abs",
                           lambda: tr.transpose_into_triton(embed, lm_head),
                           lambda: tr.transpose_into_portable(embed, lm_head))]
    grad_embed = torch.randn((v, d), device=ctx.device, generator=gen).bfloat16()
    grad_head = torch.randn((d, v), device=ctx.device, generator=gen).bfloat16()
    error = ulp_distance(tr.transpose_add_triton_(grad_head.clone(), grad_embed),
                         tr.transpose_add_portable_(grad_head.clone(), grad_embed))
    scratch = grad_head.clone()  # the timed calls accumulate into a scratch copy
    results.append(ctx.compare("transpose", f"transpose_add_ lm_head_grad+=embed_grad^T ({d},{v})", error, 1.0, "ulp",
                               lambda: tr.transpose_add_triton_(scratch, grad_embed),
                               lambda: tr.transpose_add_portable_(scratch, grad_embed)))
    return results


def _zipf_like_ids(n: int, vocab: int, gen: torch.Generator, device) -> torch.Tensor:
    """Token ids with a heavy head (the commonest id ~7% of tokens), like real text: stresses duplicate rows."""
    return (vocab * torch.rand(n, generator=gen, device=device) ** 4).long().clamp_max(vocab - 1)


@register("value_embed")
def check_value_embed(ctx: Context) -> list[Result]:
    from perf.kernels import value_embed as ve

    # record #360 (track_1_short/model/gpt.py): value_embeds [4·50304, 768]; stage 2 runs 49,152 tokens per rank
    vocab, dim, tokens = ctx.shape(record=(50304, 768, 49152), tiny=(50, 24, 30))
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    table = (0.01 * torch.randn((4 * vocab, dim), device=ctx.device, generator=gen)).bfloat16()
    token_ids = _zipf_like_ids(tokens, vocab, gen, ctx.device)
    ids = (torch.arange(4, device=ctx.device)[:, None] * vocab + token_ids).reshape(-1)  # (4·T,): each plane's row
    error = _max_abs(ve.gather_rows_triton(table, ids).float() - ve.gather_rows_portable(table, ids).float())
    results = [ctx.compare("value_embed", f"gather ({ids.numel()} of {4 * vocab}, {dim})", error, 0.0, "abs",
                           lambda: ve.gather_rows_triton(table, ids), lambda: ve.gather_rows_portable(table, ids))]
    grad = torch.randn((ids.numel(), dim), device=ctx.device, generator=gen).bfloat16()
    # the persistent fp16 gradient buffer (track_1_short/perf/value_embed_pull.py)
    buffer = (0.1 * torch.randn((4 * vocab, dim), device=ctx.device, generator=gen)).half()
    repeats = int(torch.bincount(ids).max())
    error = ulp_distance(ve.scatter_add_rows_triton_(buffer.clone(), ids, grad),
                         ve.scatter_add_rows_portable_(buffer.clone(), ids, grad),
                         atol=_fp32_sum_slack(repeats, repeats * _max_abs(grad)))
    scratch = buffer.clone()  # the timed calls accumulate into a scratch copy
    results.append(ctx.compare("value_embed", f"scatter_add_ fp16 buffer ({ids.numel()} rows, {dim})", error, 1.0, "ulp",
                               lambda: ve.scatter_add_rows_triton_(scratch, ids, grad),
                               lambda: ve.scatter_add_rows_portable_(scratch, ids, grad)))
    return results


@register("ngram_embed")
def check_ngram_embed(ctx: Context) -> list[Result]:
    from perf.kernels import ngram_embed as ng

    # 49,152 tokens per rank (record #360's config.py), dim 768, sign pool 8192 rows (its ngram_table.py)
    tokens, dim, pool_rows = ctx.shape(record=(49152, 768, 8192), tiny=(13, 24, 16))
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    rows = torch.randn((2 * tokens, dim), device=ctx.device, generator=gen).bfloat16().requires_grad_()
    pool = torch.randn((pool_rows, dim), device=ctx.device, generator=gen).sign().bfloat16()
    sign_rows = torch.randint(0, pool_rows, (2 * tokens,), device=ctx.device, generator=gen, dtype=torch.int32)
    grad = torch.randn((tokens, dim), device=ctx.device, generator=gen).bfloat16()
    out_k, out_t = ng.ngram_embed_triton(rows, pool, sign_rows), ng.ngram_embed_portable(rows, pool, sign_rows)
    with torch.no_grad():
        results = [ctx.compare("ngram_embed", f"forward ({tokens},{dim})", ulp_distance(out_k, out_t), 1.0, "ulp",
                               lambda: ng.ngram_embed_triton(rows, pool, sign_rows),
                               lambda: ng.ngram_embed_portable(rows, pool, sign_rows))]

    def sink_grad(out):
        return torch.autograd.grad(out, rows, grad, retain_graph=True)[0]

    error = _max_abs(sink_grad(out_k).float() - sink_grad(out_t).float())
    results.append(ctx.compare("ngram_embed", f"sink backward ({2 * tokens},{dim})", error, 0.0, "abs",
                               lambda: sink_grad(out_k), lambda: sink_grad(out_t)))
    return results


@register("cross_entropy")
def check_cross_entropy(ctx: Context) -> list[Result]:
    """The fused softcapped CE (loss + logit gradient) against its twin, forward and backward timed together."""
    from perf.kernels import cross_entropy as ce

    rows = ctx.shape(record=16384, tiny=9)  # one rank's rows at the CE (brief of issue 7)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    results = []
    # full softmax (V = 50304, as stages 3-4 run it: next token only) and the sampled width P = 10240
    # with the MTP and prefix terms of stages 0-1 (record #360: track_1_short/sampled_softmax.py)
    cases = [("full V", ctx.shape(record=50304, tiny=40), (1.0,), False),
             ("sampled P", ctx.shape(record=10240, tiny=24), (1.0, 0.5, 0.25), True)]
    for name, width, mtp, with_prefix in cases:
        # logits on the e4m3 grid, as the fp8 lm_head emits them
        logits = (3 * torch.randn((rows, width), device=ctx.device, generator=gen)).to(torch.float8_e4m3fn).float()
        targets = torch.randint(0, width, (rows,), device=ctx.device, generator=gen)
        prefix = torch.randint(-1, width, (rows,), device=ctx.device, generator=gen) if with_prefix else None
        leaf = logits.requires_grad_()

        def loss_and_grad(fn):
            loss = fn(leaf, targets, mtp, prefix, 0.3)
            return loss, torch.autograd.grad(loss, leaf)[0]

        (got_loss, got_grad), (want_loss, want_grad) = loss_and_grad(ce.softcapped_loss_sum_triton), \
            loss_and_grad(ce.softcapped_loss_sum_portable)
        loss_rel = abs(float(got_loss) - float(want_loss)) / max(abs(float(want_loss)), 1e-30)
        grad_abs = _max_abs(got_grad - want_grad)
        del got_grad, want_grad
        # fp32 math in both; they differ in the order of the Σ exp(z − 23) sums and in the sigmoid's
        # last bits (the GPU's exp is approximate): the loss within 1e-5 relative, the gradient
        # (|g| <= 1.4) within 2e-6 absolute, about 16 fp32 ulps at 1.4
        error = max(loss_rel / 1e-5, grad_abs / 2e-6)
        case = f"{name} ({rows},{width}) K={len(mtp)}{' +prefix' if with_prefix else ''} fwd+bwd"
        row = ctx.compare("cross_entropy", case, error, 1.0, "x tol",
                          lambda: loss_and_grad(ce.softcapped_loss_sum_triton),
                          lambda: loss_and_grad(ce.softcapped_loss_sum_portable))
        row.note = f"loss rel {loss_rel:.2g} (tol 1e-5), grad abs {grad_abs:.2g} (tol 2e-6)"
        results.append(row)
    results += _check_cross_entropy_e4m3(ctx, rows, cases)
    return results


def _e5m2_ordinal(t: torch.Tensor) -> torch.Tensor:
    """e5m2 bytes as signed positions on the number line (sign-magnitude codes: one sign is monotone)."""
    code = t.view(torch.uint8).int()
    return torch.where(code >= 128, 128 - code, code)


def _check_cross_entropy_e4m3(ctx: Context, rows: int, cases) -> list[Result]:
    """The fp8 path's CE: e4m3 logits in (forward: loss and lse), e5m2 gradient out (backward), the
    kernels against their twins; forward and backward timed together."""
    from perf.kernels import cross_entropy as ce

    gen = torch.Generator(device=ctx.device).manual_seed(1)
    results = []
    for name, width, mtp, with_prefix in cases:
        logits8 = (3 * torch.randn((rows, width), device=ctx.device, generator=gen)).to(torch.float8_e4m3fn)
        targets = torch.randint(0, width, (rows,), device=ctx.device, generator=gen)
        prefix = torch.randint(-1, width, (rows,), device=ctx.device, generator=gen) if with_prefix else None
        weights = ce.loss_weights(mtp, 0.3 if with_prefix else None, ctx.device)
        grad_out = torch.ones((), device=ctx.device)
        grad_scale = torch.full((), 0.75 / 8 / 448, device=ctx.device)  # record #360's lm_head grad scale

        def fwd_bwd(forward, backward):
            loss, lse = forward(logits8, targets, prefix, weights, len(mtp))
            return loss, backward(logits8, lse, targets, prefix, weights, len(mtp), grad_out, grad_scale)

        kernel = lambda: fwd_bwd(ce.softcapped_ce_e4m3_triton, ce.softcapped_ce_grad_e5m2_triton)  # noqa: E731
        twin = lambda: fwd_bwd(ce.softcapped_ce_e4m3_portable, ce.softcapped_ce_grad_e5m2_portable)  # noqa: E731
        (got_loss, got_g8), (want_loss, want_g8) = kernel(), twin()
        loss_rel = abs(float(got_loss) - float(want_loss)) / max(abs(float(want_loss)), 1e-30)
        # same fp32 operation order; the GPU's approximate exp can move a value across an e5m2
        # rounding boundary: at most one representable step, on a small share of the elements
        steps = (_e5m2_ordinal(got_g8) - _e5m2_ordinal(want_g8)).abs()
        moved = float((steps > 0).float().mean())
        error = max(loss_rel / 1e-5, float(steps.max()), moved / 0.02)
        case = f"e4m3 {name} ({rows},{width}) K={len(mtp)}{' +prefix' if with_prefix else ''} fwd+bwd"
        row = ctx.compare("cross_entropy", case, error, 1.0, "x tol", kernel, twin)
        row.note = f"loss rel {loss_rel:.2g} (tol 1e-5), e5m2 steps max {int(steps.max())} (tol 1), moved {moved:.2%} (tol 2%)"
        results.append(row)
    return results


def _attention_inputs(ctx: Context, T: int, requires_grad: bool):
    """bf16 q/k [T, 6, 64], v [T, 6, 128] (the paired narrow layers' widths) and a few documents."""
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    q, k, v = (torch.randn((T, 6, d), device=ctx.device, generator=gen).bfloat16().requires_grad_(requires_grad)
               for d in (64, 64, 128))
    cuts = sorted({T // 7, T // 2, T // 2 + 3, (4 * T) // 5})
    cu = torch.tensor([0, *cuts, T, T], dtype=torch.int32, device=ctx.device)
    return q, k, v, cu


def _attention_parity(ctx: Context, name: str, fn, T: int, window: int, paired: bool) -> Result:
    """fn against SDPA on one layer's shapes: forward (and, on a GPU, the q/k/v gradients), max abs error."""
    from perf.attention_backends import sdpa_varlen_attention

    backward = ctx.device.type == "cuda"  # flex has no CPU backward; the dry run checks the forward
    q, k, v, cu = _attention_inputs(ctx, T, backward)
    grad = torch.randn((T, 6, 128), device=ctx.device).bfloat16()

    def run(attend):
        y = attend(q, k, v, cu, window, 0.12, paired=paired)
        return [y] + (list(torch.autograd.grad(y, (q, k, v), grad)) if backward else [])

    error = max(_max_abs(a.float() - b.float()) for a, b in zip(run(fn), run(sdpa_varlen_attention)))
    case = f"{name}{' paired' if paired else ''} T={T} window={window} {'fwd+bwd' if backward else 'fwd'}"
    # bf16 outputs of attention summed in different orders: a few bf16 ulps at |y| <~ 4
    return ctx.compare("attention", case, error, 0.05, "abs", lambda: run(fn), lambda: run(sdpa_varlen_attention))


@register("attention")
def check_attention(ctx: Context) -> list[Result]:
    """flex and FA3 against SDPA at one small T. FA3 must load (pinned revision, sha256 verified): a failed
    load is a failed row naming why; the dry run leaves FA3 out (it needs CUDA and the kernels hub)."""
    from perf import attention_backends as ab

    T = ctx.shape(record=4096, tiny=40)  # small T: the SDPA baseline builds chunk × window masks
    window = ctx.shape(record=384, tiny=9)  # record #360: stage 0's long window, 3 blocks of 128
    backends = [("attention flex", ab.flex_varlen_attention)]
    results = []
    if not ctx.dry_run:
        try:
            ab.load_fa3()
            backends.append(("attention fa3", ab.fa3_varlen_attention))
        except RuntimeError as exc:
            results.append(Result("attention", f"fa3 load {ab.FA3_REPO}@{ab.FA3_REVISION[:8]}", float("inf"), 0.0, "-",
                                  note=str(exc)))
    for name, fn in backends:
        results += [_attention_parity(ctx, name, fn, T, window, paired) for paired in (False, True)]
    return results


def _windowed_backward_row(ctx: Context, heads: int, d_v: int, tokens: int, codes: list[int], fa3) -> Result:
    """PR #371's restricted backward (perf/kernels/windowed_backward.py, bf16) on one layer's stream at stage
    1's window: its norm-wise error against the definition (fp32, same GPU) and its time against what it
    replaces, FA3's stock backward of the same forward (the definition's time in the dry run, where FA3 is
    absent). `heads` stream heads: 3 on a paired layer ([2T, 3, d]), 6 on layers 1 and 8."""
    from perf.attention_backends import fa3_varlen_attention
    from perf.kernels.windowed_backward import windowed_attention_backward_triton
    from perf.windowed_backward import windowed_attention_backward, windowed_attention_forward

    window, scale = ctx.shape(record=384, tiny=9), 0.12  # record #360: stage 1's long window, where 592-593 calibrate
    n = tokens * 6 // heads  # stream positions
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    # peaked softmaxes, as QK-normed and gained scores give
    q, k = ((1.5 * torch.randn((n, heads, 64), device=ctx.device, generator=gen)).bfloat16() for _ in range(2))
    v, d_out = (torch.randn((n, heads, d_v), device=ctx.device, generator=gen).bfloat16() for _ in range(2))
    cuts = sorted({n // 7, n // 3, n // 2 + 3, (4 * n) // 5})
    cu = torch.tensor([0, *cuts, n, n], dtype=torch.int32, device=ctx.device)
    table = torch.tensor(codes, dtype=torch.int32, device=ctx.device)
    out, lse = windowed_attention_forward(q.float(), k.float(), v.float(), cu, scale, window)
    out = out.bfloat16()  # the forward's output as the backward gets it, for both (D is read from it)
    want = windowed_attention_backward(q.float(), k.float(), v.float(), out.float(), lse, d_out.float(), cu, scale,
                                       window, table)
    args = (q, k, v, out, lse, d_out, cu, scale, window, table)
    got = windowed_attention_backward_triton(*args)
    error = max(((g.float() - w).norm() / w.norm().clamp_min(1e-30)).item() for g, w in zip(got, want))
    if fa3 is not None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = fa3_varlen_attention(*leaves, cu, window, scale, max_seqlen=int((cu[1:] - cu[:-1]).max()))
        baseline, against = (lambda: torch.autograd.grad(y, leaves, d_out, retain_graph=True)), "FA3 stock bwd"
    else:
        baseline, against = (lambda: windowed_attention_backward(*args)), "definition"
    case = (f"windowed bwd {heads}x(64/{d_v}) n={n} W={window} codes={codes} vs {against}")
    # bf16 P and dS before their GEMMs (as FA2/FA3): PR #371's own check, 0.008 norm-wise
    return ctx.compare("windowed_backward", case, error, 0.008, "rel", lambda: windowed_attention_backward_triton(*args),
                       baseline)


@register("windowed_backward")
def check_windowed_backward(ctx: Context) -> list[Result]:
    """PR #371 part 2's Triton backward at one rank's stage-1 batch (32,768 tokens) on a paired layer and a
    64/64 layer, with the windows of the PR's certify run 01 and with every head full (equal work: its
    overhead against FA3's backward). The ratio is FA3 stock backward time / ours (> 1: the shortened
    backward is faster)."""
    from perf import attention_backends as ab

    fa3 = None
    if not ctx.dry_run:
        try:
            fa3 = ab.load_fa3()
        except RuntimeError:  # the attention check names the failed load; here the definition is the baseline
            fa3 = None
    tokens = ctx.shape(record=32768, tiny=24)
    paired, narrow = ctx.shape(record=([64, 64, 256], [256] * 6), tiny=([2, 2, 5], [5] * 6))  # the dry run: W = 9
    rows = [_windowed_backward_row(ctx, 3, 128, tokens, paired, fa3), _windowed_backward_row(ctx, 6, 64, tokens, narrow, fa3)]
    if not ctx.dry_run:  # every head full: equal work, so the ratio is the kernel's overhead against FA3's
        rows += [_windowed_backward_row(ctx, 3, 128, tokens, [-1] * 3, fa3),
                 _windowed_backward_row(ctx, 6, 64, tokens, [-1] * 6, fa3)]
    return rows


def _mlp_ops(ctx: Context, tokens: int, dim: int, hidden: int) -> dict[str, Callable]:
    """The MLP kernels and their twins as closures over one case: a refreshed one-slot Fp8MLPState
    whose delayed scales come from one portable step, and bf16 x (normed rows), W1, W2, g, p."""
    from perf.backend import use_backend
    from perf.fp8 import E5M2, quantize
    from perf.kernels import mlp

    gen = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn((tokens, dim), device=ctx.device, generator=gen)
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))).bfloat16()
    bank = ((torch.rand((1, 2, hidden, dim), device=ctx.device, generator=gen) * 2 - 1) * dim**-0.5).bfloat16()
    w1, w2 = bank[0, 0], bank[0, 1]
    g = (torch.randn((tokens, dim), device=ctx.device, generator=gen) * 0.05).bfloat16()
    p = torch.tensor(0.8125, device=ctx.device)
    state = mlp.Fp8MLPState(1, hidden, dim, device=ctx.device)

    def train_step(use_triton: bool) -> list[torch.Tensor]:
        """out, dx, dW1, dW2, dp of one fp8 training forward + backward, fold on."""
        xg, w1g, w2g, pg = (t.detach().clone().requires_grad_() for t in (x, w1, w2, p))
        with use_backend(triton=use_triton):
            out = mlp.fp8_mlp(xg, w1g, w2g, pg, state, 0)
            out.backward(g)
        return [out.detach(), xg.grad, w1g.grad, w2g.grad, pg.grad]

    state.refresh(bank)
    train_step(False)  # records the amaxes the next refresh turns into delayed scales
    state.refresh(bank)
    x8, g8, bf16 = state.quantize_input(x), quantize(g, state.grad_scale, E5M2), torch.bfloat16
    amax = torch.zeros((), device=ctx.device)  # scratch: the state's amaxes stay untouched
    up_args = (x8, state.w1_f8[0], state.x_scale, state.w1_scale[0], state.post_scale[0], amax, bf16)
    post8 = mlp.up_relu2_fp8_portable(*up_args)[0]
    dpre_args = (g8, state.w2_f8[0], state.grad_scale, state.w2_scale[0] * p, post8, state.post_scale[0],
                 state.dpre_scale[0], amax, bf16)
    return {
        "amax": amax, "x": x, "w1": w1, "w2": w2, "train_step": train_step,
        "up_kernel": lambda: mlp.up_relu2_fp8_triton(*up_args), "up_twin": lambda: mlp.up_relu2_fp8_portable(*up_args),
        "dpre_kernel": lambda: mlp.dpre_fp8_triton(*dpre_args), "dpre_twin": lambda: mlp.dpre_fp8_portable(*dpre_args),
        "bf16_kernel": lambda: mlp.bf16_mlp_triton(x, w1, w2), "bf16_twin": lambda: mlp.bf16_mlp_portable(x, w1, w2),
    }


def _mlp_parity(ops: dict) -> dict[str, float]:
    """Parity errors of the MLP kernels against their twins on the same inputs (tolerances: check_mlp)."""
    from perf.fp8 import E4M3, E5M2

    def fp8_ulps(kernel, twin, fmt):
        """Largest distance over both layouts in `fmt` ulps, or of the recorded amax in bf16 ulps."""
        ops["amax"].zero_()
        got = kernel()
        got_amax = ops["amax"].clone()
        ops["amax"].zero_()
        want = twin()
        amax_ulps = ulp_distance(got_amax, ops["amax"], torch.bfloat16)
        return max(amax_ulps, *(ulp_distance(a.float(), b.float(), fmt) for a, b in zip(got, want)))

    post_ulps = fp8_ulps(ops["up_kernel"], ops["up_twin"], E4M3)
    dpre_ulps = fp8_ulps(ops["dpre_kernel"], ops["dpre_twin"], E5M2)
    step = max(float((a.float() - b.float()).norm() / b.float().norm())
               for a, b in zip(ops["train_step"](True), ops["train_step"](False)))
    x, w1, w2 = ops["x"], ops["w1"], ops["w2"]
    slack = float((2.0**-6 * (torch.relu(x.float() @ w1.float().t()).square() @ w2.float().abs())).max())
    return {"post8": post_ulps, "dpre8": dpre_ulps, "step": step,
            "bf16": ulp_distance(ops["bf16_kernel"](), ops["bf16_twin"](), atol=slack)}


@register("mlp")
def check_mlp(ctx: Context) -> list[Result]:
    dim, hidden = ctx.shape(record=(768, 2816), tiny=(40, 72))  # record #360: model dim 768, MLP hidden 2816
    # parity at one rank's record batch (49,152 tokens, stage 2); timings at a third of it
    parity_tokens, time_tokens = ctx.shape(record=(49152, 16384), tiny=(45, 45))
    errors = _mlp_parity(_mlp_ops(ctx, parity_tokens, dim, hidden))
    ops = _mlp_ops(ctx, time_tokens, dim, hidden)
    shape = f"T={time_tokens} (parity T={parity_tokens}), D={dim}, H={hidden}"
    # Tolerances as tests/perf/test_perf_kernels_mlp.py: fp8 bytes within one fp8 ulp (a rounding-boundary
    # flip of the bf16 intermediate) and the recorded amax within one bf16 ulp, in one "ulp" column; the
    # training step's outputs and gradients within 2⁻⁵ of their norm (a few fp8 operands one ulp off).
    step_row = ctx.compare("mlp", f"fp8_mlp fwd+bwd, fold on, {shape}", errors["step"], 2.0**-5, "rel",
                           lambda: ops["train_step"](True), lambda: ops["train_step"](False))
    step_row.peak_mib = ctx.peak_mib(lambda: ops["train_step"](True))
    step_row.note = f"peak MiB portable: {_fmt(ctx.peak_mib(lambda: ops['train_step'](False)), '.0f')}"
    return [
        ctx.compare("mlp", f"up_relu2_fp8 post8 both layouts + amax {shape}", errors["post8"], 1.0, "ulp",
                    ops["up_kernel"], ops["up_twin"]),
        ctx.compare("mlp", f"dpre_fp8 dpre8 both layouts + amax {shape}", errors["dpre8"], 1.0, "ulp",
                    ops["dpre_kernel"], ops["dpre_twin"]),
        step_row,
        ctx.compare("mlp", f"bf16_mlp forward {shape}", errors["bf16"], 1.0, "ulp", ops["bf16_kernel"], ops["bf16_twin"]),
    ]


def _qkv_case(ctx: Context, T: int, D: int, H: int, dq: int, dv: int, paired: bool, key_offset: bool,
              rotary_dim: int) -> dict[str, Callable]:
    """One attention layer's training QKV, fused (perf/kernels/qkv_rope.py, its Triton kernels) and
    unfused (perf/fp8.py fp8_qkv, then perf/kernels/qkv_rope.py normed_rotary_qk, eager autograd), each as
    a closure running forward + backward on the same inputs and returning q, k, v and every gradient."""
    from model.rotary import Yarn
    from perf.backend import use_backend
    from perf.fp8 import fp8_qkv
    from perf.kernels.qkv_rope import fp8_qkv_rope, normed_rotary_qk

    gen = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn((T, D), device=ctx.device, generator=gen)
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))).bfloat16()  # the normed attention input
    bound = 3**0.5 * 0.5 * D**-0.5  # record #360 (track_1_short/model/gpt.py): the banks' uniform init bound
    w_qk, w_v = (((torch.rand((rows, D), device=ctx.device, generator=gen) * 2 - 1) * bound).bfloat16()
                 for rows in (2 * H * dq, H * dv))
    sa0 = torch.tensor(0.5, device=ctx.device)  # record #360 (track_1_short/model/gpt.py): sa0's init
    yarn = Yarn(dq, rotary_dim, 0.13, paired=paired).to(ctx.device)
    yarn.rescale(128, 384)  # the first window change's stretched frequencies
    grads = [(0.01 * torch.randn((T, H, w), device=ctx.device, generator=gen)).bfloat16() for w in (dq, dq, dv)]

    def step(fused: bool) -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_() for t in (x, w_qk, w_v, sa0)]
        f1, f2 = yarn.tables(T)
        if fused:
            with use_backend(triton=True):
                q, k, v = fp8_qkv_rope(*leaves, f1, f2, H, rotary_dim, paired, key_offset)
        else:
            qk, v = fp8_qkv(*leaves).split([2 * H * dq, H * dv], dim=-1)
            q, k = (t.bfloat16() for t in normed_rotary_qk(qk.view(T, 2 * H, dq), f1, f2, rotary_dim, paired,
                                                            key_offset))
            v = v.view(T, H, dv)
        torch.autograd.backward((q, k, v), grads)
        return [q.detach(), k.detach(), v.detach()] + [t.grad for t in leaves]

    return {"fused": lambda: step(True), "unfused": lambda: step(False)}


@register("fused_qkv")
def check_fused_qkv(ctx: Context) -> list[Result]:
    """The fused training QKV (quantize, GEMM, QK-norm + rotary epilogue; the fused backward) against
    the unfused path at one rank's stage-2 shapes, per attention layer kind: forward + backward
    parity (relative to each tensor's norm) and time, both eager."""
    T, D, H = ctx.shape(record=(49152, 768, 6), tiny=(9, 40, 2))  # record #360's config.py: 49,152 tokens per rank
    # (name, d_qk, d_v, paired, key offset, rotary dims): record #360's track_1_short/model/attention.py
    kinds = ctx.shape(record=[("narrow paired (layers 0, 2, 5)", 64, 128, True, False, 64),
                              ("half-v (layers 1, 8)", 64, 64, False, False, 64),
                              ("wide + key offset (layers 3, 10)", 128, 128, False, True, 64)],
                      tiny=[("narrow paired", 8, 16, True, False, 8), ("wide + key offset", 16, 16, False, True, 8)])
    names = ("q", "k", "v", "dx", "dW_qk", "dW_v", "dsa0")
    results = []
    for name, dq, dv, paired, key_offset, rotary_dim in kinds:
        ops = _qkv_case(ctx, T, D, H, dq, dv, paired, key_offset, rotary_dim)
        got, want = ops["fused"](), ops["unfused"]()
        errors = {n: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                  for n, a, b in zip(names, got, want)}
        qk_ulps = max(ulp_distance(got[i], want[i], torch.bfloat16, atol=1e-6) for i in (0, 1))
        del got, want
        # q/k within an ulp (another Σu² order), a few g8 bytes one e4m3 ulp off: 1% of each norm
        # bounds it with a wide margin (tests/perf/test_perf_kernels_qkv_rope.py)
        row = ctx.compare("fused_qkv", f"{name} T={T} H={H} d_qk={dq} d_v={dv} fwd+bwd", max(errors.values()), 1e-2,
                          "rel", ops["fused"], ops["unfused"])
        on_gpu = ctx.device.type == "cuda"  # the dry run skips the memory runs (None on a CPU anyway)
        row.peak_mib = ctx.peak_mib(ops["fused"]) if on_gpu else None
        unfused_peak = ctx.peak_mib(ops["unfused"]) if on_gpu else None
        worst = max(errors, key=errors.get)
        row.note = (f"fused/unfused time {_fmt(row.kernel_ms / row.torch_ms if row.torch_ms else None, '.2f')}; "
                    f"peak MiB unfused {_fmt(unfused_peak, '.0f')}; q/k max {qk_ulps:.2g} bf16 ulp; "
                    f"worst {worst} {errors[worst]:.2g}")
        results.append(row)
    return results


@dataclass
class RecordStep:
    """One rank's stage-2 record-shaped training step, built once for model_step and model_compile."""
    preset: str
    step: int
    settings: object
    schedule: object
    model: torch.nn.Module
    table: object
    manager: object
    exchange: object
    plan: object
    batch: object
    candidates: torch.Tensor


def _record_step(ctx: Context) -> RecordStep:
    """The `dev` model (the record's, with an 8.4M-row n-gram table) at the first stage-2 step, one
    rank's batch of the 8 (49,152 tokens, doc cap 3072, windows (5, 11), P = 14,336); a dry run
    takes the smoke model instead, also one rank's share of the 8 (384 tokens: the plumbing is the
    same at any batch; tests/kernels' dry-run test: 65 s → 34 s with the `eager` backend below)."""
    from config import MODEL_PRESETS, OPTIM_PRESETS, SCHEDULE_PRESETS
    from data.loader import dummy_batch
    from data.ngram import ngram_hash_sizes
    from model.embeddings import NgramTable
    from model.gpt import GPT
    from model.loss import CandidateSampler
    from optim.manager import OptimizerManager, RowExchange
    from optim.schedule import TrainingSchedule
    from perf.backend import current

    preset, ranks = ("smoke", 8) if ctx.dry_run else ("dev", 8)
    cfg, schedule = MODEL_PRESETS[preset], TrainingSchedule(SCHEDULE_PRESETS[preset])
    step = schedule.stage_ends[2]  # the first stage-2 step: the largest batch
    s = schedule.settings(step)
    torch.manual_seed(0)
    model = GPT(cfg, fp8=current().fp8, block_size=SCHEDULE_PRESETS[preset].block_size).to(ctx.device)
    table = NgramTable(cfg, 0, 1, device=ctx.device)
    manager = OptimizerManager(model.named_parameters(), schedule, OPTIM_PRESETS[preset])
    model.value_embed_grad_buffer = manager.cycle_gradient("value_embeds")
    model.refresh_fp8()
    host_batch = dummy_batch(s.batch_tokens // ranks, s.doc_cap, virtual_seq_cap=SCHEDULE_PRESETS[preset].virtual_seq_cap,
                             **ngram_hash_sizes(cfg))
    exchange = RowExchange(table.num_rows, 0, 1, ctx.device)
    plan = exchange.plan(host_batch.ngram_ids)  # planned on the host, before the upload
    batch = host_batch.to(ctx.device)
    candidates = CandidateSampler(cfg.vocab_size).candidates(host_batch.targets, s.softmax_p).to(ctx.device)
    return RecordStep(preset, step, s, schedule, model, table, manager, exchange, plan, batch, candidates)


@register("model_step")
def check_model_step(ctx: Context) -> list[Result]:
    """One forward + backward + optimizer step of the model at one rank's stage-2 record shapes
    (`_record_step`), on the current backend against the portable path: loss parity (relative),
    step time and peak memory. The optimizer updates every bank matrix (8× one rank's share); not
    compiled (model_compile does that). A dry run uses the smoke model and the portable path on
    both sides (plumbing only)."""
    from model.gpt import StepArgs
    from perf.backend import use_backend

    r = _record_step(ctx)
    s, model, manager, batch, step, preset = r.settings, r.model, r.manager, r.batch, r.step, r.preset
    args = StepArgs(ws_short=s.ws_short, ws_long=s.ws_long, mtp_weights=s.mtp_weights, prefix_weight=s.prefix_weight,
                    candidates=r.candidates, max_seq_len=batch.max_seq_len)

    def loss():
        rows = r.exchange.pull(r.table.rows, r.plan).requires_grad_(True)
        return model(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows, args)

    def train_step():
        loss().backward()
        manager.step(step)
        model.refresh_fp8()

    portable = dict(triton=False, attention="sdpa", compile=False)
    fast = portable if ctx.dry_run else {}
    with torch.no_grad():
        with use_backend(**portable):
            reference = float(loss())
        with use_backend(**fast):
            value = float(loss())
    with use_backend(**fast):
        peak = ctx.peak_mib(train_step)
        kernel_ms = ctx.time_ms(train_step)
    with use_backend(**portable):
        torch_ms = ctx.time_ms(train_step)
    case = f"{preset} model, {batch.inputs.numel()} tokens, P={s.softmax_p}, windows {(s.ws_short, s.ws_long)}"
    estimate = _step_memory_estimate_mib(preset, 2 if ctx.dry_run else 1, step)
    return [Result("model_step", case, abs(value - reference) / abs(reference), 2e-2, "rel", kernel_ms=kernel_ms,
                   torch_ms=torch_ms, peak_mib=peak,
                   note=f"loss {value:.5f} vs portable {reference:.5f}; tools.memory estimates "
                        f"{estimate:,.0f} MiB for this preset and geometry on {2 if ctx.dry_run else 1} process(es)")]


def _step_memory_estimate_mib(preset: str, world_size: int, step: int) -> float:
    """`python -m tools.memory --config PRESET --world-size W`'s estimate for the geometry of
    `step` (static device items + that step's column), in MiB, to print next to the measured peak."""
    from config import RUN_PRESETS
    from tools.memory import static_items, step_memory
    from runtime.meta_rank import build_rank_on_meta, geometries

    rank = build_rank_on_meta(RUN_PRESETS[preset], world_size)
    settings, steps = next((g, st) for g, st in geometries(rank.schedule) if step in st)
    static = sum(i.bytes for i in static_items(rank) if i.where == "device")
    return (static + step_memory(rank, settings, steps).total) / 2**20


@register("model_compile")
def check_model_compile(ctx: Context) -> list[Result]:
    """The record-shaped training forward + backward compiled as a record run compiles it
    (perf/compile.py: fullgraph, static shapes, inductor; a dry run: the smoke model with dynamo's
    `eager` backend, which decides graphs and recompiles as any backend does; the backward's AOT
    trace of the smoke model is tests/run's compiled runs', and skipping it here halves the dry
    run's compile: 19 s → 11 s). Reports the first step's compile time, the compiled step's time
    against eager, and, as the error, how many graphs a second step of the same geometry with other loss weights
    compiles (must be 0: the weights are in-place tensors, optim/schedule.py StepWeights)."""
    from dataclasses import replace

    from model.gpt import StepArgs
    from optim.schedule import StepWeights
    from perf.backend import current
    from perf.compile import compile_model, compiled_graphs

    r = _record_step(ctx)
    s, batch = r.settings, r.batch
    backend = replace(current(), compile=True, compile_backend="eager" if ctx.dry_run else "inductor")
    compiled = compile_model(r.model, backend)
    weights = StepWeights(r.schedule, ctx.device)

    def train_step(forward, step):
        mtp, prefix = weights.load(step)
        args = StepArgs(ws_short=s.ws_short, ws_long=s.ws_long, mtp_weights=mtp, prefix_weight=prefix,
                        candidates=r.candidates, max_seq_len=batch.max_seq_len)
        rows = r.exchange.pull(r.table.rows, r.plan).requires_grad_(True)
        forward(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows, args).backward()
        r.model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    before = compiled_graphs()
    t0 = time.perf_counter()
    train_step(compiled, r.step)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    compile_s, first = time.perf_counter() - t0, compiled_graphs() - before
    same_geometry = r.step + 1
    assert r.schedule.settings(same_geometry).geometry == s.geometry
    train_step(compiled, same_geometry)
    recompiled = compiled_graphs() - before - first
    compiled_ms = ctx.time_ms(lambda: train_step(compiled, same_geometry))
    eager_ms = ctx.time_ms(lambda: train_step(r.model, same_geometry))
    torch._dynamo.reset()
    case = f"{r.preset} model, {batch.inputs.numel()} tokens, P={s.softmax_p}, {backend.compile_backend}"
    return [Result("model_compile", case, float(recompiled), 0.0, "graphs", kernel_ms=compiled_ms, torch_ms=eager_ms,
                   note=f"first step compiled {first} graph(s) in {compile_s:.1f} s; a second step compiled "
                        f"{recompiled}")]

@register("cuda_graphs")
def check_cuda_graphs(ctx: Context) -> list[Result]:
    """The record-shaped step's two capturable regions (`_record_step`, one rank of 8, uncompiled
    so as not to pay a second compile here): forward + backward, and the optimizer update with the
    fp8 refresh, each warmed up, captured and checked against an eager call as training.Run does it
    (perf/cuda_graphs/capture.py), then timed eager against replayed. The error is the capture
    check's worst relative difference (tolerance CUDA_TOLERANCE; bitwise in a dry run, where the
    smoke model replays through the CPU twin on the portable path: plumbing only)."""
    from perf.backend import use_backend

    with use_backend(**(dict(triton=False, attention="sdpa", compile=False) if ctx.dry_run else {})):
        return _cuda_graphs_results(ctx)


def _cuda_graphs_results(ctx: Context) -> list[Result]:
    from model.gpt import StepArgs
    from optim.schedule import StepWeights
    from perf.cuda_graphs.capture import CUDA_TOLERANCE, RegionGraphs
    from perf.cuda_graphs.state import module_state, optimizer_state

    r = _record_step(ctx)
    s, model, manager, batch, step = r.settings, r.model, r.manager, r.batch, r.step
    manager.keep_grads = True  # a captured backward adds into the same .grad storage every time
    mtp, prefix = StepWeights(r.schedule, ctx.device).load(step)
    args = StepArgs(ws_short=s.ws_short, ws_long=s.ws_long, mtp_weights=mtp, prefix_weight=prefix,
                    candidates=r.candidates, training=True, max_seq_len=batch.max_seq_len)
    table = r.table.rows
    rows = torch.empty((r.plan.inverse_dev.numel(), table.size(1)), dtype=table.dtype, device=ctx.device,
                       requires_grad=True)  # the static sink leaf
    graphs = RegionGraphs.for_device(ctx.device, lambda: module_state(model) + optimizer_state(manager) +
                                     [("ngram_rows", rows), ("ngram_rows.grad", rows.grad)])

    def forward_backward():
        loss = model(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows, args)
        loss.backward()
        return loss.detach()

    def step_once():
        r.exchange.pull(table, r.plan, out=rows)
        graphs.run("forward_backward", s.geometry, forward_backward)
        rows.grad.zero_()
        manager.load_scalars(step)
        graphs.run("optimizer", manager.phase(step), lambda: manager.update(step))
        exact = model.next_fp8_refresh_exact()  # training.Run.flush, at the next step's top
        graphs.run("fp8_refresh", exact, lambda: model.refresh_fp8(exact))

    step_once()  # warm-up calls
    step_once()  # capture and check
    graphs.freeze()
    tol = 0.0 if ctx.dry_run else CUDA_TOLERANCE
    results = []
    for report in graphs.reports:
        captured = graphs.graphs[(report.region, report.key)]
        if report.region == "forward_backward":
            eager = forward_backward
        elif report.region == "optimizer":
            def eager():
                manager.update(step)
        else:
            def eager(exact=report.key):
                model.refresh_fp8(exact)
        results.append(Result(
            "cuda_graphs", f"{r.preset} {report.region}, {batch.inputs.numel()} tokens, P={s.softmax_p}, eager model",
            report.worst, tol, "rel", kernel_ms=ctx.time_ms(captured.graph.replay), torch_ms=ctx.time_ms(eager),
            note=f"capture check: {report.bitwise}/{report.tensors} tensors bitwise"
                 + (f", worst {report.worst_name}" if report.worst else "") + "; kernel = replay, torch = eager"))
    return results


REPO_ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS_TIMEOUT_S = 240  # keeps the whole script inside its 8-minute budget


@register("gpu_tests")
def check_gpu_tests(ctx: Context) -> list[Result]:
    """The pytest tests marked `gpu` (skipped in CI) run here; a dry run only collects them."""
    # -n 0: in one process (pyproject's -n auto would start a worker per core, each on the one GPU)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-n", "0"]
    if ctx.dry_run:  # the plumbing only: collect the files that mark a test `gpu` (the whole tree: 30 s more)
        cmd += ["--collect-only", *gpu_test_files()]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=GPU_TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [Result("gpu_tests", "pytest -m gpu", float("inf"), 0.0, "tests", note=f"timed out after {GPU_TESTS_TIMEOUT_S} s")]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else proc.stderr.strip()[-200:]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|selected|collected)", summary)}
    # pytest exits 0 (all passed), 1 (failures) or 5 (nothing selected); anything else broke the run itself
    broken = proc.returncode not in (0, 1, 5)
    failures = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0) + (1 if broken else 0)
    if broken:
        traceback_tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        summary += " | " + " / ".join(traceback_tail)
    return [Result("gpu_tests", "pytest -m gpu" + (" --collect-only" if ctx.dry_run else ""), float(failures), 0.0,
                   "failed", note=f"{summary} ({time.perf_counter() - t0:.0f} s)")]


def gpu_test_files() -> list[str]:
    """The test files with a test marked `gpu` (by the text `mark.gpu`), relative to the repository."""
    return sorted(str(f.relative_to(REPO_ROOT)) for f in (REPO_ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in f.read_text())


SANITIZER_TIMEOUT_S = 150  # per run; two runs keep the script inside its 8-minute budget
# one graphed step of the smoke preset, eager (the sanitizer sees aten ops, not inductor's kernels),
# SDPA (the smoke heads are 8 wide, and the kernels hub's FA3 needs a network the GPU node may lack)
SANITIZER_RUNS = {"smoke": [], "host table": ["--set", "ngram_table=host"]}


@register("sanitizer")
def check_sanitizer(ctx: Context) -> list[Result]:
    """PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1: every kernel's reads and writes checked for
    races between streams) over one graphed step of the smoke run and of the host-table run: the GPU
    side of perf/streams.py's CPU checks. A dry run lists the commands only (the sanitizer needs CUDA)."""
    results = []
    for name, extra in SANITIZER_RUNS.items():
        with tempfile.TemporaryDirectory() as records:
            cmd = [sys.executable, "train_gpt.py", "--config", "smoke", "--max-steps", "1", "--val-tokens", "2048",
                   "--val-every", "0", "--records-dir", records, *extra]
            case = f"{name}: one graphed step under TORCH_CUDA_SANITIZER=1"
            if ctx.dry_run:
                results.append(Result("sanitizer", case, 0.0, 0.0, "failed", note="dry run: " + " ".join(cmd[1:])))
                continue
            env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "SPEEDRUN_COMPILE": "0", "SPEEDRUN_CUDA_GRAPHS": "1",
                   "SPEEDRUN_ATTENTION": "sdpa"}
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                      timeout=SANITIZER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                results.append(Result("sanitizer", case, float("inf"), 0.0, "failed",
                                      note=f"timed out after {SANITIZER_TIMEOUT_S} s"))
                continue
            tail = " / ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:])
            results.append(Result("sanitizer", case, float(proc.returncode != 0), 0.0, "failed",
                                  note=f"{'clean' if proc.returncode == 0 else tail} ({time.perf_counter() - t0:.0f} s)"))
    return results


# ------------------------------------------------------------------------------------------------
# Runner, table, files


def environment(device: torch.device) -> dict:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    from perf.backend import current

    return {"device": name, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
            "backend": asdict(current())}  # what the model would run here (the checks call both paths directly)


def run_checks(ctx: Context, names: list[str]) -> list[Result]:
    """Run the named checks in order; a check that raises becomes one failed row naming the error."""
    results = []
    for name in names:
        t0 = time.perf_counter()
        try:
            rows = CHECKS[name](ctx)
        except Exception as exc:  # one broken check must not hide the others' numbers
            traceback.print_exc()
            rows = [Result(name, "raised", float("inf"), 0.0, "-", note=f"{type(exc).__name__}: {exc}")]
        results.extend(rows)
        print(f"[gpu_check] {name}: {len(rows)} case(s) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return results


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_lines(env: dict, results: list[Result], dry_run: bool) -> list[str]:
    header = (f"device: {env['device']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']}"
              + (" | DRY RUN (CPU, interpreter, tiny shapes: times are not kernel speeds)" if dry_run else ""))
    lines = [header, "",
             "| check | case | parity | tol | pass | kernel ms | torch ms | torch/kernel | peak MiB | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.check} | {r.case} | {r.error:.3g} {r.unit} | {r.tol:g} | {'yes' if r.passed else 'NO'} | "
                     f"{_fmt(r.kernel_ms, '.3f')} | {_fmt(r.torch_ms, '.3f')} | {_fmt(r.ratio, '.2f')} | "
                     f"{_fmt(r.peak_mib, '.0f')} | {r.note} |")
    return lines


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_results(out_dir: Path, env: dict, results: list[Result], dry_run: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "dry_run": dry_run, "all_passed": all(r.passed for r in results),
               "results": [{**asdict(r), "passed": r.passed, "ratio": r.ratio} for r in results]}
    _write_atomic(out_dir / "results.json", json.dumps(payload, indent=2, allow_nan=True) + "\n")
    _write_atomic(out_dir / "results.md", "# tools/gpu_check.py\n\n" + "\n".join(table_lines(env, results, dry_run)) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results")
    parser.add_argument("--out", default=default_out, help="folder for results.json and results.md (default: $OUT, else tools/results)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter: check the plumbing")
    parser.add_argument("--only", nargs="*", default=None, help="run only checks whose name starts with one of these")
    args = parser.parse_args(argv)

    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read by @triton.jit when the kernel modules are imported
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run on the GPU machine, or use --dry-run on a CPU")
    else:
        device = torch.device("cuda")
    names = [n for n in CHECKS if args.only is None or any(n.startswith(p) for p in args.only)]
    if not names:
        parser.error(f"--only {args.only} matches no check; registered: {', '.join(CHECKS)}")

    env = environment(device)
    t0 = time.perf_counter()
    results = run_checks(Context(device=device, dry_run=args.dry_run), names)
    env["wall_s"] = round(time.perf_counter() - t0, 1)
    print("\n".join(table_lines(env, results, args.dry_run)))
    write_results(Path(args.out), env, results, args.dry_run)
    print(f"\nwrote {Path(args.out) / 'results.json'} and results.md ({env['wall_s']} s)")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
