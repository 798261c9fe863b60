"""Pinned host memory for shards and batches, and asynchronous uploads (needs CUDA)."""
import pytest
import torch

from data.loader import TrainLoader
from data.shards import BOS_ID, load_shard, write_shard

TENSORS = ("inputs", "targets", "cu_seqlens", "ngram_ids", "ngram_sign_rows")


@pytest.mark.gpu
def test_pinned_shard_and_batches_upload_unchanged(tmp_path):
    tokens = ([BOS_ID] + list(range(1, 700))) * 40
    path = tmp_path / "gpu_train_000001.bin"
    write_shard(path, tokens)
    pinned = load_shard(path, pin_memory=True)
    assert pinned.is_pinned() and pinned.numpy().tolist() == tokens

    loader = TrainLoader([path], 0, 1, pin_memory=True)
    batch = loader.next_batch(2048, 896)
    loader.close()
    assert all(getattr(batch, name).is_pinned() for name in TENSORS)
    on_gpu = batch.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    for name in TENSORS:
        moved = getattr(on_gpu, name)
        assert moved.is_cuda and torch.equal(moved.cpu(), getattr(batch, name))
