"""pull_rows: a batch's rows of a row-sharded table, fetched from their owners, equal a lookup in
the whole table (1 process; 2 gloo ranks with different, repeating and empty requests)."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from optim.manager import pull_rows

REPO = Path(__file__).resolve().parents[2]
ROWS, DIM = 64, 12


def full_table():
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7)).bfloat16()


def requests(rank: int) -> list[torch.Tensor]:
    """Per call: rank 0 asks rows of both halves (with repeats), rank 1 mostly its own; in the
    third call rank 1 asks nothing, in the fourth nobody does."""
    g = torch.Generator().manual_seed(100 + rank)
    calls = [torch.randint(0, ROWS, (40,), generator=g, dtype=torch.int32),
             torch.tensor([63, 0, 31, 32, 0, 63], dtype=torch.int32) if rank == 0
             else torch.randint(ROWS // 2, ROWS, (9,), generator=g, dtype=torch.int32)]
    calls.append(torch.tensor([5, 40, 5], dtype=torch.int32) if rank == 0 else torch.empty(0, dtype=torch.int32))
    calls.append(torch.empty(0, dtype=torch.int32))
    return calls


WORKER = textwrap.dedent(f'''
    import datetime, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from optim.manager import pull_rows
    from test_optim_pull_rows import full_table, requests

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # torchrun's env://
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = {ROWS} // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    shard = full_table()[lo:hi].clone()
    torch.save([pull_rows(shard, lo, hi, ids, world) for ids in requests(rank)], f"{{sys.argv[2]}}.{{rank}}")
    dist.destroy_process_group()
''')


def test_one_process_is_a_lookup():
    table = full_table()
    ids = torch.tensor([3, 3, 60, 0, 17], dtype=torch.int32)
    assert torch.equal(pull_rows(table, 0, ROWS, ids, 1), table[ids.long()])
    # a shard that starts at row 32 (rank 1 of 2, alone)
    assert torch.equal(pull_rows(table[32:], 32, ROWS, ids[2:3], 1), table[60:61])
    with pytest.raises(IndexError, match=r"outside the table's rows \[32, 64\)"):
        pull_rows(table[32:], 32, ROWS, ids, 1)
    with pytest.raises(ValueError, match="table_shard"):
        pull_rows(table, 0, 10, ids, 1)


@pytest.mark.distributed
def test_two_gloo_ranks_equal_a_lookup_of_the_whole_table(tmp_path):
    world, out = 2, tmp_path / "pulled"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # torchrun --standalone picks a free port itself
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(script), str(Path(__file__).parent), str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    table = full_table()
    for rank in range(world):
        got = torch.load(f"{out}.{rank}")
        for call, (ids, rows) in enumerate(zip(requests(rank), got)):
            assert rows.dtype == torch.bfloat16 and rows.shape == (ids.numel(), DIM)
            assert torch.equal(rows, table[ids.long()]), (rank, call)
