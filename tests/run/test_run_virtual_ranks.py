"""One process computes what the ranks it plays compute (optim/lanes.py, RowPlan.lane).

* 1 process playing the smoke recipe's 2 ranks and 2 gloo ranks: bitwise the same training
  losses for 11 steps of the smoke preset at base 30 steps (across its first stage transition, at 9,
  and five table events) and the same validation loss;
* each virtual rank's fp8 delayed scales and sampled-lm_head counter: 1 process playing 2 ranks ends
  with what each of 2 ranks ends with, bit for bit (one pair of runs for both);
* 8 virtual ranks run as 1×8, 2×4 and 8×1: within the bound stated in `EIGHT_RANK_BOUND`.
"""
import json
import textwrap

import pytest
import torch

from tests.gloo_workers import run_workers
import train_gpt
from tests.run.test_run_train import _torchrun, shards  # noqa: F401 (shards: the tokenized text, a fixture)

# base 30 steps (stage ends 0, 9, 18, 32, 34, 40): the first stage transition at step 9, not 17 (CI time: 20
# steps before, 2026-12-06)
ACROSS_THE_FIRST_TRANSITION = ["--no-warmup", "--val-every", "0", "--val-tokens", "2048", "--seed", "0", "--max-steps",
                               "11", "--log-train-loss", "--set", "schedule.base_steps=30"]


def _entry(records) -> dict:
    (line,) = (records / "runs.jsonl").read_text().splitlines()
    return json.loads(line)


@pytest.mark.distributed
@pytest.mark.slow
def test_one_process_and_two_ranks_train_bitwise_alike_across_the_first_stage_transition(tmp_path, shards):
    train_gpt.main(["--config", "smoke", "--data-path", str(shards), *ACROSS_THE_FIRST_TRANSITION, "--records-dir", str(tmp_path / "one")])
    out = _torchrun(2, "--data-path", str(shards), *ACROSS_THE_FIRST_TRANSITION, "--records-dir", str(tmp_path / "two"),
                    env={"SPEEDRUN_STREAM_CHECK": "1"})   # (an env: stderr merged into the output)
    # torch 2.13 warns at every call of a deprecated collective name (perf/collectives.py picks the current ones)
    assert "FutureWarning" not in out and "DeprecationWarning" not in out, out
    one, two = _entry(tmp_path / "one"), _entry(tmp_path / "two")
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert len(one["train_losses"]) == 11
    assert one["train_losses"] == two["train_losses"], list(zip(one["train_losses"], two["train_losses"]))
    assert one["val_loss"] == two["val_loss"]


LANE_WORKER = textwrap.dedent("""
    import dataclasses, os, sys
    import torch
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    from runtime import training
    from config import RUN_PRESETS, FeatureConfig
    from data.loader import dummy_batch

    cfg = dataclasses.replace(RUN_PRESETS["smoke"], seed=0, features=FeatureConfig(approx_lm_head_grad=True))
    setup = training.Setup(cfg)
    setup.init_process_group(120)
    run = training.Run(cfg, setup)
    for step in (17, 18, 19):  # sampled lm_head dW (stage 1), Adam updates on 17 and 19, three fp8 refreshes
        tokens = run.schedule.batch_tokens(step) // cfg.virtual_world_size
        run.train_step(step, [dummy_batch(tokens, run.schedule.doc_cap(step), seed=1000 * step + r, **run.hash_args)
                              for r in setup.virtual_ranks])
    run.flush()  # the last refresh: every (virtual) rank rolls its amaxes into its scales
    state = run.model.mlp_fp8.delayed_state()
    per_rank = run.lanes.lane_copies(state) if run.lanes is not None else [state]
    counter = run.head_sample.counter
    counters = [c[0] for c in run.lanes.lane_copies([counter])] if run.lanes is not None else [counter]
    torch.save({"fp8": [[t.clone() for t in s] for s in per_rank], "counters": [int(c) for c in counters],
                "lm_head": run.model.lm_head.weight.detach().clone()}, f"{out}.{rank}")
    run.close()
    if world > 1:
        torch.distributed.destroy_process_group()
""")


@pytest.fixture(scope="module")
def lane_runs(tmp_path_factory):
    """3 smoke steps (17-19) on dummy batches, each virtual rank's own, with the sampled lm_head dW on: what
    1 process playing 2 ranks and 2 gloo ranks each keep per rank (one pair of runs for both tests below)."""
    folder = tmp_path_factory.mktemp("lanes")
    run_workers(LANE_WORKER, folder, 1, folder / "one", timeout=300)
    run_workers(LANE_WORKER, folder, 2, folder / "two", timeout=300)
    return torch.load(folder / "one.0"), [torch.load(folder / f"two.{r}") for r in range(2)]


