"""data/synthetic.py, the embedded corpus: its exact entropies against a dense reference (the whole
transition matrix and its eigenvector), its sampler against those probabilities, the default
corpus's bytes, shape and statistics, the cached folder's life (kept, repaired, rewritten), and the
smoke preset writing it on first use."""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from config import RUN_PRESETS
from data.loader import cu_seqlens_rows
from data.shards import BOS_ID, VOCAB_SIZE, read_shard
import data.synthetic as synthetic
from data.synthetic import SyntheticProcess, SyntheticSpec, ensure_corpus, read_meta, write_corpus

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = SyntheticSpec(seed=3, vocab=30, classes=3, successors=4, follow=0.8, end=0.1, train_tokens=600,
                      val_tokens=300)


def _h(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def dense_reference(process: SyntheticProcess) -> dict:
    """The chain written out state by state from the spec's definition, with plain loops:
    (transition matrix over states (class of previous, current) with BOS = index V, its stationary
    distribution from numpy's eigen-solver, the three entropies)."""
    spec = process.spec
    V, C, K = spec.vocab, spec.classes, spec.successors
    n = C * (V + 1)

    def state(c, s):
        return c * (V + 1) + s

    P = np.zeros((n, n))
    for c in range(C):
        for s in range(V + 1):
            row = P[state(c, s)]
            if s == V:  # after BOS: the first token, from u
                for t in range(V):
                    row[state(process.token_class[V], t)] += process.u[t]
                continue
            c_next = process.token_class[s]
            row[state(c_next, V)] += spec.end
            for t in range(V):
                row[state(c_next, t)] += (1 - spec.end) * (1 - spec.follow) * process.u[t]
            for k in range(K):
                row[state(c_next, process.succ[c, s, k])] += (1 - spec.end) * spec.follow * process.w[k]
    assert np.allclose(P.sum(1), 1)
    values, vectors = np.linalg.eig(P.T)
    pi = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    pi /= pi.sum()
    # from a state the next token fixes the next state (its class is the current token's), so the
    # next-token distribution of a state is its row, summed over the next state's class
    next_token = P.reshape(n, C, V + 1).sum(1)                       # (n, V + 1)
    rate = sum(pi[i] * _h(next_token[i]) for i in range(n))
    by_current = pi.reshape(C, V + 1)                                # (C, V + 1)
    on = by_current.sum(0)                                           # (V + 1,) the current token's marginal
    bigram = 0.0
    for s in range(V + 1):
        mix = sum(by_current[c, s] * next_token[state(c, s)] for c in range(C)) / on[s]
        bigram += on[s] * _h(mix)
    return {"P": P, "pi": pi, "next_token": next_token,
            "entropies": {"rate": rate, "bigram": bigram, "unigram": _h(on)}}


def test_entropies_and_stationary_distribution_match_the_dense_chain():
    process = SyntheticProcess(SMALL)
    ref = dense_reference(process)
    assert np.abs(process.stationary.reshape(-1) - ref["pi"]).max() < 1e-10
    for name, value in ref["entropies"].items():
        assert process.entropies[name] == pytest.approx(value, abs=1e-9), name
    h = process.entropies
    assert h["rate"] < h["bigram"] < h["unigram"] < math.log(SMALL.vocab + 1)


def test_the_sampler_draws_from_the_chains_probabilities():
    """On a long sample: the process's own log-loss is the dense chain's probability of each step,
    and its mean is the entropy rate within 4 standard errors (a sampler drawing from other
    probabilities pays their KL divergence on top); the token frequencies are the stationary ones."""
    process = SyntheticProcess(SMALL)
    ref = dense_reference(process)
    V = SMALL.vocab
    tokens = process.sample(200_000, stream=1)
    assert tokens[0] == BOS_ID and tokens.dtype == np.uint16
    states = np.where(tokens == BOS_ID, V, tokens).astype(np.int64)
    prev_class = process.token_class[np.r_[V, states[:-2]]]
    p_ref = ref["next_token"][prev_class * (V + 1) + states[:-1], states[1:]]
    loss = process.log_loss(tokens)
    np.testing.assert_allclose(np.exp(-loss), p_ref, rtol=1e-12)
    sem = loss.std() / math.sqrt(loss.size)
    assert abs(loss.mean() - process.entropies["rate"]) < 4 * sem, (loss.mean(), process.entropies["rate"], sem)
    seen = np.bincount(states, minlength=V + 1) / states.size
    assert np.abs(seen - ref["pi"].reshape(SMALL.classes, V + 1).sum(0)).sum() < 0.02


# ---- the default corpus (the smoke preset's) ----------------------------------------------------

DEFAULT_HASHES = {  # data/synthetic.py VERSION 1, seed 0: bump VERSION when these move
    "synthetic_val_000000.bin": "42c5b758f22e85306b1f3aefe03d390fb3462a3fe77f139d6bd8f4a46935b443",
    "synthetic_train_000001.bin": "ac649f03c5f006602e1aa97da6d53ff4d8fc9860a791aead4f091344d6785509",
    "synthetic_train_000002.bin": "aeea3882411ed1daa20548f6c2c0e18e3674f56d4b6d079be754158665c4505d",
}


def test_the_default_corpus_bytes_shape_and_yardsticks(synthetic_shards):
    meta = json.loads((synthetic_shards / synthetic.META).read_text())
    assert meta["files"] == DEFAULT_HASHES  # the same bytes on every machine
    assert {p.name for p in synthetic_shards.glob("*.bin")} == set(DEFAULT_HASHES)
    for name, digest in DEFAULT_HASHES.items():
        assert hashlib.sha256((synthetic_shards / name).read_bytes()).hexdigest() == digest
    val = read_shard(synthetic_shards / "synthetic_val_000000.bin")
    train = np.concatenate([read_shard(synthetic_shards / f"synthetic_train_00000{i}.bin") for i in (1, 2)])
    assert val.size == 65_537 and train.size == 1_000_000 and val[0] == BOS_ID and train[0] == BOS_ID
    assert int(train.max()) < VOCAB_SIZE
    bos = train == BOS_ID
    assert not (bos[:-1] & bos[1:]).any()  # no empty document
    docs = np.diff(np.flatnonzero(bos))
    assert docs.mean() == pytest.approx(129, abs=3)  # 128 tokens on average, plus the BOS
    # the smoke preset's largest per-rank batch, 1,536 tokens (+ 1): its segments must fit the
    # cu_seqlens table with room to spare, anywhere in the stream
    smoke = RUN_PRESETS["smoke"]
    per_rank = max(stage.batch_tokens for stage in smoke.schedule.stages) // smoke.virtual_world_size
    window = per_rank + 1
    counts = np.r_[0, np.cumsum(bos)]
    most = int((counts[window:] - counts[:-window]).max())
    assert most < (cu_seqlens_rows(per_rank) - 1) // 2, most
    # Zipf-like: the top ranks' frequencies fall like rank^-1.1 (the spec's exponent) within 0.15
    freq = np.sort(np.bincount(train[~bos], minlength=BOS_ID))[::-1]
    ranks = np.arange(10, 300)
    slope = np.polyfit(np.log(ranks + 1 + 2.7), np.log(freq[ranks]), 1)[0]
    assert slope == pytest.approx(-1.1, abs=0.15), slope
    h = meta["entropy_nats"]
    assert h["rate"] == pytest.approx(2.7201, abs=1e-4)  # the README quotes these three
    assert h["bigram"] == pytest.approx(3.5154, abs=1e-4) and h["unigram"] == pytest.approx(6.8761, abs=1e-4)
    # the process's own loss on the smoke validation's 32,768 targets: the rate, up to sampling noise
    assert meta["process_val_loss"]["32768"] == pytest.approx(h["rate"], abs=0.05)
    readme = (REPO_ROOT / "README.md").read_text()
    assert f"{h['rate']:.2f} nats" in readme, "the README states the corpus's entropy rate"


# ---- the folder: kept, repaired, rewritten ----------------------------------------------------------


def test_ensure_keeps_a_complete_folder_and_rewrites_a_damaged_one(tmp_path):
    spec = replace(SMALL, train_tokens=700_000)  # two shards, the second short
    folder = tmp_path / "corpus"
    meta = ensure_corpus(folder, spec, progress=False)
    names = sorted(meta["files"])
    assert names == ["synthetic_train_000001.bin", "synthetic_train_000002.bin", "synthetic_val_000000.bin"]
    assert read_shard(folder / names[1]).size == 200_000
    stamps = {n: (folder / n).stat().st_mtime_ns for n in names}
    assert ensure_corpus(folder, spec, progress=False) == meta  # complete: nothing rewritten
    assert {n: (folder / n).stat().st_mtime_ns for n in names} == stamps

    # a flipped byte: the hash differs, the folder is rewritten to the same bytes
    path = folder / names[0]
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert read_meta(folder) is None
    assert ensure_corpus(folder, spec, progress=False)["files"] == meta["files"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["files"][names[0]]

    # another spec: rewritten, and the earlier corpus's extra shard removed
    smaller = replace(spec, train_tokens=1000)
    assert sorted(ensure_corpus(folder, smaller, progress=False)["files"]) == [names[0], names[2]]
    assert sorted(p.name for p in folder.glob("*.bin")) == [names[0], names[2]]

    # an earlier VERSION's folder is rewritten
    record = json.loads((folder / synthetic.META).read_text())
    (folder / synthetic.META).write_text(json.dumps({**record, "version": synthetic.VERSION - 1}))
    assert read_meta(folder) is None and ensure_corpus(folder, smaller, progress=False)["version"] == synthetic.VERSION


@pytest.mark.slow
def test_the_smoke_preset_writes_its_corpus_on_first_use(tmp_path, synthetic_shards, monkeypatch):
    """config_check.data_problems on the smoke preset's folder: a complete copy is only checked; a
    folder missing its validation shard is rewritten, to the default corpus's bytes."""
    from runtime.config_check import data_problems
    from optim.schedule import TrainingSchedule

    folder = tmp_path / "synthetic"
    shutil.copytree(synthetic_shards, folder)
    monkeypatch.setattr(synthetic, "DEFAULT_DIR", folder)
    smoke = replace(RUN_PRESETS["smoke"], data_path=str(folder))
    schedule = TrainingSchedule(smoke.schedule)
    stamp = (folder / "synthetic_train_000001.bin").stat().st_mtime_ns
    assert data_problems(smoke, schedule.total_steps, schedule) == []
    assert (folder / "synthetic_train_000001.bin").stat().st_mtime_ns == stamp
    (folder / "synthetic_val_000000.bin").unlink()
    assert data_problems(smoke, schedule.total_steps, schedule) == []
    assert read_meta(folder)["files"] == DEFAULT_HASHES


@pytest.mark.slow
def test_the_script_writes_a_corpus_and_keeps_the_smoke_folder_default(tmp_path):
    script = REPO_ROOT / "data" / "synthetic.py"
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, script, "--out", tmp_path / "big", "--train-tokens", "600000",
                           "--val-tokens", "4097", "--seed", "1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "entropy rate" in done.stdout and f"--data-path {tmp_path / 'big'}" in done.stdout
    sizes = {p.name: read_shard(p).size for p in (tmp_path / "big").glob("*.bin")}
    assert sizes == {"synthetic_val_000000.bin": 4097, "synthetic_train_000001.bin": 500_000,
                     "synthetic_train_000002.bin": 100_000}
    refused = subprocess.run([sys.executable, script, "--out", synthetic.DEFAULT_DIR, "--seed", "1"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "the smoke preset's copy of the default corpus" in refused.stderr
