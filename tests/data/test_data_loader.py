"""Training and validation batches against a brute-force, token-by-token reference."""
import dataclasses

import numpy as np
import pytest
import torch

from data.loader import CU_SEQLENS_ROWS, Batch, EndOfData, TrainLoader, cu_seqlens_rows, val_batches
from data.ngram import ngram_row_ids, ngram_sign_rows
from data.shards import BOS_ID, ShardTokenError, write_shard

# Geometries (tokens per rank, doc cap) a run might walk through, with repeats (the prefetch path)
# and changes (the prefetched batch is thrown away).
GEOMETRIES = [(1024, 300), (1024, 300), (1024, 300), (3000, 3072), (3000, 3072), (512, 896), (3000, 3072)]


def synthetic_docs(seed: int, count: int) -> list[list[int]]:
    """Documents (BOS first) of mixed lengths: mostly short, some beyond 2560 and beyond 3072."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        kind = rng.random()
        length = int(rng.integers(1, 60) if kind < 0.5 else rng.integers(60, 900) if kind < 0.93
                     else rng.integers(2500, 7000))
        docs.append([BOS_ID] + rng.integers(0, BOS_ID, length).tolist())
    return docs


@pytest.fixture
def train_files(tmp_path):
    """Three shards; the first starts mid-document (no BOS at 0), as a continuation would."""
    paths = []
    for i in range(3):
        tokens = [5, 6, 7] * (i == 0) + [t for doc in synthetic_docs(i, 90) for t in doc]
        paths.append(tmp_path / f"syn_train_{i + 1:06d}.bin")
        write_shard(paths[-1], tokens)
    return paths


# ---- the reference: documents found by a token scan, handed out rank by rank -------------------


def documents_of(tokens: np.ndarray) -> list[list[int]]:
    docs, current = [], None
    for t in tokens.tolist():
        if t == BOS_ID:
            current = [t]
            docs.append(current)
        elif current is not None:  # tokens before the first BOS belong to no document
            current.append(t)
    return docs


def reference_steps(paths, world_size, geometries, virtual_cap):
    """Per step: per rank (inputs, targets, cu_seqlens), or 'end' when the data runs out."""
    shards = [documents_of(np.fromfile(p, dtype=np.uint16, offset=1024)) for p in paths]
    shard, next_doc = 0, 0
    out = []
    for tokens_per_rank, doc_cap in geometries:
        while True:  # a step that runs out of documents restarts in the next shard
            if shard == len(shards):
                out.append("end")
                return out
            docs, i, step = shards[shard], next_doc, []
            for _ in range(world_size):
                pieces, need = [], tokens_per_rank + 1
                while need > 0 and i < len(docs):
                    pieces.append(docs[i][:min(doc_cap, need)])
                    need -= len(pieces[-1])
                    i += 1
                if need > 0:
                    break
                step.append(pieces)
            if len(step) == world_size:
                next_doc = i
                break
            shard, next_doc = shard + 1, 0
        ranks = []
        for pieces in step:
            buf = [t for piece in pieces for t in piece]
            # Segment starts, token by token: a document start, or every virtual_cap tokens into one.
            starts, position = [], 0
            for piece in pieces:
                for offset in range(len(piece)):
                    if position < tokens_per_rank and offset % virtual_cap == 0:
                        starts.append(position)
                    position += 1
            rows = cu_seqlens_rows(tokens_per_rank)
            cu = starts + [tokens_per_rank] * (rows - len(starts))
            ranks.append((buf[:-1], buf[1:], cu))
        out.append(ranks)
    return out


def run_loader(loader, geometries):
    out = []
    for geometry in geometries:
        try:
            out.append(loader.next_batches(*geometry))
        except EndOfData:
            out.append("end")
            break
    loader.close()
    return out


def assert_batch_matches(batch: Batch, reference, doc_cap, virtual_cap):
    inputs, targets, cu = reference
    assert batch.inputs.dtype == torch.int32 and batch.inputs.tolist() == inputs
    assert batch.targets.dtype == torch.int64 and batch.targets.tolist() == targets
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == cu
    assert batch.max_seq_len == min(doc_cap, virtual_cap)
    assert torch.equal(batch.ngram_ids, ngram_row_ids(batch.inputs))  # hashed over the packed stream
    assert torch.equal(batch.ngram_sign_rows, ngram_sign_rows(batch.inputs))


@pytest.mark.parametrize("world_size, virtual_cap", [(1, 2560), (2, 2560), (3, 200)])
@pytest.mark.parametrize("prefetch", [True, False])
def test_train_batches_match_reference(train_files, world_size, virtual_cap, prefetch):
    geometries = GEOMETRIES * 12  # enough steps to cross both shard boundaries and run out
    expected = reference_steps(train_files, world_size, geometries, virtual_cap)
    loader = TrainLoader(str(train_files[0].parent / "syn_train_*.bin"), list(range(world_size)), world_size,
                         virtual_seq_cap=virtual_cap, prefetch=prefetch)
    got = run_loader(loader, geometries)
    assert expected[-1] == "end" and got[-1] == "end" and len(got) == len(expected)
    assert len(expected) > 8  # the data spans many steps
    for step, (batches, reference) in enumerate(zip(got[:-1], expected[:-1])):
        for rank in range(world_size):
            assert_batch_matches(batches[rank], reference[rank], geometries[step][1], virtual_cap)


def test_one_process_playing_two_ranks_sees_the_tokens_of_two(train_files):
    pattern = str(train_files[0].parent / "syn_train_*.bin")
    together = run_loader(TrainLoader(pattern, [0, 1], 2), GEOMETRIES * 3)
    apart = [run_loader(TrainLoader(pattern, rank, 2, prefetch=rank == 0), GEOMETRIES * 3) for rank in (0, 1)]
    assert len(together) == len(apart[0]) == len(apart[1]) and together[-1] == "end"
    for step, both in enumerate(together[:-1]):
        for rank in (0, 1):
            for name in ("inputs", "targets", "cu_seqlens", "ngram_ids", "ngram_sign_rows"):
                assert torch.equal(getattr(both[rank], name), getattr(apart[rank][step][0], name))
        # the two ranks' inputs are disjoint runs of documents
        assert not torch.equal(both[0].inputs, both[1].inputs)


def test_segments_start_at_bos_or_cap_boundary(train_files):
    loader = TrainLoader(train_files, 0, 1, virtual_seq_cap=256)
    for _ in range(6):
        batch = loader.next_batch(3000, 3072)
        inputs, cu = batch.inputs.tolist(), batch.cu_seqlens.tolist()
        assert cu[0] == 0 and cu == sorted(cu) and cu[-1] == 3000
        assert inputs[0] == BOS_ID  # training batches are BOS-aligned
        for start, stop in zip(cu, cu[1:]):
            if start == stop:
                continue
            last_bos = max(p for p in range(start + 1) if inputs[p] == BOS_ID)
            assert (start - last_bos) % 256 == 0  # at the BOS itself or a whole number of caps in
            assert stop - start <= min(256, 3072) and batch.max_seq_len == 256
    loader.close()


def test_end_of_data_says_what_was_consumed(train_files):
    steps = 0
    with TrainLoader(train_files, 0, 2) as loader, pytest.raises(EndOfData) as info:
        while True:
            loader.next_batch(2048, 896)
            steps += 1
    held = sum(p.stat().st_size - 1024 for p in train_files) // 2
    message = str(info.value)
    assert f"step {steps}" in message and f"{steps * 2 * 2048:,} input tokens" in message
    assert f"of the {held:,} tokens in all 3 files" in message
    assert all(p.name in message for p in train_files) and "cached_fineweb10B" in message


def test_bad_arguments_and_files(tmp_path, train_files):
    with pytest.raises(FileNotFoundError, match="nothing_\\*"):
        TrainLoader(str(tmp_path / "nothing_*.bin"), 0, 1)
    with pytest.raises(ValueError, match="world_size=2"):
        TrainLoader(train_files, 2, 2)
    loader = TrainLoader(train_files, [0, 1], 2)
    with pytest.raises(ValueError, match="next_batches"):
        loader.next_batch(1024, 300)
    loader.close()


def test_too_many_documents_for_the_cu_seqlens_table(tmp_path):
    write_shard(tmp_path / "tiny_train_000001.bin", [BOS_ID, 1, 2] * 2000)
    loader = TrainLoader([tmp_path / "tiny_train_000001.bin"], 0, 1)
    with pytest.raises(ValueError, match=r"tiny_train_000001.bin\): 342 attention segments overflow the 128-row"):
        loader.next_batch(1024, 896)  # 3-token documents: ceil(1024 / 3) segments
    loader.close()


def test_cu_seqlens_rows_follow_the_recipe_table():
    assert CU_SEQLENS_ROWS == {16384: 64, 32768: 96, 40960: 128, 49152: 128}
    assert cu_seqlens_rows(49152) == 128 and cu_seqlens_rows(262144) == 896  # validation: 873 -> 896
    assert cu_seqlens_rows(1024) == 128 and cu_seqlens_rows(300 * 129) == 256


def test_batch_is_frozen_and_moves(train_files):
    loader = TrainLoader(train_files, 0, 1)
    batch = loader.next_batch(512, 896)
    loader.close()
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.max_seq_len = 3
    moved = batch.to("cpu")
    assert moved.max_seq_len == batch.max_seq_len and torch.equal(moved.cu_seqlens, batch.cu_seqlens)


# ---- validation -------------------------------------------------------------------------------


@pytest.fixture
def val_file(tmp_path):
    path = tmp_path / "syn_val_000000.bin"
    write_shard(path, [t for doc in synthetic_docs(7, 60) for t in doc])
    return path


def test_val_batches_are_the_unaligned_stream(val_file):
    tokens = np.fromfile(val_file, dtype=np.uint16, offset=1024).tolist()
    world, per_rank, total = 2, 1000, 6000
    for rank in range(world):
        batches = list(val_batches(str(val_file), rank, world, per_rank, total))
        assert len(batches) == total // (world * per_rank)
        for step, batch in enumerate(batches):
            start = step * world * per_rank + rank * per_rank
            assert batch.inputs.tolist() == tokens[start:start + per_rank]
            assert batch.targets.tolist() == tokens[start + 1:start + per_rank + 1]
            bos = [p for p in range(per_rank) if tokens[start + p] == BOS_ID]
            rows = cu_seqlens_rows(per_rank)
            assert batch.cu_seqlens.tolist() == [0] + bos + [per_rank] * (rows - 1 - len(bos))
            assert batch.max_seq_len == per_rank
            assert torch.equal(batch.ngram_ids, ngram_row_ids(batch.inputs))


def test_val_from_one_process_matches_two_ranks_and_repeats(val_file):
    two = [list(val_batches([val_file], r, 2, 500, 4000)) for r in (0, 1)]
    one = list(val_batches([val_file], 0, 1, 500, 4000))
    interleaved = [two[r][s] for s in range(4) for r in (0, 1)]
    assert [b.inputs.tolist() for b in one] == [b.inputs.tolist() for b in interleaved]
    again = list(val_batches([val_file], 0, 1, 500, 4000))  # every evaluation starts at token 0
    assert [b.inputs.tolist() for b in again] == [b.inputs.tolist() for b in one]


def test_val_bos_at_position_zero_gives_an_empty_first_segment(tmp_path):
    path = tmp_path / "v.bin"
    write_shard(path, [BOS_ID, 1, 2, BOS_ID, 3, 4, 5, 6, 7])
    batch, = val_batches([path], 0, 1, 8, 8)
    assert batch.cu_seqlens.tolist()[:4] == [0, 0, 3, 8]


def test_val_checks_the_token_ids_it_reads(tmp_path):
    path = tmp_path / "v.bin"
    write_shard(path, [BOS_ID, 1, 2, 3, 4, 5, 6, 7, 8])
    data = bytearray(path.read_bytes())
    data[1024 + 2 * 6:1024 + 2 * 7] = (60000).to_bytes(2, "little")  # token 6 becomes 60000
    path.write_bytes(bytes(data))
    batches = val_batches([path], 0, 1, 4, 8)
    assert next(batches).inputs.tolist() == [BOS_ID, 1, 2, 3]
    with pytest.raises(ShardTokenError, match="token id 60000 at position 6"):
        next(batches)


def test_val_runs_out_with_a_clear_error(val_file):
    size = val_file.stat().st_size // 2 - 512
    with pytest.raises(EndOfData, match="validation data exhausted at step 1.*syn_val_000000.bin"):
        list(val_batches([val_file], 0, 1, size // 2 + 1, 2 * (size // 2 + 1)))
    with pytest.raises(ValueError, match="multiple"):
        list(val_batches([val_file], 0, 2, 100, 300))
