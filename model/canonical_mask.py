"""The canonical (prev, cur) validation mask of record #92 (PR #350): token pairs GPT-2 never emits.

M[p, x] = 1 asserts that GPT-2's tokenizer never emits token x directly after token p, in any
context, so the final validation's softmax may drop class x on a row whose input token is p: its
softcapped logit becomes −60. On tokenizer-produced text the true target is never dropped (bar the
record's 11 bits below), so the mask can only lower the loss. Validation only; training never sees it.

How the bits are found (record #360: track_1_short/canonical_mask.py, from PR #350). Inside one
pretoken, byte-level BPE applies merges in rank order. Re-running BPE on each token's own bytes
gives the merge (a, b) that forms token r (its id is that merge's rank) and, for every token, which
piece sits at its first and at its last position at each "time" (rank). If p ends in piece a and x
starts with piece b when the tokenizer reaches rank r, and p and x meet inside one pretoken, merge r
fires across the seam and [.., p, x, ..] cannot survive. So M[p, x] = 1 for every p in ps(r) and x
in xs(r), when the pretokenizer classes at the seam (whitespace, number, letter, other,
mid-character) keep p's end and x's start in one pretoken. Pairs whose answer depends on the
surrounding text stay 0: tokens ending in a contraction ('s 't 're 've 'm 'll 'd) mask nothing, and
no x starting inside a UTF-8 character is masked. One case the record misses: a token whose last
bytes complete a character begun in an earlier token (an emoji's tail, say) has an unknown class at
its end, yet the record's table lets it mask; 11 bits, some of which GPT-2 does emit ('😑士').
strict=True leaves those rows unset.

Storage: uint8 [V, ceil(V/8)], little-endian bits (bit x of row p = bit x % 8 of byte x // 8),
316 MB for V = 50304. Rows and columns of ids outside the BPE ranks (50256 <|endoftext|>, the pads
50257..) are zero, so the first token of a document is never masked and pads stay in the softmax.

The build is a few seconds of Python and NumPy; a run starts it in a forked child of rank 0 right
after the clock starts (CanonicalMaskBuild), so it never holds the trainer's GIL, and collects it
at the final validation.

    python -m model.canonical_mask     # builds the mask, prints its time and density
"""
from __future__ import annotations

import mmap
import os
import signal
import time
import traceback
import unicodedata
import warnings

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from model.prefix import gpt2_token_bytes

VOCAB_SIZE = 50304  # record #360: GPT-2's 50257 ids padded to a multiple of 128
MASK_FILL = -60.0  # record #92 (PR #350): far below the softcapped range (0, 23]; exp underflows
WAIT_TIMEOUT_S = 60.0  # record #92 (PR #350): then the child is killed and the mask built inline
POLL_INTERVAL_S = 0.05  # record #92 (PR #350)
ROWS_PER_BLOCK = 1024  # rows filled as dense bool (50 MB) and packed at a time; speed/memory only

# Pretokenizer character classes at a token's edges (track_1_short/canonical_mask.py).
WHITESPACE, NUMBER, LETTER, OTHER, MID_CHAR = range(5)
# SEAM_OK[end class of p, start class of x]: may p's end and x's start sit in one pretoken?
SEAM_OK = np.ones((5, 5), dtype=bool)
SEAM_OK[:, MID_CHAR] = False  # x starts inside a character begun before the seam: left unset
SEAM_OK[WHITESPACE, WHITESPACE] = False  # a whitespace run is one pretoken, split by lookahead
SEAM_OK[OTHER, LETTER] = False  # an apostrophe may open a contraction pretoken, depending on the left
CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")  # GPT-2's pretokenizer
NEVER = 1 << 30  # end of the last interval of a trajectory (beyond every rank)


def char_class(ch: str) -> int:
    if ch.isspace() and not "\x1c" <= ch <= "\x1f":  # \x1c..\x1f: str.isspace but not regex \s
        return WHITESPACE
    category = unicodedata.category(ch)[0]
    return NUMBER if category == "N" else LETTER if category == "L" else OTHER


def edge_class(token: bytes, start: bool) -> int:
    """Class of the first (start) or last character of `token`, MID_CHAR if its edge bytes are
    not a whole UTF-8 character."""
    for n in range(1, 5):
        try:
            text = (token[:n] if start else token[-n:]).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return char_class(text[0] if start else text[-1])
    return MID_CHAR


