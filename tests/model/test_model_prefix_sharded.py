"""model/prefix.py's sliced build: the slices of every world size concatenate to the whole build
(the sorted stack pass, itself checked against brute force in test_model_prefix.py), and two gloo
ranks assemble the same table with one all-gather."""
import os
import textwrap

import pytest
import torch

from model.prefix import build_prefix_table, build_prefix_table_slice, prefix_slice_bounds
from tests.gloo_workers import run_workers

GPT2_TABLE = 50304  # record #360's padded vocabulary: ids 50257..50303 are padding


@pytest.fixture(scope="module")
def gpt2_whole():
    return build_prefix_table(GPT2_TABLE)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_slices_of_gpt2_concatenate_to_the_whole_build(gpt2_whole, world):
    slices = [build_prefix_table_slice(GPT2_TABLE, r, world) for r in range(world)]
    for r, s in enumerate(slices):
        lo, hi = prefix_slice_bounds(GPT2_TABLE, r, world)
        assert s.dtype == torch.long and s.shape == (hi - lo,), (r, s.dtype, s.shape)
    assert torch.equal(torch.cat(slices), gpt2_whole)


def test_slice_bounds_are_equal_contiguous_and_cover_the_vocabulary():
    # 10 ids on 4 ranks: slices of ceil(10/4) = 3, the last one short
    assert [prefix_slice_bounds(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # more ranks than a slice can fill: the tail ranks hold nothing
    assert [prefix_slice_bounds(3, r, 5) for r in range(5)] == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    with pytest.raises(ValueError, match=r"rank 4 must be in \[0, world_size=4\)"):
        prefix_slice_bounds(10, 4, 4)


# a: 0, b: 1, ab: 2, abc: 3, abd: 4, "b a": 5, abcd: 6, ba: 7, then "abcde" (8) whose longest
# prefix abcd is 6, and "abx" (11, past a 9-id table) whose prefix ab is 2
HANDMADE = {b"a": 0, b"b": 1, b"ab": 2, b"abc": 3, b"abd": 4, b"b a": 5, b"abcd": 6, b"ba": 7, b"abcde": 8,
            b"abx": 11}


@pytest.mark.parametrize("world", [1, 2, 3, 8, 12])
def test_slices_of_a_handmade_vocabulary(world):
    expected = [-1, -1, 0, 2, 2, 1, 3, 1, 6]  # by hand, ids 0..8
    got = torch.cat([build_prefix_table_slice(9, r, world, HANDMADE) for r in range(world)])
    assert got.tolist() == expected
    assert torch.equal(got, build_prefix_table(9, HANDMADE))


def test_a_longest_prefix_past_the_table_gives_minus_one_not_a_shorter_one():
    # "ab" is id 5, outside a 3-id table; "a" (0) is a shorter prefix of "abc" but not the longest
    vocab = {b"a": 0, b"abc": 1, b"ab": 5}
    assert build_prefix_table(3, vocab).tolist() == [-1, -1, -1]
    assert torch.cat([build_prefix_table_slice(3, r, 2, vocab) for r in range(2)]).tolist() == [-1, -1, -1]


WORKER = textwrap.dedent('''
    import datetime, sys
    import torch, torch.distributed as dist
    from model.prefix import build_prefix_table_sharded

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:  # a caller that names the wrong rank is stopped before any collective
        build_prefix_table_sharded(50304, (rank + 1) % world, world, "cpu")
        wrong_rank = "no error"
    except ValueError as e:
        wrong_rank = str(e)
    table = build_prefix_table_sharded(50304, rank, world, "cpu")
    torch.save({"table": table.clone(), "wrong_rank": wrong_rank}, f"{out}.{rank}")
    dist.barrier()  # no rank tears gloo down while a peer is still in a collective
    dist.destroy_process_group()
''')


@pytest.mark.distributed
def test_two_gloo_ranks_gather_the_single_rank_table(tmp_path, gpt2_whole):
    out, world = tmp_path / "table", 2
    env = {"HF_HUB_OFFLINE": "1"}
    if "TIKTOKEN_CACHE_DIR" in os.environ:  # conftest points it at ../shared's GPT-2 BPE
        env["TIKTOKEN_CACHE_DIR"] = os.environ["TIKTOKEN_CACHE_DIR"]
    run_workers(WORKER, tmp_path, world, out, timeout=120, env=env)
    for r in range(world):
        saved = torch.load(f"{out}.{r}")
        assert saved["table"].dtype == torch.long and torch.equal(saved["table"], gpt2_whole), f"rank {r}"
        assert f"called as rank {(r + 1) % world} of 2" in saved["wrong_rank"], saved["wrong_rank"]
