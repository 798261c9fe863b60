"""evaluate.py on a smoke checkpoint, on CPU: HellaSwag from a local file through lm-eval, the
log-likelihoods against the validation forward summed by hand, sampling, 2 ranks against 1 process,
and bad input.

The checkpoint is the smoke model moved off its init (every weight and n-gram row random, so the
scores depend on each of them: the row exchange included) and written by checkpoints.save_checkpoint,
the writer of train_gpt.py --save-checkpoint: a training run would cost CI seconds and leave most
n-gram rows at zero. The tests that score tasks need lm-eval (requirements-eval.txt, which CI installs).
"""
import contextlib
import io
import json
import os
import re
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from config import RUN_PRESETS
from data.loader import Batch, cu_seqlens_rows, padded_cu_seqlens
from data.ngram import ngram_row_ids, ngram_sign_rows
import evaluate
from model.gpt import StepArgs
from perf import backend as perf_backend
from runtime.checkpoints import save_checkpoint
from runtime.training import Run, Setup
from tests.gloo_workers import run_workers

needs_harness = pytest.mark.skipif(not evaluate.harness_available(),
                                   reason="lm-eval not installed (pip install -r requirements-eval.txt)")

# HellaSwag's own jsonl format (hellaswag_val.jsonl: ind, activity_label, ctx_a, ctx_b, ctx, split,
# split_type, label, endings, source_id); made-up items, two with WikiHow's bracket artifacts,
# which the harness's preprocessing removes.
ITEMS = [
    ("Roof shingle removal", "A man is sitting on a roof.", "he",
     ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.", "is holding a rubik's cube.",
      "starts pulling up roofing on a roof."], 3),
    ("Clean and jerk", "A lady walks to a barbell. She bends down and grabs the pole.", "the lady",
     ["swings and lands in her arms.", "pulls the barbell forward.", "pulls a rope attached to the barbell.",
      "stands and lifts the weight over her head."], 3),
    ("Making a sandwich", "A boy puts two slices of bread on a plate.", "he",
     ["spreads butter on the bread.", "throws the plate out of the window.", "sings to the bread.",
      "paints the plate blue."], 0),
    ("Home and Garden", "[header] How to water a fern [title] Check the soil.", "",
     ["[step] Press a finger into the soil to feel if it is dry.", "[step] Fern soil is made of cheese.",
      "[step] Ask the fern what it wants.", "[title] Ferns live on the moon."], 0),
]
PROMPT = "To be, or not to be"


def write_hellaswag(path, items=ITEMS):
    with open(path, "w") as f:
        for i, (activity, ctx_a, ctx_b, endings, label) in enumerate(items):
            f.write(json.dumps({"ind": i, "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b,
                                "ctx": f"{ctx_a} {ctx_b}".strip(), "split": "val", "split_type": "indomain",
                                "label": label, "endings": endings, "source_id": f"test~{i}"}) + "\n")
    return path


def harness_requests(activity, ctx_a, ctx_b, endings):
    """The (context, continuation) pairs lm-eval's hellaswag task makes of an item (restated from its
    definition: query "label: ctx_a Ctx_b", choices " ending", "[title]" → ". ", brackets dropped)."""
    def preprocess(text):
        text = re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". "))
        return text.replace("  ", " ")
    query = preprocess(f"{activity}: {ctx_a} {ctx_b.capitalize()}")
    return [(query, " " + preprocess(e)) for e in endings], [preprocess(e) for e in endings]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """records/logs/test-run/state_step000005 of a smoke model off its init (see the module docstring)."""
    records = tmp_path_factory.mktemp("records")
    cfg = replace(RUN_PRESETS["smoke"], seed=0, device="cpu")
    setup = Setup(cfg)
    run = Run(cfg, setup)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_((0.05 * torch.randn(p.shape, generator=gen)).to(p.dtype))
        run.table.rows.copy_(0.5 * torch.randn(run.table.rows.shape, generator=gen))
    folder = save_checkpoint(run, 5, records / "logs", "test-run")
    run.close()
    return folder