def ends_in_contraction(token: bytes) -> bool:
    """Does the token's text end in a contraction that GPT-2 pretokenizes on its own?"""
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        return False  # ends mid-character
    for suffix in CONTRACTIONS:
        if text.endswith(suffix):
            before = text[: -len(suffix)]
            return not before or char_class(before[-1]) in (LETTER, NUMBER)
    return False


def bpe_trajectories(ranks: dict[bytes, int]):
    """Re-run byte-level BPE on every token's own bytes.

    Returns (rules, first, last): rules = int64 [R, 3] rows (rank, left piece, right piece) of the
    merge that forms each multi-byte token; first/last = int64 [E, 4] rows (piece, start, end,
    token): the token's first/last piece is `piece` for ranks in [start, end). Ties go to the
    leftmost pair, so at rank r a seam merge fires before a merge of the same rank inside x (x's
    new first piece counts from r + 1) and after one inside p (p's new last piece counts from r).
    Pieces are tokens, named by their ids.
    """
    rules, first, last = [], [], []
    for token, tid in ranks.items():
        pieces = [token[i:i + 1] for i in range(len(token))]
        firsts, lasts, last_merge = [(0, pieces[0])], [(0, pieces[-1])], None
        while len(pieces) > 1:
            best, at = None, -1
            for i in range(len(pieces) - 1):
                rank = ranks.get(pieces[i] + pieces[i + 1])
                if rank is not None and (best is None or rank < best):  # strict: ties go left
                    best, at = rank, i
            if best is None:
                break
            last_merge = (ranks[pieces[at]], ranks[pieces[at + 1]])
            pieces[at:at + 2] = [pieces[at] + pieces[at + 1]]
            if at == 0:
                firsts.append((best + 1, pieces[0]))
            if at == len(pieces) - 1:
                lasts.append((best, pieces[-1]))
        if last_merge is not None:  # the last merge performed forms the token
            rules.append((tid, *last_merge))
        for trajectory, out in ((firsts, first), (lasts, last)):
            ends = [start for start, _ in trajectory[1:]] + [NEVER]
            out.extend((ranks[piece], start, end, tid)
                       for (start, piece), end in zip(trajectory, ends) if start < end)
    return tuple(np.array(rows, dtype=np.int64).reshape(-1, width)
                 for rows, width in ((rules, 3), (first, 4), (last, 4)))


def segment_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lengths)), vectorized."""
    total = int(lengths.sum())
    segment_base = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return segment_base + np.arange(total, dtype=np.int64)


def tokens_showing_piece(rules: np.ndarray, side: int, entries: np.ndarray):
    """(rule index, token) pairs, sorted by rule: tokens whose trajectory (entries) shows the
    rule's left (side 1) or right (side 2) piece at the rule's rank. The rules of one piece with
    ranks in an entry's interval are a contiguous run once sorted by (piece, rank)."""
    key = rules[:, side] << 31 | rules[:, 0]  # ranks and NEVER are < 2^31
    by_key = np.argsort(key, kind="stable")
    key = key[by_key]
    piece, start, end, token = entries.T
    lo = np.searchsorted(key, piece << 31 | start)
    counts = np.searchsorted(key, piece << 31 | end) - lo
    rule = by_key[segment_ranges(lo, counts)]
    token = np.repeat(token, counts)
    order = np.argsort(rule, kind="stable")
    return rule[order], token[order]


