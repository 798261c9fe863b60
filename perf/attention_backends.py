"""Varlen causal sliding-window attention backends: FA3 (record), flex_attention (CUDA dev runs), SDPA (CPU).

The packed batch of one rank holds many documents; `cu_seqlens` (int32 [R], trailing entries
padded with T) marks their starts. A query sees the keys of its own segment at distances
0..window to its left (FA3's window_size = (window, 0)). Paired-head layers (record #360 layers
0, 2, 5) reinterpret [T, 6, d] as [2T, 3, d]: position 2t carries heads 0..2 of token t, 2t+1 heads
3..5, so heads h and h+3 share one attention stream, segments and window count interleaved
positions. q/k and v may have different head widths (64/128 on the narrow layers).

`varlen_attention` runs the backend `perf.backend.current().attention` names (SPEEDRUN_ATTENTION):
  fa3   the record's patched FA3 build (record #360's model/attention.py), pinned to a revision and sha256-checked
        before first use: from SPEEDRUN_FA3_DIR (a local copy), else via `kernels` from the hub cache
        or, the first time, the Hugging Face Hub (see the FA3 section for the three sources).
  flex  torch's flex_attention with a block mask built from cu_seqlens and the window (compiled on
        CUDA; on CPU it runs eagerly, forward only, for tests).
  sdpa  the portable path: SDPA with a dense boolean mask. Queries run in chunks, each against the
        keys its window reaches, so the masks stay small; still, it is for CPU tests and small runs.
All three take q, k [T, H, d_qk], v [T, H, d_v] and return [T, H, d_v]; SDPA defines the math.
`assert_record_backends()` is what the record preset calls at start-up: it raises unless the fast
path (FA3, Triton, fp8, compile on SM90) is what will run.

Run the tests: pytest tests/perf/test_perf_attention_backends.py tests/perf/test_perf_attention_sdpa.py -q
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from perf.backend import Backend, current, host_checks, require_fast_path


def segment_ids(cu_seqlens: Tensor, num_positions: int) -> Tensor:
    """Segment index of every packed position: int64 [num_positions]."""
    positions = torch.arange(num_positions, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens.to(torch.int64), positions, right=True) - 1


def _window_mask(seg: Tensor, pos: Tensor, queries: slice, keys: slice, window: int) -> Tensor:
    dist = pos[queries, None] - pos[None, keys]
    return (seg[queries, None] == seg[None, keys]) & (dist >= 0) & (dist <= window)


def varlen_attention_mask(cu_seqlens: Tensor, num_positions: int, window: int) -> Tensor:
    """Boolean [T, T] mask, True where query i may attend key j: same segment, 0 <= i − j <= window."""
    seg = segment_ids(cu_seqlens, num_positions)
    pos = torch.arange(num_positions, device=cu_seqlens.device)
    return _window_mask(seg, pos, slice(None), slice(None), window)


def check_cu_seqlens(cu_seqlens: Tensor, num_tokens: int) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with >= 2 entries, got {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={num_tokens} (pad with T), got "
                         f"{int(cu_seqlens[0])}..{int(cu_seqlens[-1])}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def _check_segments(cu_seqlens: Tensor, num_tokens: int) -> None:
    """check_cu_seqlens where host checks run (perf.backend.host_checks: eager, CPU by default);
    reading cu_seqlens on the host would stall a GPU and break a compiled graph. The loader builds
    cu_seqlens on the host and checks its shape there."""
    if host_checks():
        check_cu_seqlens(cu_seqlens, num_tokens)


def _stream_layout(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, paired: bool):
    """Paired heads: the same memory seen as twice the positions with half the heads, segments doubled."""
    if not paired:
        return q, k, v, cu_seqlens
    T, H, _ = q.shape
    if H % 2:
        raise ValueError(f"paired heads need an even head count, got {H}")
    q, k, v = (t.reshape(2 * T, H // 2, t.shape[-1]) for t in (q, k, v))
    return q, k, v, 2 * cu_seqlens


def sdpa_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                          softmax_scale: float, paired: bool = False, chunk: int = 2048) -> Tensor:
    """Attention of q, k [T, H, d_qk] and v [T, H, d_v] over the packed documents → [T, H, d_v].

    Queries go in chunks of `chunk` positions against the keys they can reach (the chunk and the
    `window` positions before it), so the mask is [chunk, chunk + window], not [T, T].
    """
    T, H, _ = q.shape
    _check_segments(cu_seqlens, T)
    q, k, v, cu_seqlens = _stream_layout(q, k, v, cu_seqlens, paired)
    n = q.shape[0]
    seg = segment_ids(cu_seqlens, n)
    pos = torch.arange(n, device=q.device)
    # (1, heads, n, d): SDPA's fused kernels (the CPU flash kernel among them, which takes a boolean
    # mask) need 4-D inputs; 3-D ones always run the unfused math path, ours: 4-7x slower on 2 cores.
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    # On the CPU the flash kernel runs in fp32, on heads of one width. Its bf16 backward is 3x slower than its
    # fp32 one, and a layer whose d_qk and d_v differ (64 and 128: the paired layers 0, 2, 5) takes the unfused
    # math path (measured at a smoke paired layer, 3 heads × 3,072 positions, one thread, forward + backward:
    # bf16 math 0.79 s, bf16 flash 0.68 s, fp32 flash 0.25 s; 2026-12-06). fp32 inside is what FA3 keeps for
    # the scores and the softmax; zero columns keep the math (a zero-padded q·k adds only 0·0 terms; a zero
    # value column, were d_v the narrower, fills an output column that is dropped).
    d_v, dtype = v.shape[-1], v.dtype
    if q.device.type == "cpu":
        width = max(q.shape[-1], d_v)
        compute = torch.promote_types(dtype, torch.float32)  # bf16 → fp32; fp64 (the tests' references) stays
        q, k, v = (F.pad(t.to(compute), (0, width - t.shape[-1])) for t in (q, k, v))
    outputs = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        k_lo = max(0, lo - window)
        mask = _window_mask(seg, pos, slice(lo, hi), slice(k_lo, hi), window)  # (chunk, keys)
        outputs.append(F.scaled_dot_product_attention(q[:, :, lo:hi], k[:, :, k_lo:hi], v[:, :, k_lo:hi],
                                                      attn_mask=mask, scale=softmax_scale))
    y = torch.cat(outputs, dim=2)[0, ..., :d_v].to(dtype)  # (heads, n, d_v)
    return y.transpose(0, 1).reshape(T, H, d_v)


# ------------------------------------------------------------------------------------------------
# flex_attention: a block mask from cu_seqlens and the window

FLEX_BLOCK_SIZE = 128  # flex_attention's default tile; blocks fully outside every window are skipped


# The segment ids flex's mask reads, as one opaque op. In an inference graph (a validation forward),
# inductor inlines a computed tensor the mask_mod captures into the attention template, and the
# searchsorted inside it loads the int64 copy of cu_seqlens, a buffer whose layout nothing froze:
# every flex validation failed to lower ("convert FlexibleLayout to FixedLayout first", torch 2.13;
# training graphs compiled), on every GPU that runs flex. An op's output has a fixed layout (found by
# python -m tools.cross_compile --config recipe --world-size 1 --sm 89; tests/tools/test_tools_cross_compile.py
# keeps it). The op is one searchsorted, what the inlined code would compute.
@torch.library.custom_op("speedrun::segment_ids", mutates_args=())
def _segment_ids_op(cu_seqlens: Tensor, num_positions: int) -> Tensor:
    return segment_ids(cu_seqlens, num_positions)


@_segment_ids_op.register_fake
def _(cu_seqlens, num_positions):
    return cu_seqlens.new_empty((num_positions,), dtype=torch.int64)


def flex_block_mask(cu_seqlens: Tensor, num_positions: int, window: int, block_size: int = FLEX_BLOCK_SIZE):
    """flex_attention's BlockMask for the rule of `varlen_attention_mask`: same segment, 0 <= q − k <= window."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg = _segment_ids_op(cu_seqlens, num_positions)  # opaque: see above

    def same_segment_in_window(batch, head, q_idx, kv_idx):
        dist = q_idx - kv_idx
        return (seg[q_idx] == seg[kv_idx]) & (dist >= 0) & (dist <= window)

    return create_block_mask(same_segment_in_window, None, None, num_positions, num_positions,
                             device=cu_seqlens.device, BLOCK_SIZE=block_size)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)  # eager flex materializes the full score matrix