def _main(*args):
    """evaluate.main in this process: (stdout, stderr, [((context, continuation), (ll, greedy))])."""
    scored, original = [], evaluate.CheckpointModel.loglikelihood

    def loglikelihood(self, pairs):
        results = original(self, pairs)
        scored.extend(zip(pairs, results))
        return results

    out, err = io.StringIO(), io.StringIO()
    # one intra-op thread, as torchrun's processes (module fixtures run before `single_thread`; on 2
    # threads this CPU rounds a log-likelihood differently from the 2-rank run, 2026-12-03)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            mp.setattr(evaluate.CheckpointModel, "loglikelihood", loglikelihood)
            evaluate.main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)
    return out.getvalue(), err.getvalue(), scored


@pytest.fixture(scope="module")
def one_process(checkpoint, tmp_path_factory, gpt2_bpe):
    """One in-process evaluation: HellaSwag from the local file, then a greedy sample."""
    if not evaluate.harness_available():
        pytest.skip("lm-eval not installed (pip install -r requirements-eval.txt)")
    tmp = tmp_path_factory.mktemp("one")
    data = write_hellaswag(tmp / "hellaswag.jsonl")
    stdout, stderr, scored = _main(checkpoint, "--tasks", "hellaswag", "--data", data, "--sample", PROMPT,
                                   "--tokens", "4", "--temperature", "0")
    return {"stdout": stdout, "stderr": stderr, "scored": scored, "data": data,
            "runs": checkpoint.parents[2] / "runs.jsonl"}


@pytest.fixture(scope="module")
def model(checkpoint, gpt2_bpe):
    """The checkpoint built and loaded as evaluate.py does, on one process."""
    cfg, _ = evaluate.read_checkpoint(checkpoint)
    with perf_backend.use_backend(compile=False, cuda_graphs=False):
        setup, run = evaluate.build(cfg, checkpoint, "cpu")
        yield evaluate.CheckpointModel(run, setup)
    run.close()


# ---- HellaSwag through the harness: every item scored, acc and acc_norm as defined ------------------------


@needs_harness
def test_hellaswag_from_a_local_file_prints_acc_and_acc_norm_over_every_item(one_process):
    table = one_process["stdout"].split(PROMPT)[0]
    row = re.search(r"^hellaswag\s*\|\s*(\d+)\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)", table, re.M)
    assert row and int(row[1]) == len(ITEMS), table
    # acc and acc_norm recomputed from the log-likelihoods the model gave the harness: the argmax
    # of the sum, and of the sum over the choice's length in characters (lm-eval's acc_norm)
    lls = {pair: ll for pair, (ll, _) in one_process["scored"]}
    assert len(lls) == 4 * len(ITEMS)
    acc = acc_norm = 0
    for activity, ctx_a, ctx_b, endings, label in ITEMS:
        pairs, choices = harness_requests(activity, ctx_a, ctx_b, endings)
        scores = np.array([lls[p] for p in pairs])
        acc += int(np.argmax(scores)) == label
        acc_norm += int(np.argmax(scores / np.array([len(c) for c in choices]))) == label
    assert float(row[2]) == pytest.approx(acc / len(ITEMS), abs=1e-4)
    assert float(row[3]) == pytest.approx(acc_norm / len(ITEMS), abs=1e-4)
    # one runs.jsonl line under the checkpoint's run id
    (line,) = [json.loads(x) for x in one_process["runs"].read_text().splitlines()]
    assert line["run_id"] == "test-run" and line["kind"] == "evaluation" and line["step"] == 5
    assert line["tasks"]["hellaswag"] == {"items": len(ITEMS), "acc": acc / len(ITEMS), "acc_norm": acc_norm / len(ITEMS)}