def build_canonical_mask(vocab_size: int = VOCAB_SIZE, ranks: dict[bytes, int] | None = None,
                         out: np.ndarray | None = None, progress: bool = False,
                         strict: bool = False) -> np.ndarray:
    """The packed mask, uint8 [vocab_size, ceil(vocab_size / 8)] (written into `out` if given).

    ranks: GPT-2's mergeable ranks (bytes → id), read from tiktoken's cache when None.
    strict: also leave unset the rows of tokens whose last bytes are not a whole character. Such a
      token completes a character begun in an earlier token, so the character's class, and whether
      the seam is a pretoken boundary, depend on context. The record sets 11 bits in these rows and
      GPT-2 does emit some of those pairs (e.g. '😑士' → [.., b'\\x91', '士']); strict drops them.
    """
    ranks = gpt2_token_bytes() if ranks is None else ranks
    width = (vocab_size + 7) // 8
    if max(ranks.values()) >= vocab_size:
        raise ValueError(f"canonical mask: vocab_size={vocab_size} is smaller than the tokenizer's "
                         f"{max(ranks.values()) + 1} ids")
    if out is None:
        out = np.empty((vocab_size, width), dtype=np.uint8)
    elif out.shape != (vocab_size, width) or out.dtype != np.uint8:
        raise ValueError(f"canonical mask: out must be uint8 {(vocab_size, width)}, "
                         f"got {out.dtype} {tuple(out.shape)}")

    start_class = np.full(vocab_size, MID_CHAR, dtype=np.int64)
    end_class = np.full(vocab_size, MID_CHAR, dtype=np.int64)
    closed = np.zeros(vocab_size, dtype=bool)  # ends in a contraction: masks nothing
    for token, tid in ranks.items():
        start_class[tid], end_class[tid] = edge_class(token, start=True), edge_class(token, start=False)
        closed[tid] = ends_in_contraction(token)

    seam_ok = SEAM_OK.copy()
    if strict:
        seam_ok[MID_CHAR, :] = False
    rules, first, last = bpe_trajectories(ranks)
    p_rule, ps = tokens_showing_piece(rules, 1, last)  # p ends in piece a at time r
    keep = ~closed[ps]
    p_rule, ps = p_rule[keep], ps[keep]
    x_rule, xs = tokens_showing_piece(rules, 2, first)  # x starts with piece b at time r

    # For each end class e of p: the xs of each rule whose start class may follow e, as segments
    # of one flat array (x_rule is sorted, so each rule's xs are contiguous).
    segment_xs, base = [], 0
    seg_start, seg_len = np.empty((5, len(rules)), np.int64), np.empty((5, len(rules)), np.int64)
    for e in range(5):
        allowed = seam_ok[e, start_class[xs]]
        seg_len[e] = np.bincount(x_rule[allowed], minlength=len(rules))
        seg_start[e] = base + np.cumsum(seg_len[e]) - seg_len[e]
        segment_xs.append(xs[allowed])
        base += int(allowed.sum())
    segment_xs = np.concatenate(segment_xs)

    # Row p = the union of its rules' segments; fill dense bool rows a block at a time, then pack.
    order = np.argsort(ps, kind="stable")
    ps, p_rule = ps[order], p_rule[order]
    starts, lengths = seg_start[end_class[ps], p_rule], seg_len[end_class[ps], p_rule]
    block = np.empty((ROWS_PER_BLOCK, vocab_size), dtype=bool)
    for row0 in tqdm(range(0, vocab_size, ROWS_PER_BLOCK), desc="canonical mask", disable=not progress):
        row1 = min(row0 + ROWS_PER_BLOCK, vocab_size)
        lo, hi = np.searchsorted(ps, [row0, row1])
        rows = np.repeat(ps[lo:hi] - row0, lengths[lo:hi])
        cols = segment_xs[segment_ranges(starts[lo:hi], lengths[lo:hi])]
        block.fill(False)
        block.reshape(-1)[rows * vocab_size + cols] = True
        out[row0:row1] = np.packbits(block[: row1 - row0], axis=1, bitorder="little")
    return out


def unpack_rows(mask: Tensor, prev_tokens: Tensor, vocab_size: int | None = None) -> Tensor:
    """bool [T, vocab_size]: row prev_tokens[t] of the packed mask, bit x at column x."""
    vocab_size = mask.shape[1] * 8 if vocab_size is None else vocab_size
    rows = mask[prev_tokens]  # (T, W) uint8
    bit_values = (2 ** torch.arange(8, device=mask.device)).to(torch.uint8)  # 1, 2, ..., 128 (no host copy)
    bits = (rows.unsqueeze(-1) & bit_values) != 0  # (T, W, 8): byte j, bit k is column 8j + k
    return bits.flatten(1)[:, :vocab_size]


