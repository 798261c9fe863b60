"""DocCopy (upstream PR #378): each position's longest earlier match inside its document, as an input.

For every position t of a rank's packed stream, the matcher looks for the longest context length L in
COPY_LENGTHS whose window of normalized ids n[t−L+1..t] (model/token_norm.py) occurred earlier in the
same document, ending at some j < t. The latest such j gives the candidate, the raw token x[j+1] (the
token that followed the earlier occurrence: j + 1 ≤ t, so nothing past t is read), and L with the
number of earlier occurrences c gives the bucket 1 + 3·k(L) + min(c, 3) − 1 ∈ [1, 30]; no match gives
candidate −1 and bucket 0. Documents start at a BOS (the BOS belongs to the document it opens);
positions before a stream's first BOS form document 0. The 2560-token attention cut does not split.

The model adds v = embed(candidate)·scale[bucket] + bucket_embed[bucket] after the smear (times
site[0]) and before the final norm (times site[1]); bucket 0's rows are zeroed (`copy_vector`).

How it is computed (PR #378: track_1_short/doc_copy.py; frontier_doc_copy.md §2.2), all lengths at once,
with no host sync and static shapes, so it sits inside the compiled forward and its CUDA graph:
    y = n + 1; S[t] = Σ_{i≤t} y[i]·M^−i (wrapping int64); H_L(t) = M^t·(S[t] − S[t−L]) = Σ y[i]·M^(t−i)
    key(L, t) = H_L(t) XOR L·LEN_MUL XOR doc(t)·DOC_MUL, or −1−t where the window leaves the document
Then one stable sort of the 10·T keys (row-major: length, then position): an entry's predecessor with
an equal key is the latest earlier j of that length, its offset in its run of equal keys the count c.
A match also requires j < t (PR #378's final code; FLAG 4 of the spec: its runs lacked the check,
which only differs on a cross-length 64-bit key collision). The result differs from the definition
above only on such a collision: about (10T)²/2^65, 1e-8 per training forward of 49,152 tokens.

    candidate, bucket = doc_copy_features(inputs, norm_map, pow_fwd, pow_bwd)   # (T,), (T,) int64
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

# PR #378 (track_1_short/doc_copy.py): the context lengths, count buckets and hash constants
COPY_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
COPY_COUNT_BUCKETS = 3                                      # 1, 2, 3+ earlier occurrences
COPY_BUCKETS = 1 + len(COPY_LENGTHS) * COPY_COUNT_BUCKETS   # 31; bucket 0 = no match
COPY_SITE_INIT = (0.5, 1.0)                                 # PR #378: the input and output site gains
COPY_MAX_TOKENS = 262_144                                   # PR #378: the power tables' length (a validation rank's T)
BOS_ID = 50256                                              # GPT-2's <|endoftext|>
_HASH_MUL = 0x9E3779B97F4A7C15  # PR #378: M, odd (so invertible mod 2^64)
_DOC_MUL = 0x5851F42D4C957F2D   # PR #378
_LEN_MUL = 0x2545F4914F6CDD1D   # PR #378


def as_int64(value: int) -> int:
    """An integer mod 2^64 as the signed int64 with the same bits."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


HASH_MUL, DOC_MUL, LEN_MUL = as_int64(_HASH_MUL), as_int64(_DOC_MUL), as_int64(_LEN_MUL)  # the same, as int64


def hash_powers(n: int = COPY_MAX_TOKENS) -> tuple[Tensor, Tensor]:
    """(M^t, M^−t) for t < n, int64 [n] each (mod 2^64): the model's constant buffers, made on the
    current default device (a model built under a device context gets them there)."""
    fwd = np.full(n, _HASH_MUL, dtype=np.uint64)
    bwd = np.full(n, pow(_HASH_MUL, -1, 1 << 64), dtype=np.uint64)
    fwd[0] = bwd[0] = 1
    with np.errstate(over="ignore"):  # uint64 products wrap mod 2^64, as the hash wants
        fwd, bwd = np.cumprod(fwd, dtype=np.uint64), np.cumprod(bwd, dtype=np.uint64)
    return torch.tensor(fwd.view(np.int64)), torch.tensor(bwd.view(np.int64))