def _validation_loss_sum(run, tokens, windows):
    """Σ over tokens[1:] of the next-token loss, from the validation forward's mean (its own loss
    path: bf16, fp32 cross-entropy), the n-gram rows read straight from the whole table."""
    n = len(tokens) - 1
    if n == 0:
        return 0.0
    x = np.asarray(tokens, dtype=np.int32)
    half, pool = run.cfg.model.ngram_rows // 2, run.cfg.model.ngram_sign_rows
    batch = Batch(torch.from_numpy(x[:-1]), torch.from_numpy(x[1:].astype(np.int64)),
                  padded_cu_seqlens([n], n, cu_seqlens_rows(n), "test"), None, ngram_sign_rows(x[:-1], pool), n)
    rows = run.table.rows[ngram_row_ids(x[:-1], half).long()]
    with torch.no_grad():
        mean = run.model(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows,
                         StepArgs(ws_short=windows[0], ws_long=windows[1], training=False))
    return mean.double().item() * n


@needs_harness
def test_log_likelihoods_are_the_validation_forward_summed_by_hand(one_process, model):
    """Each scored continuation: −(loss sum over [BOS]+context+continuation − loss sum over
    [BOS]+context), two plain validation forwards of the model (causal: a prefix's losses are the
    whole's first ones)."""
    heads = {}
    for (context, continuation), (ll, greedy) in one_process["scored"][:8]:  # two items' (CI time)
        ctx, cont = model.encode_pair(context, continuation)
        assert ctx[0] == evaluate.BOS_ID and len(cont) > 0
        whole = _validation_loss_sum(model.run, ctx + cont, model.windows)
        if context not in heads:
            heads[context] = _validation_loss_sum(model.run, ctx, model.windows)
        head = heads[context]
        assert ll == pytest.approx(-(whole - head), abs=2e-3 * len(cont)), (context, continuation)
        assert ll < 0 and isinstance(greedy, bool)


def test_scores_use_the_whole_context_and_continuation(model):
    """The scores read the context (another context, another score) and sum over the continuation
    (a one-token continuation's score is that token's log-probability at the context's last row)."""
    (a, _), (b, _) = model.score([([evaluate.BOS_ID, 40, 41], [42]), ([evaluate.BOS_ID, 50, 41], [42])])
    assert a != b
    logits = model.logits([evaluate.BOS_ID, 40, 41])
    assert a == pytest.approx(torch.log_softmax(logits[-1].double(), dim=-1)[42].item(), abs=1e-9)
    (two, _), = model.score([([evaluate.BOS_ID, 40, 41], [42, 43])])
    logits = model.logits([evaluate.BOS_ID, 40, 41, 42])
    by_hand = sum(torch.log_softmax(logits[t].double(), dim=-1)[tok].item() for t, tok in ((2, 42), (3, 43)))
    assert two == pytest.approx(by_hand, abs=1e-9)


# ---- sampling ---------------------------------------------------------------------------------------------------------


@needs_harness
def test_sampling_prints_the_prompt_then_new_text_and_greedy_is_deterministic(one_process, model):
    sample = one_process["stdout"][one_process["stdout"].index(PROMPT):]
    assert sample.startswith(PROMPT) and len(sample.strip()) > len(PROMPT)
    again = model.generate([PROMPT], 4, temperature=0.0)
    assert sample.rstrip("\n") == PROMPT + again[0]
    assert model.generate([PROMPT], 4, temperature=0.0) == again


def test_sampling_draws_from_the_seeded_generator(model):
    """Seeded draws repeat; other seeds draw other text; top-k draws only among the k likeliest."""
    a = model.generate([PROMPT], 5, temperature=1.0, seed=1)
    assert model.generate([PROMPT], 5, temperature=1.0, seed=1) == a
    assert any(model.generate([PROMPT], 5, temperature=1.0, seed=s) != a for s in (2, 3, 4))
    z = model.logits([evaluate.BOS_ID, *model.encode(PROMPT)])[-1, :50257]  # the first draw's row
    likeliest = {model.encoding.decode([t]) for t in (z >= torch.topk(z, 3).values[-1]).nonzero().squeeze(1).tolist()}
    firsts = {model.generate([PROMPT], 1, temperature=2.0, top_k=3, seed=s)[0] for s in range(8)}
    assert firsts <= likeliest and len(firsts) > 1, (firsts, likeliest)


# ---- 2 ranks against 1 process --------------------------------------------------------------------------------------

