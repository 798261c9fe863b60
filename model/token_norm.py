"""The token-normalization map of upstream PR #375: each GPT-2 token id → the smallest id of its class.

Two tokens share a class when their byte strings normalize to the same non-empty key: case,
accents (every Unicode mark), NFKC compatibility forms and whitespace runs are folded and the outer
whitespace stripped, so " The", "THE" and "the" share a class, and so do " 1" and "1". Punctuation
and digits are kept as they are. With `features.token_norm_hashes` the n-gram row and sign hashes read
map[x] instead of x (data/ngram.py); with `features.doc_copy` the matcher compares normalized
contexts (model/doc_copy.py). Embeddings, targets and the data stream keep the raw ids.

The key of a token's bytes b (PR #375: track_1_short/token_norm.py, as frontier_doc_copy.md §1.1 states it):
- ASCII bytes: ASCII letters lowercased, every run of space/TAB/LF/CR made one space; a key that is
  exactly " " stays; otherwise the six ASCII White_Space bytes are stripped from both ends.
- other bytes: not valid UTF-8 (a byte fragment of a longer character) → the empty key. Else NFKC,
  NFD, every character of category Mark (Mn, Mc, Me) deleted, Unicode lowercase, the same whitespace
  runs collapsed, " " kept, otherwise Unicode White_Space stripped from both ends.
An empty key keeps the token its own id; ids past GPT-2's 50,256 byte tokens (<|endoftext|> and the
padding up to the model's vocabulary) map to themselves.

Upstream runs the non-ASCII keys through HF `tokenizers` 0.23.2's normalizer sequence. Ours is the
standard library's `unicodedata`: no dependency, and it reproduces upstream's map exactly, which
`token_norm_map` checks against the published sha256 on every build (Python's Unicode tables are
versioned with Python; a build whose tables move a class stops with the digest it got).

    python -m model.token_norm       # the map's classes, remapped ids, digest and a few examples
"""
from __future__ import annotations

import functools
import hashlib
import re
import time
import unicodedata
from dataclasses import dataclass

import numpy as np

from model.prefix import GPT2_IDS, gpt2_token_bytes

# PR #375 (its README and the #378 README): sha256 of map[0..50256] as little-endian int32, and its counts
TOKEN_NORM_SHA256 = "79fb57ac259495ba36f1afb9b0d5da35f3048b5067fa59c101d5a3c1ed15c2a2"
TOKEN_NORM_CLASSES = 32_980   # classes over GPT-2's 50,257 ids (PR #375)
TOKEN_NORM_REMAPPED = 17_277  # ids whose class representative is another id (PR #375)

_WHITESPACE_RUN = re.compile(r"[ \t\n\r]+")  # the four characters a run collapses over (PR #375)
_ASCII_STRIP = " \t\n\x0b\x0c\r"  # ASCII White_Space
# Unicode White_Space (what Rust's char::is_whitespace strips; Python's str.isspace also takes
# U+001C..U+001F, which are not White_Space)
_UNICODE_STRIP = _ASCII_STRIP + "\x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + \
    "\u2028\u2029\u202f\u205f\u3000"
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def normalization_key(token: bytes) -> str:
    """The class key of one token's bytes ("" where the token keeps its own id)."""
    if token.isascii():
        key = _WHITESPACE_RUN.sub(" ", token.decode("ascii").translate(_ASCII_LOWER))
        return key if key == " " else key.strip(_ASCII_STRIP)
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:  # a fragment of a multi-byte character
        return ""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if not unicodedata.category(c).startswith("M")).lower()
    key = _WHITESPACE_RUN.sub(" ", text)
    return key if key == " " else key.strip(_UNICODE_STRIP)


def build_token_norm_map(vocab_size: int, token_bytes: dict[bytes, int]) -> np.ndarray:
    """int32 [vocab_size]: each id's class representative, the smallest id with the same non-empty
    key (ids without bytes, or with an empty key, map to themselves)."""
    by_id = {i: b for b, i in token_bytes.items()}
    out = np.arange(vocab_size, dtype=np.int32)
    first: dict[str, int] = {}
    for i in sorted(i for i in by_id if i < vocab_size):
        key = normalization_key(by_id[i])
        if key:
            out[i] = first.setdefault(key, i)
    return out


@dataclass(frozen=True)
class TokenNormMap:
    """The map, what it is (counts and digest over GPT-2's ids) and how long its build took."""
    ids: np.ndarray  # int32 [vocab_size]
    classes: int
    remapped: int
    sha256: str
    build_s: float

    def line(self) -> str:
        """The run log's line (a run prints what it hashes with)."""
        return (f"token_norm: {self.classes:,} classes over GPT-2's {GPT2_IDS:,} ids, {self.remapped:,} remapped, "
                f"sha256 {self.sha256} (PR #375's; unicodedata {unicodedata.unidata_version}), built in "
                f"{self.build_s:.2f} s before the clock")


def describe(ids: np.ndarray) -> tuple[int, int, str]:
    """(classes, remapped ids, sha256) over the first 50,257 entries, little-endian int32."""
    head = np.asarray(ids[:GPT2_IDS], dtype="<i4")
    return (len(np.unique(head)), int((head != np.arange(head.size)).sum()),
            hashlib.sha256(head.tobytes()).hexdigest())


@functools.cache
def token_norm_map(vocab_size: int) -> TokenNormMap:
    """GPT-2's map from tiktoken's BPE files (cached, or fetched online), built once per process and
    checked against PR #375's digest; a map that differs stops here, naming what it got."""
    if vocab_size < GPT2_IDS:
        raise ValueError(f"token_norm_map: vocab_size {vocab_size} must hold GPT-2's {GPT2_IDS} ids")
    start = time.perf_counter()
    try:
        token_bytes = gpt2_token_bytes()
    except Exception as e:  # no cached files and no network, a bad download
        raise RuntimeError(f"features.token_norm_hashes / features.doc_copy: the normalization map is built from "
                           f"GPT-2's BPE files, which tiktoken could not load ({type(e).__name__}: {e}); set "
                           f"TIKTOKEN_CACHE_DIR to a folder holding them, or run once with network") from None
    ids = build_token_norm_map(vocab_size, token_bytes)
    classes, remapped, digest = describe(ids)
    if digest != TOKEN_NORM_SHA256:
        raise RuntimeError(f"token_norm_map: the map built here has {classes:,} classes, {remapped:,} remapped, "
                           f"sha256 {digest}; PR #375's is {TOKEN_NORM_CLASSES:,} / {TOKEN_NORM_REMAPPED:,} / "
                           f"{TOKEN_NORM_SHA256} (this Python's Unicode tables are {unicodedata.unidata_version})")
    ids.flags.writeable = False  # shared by every caller of this process
    return TokenNormMap(ids, classes, remapped, digest, time.perf_counter() - start)


if __name__ == "__main__":
    from model.prefix import gpt2_encoding

    m = token_norm_map(50304)
    print(m.line())
    enc = gpt2_encoding()
    for text in (" the", "The", " THE", " hello", " café", " 1", " !", "'s"):
        (i,) = enc.encode(text)
        print(f"{text!r:>9} {i:>6} -> {int(m.ids[i]):>6} {enc.decode([int(m.ids[i])])!r}")