def window_keys(tokens: Tensor, norm_map: Tensor, pow_fwd: Tensor, pow_bwd: Tensor) -> tuple[Tensor, Tensor]:
    """(keys [K, T] int64, valid [K, T] bool): each length's window hash, salted by length and
    document, −1−t where the window reaches before its document's start."""
    T = tokens.numel()
    x = tokens.long()
    pos = torch.arange(T, device=tokens.device)  # (T,)
    is_bos = x == BOS_ID
    doc = torch.cumsum(is_bos.long(), 0)  # (T,) BOS at or before t
    doc_start = torch.cummax(torch.where(is_bos, pos, torch.zeros_like(pos)), 0).values  # (T,) latest BOS <= t, else 0
    y = norm_map[x].long() + 1  # (T,) normalized ids, never 0
    prefix = torch.cat([torch.zeros(1, dtype=torch.long, device=tokens.device),
                        torch.cumsum(y * pow_bwd[:T], 0)])  # (T+1,) S[t−1], wrapping
    # (K, T): each window's first position, and its length's salt (Python ints: no tensor made from a
    # host list inside the compiled graph, which a CUDA graph could not capture)
    starts = torch.stack([pos - (L - 1) for L in COPY_LENGTHS])
    salts = torch.stack([torch.full_like(pos, as_int64(L * _LEN_MUL)) for L in COPY_LENGTHS])
    hashes = pow_fwd[:T][None, :] * (prefix[None, 1:] - prefix[starts.clamp_min(0)])  # (K, T) H_L(t)
    keys = hashes ^ salts ^ (doc * DOC_MUL)[None, :]
    valid = starts >= doc_start[None, :]
    return torch.where(valid, keys, -1 - pos[None, :]), valid


def doc_copy_features(tokens: Tensor, norm_map: Tensor, pow_fwd: Tensor, pow_bwd: Tensor) -> tuple[Tensor, Tensor]:
    """tokens int [T] (raw ids), norm_map int [V], the power tables int64 [≥ T] →
    (candidate int64 [T], −1 where none; bucket int64 [T] in [0, 31)). Integer ops only (no
    gradient), no host sync, shapes fixed by T."""
    T, K = tokens.numel(), len(COPY_LENGTHS)
    if tokens.dim() != 1 or T > pow_fwd.numel():
        raise ValueError(f"doc_copy_features: tokens must be [T] with T <= {pow_fwd.numel()} (the power tables), "
                         f"got {tuple(tokens.shape)}")
    keys, valid = window_keys(tokens, norm_map, pow_fwd, pow_bwd)
    sorted_keys, order = torch.sort(keys.reshape(-1), stable=True)  # equal keys keep (length, position) order
    index = torch.arange(K * T, device=tokens.device)
    run_head = torch.ones_like(sorted_keys, dtype=torch.bool)
    run_head[1:] = sorted_keys[1:] != sorted_keys[:-1]
    earlier = index - torch.cummax(torch.where(run_head, index, torch.zeros_like(index)), 0).values  # (KT,) offset in run
    before = torch.cat([order[:1], order[:-1]]) % T  # (KT,) position of the sorted predecessor
    count = torch.empty_like(earlier).scatter_(0, order, earlier).view(K, T)  # back in (length, position) order
    latest = torch.empty_like(before).scatter_(0, order, before).view(K, T)
    pos = torch.arange(T, device=tokens.device)
    found = valid & (count > 0) & (latest < pos[None, :])  # (K, T)
    lengths_idx = torch.arange(K, device=tokens.device)[:, None]
    k_star = torch.where(found, lengths_idx, -1).amax(0)  # (T,) longest matched length, −1 where none
    k_safe = k_star.clamp_min(0)[None, :]
    j_star = latest.gather(0, k_safe)[0]  # (T,)
    c_star = count.gather(0, k_safe)[0]
    matched = k_star >= 0
    candidate = torch.where(matched, tokens.long()[(j_star + 1).clamp(max=T - 1)], -1)
    bucket = torch.where(matched, 1 + COPY_COUNT_BUCKETS * k_star + c_star.clamp(max=COPY_COUNT_BUCKETS) - 1, 0)
    return candidate, bucket


def copy_vector(copied: Tensor, bucket: Tensor, scale: Tensor, bucket_embed: Tensor, live: Tensor) -> Tensor:
    """v [T, D] in copied's dtype: embed(candidate)·scale[bucket] + bucket_embed[bucket], bucket 0's
    rows zeroed by `live` (so they never get a gradient). copied: the candidates' embedding rows [T, D]."""
    s = (scale * live)[bucket].type_as(copied)[:, None]  # (T, 1)
    e = (bucket_embed * live[:, None])[bucket].type_as(copied)  # (T, D)
    return copied * s + e
