"""The embedded corpus: a seeded synthetic token process, written as ordinary shards on first use.

    python data/synthetic.py                      # write data/synthetic/ (the smoke preset does it on first use)
    python data/synthetic.py --out data/synthetic_4m --train-tokens 4000000   # a bigger one elsewhere

The smoke preset reads data/synthetic/ by default, so a fresh clone trains and tests with nothing
from outside the repository: no tokenizer, no download, no text. The corpus is made here, with
numpy and a fixed seed, in a few seconds; the same bytes on every machine (tests/data/test_data_synthetic.py
pins a hash of them). Real text is one flag away: `--data-path data/fineweb10B` after
`python data/cached_fineweb10B.py 1`, or your own text through data/tokenize.py (docs/data.md).

The process. Documents start with BOS (GPT-2's <|endoftext|>, 50256, as in the FineWeb shards); the
other tokens are GPT-2's 50,256 ordinary ids. After BOS the first token is drawn from a Zipf-like
unigram distribution u (Zipf–Mandelbrot over ranks, p(rank r) ∝ (r + 1 + 2.7)^-1.1, the exponent and
offset of word counts in English text; ranks go to ids in a seeded random order). After an
ordinary token the document ends (the next token is BOS) with probability 1/128, so documents
have geometric lengths, 128 tokens on average plus the BOS. Otherwise the next token depends on the
current token s and the class of the token before it (each id is one of 4 seeded classes): with
probability 0.9 it is one of the 8 successors listed for (class, s), the k-th with weight
∝ 1/(k + 1); else a fresh draw from u. The successor lists are drawn from u, so the tokens keep a
Zipf-like frequency.

So the corpus is a Markov chain over the states (class of the previous token, current token), and its
entropy rate is exact: H = Σ_state π(state) · H(next token | state), with π the chain's stationary
distribution (found by iterating the chain's transition on a vector, to 1e-12). That H is the loss no
model can beat in expectation: any model's cross-entropy on the stream is at least the entropy of
the next token given the whole past, which for this chain is given by the state. Two more
yardsticks, as exact: the conditional entropy given the current token alone (the best a bigram model
does) and the unigram entropy (the best a model without context does). `python data/synthetic.py`
prints them (the README quotes them), and each folder's synthetic.json keeps them with the loss
of the process's own probabilities on the first validation tokens.

The sizes fit the smoke preset: its 70 steps read about 160k training tokens of the 1M written (two
shards, so the loader crosses a shard boundary), its validation reads 32,768 of the 65,537 (the
default --val-tokens); a batch of 1,536 tokens per rank holds about 12 documents, far below the
127 segments its 128-row cu_seqlens table allows (data/loader.py).
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a script: put the repository root first on sys.path (data/tokenize.py would shadow the
    # standard library's `tokenize` if data/ stayed there).
    _data_dir = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _data_dir]
    sys.path.insert(0, os.path.dirname(_data_dir))

import argparse  # noqa: E402  (after the sys.path fix above)
import hashlib  # noqa: E402
import json  # noqa: E402
import uuid  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from functools import cached_property  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from data.shards import BOS_ID, write_shard  # noqa: E402

DEFAULT_DIR = Path(__file__).resolve().parent / "synthetic"  # the smoke preset's data_path (config.py)
NAME = "synthetic"  # shards: synthetic_val_000000.bin, synthetic_train_000001.bin, ...
META = "synthetic.json"  # written last: its presence says the folder is complete
# ours: bump when the process or its sampling changes, so every cached data/synthetic/ is rewritten
VERSION = 1
ORDINARY = BOS_ID  # GPT-2's ordinary ids: 0 .. 50255
SHARD_TOKENS = 500_000  # per training shard (ours: small, so 1M tokens make two shards)


@dataclass(frozen=True)
class SyntheticSpec:
    """The process and the sizes written (every default is the smoke preset's corpus)."""
    seed: int = 0
    vocab: int = ORDINARY        # ordinary ids used: 0 .. vocab - 1 (tests use a small one)
    zipf_exponent: float = 1.1   # ours: p(rank r) ∝ (r + 1 + offset)^-exponent, English-like (unigram H ≈ 7.5 nats)
    zipf_offset: float = 2.7
    classes: int = 4             # classes of the previous token the next one depends on (the trigram part)
    successors: int = 8          # successors listed per (class, token)
    follow: float = 0.9          # probability of taking a listed successor (else a fresh draw from u)
    end: float = 1 / 128         # probability that a document ends after a token (mean length 128)
    train_tokens: int = 1_000_000
    val_tokens: int = 65_537     # 2 × 32,768 + 1: twice the smoke preset's default validation, plus a target

    def problems(self) -> list[str]:
        bad = []
        if not 0 <= self.seed < 2 ** 63:
            bad.append(f"seed {self.seed}: must be in [0, 2**63)")
        if self.zipf_exponent <= 0 or self.zipf_offset < 0:
            bad.append(f"zipf exponent {self.zipf_exponent} / offset {self.zipf_offset}: must be > 0 / >= 0")
        if not 1 <= self.vocab <= ORDINARY:
            bad.append(f"vocab {self.vocab}: must be in [1, {ORDINARY}] (GPT-2's ordinary ids)")
        if self.classes < 1 or self.successors < 1:
            bad.append(f"classes {self.classes} / successors {self.successors}: must be >= 1")
        if not 0 <= self.follow < 1 or not 0 < self.end < 1:
            bad.append(f"follow {self.follow} must be in [0, 1), end {self.end} in (0, 1)")
        if self.train_tokens < 2 or self.val_tokens < 2:
            bad.append(f"train tokens {self.train_tokens} / val tokens {self.val_tokens}: must be >= 2")
        return bad


def _g(x: np.ndarray) -> np.ndarray:
    """-x ln x, with 0 ln 0 = 0."""
    out = np.zeros_like(x)
    pos = x > 0
    out[pos] = -x[pos] * np.log(x[pos])
    return out


def _searchsorted(cdf: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling: the index i with cdf[i-1] <= draw < cdf[i] (clipped: the last cdf
    entry may round below 1)."""
    return np.minimum(np.searchsorted(cdf, draws, side="right"), cdf.size - 1)


class SyntheticProcess:
    """The tables of one spec's process, its sampler, its exact entropies and its own log-loss.

    Only `Generator.random` draws (uniform doubles, whose stream numpy keeps stable) and inverse-CDF
    sampling are used, so the tokens do not depend on the numpy version's choice/permutation code."""

    def __init__(self, spec: SyntheticSpec):
        if spec.problems():
            raise ValueError("synthetic corpus: " + "; ".join(spec.problems()))
        self.spec = spec
        V, C, K = spec.vocab, spec.classes, spec.successors  # state index V is BOS (id 50256)
        rng = np.random.default_rng([spec.seed, 0])                     # the tables' own stream
        by_rank = (np.arange(V) + 1 + spec.zipf_offset) ** -spec.zipf_exponent
        self.rank_to_id = np.argsort(rng.random(V), kind="stable")      # (V,) a seeded permutation
        self.u = np.empty(V)                                            # (V,) unigram, by id
        self.u[self.rank_to_id] = by_rank / by_rank.sum()
        self.rank_cdf = np.cumsum(by_rank / by_rank.sum())              # (V,) by rank
        self.token_class = (rng.random(V + 1) * C).astype(np.int64)     # (V + 1,) BOS last
        self.token_class[V] = 0
        # (C, V, K): the successors of (class of the previous token, current ordinary token)
        self.succ = self.rank_to_id[_searchsorted(self.rank_cdf, rng.random((C, V, K)))]
        w = 1.0 / np.arange(1, K + 1)
        self.w = w / w.sum()                                            # (K,) successor weights
        self.w_cdf = np.cumsum(self.w)

    # ---- sampling ---------------------------------------------------------------------------

    def sample(self, num_tokens: int, stream: int, progress: tqdm | None = None) -> np.ndarray:
        """(num_tokens,) uint16: the chain run from BOS, from the seeded stream `stream` (0 is the
        validation shard, i the i-th training shard)."""
        spec, V, K = self.spec, self.spec.vocab, self.spec.successors
        rng = np.random.default_rng([spec.seed, 1, stream])
        out = np.empty(num_tokens, dtype=np.int64)  # state indices: V for BOS
        out[0] = V
        chunk = 1 << 16
        prev_class, cur = int(self.token_class[V]), V
        succ, token_class = self.succ.reshape(-1).tolist(), self.token_class.tolist()
        for lo in range(1, num_tokens, chunk):
            n = min(chunk, num_tokens - lo)
            # every draw of the chunk up front (vectorized); the loop only follows the chain
            event = rng.random(n)
            fresh = self.rank_to_id[_searchsorted(self.rank_cdf, rng.random(n))].tolist()
            pick = _searchsorted(self.w_cdf, rng.random(n)).tolist()
            # 0: end the document, 1: a listed successor, 2: a fresh draw from u
            kind = np.where(event < spec.end, 0, np.where(event < spec.end + (1 - spec.end) * spec.follow, 1, 2)).tolist()
            tokens = [0] * n
            for i in range(n):
                if cur == V:
                    nxt = fresh[i]
                elif kind[i] == 0:
                    nxt = V
                elif kind[i] == 1:
                    nxt = succ[(prev_class * V + cur) * K + pick[i]]
                else:
                    nxt = fresh[i]
                prev_class, cur = token_class[cur], nxt
                tokens[i] = nxt
            out[lo:lo + n] = tokens
            if progress is not None:
                progress.update(n)
        out[out == V] = BOS_ID
        return out.astype(np.uint16)

    # ---- the exact yardsticks ---------------------------------------------------------------

    @cached_property
    def stationary(self) -> np.ndarray:
        """(C, V + 1) float64: the stationary probability of each state (class of the previous
        token, current token), BOS the last column; iterated from u to an L1 change below 1e-12."""
        spec, V, C, K = self.spec, self.spec.vocab, self.spec.classes, self.spec.successors
        q, fresh, follow = spec.end, (1 - spec.end) * (1 - spec.follow), (1 - spec.end) * spec.follow
        cls = self.token_class
        # where each listed successor's mass lands: the state (class of the current token, successor)
        target = (np.broadcast_to(cls[:V], (C, V))[..., None] * (V + 1) + self.succ).reshape(-1)  # (C·V·K,)
        pi = np.zeros((C, V + 1))
        pi[cls[V], :V] = self.u
        for _ in range(10_000):
            on_token = pi[:, :V].sum(0)                                   # (V,) by current token
            into_class = np.bincount(cls[:V], weights=on_token, minlength=C)  # (C,) the next state's class
            new = np.bincount(target, weights=(pi[:, :V, None] * (follow * self.w)).reshape(-1),
                              minlength=C * (V + 1)).reshape(C, V + 1)
            new[:, :V] += fresh * into_class[:, None] * self.u[None, :]
            new[:, V] += q * into_class
            new[cls[V], :V] += pi[:, V].sum() * self.u                   # after BOS: a draw from u
            change = np.abs(new - pi).sum()
            pi = new
            if change < 1e-12:
                return pi / pi.sum()
        raise RuntimeError("synthetic corpus: the stationary distribution did not converge")

    def _row_entropies(self, rows: np.ndarray, ids: np.ndarray, mass: np.ndarray, num_rows: int) -> np.ndarray:
        """H(next | row) for rows over ordinary tokens: BOS with probability q, each token t with
        fresh·u(t) + the listed mass on t (entries (rows, ids, mass), duplicates summed)."""
        spec = self.spec
        q, fresh = spec.end, (1 - spec.end) * (1 - spec.follow)
        h_u = float(_g(self.u).sum())
        base = float(_g(np.array([q]))[0] + _g(np.array([fresh]))[0]) + fresh * h_u  # no listed mass
        V = spec.vocab
        unique, inverse = np.unique(rows * V + ids, return_inverse=True)
        listed = np.bincount(inverse, weights=mass)                      # summed over duplicates
        t = unique % V
        delta = _g(fresh * self.u[t] + listed) - _g(fresh * self.u[t])
        return base + np.bincount(unique // V, weights=delta, minlength=num_rows)

    @cached_property
    def entropies(self) -> dict[str, float]:
        """Nats per token of the stationary stream: `rate` (given the whole past: the state),
        `bigram` (given the current token only), `unigram` (given nothing)."""
        spec, V, C, K = self.spec, self.spec.vocab, self.spec.classes, self.spec.successors
        pi, follow = self.stationary, (1 - spec.end) * spec.follow
        h_u = float(_g(self.u).sum())
        rows = np.repeat(np.arange(C * V), K)                            # state (c, s) -> row c·V + s
        state_h = self._row_entropies(rows, self.succ.reshape(-1), np.tile(follow * self.w, C * V), C * V)
        after_bos = pi[:, V].sum()
        rate = float((pi[:, :V].reshape(-1) * state_h).sum() + after_bos * h_u)
        on_token = pi[:, :V].sum(0)                                      # (V,)
        share = pi[:, :V] / on_token                                     # (C, V): P(class | current token)
        bigram_mass = (share[..., None] * (follow * self.w)).reshape(-1)
        token_rows = np.tile(np.repeat(np.arange(V), K), C)
        token_h = self._row_entropies(token_rows, self.succ.reshape(-1), bigram_mass, V)
        bigram = float((on_token * token_h).sum() + after_bos * h_u)
        unigram = float(_g(np.append(on_token, after_bos)).sum())
        return {"rate": rate, "bigram": bigram, "unigram": unigram}

    def log_loss(self, tokens: np.ndarray) -> np.ndarray:
        """(N - 1,) -ln P(tokens[i + 1] | state at i) under the process itself (tokens[0] is BOS)."""
        spec, V = self.spec, self.spec.vocab
        states = np.where(tokens == BOS_ID, V, tokens).astype(np.int64)  # BOS -> state index V
        cur, nxt = states[:-1], states[1:]
        prev_class = self.token_class[np.r_[V, states[:-2]]]
        prob = np.empty(cur.size)
        at_bos, ends = cur == V, nxt == V
        prob[at_bos] = self.u[nxt[at_bos]]
        inner = ~at_bos
        c, s, t = prev_class[inner], cur[inner], nxt[inner]
        listed = (self.w * (self.succ[c, s] == t[:, None])).sum(1)
        t_u = self.u[np.minimum(t, V - 1)]
        p = (1 - spec.end) * (spec.follow * listed + (1 - spec.follow) * t_u)
        prob[inner] = np.where(t == V, spec.end, p)
        assert not (ends & at_bos).any(), "BOS never follows BOS in this process"
        return -np.log(prob)


# ---- the folder ---------------------------------------------------------------------------------


def shard_names(spec: SyntheticSpec) -> list[tuple[str, int, int]]:
    """(file name, stream, tokens): the validation shard (stream 0), then training shards of at
    most SHARD_TOKENS tokens (streams 1, 2, ...)."""
    sizes = [SHARD_TOKENS] * (spec.train_tokens // SHARD_TOKENS)
    if spec.train_tokens % SHARD_TOKENS:
        sizes.append(spec.train_tokens % SHARD_TOKENS)
    return ([(f"{NAME}_val_000000.bin", 0, spec.val_tokens)]
            + [(f"{NAME}_train_{i:06d}.bin", i, n) for i, n in enumerate(sizes, 1)])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_meta(out_dir: Path) -> dict | None:
    """The folder's synthetic.json if the folder is complete (this VERSION, every shard's hash as
    recorded), else None."""
    try:
        meta = json.loads((out_dir / META).read_text())
        if meta.get("version") != VERSION:
            return None
        if all(_sha256(out_dir / name) == digest for name, digest in meta["files"].items()):
            return meta
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


@contextmanager
def _folder_lock(out_dir: Path):
    """One writer at a time (two torchrun ranks may both find the folder missing): the second waits,
    then finds it complete."""
    import fcntl

    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_corpus(out_dir: str | os.PathLike, spec: SyntheticSpec = SyntheticSpec(), progress: bool = True) -> dict:
    """Write the corpus into out_dir (shards atomically, then synthetic.json, also atomically) and
    return the metadata: the spec, the entropies, the process's own loss on the first validation
    tokens and each file's sha256. Shards of an earlier corpus there are removed."""
    out_dir = Path(out_dir)
    process = SyntheticProcess(spec)
    files = shard_names(spec)
    with tqdm(total=sum(n for _, _, n in files), unit="tok", unit_scale=True, disable=not progress,
              desc=f"synthetic corpus -> {out_dir}") as bar:
        tokens = {}
        for name, stream, n in files:
            tokens[name] = process.sample(n, stream, bar)
            write_shard(out_dir / name, tokens[name])
        bar.set_postfix_str("entropy rate")
        entropies = process.entropies
    for stale in set(p.name for p in out_dir.glob(f"{NAME}_*.bin")) - {name for name, _, _ in files}:
        (out_dir / stale).unlink()
    val_loss = process.log_loss(tokens[files[0][0]])
    meta = {
        "version": VERSION,
        "spec": asdict(spec),
        "entropy_nats": entropies,
        # the process's own probabilities on the validation stream's first N targets (what the
        # smoke preset's validation reads: tokens 1..N predicted from 0..N-1)
        "process_val_loss": {str(n): float(val_loss[:n].mean()) for n in (2048, 32768, 65536) if n <= val_loss.size},
        "files": {name: _sha256(out_dir / name) for name, _, _ in files},
    }
    tmp = out_dir / f".{META}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out_dir / META)
    return meta


def ensure_corpus(out_dir: str | os.PathLike = DEFAULT_DIR, spec: SyntheticSpec = SyntheticSpec(),
                  progress: bool = True) -> dict:
    """The corpus of `spec` in out_dir: kept if complete (this VERSION and spec, hashes as recorded),
    else written. Safe to call from several processes at once."""
    out_dir = Path(out_dir)
    meta = read_meta(out_dir)
    if meta is not None and meta["spec"] == asdict(spec):
        return meta
    with _folder_lock(out_dir):
        meta = read_meta(out_dir)  # another process may have written it while we waited
        if meta is not None and meta["spec"] == asdict(spec):
            return meta
        return write_corpus(out_dir, spec, progress)


def summary(meta: dict) -> str:
    """Two lines: the sizes and the yardsticks."""
    h, spec = meta["entropy_nats"], meta["spec"]
    own = ", ".join(f"{float(v):.4f} on {int(k):,}" for k, v in meta["process_val_loss"].items())
    return (f"synthetic corpus: {spec['train_tokens']:,} training + {spec['val_tokens']:,} validation tokens, seed "
            f"{spec['seed']}\nentropy rate {h['rate']:.4f} nats/token (the loss no model beats); best bigram "
            f"model {h['bigram']:.4f}; best unigram model {h['unigram']:.4f}; the process's own loss on the "
            f"first validation tokens: {own}")


def main(argv=None) -> None:
    defaults = SyntheticSpec()
    parser = argparse.ArgumentParser(prog="data/synthetic.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help=f"destination folder (default: {DEFAULT_DIR})")
    parser.add_argument("--train-tokens", type=int, default=defaults.train_tokens,
                        help=f"training tokens, in shards of {SHARD_TOKENS:,} (default: {defaults.train_tokens:,})")
    parser.add_argument("--val-tokens", type=int, default=defaults.val_tokens,
                        help=f"validation tokens (default: {defaults.val_tokens:,})")
    parser.add_argument("--seed", type=int, default=defaults.seed, help=f"seed (default: {defaults.seed})")
    args = parser.parse_args(argv)
    spec = replace(defaults, train_tokens=args.train_tokens, val_tokens=args.val_tokens, seed=args.seed)
    if spec.problems():
        parser.error("; ".join(spec.problems()))
    if args.out.resolve() == DEFAULT_DIR and spec != defaults:
        parser.error(f"--out {args.out}: that folder is the smoke preset's copy of the default corpus (it would be "
                     f"rewritten on the next smoke run); pass another --out and --data-path it")
    print(summary(ensure_corpus(args.out, spec)))
    print(f"train on it: python train_gpt.py --config smoke --data-path {args.out}")


if __name__ == "__main__":
    main()