TWO_RANKS = """
import json, os, sys
rank, world, port, out = sys.argv[1:5]
os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
import evaluate
scored, original = [], evaluate.CheckpointModel.loglikelihood
def loglikelihood(self, pairs):
    results = original(self, pairs)
    scored.extend([list(p), list(r)] for p, r in zip(pairs, results))
    return results
evaluate.CheckpointModel.loglikelihood = loglikelihood
evaluate.main(json.loads(os.environ["EVALUATE_ARGS"]))
json.dump(scored, open(f"{out}.{rank}", "w"))
"""


@needs_harness
@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_give_the_scores_and_text_of_one_process(one_process, checkpoint, tmp_path):
    """The n-gram table split over 2 gloo ranks (rows exchanged), every W-th document on each rank:
    bitwise the same log-likelihoods, table and greedy text as one process with the table whole."""
    args = [str(checkpoint), "--tasks", "hellaswag", "--data", str(one_process["data"]), "--sample", PROMPT,
            "--tokens", "4", "--temperature", "0", "--runs", str(tmp_path / "runs.jsonl")]
    env = {"EVALUATE_ARGS": json.dumps(args), "HF_HUB_OFFLINE": "1"}
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        env["TIKTOKEN_CACHE_DIR"] = os.environ["TIKTOKEN_CACHE_DIR"]
    logs = run_workers(TWO_RANKS, tmp_path, 2, tmp_path / "scored", timeout=300, env=env)
    expected = [[list(p), list(r)] for p, r in one_process["scored"]]
    for rank in (0, 1):  # every rank ends with every score
        assert json.loads((tmp_path / f"scored.{rank}").read_text()) == expected
    table = one_process["stdout"].split(PROMPT)[0]
    assert table in logs[0] and PROMPT + one_process["stdout"].split(PROMPT)[1] in logs[0]
    (line,) = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    (one,) = [json.loads(x) for x in one_process["runs"].read_text().splitlines()]
    assert line["world_size"] == 2 and line["tasks"] == one["tasks"]


# ---- bad input: one line, exit 2 ------------------------------------------------------------------------------------