def apply_canonical_mask(logits: Tensor, prev_tokens: Tensor, mask: Tensor) -> Tensor:
    """Softcapped validation logits [T, V] with the classes row prev_tokens[t] drops set to −60.

    prev_tokens[t] is the input token at position t, whose next token row t predicts. Returns a
    new tensor; the caller slabs the rows, as the bool [T, V] mask is as large as the logits.
    """
    if logits.ndim != 2 or prev_tokens.shape != logits.shape[:1]:
        raise ValueError(f"canonical mask: logits must be [T, V] and prev_tokens [T], got "
                         f"{tuple(logits.shape)} and {tuple(prev_tokens.shape)}")
    if mask.dtype != torch.uint8 or mask.ndim != 2 or mask.shape[1] * 8 < logits.shape[1]:
        raise ValueError(f"canonical mask: mask must be uint8 [V, ceil(V/8)] for V = {logits.shape[1]}, "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    return logits.masked_fill(unpack_rows(mask, prev_tokens, logits.shape[1]), MASK_FILL)


class CanonicalMaskBuild:
    """The mask built in a forked child process while training runs (record #92, PR #350).

        build = CanonicalMaskBuild()   # rank 0, before the clock: shared buffer, BPE ranks loaded
        build.start()                  # right after the clock starts
        mask = build.wait()            # at the final validation: uint8 [V, ceil(V/8)] CPU tensor

    The child only computes, in its own interpreter, so the trainer keeps its GIL; it writes the
    bits into an anonymous shared mapping (MAP_SHARED) that the returned tensor views. If the child
    fails or runs past the timeout, it is killed and wait() builds the mask inline with a warning;
    without os.fork, wait() builds inline.
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE, ranks: dict[bytes, int] | None = None,
                 strict: bool = False):
        self.vocab_size, self.strict = vocab_size, strict
        self.ranks = gpt2_token_bytes() if ranks is None else ranks  # tiktoken's loader takes locks
        self.shape = (vocab_size, (vocab_size + 7) // 8)
        self._buffer = mmap.mmap(-1, self.shape[0] * self.shape[1])  # anonymous maps are shared
        self._pid: int | None = None
        self._mask: Tensor | None = None

    def _array(self) -> np.ndarray:
        return np.frombuffer(self._buffer, dtype=np.uint8).reshape(self.shape)

    def _build_inline(self) -> None:
        build_canonical_mask(self.vocab_size, self.ranks, out=self._array(), strict=self.strict)

    def start(self) -> None:
        if self._pid is not None or self._mask is not None:
            raise RuntimeError("CanonicalMaskBuild.start: already started")
        if not hasattr(os, "fork"):
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork with threads
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self._build_inline()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)  # skip the trainer's atexit handlers and CUDA/NCCL teardown
        self._pid = pid

    def _child_result(self, timeout: float) -> str | None:
        """Reap the child: None if it built the mask, else why it did not."""
        deadline = time.perf_counter() + timeout
        while True:
            pid, status = os.waitpid(self._pid, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
                return None if code == 0 else f"the child exited with status {code}"
            if time.perf_counter() > deadline:
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
                return f"the child was still building after {timeout:.0f} s"
            time.sleep(POLL_INTERVAL_S)

    def wait(self, timeout: float = WAIT_TIMEOUT_S) -> Tensor:
        """The mask, uint8 [V, ceil(V/8)] on the CPU (a view of the shared buffer). Builds it
        inline when no child was forked (no os.fork, or start() never called)."""
        if self._mask is None:
            if self._pid is None:
                self._build_inline()
            else:
                failure, self._pid = self._child_result(timeout), None
                if failure:
                    warnings.warn(f"canonical mask: background build failed ({failure}); building it inline")
                    self._build_inline()
            self._mask = torch.from_numpy(self._array())
        return self._mask


if __name__ == "__main__":
    started = time.perf_counter()
    mask = build_canonical_mask(progress=True)
    seconds = time.perf_counter() - started
    bits_per_byte = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.uint8)
    dropped = int(bits_per_byte[mask].sum(dtype=np.int64))
    print(f"canonical mask {mask.shape} uint8 built in {seconds:.1f} s: {dropped:,} dropped (prev, cur) "
          f"pairs, {dropped / VOCAB_SIZE ** 2:.2%} of {VOCAB_SIZE}^2")
