"""A rank that never reaches a collective ends the run within the process group's timeout, with a
message naming where the waiting rank was (issue 22, item 6), not a silent hang."""
import json

from tests.gloo_workers import run_workers

WORKER = """
import datetime, sys, time
import torch, torch.distributed as dist
from perf.collectives import CollectiveTimeout, named_timeouts

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=2))
position = {"now": "setup"}
if rank == 0:
    start = time.perf_counter()
    try:
        with named_timeouts(lambda: position["now"], 2):
            position["now"] = "training step 7, region 'optimizer' key 'adam'"
            dist.all_reduce(torch.ones(4))  # rank 1 never calls it
        message = "no error"
    except CollectiveTimeout as e:
        message = str(e)
    open(f"{out}.{rank}", "w").write(repr((message, time.perf_counter() - start)))
else:
    time.sleep(8)  # stuck elsewhere: never reaches the all-reduce
    open(f"{out}.{rank}", "w").write(repr(("slept", 0.0)))
"""


def test_a_rank_that_never_reaches_a_collective_ends_the_wait_named(tmp_path):
    out = tmp_path / "result"
    run_workers(WORKER, tmp_path, 2, out, timeout=60)
    message, seconds = eval((tmp_path / "result.0").read_text())
    assert message.startswith("training step 7, region 'optimizer' key 'adam': a collective did not complete "
                              "within 2 s (collective_timeout_s): another rank never reached it"), message
    assert seconds < 8  # ended by the timeout, before the other rank woke up


def test_the_run_sets_and_logs_its_timeout(tmp_path, monkeypatch):
    """The run's process group gets collective_timeout_s (--set), and the log names it and the
    NCCL watchdog variables."""
    import train_gpt

    seen = {}
    monkeypatch.setattr(train_gpt.Setup, "init_process_group", lambda self, timeout_s: seen.setdefault("t", timeout_s))
    monkeypatch.setattr(train_gpt, "Run", lambda cfg, setup: (_ for _ in ()).throw(SystemExit("stop after setup")))
    records = tmp_path / "records"
    try:
        train_gpt.main(["--config", "smoke", "--records-dir", str(records), "--data-path", str(_shards(tmp_path)),
                        "--set", "collective_timeout_s=45", "--val-tokens", "2048"])
    except SystemExit:
        pass
    assert seen == {"t": 45}
    (entry,) = [json.loads(line) for line in (records / "runs.jsonl").read_text().splitlines()]
    log = open(entry["log_path"]).read()
    assert "Collective settings: TORCH_NCCL_ASYNC_ERROR_HANDLING" in log
    assert entry["overrides"] == ["collective_timeout_s=45"]


def _shards(tmp_path):
    import numpy as np

    from data.shards import BOS_ID, write_shard

    folder = tmp_path / "shards"
    folder.mkdir()
    tokens = np.random.default_rng(0).integers(0, 50_000, 200_000)
    tokens[::50] = BOS_ID
    write_shard(folder / "s_train_000001.bin", tokens)
    write_shard(folder / "s_val_000000.bin", tokens[:40_000])
    return folder