def _refused(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([str(a) for a in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("evaluate.py: error: "), err
    return err


def test_a_missing_or_foreign_checkpoint_is_refused(capsys, tmp_path):
    assert "no such folder" in _refused(capsys, tmp_path / "nope", "--sample", "x")
    (tmp_path / "empty").mkdir()
    assert "no model.pt there" in _refused(capsys, tmp_path / "empty", "--sample", "x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    torch.save({"state_dict": {}}, foreign / "model.pt")
    assert "holds no config, model and step" in _refused(capsys, foreign, "--sample", "x")
    (foreign / "model.pt").write_text("not a torch file")
    assert "cannot be read" in _refused(capsys, foreign, "--sample", "x")
    # read weights_only, as the training reads it (runtime/checkpoints.open_model_file): a pickled object runs no code
    torch.save({"config": SimpleNamespace(a=1), "model": {}, "step": 1}, foreign / "model.pt")
    assert "cannot be read as a --save-checkpoint model.pt (UnpicklingError" in _refused(capsys, foreign, "--sample", "x")


def test_a_checkpoint_of_another_code_version_is_refused(capsys, checkpoint, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    saved = torch.load(checkpoint / "model.pt", weights_only=False)
    saved["config"]["model"]["retired_width"] = 3
    torch.save(saved, other / "model.pt")
    assert "does not fit this code's RunConfig" in _refused(capsys, other, "--sample", "x")


def test_usage_errors_are_refused(capsys, checkpoint, tmp_path):
    assert "nothing to do" in _refused(capsys, checkpoint)
    assert "--temperature -1.0" in _refused(capsys, checkpoint, "--sample", "x", "--temperature", "-1")
    data = write_hellaswag(tmp_path / "h.jsonl")
    assert "add hellaswag to --tasks" in _refused(capsys, checkpoint, "--tasks", "arc_easy", "--data", data)


@pytest.mark.parametrize("line, why", [
    ("{not json", "h.jsonl:2: not JSON"),
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x", "y"]}', "h.jsonl:2: missing label"),
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x", "y"], "label": 2}',
     "h.jsonl:2: label must be an integer index into the 2 endings, got 2"),
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": "xy", "label": 0}',
     "h.jsonl:2: endings must be a list of at least 2 strings"),
])
def test_a_malformed_hellaswag_file_is_refused_naming_the_line(capsys, checkpoint, tmp_path, line, why):
    data = write_hellaswag(tmp_path / "h.jsonl", ITEMS[:1])
    with open(data, "a") as f:
        f.write(line + "\n")
    assert why in _refused(capsys, checkpoint, "--tasks", "hellaswag", "--data", data)


def test_without_gpt2s_bpe_files_it_says_how_to_get_them(capsys, checkpoint, monkeypatch):
    """A fresh clone offline trains (the prefix table is stored) but cannot tokenize a task or prompt."""
    monkeypatch.setattr(evaluate, "gpt2_bpe_available", lambda: False)
    err = _refused(capsys, checkpoint, "--sample", "x")
    assert "GPT-2's BPE files" in err and "TIKTOKEN_CACHE_DIR" in err and "get_encoding('gpt2')" in err


def test_tasks_without_the_harness_say_how_to_install_it(capsys, checkpoint, monkeypatch):
    monkeypatch.setattr(evaluate, "harness_available", lambda: False)
    err = _refused(capsys, checkpoint, "--tasks", "hellaswag")
    assert "pip install -r requirements-eval.txt" in err and "--sample needs none" in err


@needs_harness
def test_an_unknown_task_is_refused_with_close_names(capsys, checkpoint, monkeypatch):
    """Checked against the harness's task index (a stand-in here: building the real one takes ~10 s)."""
    import lm_eval.tasks

    class Index:
        def __init__(self, include_defaults=True):
            self.all_tasks = ["arc_easy", "hellaswag", "piqa"] if include_defaults else []

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Index)
    err = _refused(capsys, checkpoint, "--tasks", "hellaswag,hellaswg,piqa,nonsense")
    assert "unknown to lm-evaluation-harness: hellaswg (did you mean hellaswag?); nonsense " in err


@needs_harness
def test_harness_tasks_that_import_evaluate_get_hugging_faces_package():
    """squadv2, mbpp, humaneval, ... `import evaluate` (Hugging Face's metrics, an lm-eval dependency),
    which this repository's evaluate.py shadows: not while the harness runs."""
    import importlib
    import sys

    with evaluate.hugging_face_evaluate_importable():
        hf = importlib.import_module("evaluate")
        assert hf is not evaluate and hasattr(hf, "load") and "site-packages" in hf.__file__
    assert sys.modules["evaluate"] is evaluate and importlib.import_module("evaluate") is evaluate


class _Request:  # what the harness hands an LM: an Instance's args
    def __init__(self, *args):
        self.args = args


@needs_harness
def test_the_harness_lm_rolls_long_texts_over_every_token_and_generates_until_a_stop(model, monkeypatch):
    lm = evaluate.harness_lm(model)
    text = "Now is the winter of our discontent made glorious summer by this sun of York."
    tokens = model.encode(text)
    (rolled,) = lm.loglikelihood_rolling([_Request(text)])
    (whole, _), = model.score([([evaluate.BOS_ID], tokens)])
    assert rolled == whole  # shorter than the model's reach: one window, [BOS] then every token
    scored, score = [], model.score
    monkeypatch.setattr(model, "score", lambda pairs, desc="": scored.extend(pairs) or score(pairs, desc))
    monkeypatch.setattr(model, "max_len", 8)  # a long text: several windows
    lm.loglikelihood_rolling([_Request(text + " " + text)])
    tokens = model.encode(text + " " + text)
    assert len(scored) >= len(tokens) // 8 and [t for _, cont in scored for t in cont] == tokens  # each token once
    assert all(len(ctx) + len(cont) <= 9 for ctx, cont in scored)
    monkeypatch.undo()
    (text_out,) = lm.generate_until([_Request(PROMPT, {"until": ["\n"], "max_gen_toks": 5})])
    assert text_out == model.generate([PROMPT], 5, until=["\n"])[0] and "\n" not in text_out