def _flex_attention_for(device: torch.device):
    """Inside a compiled model the plain op (the model's graph compiles it); else compiled on CUDA, eager on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling() or device.type != "cuda":
        return flex_attention
    return _compiled_flex_attention()


def flex_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                          softmax_scale: float, paired: bool = False) -> Tensor:
    """`sdpa_varlen_attention` through flex_attention: compiled on CUDA, eager (forward only) on CPU."""
    T, H, _ = q.shape
    _check_segments(cu_seqlens, T)
    q, k, v, cu_seqlens = _stream_layout(q, k, v, cu_seqlens, paired)
    n = q.shape[0]
    block_mask = flex_block_mask(cu_seqlens, n, window)
    attend = _flex_attention_for(q.device)
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, n, d)
    y = attend(q, k, v, block_mask=block_mask, scale=softmax_scale)  # (1, heads, n, d_v)
    return y[0].transpose(0, 1).reshape(T, H, v.shape[-1])


# ------------------------------------------------------------------------------------------------
# FA3: the record's patched build, from a local directory, the kernels cache or the hub; pinned and
# hash-checked whatever the source
#
# Sources, in order (the first that is configured wins; a failure names the fixes):
#   1. SPEEDRUN_FA3_DIR=DIR   a local copy: the package folder itself (__init__.py and the
#                             _flash_attn3_cuda_*.so binary) or a folder holding build/<variant>/<package>/
#                             (a `hf download --local-dir DIR` of the repo, or your own build of it).
#                             `kernels`' LOCAL_KERNELS=devenpzak/flash-attn3-12864=DIR works the same way.
#   2. the kernels cache      `get_kernel` reads the Hugging Face hub cache (or $KERNELS_CACHE, the
#                             `kernels` package's own cache variable) before the network; pre-seed it with
#                               hf download devenpzak/flash-attn3-12864 --revision <FA3_REVISION>
#                             (add --cache-dir "$KERNELS_CACHE" when that is set), then run with HF_HUB_OFFLINE=1.
#   3. the hub                the pinned revision, downloaded by `get_kernel` on first use.

FA3_REPO = "devenpzak/flash-attn3-12864"  # record #360's FA3: takes (64, 128) and (128, 64) q/k vs v widths
FA3_REVISION = "64c1e6d1f2780e7931839f41426ddcdb564a7cb9"  # record #360: the pinned commit
FA3_BINARY_SHA256 = "9beee90dbef9c9c221e677dad9f932108b70c46aa35841fc0862281d5b84c09b"  # record #360
FA3_BINARY_GLOB = "_flash_attn3_cuda_*.so"  # record #360: the file the hash is taken of
FA3_TORCH = "2.10.0+cu128"  # record #360: the only torch the pinned build has a variant for
FA3_DIR_ENV = "SPEEDRUN_FA3_DIR"  # ours: a local FA3 package or build/ tree, used before the hub
KERNELS_LOCAL_ENV = "LOCAL_KERNELS"  # kernels 0.16.1 (utils.py): repo_id=path:... local overrides; honoured too
FA3_AUTH_FIXES = (f"log in with `hf auth login` (kernels>=0.16 may get a 401 for this public repo without a "
                  f"token), or pre-seed the cache (`hf download {FA3_REPO} --revision {FA3_REVISION}`, then "
                  f"HF_HUB_OFFLINE=1), or download it anywhere (`hf download {FA3_REPO} --revision "
                  f"{FA3_REVISION} --local-dir DIR`) and set {FA3_DIR_ENV}=DIR")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_fa3_binary(package_dir: Path, expected_sha256: str = FA3_BINARY_SHA256) -> Path:
    """The one FA3 binary in the package folder, after checking its sha256; raises naming what differs."""
    binaries = sorted(Path(package_dir).glob(FA3_BINARY_GLOB))
    if len(binaries) != 1:
        found = ", ".join(b.name for b in binaries) or "none"
        raise RuntimeError(f"FA3: expected exactly one {FA3_BINARY_GLOB} in {package_dir} (the {FA3_REPO}@{FA3_REVISION} "
                           f"download), found {found}")
    digest = sha256_of(binaries[0])
    if digest != expected_sha256:
        raise RuntimeError(f"FA3: {binaries[0]} has sha256 {digest}, but the pinned build {FA3_REPO}@{FA3_REVISION} "
                           f"has {expected_sha256}; refusing to run an unverified attention kernel (clear that "
                           f"entry from the Hugging Face hub cache and download it again, or point {FA3_DIR_ENV} "
                           f"at a copy of the pinned revision)")
    return binaries[0]


_THIS_TORCH = object()  # fa3_variant's default: this process's torch (None is "no CUDA", a CPU build)


def fa3_variant(torch_version: str | None = None, cuda_version=_THIS_TORCH, machine: str | None = None) -> str:
    """The kernels-hub build variant a torch loads, e.g. torch210-cxx11-cu128-x86_64-linux (record #360's);
    by default this process's torch. cuda_version: torch.version.cuda, None for a CPU build."""
    import platform

    torch_version = torch_version if torch_version is not None else torch.__version__
    cuda_version = (torch.version.cuda if cuda_version is _THIS_TORCH else cuda_version) or ""
    major, minor = torch_version.split("+")[0].split(".")[:2]
    accel = "cu" + cuda_version.replace(".", "")[:3] if cuda_version else "cpu"
    return f"torch{major}{minor}-cxx11-{accel}-{machine or platform.machine()}-linux"


def _is_package(folder: Path) -> bool:
    return (folder / "__init__.py").is_file()


def fa3_package_dir(root: Path, variant: str | None = None) -> Path:
    """The FA3 package folder inside SPEEDRUN_FA3_DIR: the folder itself, or build/<variant>/<package>/."""
    root = Path(root)
    if _is_package(root):
        return root
    build = root / "build" if (root / "build").is_dir() else root
    variant = variant or fa3_variant()
    candidates = [build / variant] + [d for d in sorted(build.glob(variant + "*")) if d.is_dir()]
    for folder in candidates:
        if _is_package(folder):
            return folder
        packages = [d for d in sorted(folder.glob("*")) if d.is_dir() and _is_package(d)] if folder.is_dir() else []
        if len(packages) == 1:
            return packages[0]
    have = ", ".join(d.name for d in sorted(build.glob("*")) if d.is_dir()) if build.is_dir() else "no such folder"
    raise RuntimeError(f"FA3: {FA3_DIR_ENV}={root} holds no package for build variant {variant} (torch "
                       f"{torch.__version__}); found: {have or 'nothing'}. It should be the package folder "
                       f"(__init__.py and {FA3_BINARY_GLOB}) or a folder with build/{variant}/<package>/; the "
                       f"record's build has a variant for torch {FA3_TORCH} only")


def _import_package(package_dir: Path):
    """Import a package folder under a private name, so its relative imports (._ops, ...) resolve."""
    import importlib.util
    import sys

    name = "_speedrun_fa3_" + hashlib.sha256(str(package_dir.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_fa3_from_dir(root: Path, expected_sha256: str | None = None):
    """The package in a local FA3 folder, imported only after its binary's hash matches the pin."""
    package_dir = fa3_package_dir(Path(root))
    verify_fa3_binary(package_dir, expected_sha256 or FA3_BINARY_SHA256)  # before any of its code runs
    try:
        package = _import_package(package_dir)
    except Exception as exc:
        raise RuntimeError(f"FA3: importing {package_dir} ({FA3_DIR_ENV}) failed ({type(exc).__name__}: {exc}); "
                           f"the record's build needs torch {FA3_TORCH} (found {torch.__version__}) and "
                           f"libcudart.so.13 on the loader path (`python -m runtime.preflight` checks both)") from exc
    if not hasattr(package, "flash_attn_interface"):
        raise RuntimeError(f"FA3: {package_dir / '__init__.py'} ({FA3_DIR_ENV}) has no `flash_attn_interface`; "
                           f"point {FA3_DIR_ENV} at a download of {FA3_REPO}@{FA3_REVISION}")
    return package


def fa3_local_dir() -> Path | None:
    """SPEEDRUN_FA3_DIR, else the FA3 entry of `kernels`' own LOCAL_KERNELS=repo=path:... mapping, else None."""
    if os.environ.get(FA3_DIR_ENV):
        return Path(os.environ[FA3_DIR_ENV])
    for entry in os.environ.get(KERNELS_LOCAL_ENV, "").split(":"):
        repo, _, path = entry.partition("=")
        if repo == FA3_REPO and path:
            return Path(path)
    return None


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a huggingface_hub / requests / httpx error, or None."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def explain_hub_failure(exc: BaseException, hint: str = "") -> str:
    """One message for a failed `get_kernel`: which case it is and the fixes for it."""
    text = f"{type(exc).__name__}: {exc}"
    head = f"FA3: could not load {FA3_REPO}@{FA3_REVISION} from the kernels hub ({text})."
    refused = _http_status(exc) in (401, 403) or re.search(r"\b40[13]\b", str(exc)) is not None
    if refused or type(exc).__name__ in ("GatedRepoError", "RepositoryNotFoundError"):
        return f"{head} The Hub refused the request: {FA3_AUTH_FIXES}"
    if "variant" in str(exc).lower():
        return (f"{head} The pinned build has a variant for torch {FA3_TORCH} only and this is torch "
                f"{torch.__version__}: pip install -r requirements-h100.txt (torch=={FA3_TORCH} from the cu128 index)")
    return (f"{head} The first run needs network access to the Hugging Face Hub (HF_HUB_OFFLINE unset), later "
            f"runs read the hub cache; without the network, {FA3_AUTH_FIXES.split(', or ', 1)[1]}; {hint}")


_fa3_interface = None  # set by load_fa3(); a plain global, so a compiled model reads it without tracing the loader


def load_fa3():
    """The verified FA3 `flash_attn_interface` module: from SPEEDRUN_FA3_DIR, else the kernels cache or hub."""
    global _fa3_interface
    if _fa3_interface is not None:
        return _fa3_interface
    local = fa3_local_dir()
    if local is not None:
        _fa3_interface = load_fa3_from_dir(local).flash_attn_interface
        return _fa3_interface
    hint = f"or set {FA3_DIR_ENV}, or choose another backend with SPEEDRUN_ATTENTION=flex (CUDA) or sdpa"
    try:
        from kernels import get_kernel
    except ImportError as exc:
        raise RuntimeError(f"FA3 attention needs the `kernels` package: pip install kernels ({hint})") from exc
    try:
        # a personal hub account, which `kernels` does not trust by default: trust comes from the
        # pinned revision and the binary's hash, checked below
        package = get_kernel(FA3_REPO, revision=FA3_REVISION, trust_remote_code=True)
    except Exception as exc:
        raise RuntimeError(explain_hub_failure(exc, hint)) from exc
    verify_fa3_binary(Path(package.__file__).parent, FA3_BINARY_SHA256)
    _fa3_interface = package.flash_attn_interface
    return _fa3_interface


def check_fa3_compilable(fa3=None, device: str = "cuda") -> None:
    """Raise unless FA3's varlen call traces on fake tensors, forward and backward: torch.compile
    traces the model with fake tensors, so every op FA3 calls needs a fake (shape) kernel, or the
    record's first compiled step fails after minutes of compiling. Seconds, no kernel runs; the
    record preset calls it at start-up, before the clock, and `python -m runtime.preflight` reports it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fa3 = fa3 if fa3 is not None else load_fa3()
    try:
        with FakeTensorMode():
            T, H, d = 256, 2, 128  # two documents of 128 tokens
            q, k, v = (torch.empty(T, H, d, dtype=torch.bfloat16, device=device, requires_grad=True) for _ in range(3))
            cu_seqlens = torch.zeros(3, dtype=torch.int32, device=device)
            y = fa3.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=128,
                                           max_seqlen_k=128, causal=True, softmax_scale=d ** -0.5, window_size=(64, 0))
            y = y[0] if isinstance(y, tuple) else y
            if tuple(y.shape) != (T, H, d):
                raise RuntimeError(f"output shape {tuple(y.shape)}, expected {(T, H, d)}")
            torch.autograd.grad(y.float().sum(), (q, k, v))
    except Exception as exc:
        raise RuntimeError(f"FA3: flash_attn_varlen_func does not trace on fake tensors ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}), so torch.compile cannot compile the model "
                           f"around it: its ops need fake (meta) kernels. Use the pinned build "
                           f"{FA3_REPO}@{FA3_REVISION}, whose ops register them") from exc


def fa3_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                         softmax_scale: float, paired: bool = False, max_seqlen: int | None = None) -> Tensor:
    """`sdpa_varlen_attention` through FA3 varlen (record #360's model/attention.py). max_seqlen: the longest segment in
    tokens (the record passes its configured maximum); None reads it from cu_seqlens (a host sync)."""
    T, H, _ = q.shape
    _check_segments(cu_seqlens, T)
    if max_seqlen is None:
        if torch.compiler.is_compiling():
            raise ValueError("fa3_varlen_attention inside torch.compile needs max_seqlen (reading it from "
                             "cu_seqlens would break the graph): pass the configured maximum segment length")
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    q, k, v, cu_seqlens = _stream_layout(q, k, v, cu_seqlens, paired)
    if paired:
        max_seqlen = 2 * max_seqlen
    cu_seqlens = cu_seqlens.to(torch.int32)
    fa3 = _fa3_interface if _fa3_interface is not None else load_fa3()  # loaded at start-up on record runs
    y = fa3.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                          max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=True,
                                          softmax_scale=softmax_scale, window_size=(window, 0))
    if isinstance(y, tuple):  # some FA3 builds also return the log-sum-exp
        y = y[0]
    return y.reshape(T, H, v.shape[-1])


def fa3_varlen_forward_with_lse(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                                softmax_scale: float, max_seqlen: int) -> tuple[Tensor, Tensor]:
    """FA3 varlen's forward on the *stream* layout (q, k [n, H, d_qk], v [n, H, d_v], cu_seqlens int32 [R],
    max_seqlen in stream positions) with its softmax log-sum-exp: (out [n, H, d_v], lse [H, n] fp32).

    The same kernel and arguments as `fa3_varlen_attention`, so out is bitwise its output (PR #371: the
    restricted backward leaves the forward as #360's). The LSE is what FA3 saves for its own backward; the
    build hands it back when asked with `return_attn_probs=True` (FA3's name for it), older builds always.
    Called without autograd: the caller (perf/windowed_backward.py's op) owns the backward."""
    fa3 = _fa3_interface if _fa3_interface is not None else load_fa3()
    call = fa3.flash_attn_varlen_func
    extra = {"return_attn_probs": True} if "return_attn_probs" in _parameters(call) else {}
    with torch.no_grad():
        result = call(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                      max_seqlen_k=max_seqlen, causal=True, softmax_scale=softmax_scale, window_size=(window, 0),
                      **extra)
    n, H, _ = q.shape
    if not isinstance(result, tuple) or len(result) < 2:
        raise RuntimeError(f"FA3 ({FA3_REPO}@{FA3_REVISION}): flash_attn_varlen_func returned no softmax LSE "
                           f"(a {type(result).__name__}); the restricted backward (PR #371) needs it")
    out, lse = result[0], result[1]
    if tuple(lse.shape) != (H, n) or lse.dtype != torch.float32:
        raise RuntimeError(f"FA3: softmax LSE of shape {tuple(lse.shape)} {lse.dtype}, expected {(H, n)} "
                           f"float32 (varlen: [num_heads, total_q])")
    return out, lse


@functools.lru_cache(maxsize=None)
def _parameter_names(fn) -> frozenset[str]:
    import inspect
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing extra
        return frozenset()


def _parameters(fn) -> frozenset[str]:
    return _parameter_names(getattr(fn, "__func__", fn))


# ------------------------------------------------------------------------------------------------
# Public op and the record's start-up check

def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, softmax_scale: float,
                     paired: bool = False, max_seqlen: int | None = None) -> Tensor:
    """Causal sliding-window attention over the packed documents on the current backend → [T, H, d_v].

    max_seqlen only reaches FA3 (see `fa3_varlen_attention`); the other backends do not need it.
    """
    backend = current().attention
    if backend == "fa3":
        return fa3_varlen_attention(q, k, v, cu_seqlens, window, softmax_scale, paired, max_seqlen)
    if backend == "flex":
        return flex_varlen_attention(q, k, v, cu_seqlens, window, softmax_scale, paired)
    return sdpa_varlen_attention(q, k, v, cu_seqlens, window, softmax_scale, paired)


def assert_record_backends(backend: Backend | None = None) -> None:
    """Raise unless FA3 + Triton + fp8 + compile on SM90 is what will run (the record preset calls this
    at start-up, so a record run never takes a portable fallback)."""
    backend = backend or current()
    require_fast_path(backend)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the record preset needs compiled Triton kernels, but TRITON_INTERPRET=1 runs them in "
                           "Triton's interpreter: unset it")
    check_fa3_compilable(load_fa3())  # fails now, naming the cause, not at the first compiled step