@pytest.mark.distributed
def test_one_process_keeps_each_virtual_ranks_fp8_scales(lane_runs):
    """The post/dpre amaxes and scales of virtual rank r in 1 process equal rank r's of a 2-rank run, and the
    two ranks' differ."""
    one, two = lane_runs
    lanes, ranks = one["fp8"], [two[r]["fp8"][0] for r in range(2)]
    assert len(lanes) == 2
    for r in range(2):
        for name, a, b in zip(("post_amax", "post_scale", "dpre_amax", "dpre_scale"), lanes[r], ranks[r]):
            assert torch.equal(a, b), (r, name, a, b)
    assert not torch.equal(ranks[0][1], ranks[1][1]), "both ranks' post scales are equal: the test sees no per-rank state"


# ---- 8 virtual ranks in three layouts -------------------------------------------------------------
# The bound, and why: every layout adds the same per-rank gradients, and the n-gram rows in the same
# order (RowPlan.lane), but the dense gradients of 8 ranks are summed in another association:
# 1x8 adds g0 + g1 + ... + g7 in turn, 2x4 adds two partial sums of 4, gloo's 8-rank all-reduce its
# own tree. Each association rounds each bf16 gradient element differently by at most 1 ulp per
# addition (2^-8 relative to the partial sum), and those differences grow through the updates.
# Measured on the smoke recipe (2026-12-02, 2 CPU cores, 3 steps): step 1 was bitwise equal in all
# three layouts (nothing updated yet; equal to fp32 rounding of the 8-rank sum on another machine); the largest relative difference is 9.9e-5 of a training loss
# (step 3, 1x8 vs 8x1) and 1.2e-4 of the validation loss (2x4 vs 8x1); over 6 steps, 1.6e-4. Bound
# asserted: 1e-3 relative, every step and the validation.
EIGHT_RANK_BOUND = 1e-3
EIGHT_RANKS = ["--no-warmup", "--val-every", "0", "--val-tokens", "2048", "--seed", "0", "--max-steps", "3",
               "--log-train-loss", "--set", "virtual_world_size=8", "--set", "allowed_world_sizes=1,2,4,8"]


@pytest.mark.distributed
@pytest.mark.slow
def test_eight_virtual_ranks_agree_as_1x8_2x4_and_8x1(tmp_path, shards):
    runs = {}
    train_gpt.main(["--config", "smoke", "--data-path", str(shards), *EIGHT_RANKS, "--records-dir", str(tmp_path / "1")])
    runs[1] = _entry(tmp_path / "1")
    for nproc in (2, 8):
        _torchrun(nproc, "--data-path", str(shards), *EIGHT_RANKS, "--records-dir", str(tmp_path / str(nproc)))
        runs[nproc] = _entry(tmp_path / str(nproc))
    print("step  " + "  ".join(f"{n}x{8 // n}".rjust(18) for n in runs))
    for i, losses in enumerate(zip(*(r["train_losses"] for r in runs.values()))):
        print(f"{i + 1:>4}  " + "  ".join(f"{v:18.15f}" for v in losses))
    print(" val  " + "  ".join(f"{r['val_loss']:18.15f}" for r in runs.values()))
    ref = runs[1]
    for nproc in (2, 8):
        # before any update: the same per-rank losses, summed over 8 ranks in another association
        # (fp32: 1x8 in turn, gloo's tree across processes), so equal to fp32 rounding only (bitwise on
        # the corpus of 2026-12-02; 12.513314 against 12.513313 on 2026-12-03's machine)
        assert runs[nproc]["train_losses"][0] == pytest.approx(ref["train_losses"][0], rel=1e-6)
        assert runs[nproc]["train_losses"] == pytest.approx(ref["train_losses"], rel=EIGHT_RANK_BOUND)
        assert runs[nproc]["val_loss"] == pytest.approx(ref["val_loss"], rel=EIGHT_RANK_BOUND)


@pytest.mark.distributed
def test_one_process_keeps_each_virtual_ranks_head_sample_counter(lane_runs):
    """features.approx_lm_head_grad (PR #371): virtual rank r's counter in 1 process is rank r's of a 2-rank run
    (r + 2·3 after three sampled calls), and the lm_head both end with is bitwise the same (each rank kept the
    same rows)."""
    one, two = lane_runs
    assert one["counters"] == [6, 7] and [two[r]["counters"] for r in range(2)] == [[6], [7]]
    assert torch.equal(one["lm_head"], two[0]["lm_head"]) and torch.equal(two[0]["lm_head"], two[1]["lm_head"])
