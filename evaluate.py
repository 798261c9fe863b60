"""Score and sample a checkpoint written by `train_gpt.py --save-checkpoint`.

    python evaluate.py records/logs/<run_id>/state_step001194 --tasks hellaswag          # downloads HellaSwag
    python evaluate.py CKPT --tasks hellaswag --data hellaswag_val.jsonl --limit 500     # a local HellaSwag file
    python evaluate.py CKPT --tasks hellaswag,arc_easy,piqa,lambada_openai               # any lm-eval task
    python evaluate.py CKPT --sample "The meaning of life is" --tokens 64 --temperature 0.8 --top-k 50
    torchrun --standalone --nproc_per_node=8 evaluate.py CKPT --tasks hellaswag          # the n-gram table sharded

Tasks run on EleutherAI's lm-evaluation-harness (`pip install -r requirements-eval.txt`; --sample
needs none of it). The harness owns the data, the prompts and the metrics: acc (the choice of
highest log-likelihood) and acc_norm (log-likelihood divided by the choice's length in
characters), so the numbers compare with published ones. This file is only what the harness
leaves to a model (docs/evaluate.md): the checkpoint as the harness's `LM` (loglikelihood,
loglikelihood_rolling, generate_until), HellaSwag read from a local jsonl file (the harness's own
hellaswag task with its data swapped for the file), the table and the runs.jsonl line.

The model is built by runtime/training.py's Setup and Run, as the training builds it, and loaded by
checkpoints.load_checkpoint; it runs its validation forward (bf16, no canonical mask, the final
windows) with `StepArgs(logits=True, logits_from=k)` (the rows it reads), eagerly. One document per forward: [BOS] + context +
continuation. Packing several would change the scores, since the smear, the key offset and the
n-gram hashes read the previous token across documents; alone, a document's scores do not
depend on what else is scored, on the order, nor on how many processes share the work. Under
torchrun each rank forwards every W-th document and all ranks forward in lockstep, so the n-gram
rows are exchanged as in validation (optim/row_exchange.py); the scores are gathered to every rank.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from cli import ArgumentParser, exit_on_config_error
from config import (ConfigError, FeatureConfig, ModelConfig, OptimConfig, RunConfig, ScheduleConfig,
                    StageConfig)
from data.loader import Batch, attention_segment_ends, cu_seqlens_rows, padded_cu_seqlens
from data.ngram import ngram_row_ids, ngram_sign_rows
from data.shards import BOS_ID
from model.gpt import StepArgs
from model.prefix import gpt2_bpe_available, gpt2_encoding
from perf import backend as perf_backend
from records.run_log import REPO_ROOT, git_state
from records.runs_log import append_run, now_iso
from runtime.checkpoints import CHECKPOINT_FOLDER, CheckpointError, load_checkpoint, open_model_file
from runtime.training import Run, Setup

EVAL_REQUIREMENTS = "requirements-eval.txt"
HELLASWAG_FIELDS = ("activity_label", "ctx_a", "ctx_b", "endings", "label")  # what the harness's hellaswag reads


# ----------------------------------------------------------------------------------------------------
# the checkpoint
# ----------------------------------------------------------------------------------------------------


def run_config_from_dict(saved: dict) -> RunConfig:
    """The RunConfig that `asdict(cfg)` saved (checkpoints.save_checkpoint), sections rebuilt."""
    schedule = dict(saved["schedule"])
    schedule["stages"] = tuple(StageConfig(**stage) for stage in schedule["stages"])
    return RunConfig(**{**saved, "model": ModelConfig(**saved["model"]), "schedule": ScheduleConfig(**schedule),
                        "optim": OptimConfig(**saved["optim"]),
                        "features": FeatureConfig(**saved.get("features", {}))})  # saved before the switches: all on


def read_checkpoint(folder: Path) -> tuple[RunConfig, int]:
    """(the saved run's config, its step) from folder/model.pt, or a ConfigError that says what is wrong."""
    where = f"checkpoint {folder}"
    try:  # memory-mapped, weights_only: only the config and the step are read here, no pickled code runs
        model_file, saved = open_model_file(folder)
    except (FileNotFoundError, CheckpointError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if not {"config", "model", "step"} <= saved.keys():
        raise ConfigError(f"{where}: {model_file} holds no config, model and step; {CHECKPOINT_FOLDER}")
    try:
        cfg = run_config_from_dict(saved["config"])
    except (TypeError, KeyError, ValueError) as e:
        raise ConfigError(f"{where}: its config does not fit this code's RunConfig ({e}); it was saved by "
                          f"another version of the code (the checkpoint holds its source: model.pt['code'])") from None
    return cfg, int(saved["step"])


def runs_path_for(folder: Path) -> Path:
    """The runs.jsonl of the records folder holding the checkpoint (<records>/logs/<run_id>/state_...),
    else the repository's."""
    records = folder.resolve().parents[2] if folder.resolve().parent.parent.name == "logs" else REPO_ROOT / "records"
    return records / "runs.jsonl"


# ----------------------------------------------------------------------------------------------------
# the model: next-token distributions over token lists, in lockstep on every rank
# ----------------------------------------------------------------------------------------------------


class CheckpointModel:
    """The checkpoint's model behind token-level calls: `score` (log-likelihoods of continuations),
    `generate` (greedy or sampled text), `run_jobs` (the lockstep that both use)."""

    def __init__(self, run: Run, setup: Setup):
        self.run, self.setup = run, setup
        self.windows = run.schedule.final_windows()  # the final validation's (ws_short, ws_long)
        # a query sees at most the long window back: a longer input gains nothing, so inputs are cut
        # to it from the left (lm-eval's models cut theirs to their maximum length the same way)
        self.max_len = max(self.windows) * run.cfg.schedule.block_size
        self.encoding = gpt2_encoding()
        self.group = None  # host collectives: the exchange's gloo group on NCCL, else the default one
        if setup.world_size > 1:
            if run.exchange is not None:
                self.group = run.exchange.group
            elif dist.get_backend() != "gloo":
                self.group = dist.new_group(backend="gloo")

    # --- one document through the validation forward ------------------------------------------------
    @torch.no_grad()
    def logits(self, tokens: list[int], start: int = 0) -> torch.Tensor:
        """(n − start, V) fp32 softcapped logits of one document of n tokens, rows start..n−1: row t
        scores token t + 1 (the lm_head runs on those rows only: at smoke size it is most of the cost)."""
        cfg, n = self.run.cfg, len(tokens)
        inputs = np.asarray(tokens, dtype=np.int32)  # (n,)
        cap = cfg.schedule.virtual_seq_cap  # attention segments cut as the training cuts them
        half_rows, pool_rows = self.run.hash_args["ngram_half_rows"], self.run.hash_args["sign_pool_rows"]
        token_map = self.run.hash_args["token_map"]  # features.token_norm_hashes: the hashes read classes
        keys = token_map[inputs] if token_map is not None else inputs  # (n,)
        batch = Batch(
            inputs=torch.from_numpy(inputs),
            targets=torch.from_numpy(np.append(inputs[1:], BOS_ID).astype(np.int64)),  # unread with logits=True
            cu_seqlens=padded_cu_seqlens(attention_segment_ends([n], cap), n, cu_seqlens_rows(n), "evaluate.py document"),
            ngram_ids=ngram_row_ids(keys, half_rows) if half_rows else None,  # hashed per document
            ngram_sign_rows=ngram_sign_rows(keys, pool_rows) if half_rows else None,
            max_seq_len=min(n, cap))
        batch, plan, _ = self.run.upload(batch, 0)  # the row plan: a host collective on several ranks
        rows = self.run.exchange.pull(self.run.table.rows, plan) if plan is not None else None
        args = StepArgs(ws_short=self.windows[0], ws_long=self.windows[1], training=False,
                        max_seq_len=batch.max_seq_len, logits=True, logits_from=start)
        return self.run.forward(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows, args)

    # --- the lockstep -----------------------------------------------------------------------------------
    def run_jobs(self, jobs: list, desc: str | None = None) -> list:
        """Run jobs (generators: each yields (tokens, start), receives `logits(tokens, start)` and
        returns its result); their results in order, on every rank (a progress bar on rank 0 when
        `desc` names the work). Job i runs on rank i % W. Every rank forwards once per round, a rank
        out of work a two-token stand-in, until no rank has work left: the row exchange inside each
        forward is a collective of all ranks."""
        W, rank = self.setup.world_size, self.setup.rank
        queue = collections.deque(range(rank, len(jobs), W))
        results: dict[int, object] = {}
        current = None  # the index of the job in progress
        bar = tqdm(total=len(queue), desc=desc if W == 1 else f"{desc} (rank 0's share of {W})", unit="job",
                   disable=desc is None or not self.setup.is_master or not jobs, leave=False)

        def next_request(reply=None):
            """Send the job in progress its logits; the next (tokens, start) to forward, None when done."""
            nonlocal current
            while True:
                if current is None:
                    if not queue:
                        return None
                    current, reply = queue.popleft(), None  # a generator starts on None
                try:
                    return jobs[current].send(reply)
                except StopIteration as done:
                    results[current] = done.value
                    current = None
                    bar.update(1)

        request = next_request()
        while True:
            busy = request is not None
            if W > 1:
                flag = torch.tensor([int(busy)])
                dist.all_reduce(flag, group=self.group)  # any rank still working: everyone forwards
                if not flag.item():
                    break
            elif not busy:
                break
            out = self.logits(*request) if busy else self.logits([BOS_ID, BOS_ID], 1)
            if busy:
                request = next_request(out)
        bar.close()
        if W > 1:
            gathered: list = [None] * W
            dist.all_gather_object(gathered, results, group=self.group)
            results = {k: v for part in gathered for k, v in part.items()}
        return [results[i] for i in range(len(jobs))]

    # --- log-likelihoods ----------------------------------------------------------------------------------
    def _score_job(self, context: list[int], continuation: list[int]):
        """(log p(continuation | context), whether greedy decoding gives the continuation)."""
        if not continuation:
            return 0.0, True
        if len(continuation) > self.max_len:
            raise ValueError(f"evaluate.py: a continuation of {len(continuation)} tokens exceeds the model's "
                             f"{self.max_len}-token reach (its long window)")
        doc = (context + continuation)[-(self.max_len + 1):]
        z = yield doc[:-1], len(doc) - 1 - len(continuation)  # (c, V): the rows that predict the continuation
        target = torch.tensor(continuation, device=z.device)
        log_probs = torch.log_softmax(z.double(), dim=-1).gather(1, target[:, None]).squeeze(1)  # (c,) in fp64: sums
        return log_probs.sum().item(), bool((z.argmax(dim=-1) == target).all())

    def score(self, pairs: list[tuple[list[int], list[int]]], desc: str = "scoring") -> list[tuple[float, bool]]:
        """[(log-likelihood, is greedy)] of (context tokens, continuation tokens) pairs; the context
        is used as given (`encode_pair` puts the BOS in front)."""
        return self.run_jobs([self._score_job(c, x) for c, x in pairs], desc)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)  # "<|endoftext|>" in a text is text, not the BOS

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """([BOS] + context tokens, continuation tokens), split as lm-eval's Hugging Face model splits
        a pair: trailing spaces of the context move to the continuation, the whole is encoded once
        and the continuation is what follows the context's own tokens. The BOS opens every document,
        as in training (an empty context is the BOS alone)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.encode(context + continuation), self.encode(context)
        return [BOS_ID] + head, whole[len(head):]

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(c, x) for c, x in pairs])

    # --- text -------------------------------------------------------------------------------------------------
    def _generate_job(self, prompt: list[int], max_tokens: int, temperature: float, top_k: int | None,
                      until: list[str], seed: int, on_token=None):
        """New token ids after [BOS] + prompt: greedy at temperature 0, else sampled (top-k, from a
        seeded host generator, so every device draws the same); stops at the end-of-text token (the
        BOS that opens the next document), at a stop string, or after max_tokens."""
        tokens, new = [BOS_ID, *prompt], []
        generator = torch.Generator().manual_seed(seed)
        for _ in range(max_tokens):
            window = tokens[-self.max_len:]
            logits = yield window, len(window) - 1  # (1, V): the last row only
            z = logits[-1, :self.encoding.n_vocab].float().cpu()  # (50257,): the padded ids have no text
            if temperature == 0:
                token = int(z.argmax())
            else:
                z = z / temperature
                if top_k:
                    z[z < torch.topk(z, min(top_k, z.numel())).values[-1]] = -float("inf")
                token = int(torch.multinomial(torch.softmax(z, dim=-1), 1, generator=generator))
            if token == BOS_ID:
                break
            tokens.append(token)
            new.append(token)
            if on_token is not None:
                on_token(new)
            if until and any(stop in self.encoding.decode(new) for stop in until):
                break
        return new

    def generate(self, prompts: list[str], max_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 until: list[str] | None = None, seed: int = 0, on_token=None) -> list[str]:
        """The text each prompt continues with (cut at the first stop string)."""
        jobs = [self._generate_job(self.encode(p), max_tokens, temperature, top_k, until or [], seed, on_token)
                for p in prompts]
        texts = [self.encoding.decode(new) for new in self.run_jobs(jobs)]  # no bar: the text streams
        for stop in until or []:
            texts = [t.split(stop)[0] for t in texts]
        return texts


# ----------------------------------------------------------------------------------------------------
# the harness
# ----------------------------------------------------------------------------------------------------


def harness_available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def harness_lm(model: CheckpointModel):
    """The checkpoint as lm-eval's `LM`. It reports rank 0 of 1 on every process, so the harness
    hands each rank every request (its tensor-parallel mode: only LOCAL_RANK 0 builds the results)
    and the model shares the forwards out itself."""
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class CheckpointLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return model.loglikelihood([tuple(r.args) for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            # the harness's own windows: each token predicted once, with as much context as fits
            pieces, owners = [], []
            for i, request in enumerate(requests):
                windows = get_rolling_token_windows(token_list=model.encode(request.args[0]), prefix_token=BOS_ID,
                                                    max_seq_len=model.max_len, context_len=1)
                for window in map(make_disjoint_window, windows):
                    pieces.append(window)
                    owners.append(i)
            totals = [0.0] * len(requests)
            for owner, (ll, _) in zip(owners, model.score(pieces, "rolling log-likelihoods")):
                totals[owner] += ll
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False):
            texts = []
            for request in requests:  # one at a time: each request has its own stop strings and length
                context, kwargs = request.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                sample = kwargs.get("do_sample", False) and kwargs.get("temperature", 0.0) > 0
                texts += model.generate([context], int(kwargs.get("max_gen_toks", 256)),
                                        float(kwargs.get("temperature", 0.0)) if sample else 0.0,
                                        kwargs.get("top_k"), until)
            return texts

    return CheckpointLM()


def hellaswag_problem(path: Path) -> str | None:
    """The first problem of a HellaSwag jsonl file (the public hellaswag_{val,train}.jsonl format:
    one object per line with at least activity_label, ctx_a, ctx_b, endings and an integer label),
    or None."""
    where = f"--data {path}"
    if not path.is_file():
        return f"{where}: no such file (expected HellaSwag's jsonl, e.g. hellaswag_val.jsonl)"
    items = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{where}:{lineno}: not JSON ({e.msg} at column {e.colno}); expected one HellaSwag item per line"
                if not isinstance(item, dict):
                    return f"{where}:{lineno}: expected a JSON object (a HellaSwag item), got {type(item).__name__}"
                missing = [k for k in HELLASWAG_FIELDS if k not in item]
                if missing:
                    return f"{where}:{lineno}: missing {', '.join(missing)} (a HellaSwag item has {', '.join(HELLASWAG_FIELDS)})"
                if not all(isinstance(item[k], str) for k in ("activity_label", "ctx_a", "ctx_b")):
                    return f"{where}:{lineno}: activity_label, ctx_a and ctx_b must be strings"
                endings = item["endings"]
                if not (isinstance(endings, list) and len(endings) >= 2 and all(isinstance(e, str) for e in endings)):
                    return f"{where}:{lineno}: endings must be a list of at least 2 strings, got {endings!r:.80}"
                label = item["label"]
                if not (isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(endings)):
                    return f"{where}:{lineno}: label must be an integer index into the {len(endings)} endings, got {label!r}"
                items += 1
    except UnicodeDecodeError as e:
        return f"{where}: not UTF-8 text ({e.reason} at byte {e.start})"
    return None if items else f"{where}: no items (expected one HellaSwag item per line)"


def local_hellaswag_task(data: Path, folder: Path) -> str:
    """A task file in `folder` that is the harness's own hellaswag task (its prompt, preprocessing
    and metrics, by include) reading `data` instead of the hub; returns its path."""
    import lm_eval.tasks

    harness_task = Path(lm_eval.tasks.__file__).parent / "hellaswag" / "hellaswag.yaml"
    spec = folder / "hellaswag_local.yaml"
    # JSON strings are YAML strings: any path quotes safely. The datasets cache goes in `folder` too:
    # a local file needs none kept.
    spec.write_text(f"include: {json.dumps(str(harness_task))}\n"
                    f"task: hellaswag\n"
                    f"dataset_path: json\n"
                    f"dataset_name: null\n"
                    f"dataset_kwargs:\n"
                    f"  data_files:\n"
                    f"    validation: {json.dumps(str(data.resolve()))}\n"
                    f"  cache_dir: {json.dumps(str(folder / 'datasets'))}\n"
                    f"training_split: null\n")
    return str(spec)


def check_tasks(names: list[str], data: Path | None):
    """Refuse before any work: a bad data file, no harness, a task the harness does not know.
    Returns the harness's TaskManager for the run."""
    if data is not None:
        if "hellaswag" not in names:
            raise ConfigError(f"--data {data} is a HellaSwag file: add hellaswag to --tasks (got {','.join(names)})")
        problem = hellaswag_problem(data)
        if problem:
            raise ConfigError(problem)
    if not harness_available():
        raise ConfigError(f"--tasks runs on EleutherAI's lm-evaluation-harness, which is not installed: "
                          f"pip install -r {EVAL_REQUIREMENTS} (--sample needs none of it)")
    from lm_eval.tasks import TaskManager

    named = [t for t in names if not (data is not None and t == "hellaswag")]
    with hugging_face_evaluate_importable():  # the built-in index takes ~10 s: only when needed
        manager = TaskManager(include_defaults=bool(named))
    unknown = [t for t in named if t not in manager.all_tasks]
    if unknown:
        import difflib

        hints = [f"{t} (did you mean {', '.join(difflib.get_close_matches(t, manager.all_tasks, 3))}?)"
                 if difflib.get_close_matches(t, manager.all_tasks, 1) else t for t in unknown]
        raise ConfigError(f"--tasks: unknown to lm-evaluation-harness: {'; '.join(hints)} "
                          f"(`lm-eval ls tasks` lists them)")
    return manager


@contextlib.contextmanager
def hugging_face_evaluate_importable():
    """While the harness runs, `import evaluate` means Hugging Face's metrics package (an lm-eval
    dependency that tasks such as squadv2, mbpp and humaneval import), not this file, whose name
    shadows it: the repository root moves to the end of sys.path (the project's modules are
    imported already) and this module, when imported as `evaluate`, steps out of sys.modules."""
    root, path = str(REPO_ROOT), list(sys.path)
    mine = sys.modules.get("evaluate")
    ours = mine is not None and Path(getattr(mine, "__file__", "") or "").resolve() == Path(__file__).resolve()
    sys.path[:] = [p for p in path if Path(p or ".").resolve() != REPO_ROOT] + [root]
    if ours:
        del sys.modules["evaluate"]
    try:
        yield
    finally:
        sys.path[:] = path
        if ours:
            sys.modules["evaluate"] = mine


def run_tasks(model: CheckpointModel, names: list[str], manager, data: Path | None, limit: int | None) -> dict:
    """{task: {"items", "acc", "acc_norm", and the task's other metrics}} from the harness."""
    from lm_eval import simple_evaluate

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notices; errors still show
    with tempfile.TemporaryDirectory(prefix="evaluate_") as tmp, hugging_face_evaluate_importable():
        specs = [local_hellaswag_task(data, Path(tmp)) if data is not None and t == "hellaswag" else t for t in names]
        if model.setup.world_size > 1:  # rank 0 downloads and caches the data, then the others read the cache
            if model.setup.is_master:
                manager.load(specs)
            dist.barrier(group=model.group)
        out = simple_evaluate(model=harness_lm(model), tasks=specs, task_manager=manager, limit=limit,
                              log_samples=False, bootstrap_iters=0)
    if out is None:  # a rank whose LOCAL_RANK is not 0: the harness builds no results there
        return {}
    table = {}
    for task, metrics in out["results"].items():
        row = {"items": out.get("n-samples", {}).get(task, {}).get("effective", metrics.get("sample_len"))}
        for key, value in metrics.items():
            name, _, _filter = key.partition(",")
            if isinstance(value, (int, float)) and not name.endswith("_stderr") and name != "sample_len":
                row[name] = value
        table[task] = row
    return table


def format_table(table: dict) -> str:
    """task | items | acc | acc_norm | the task's other metrics."""
    def number(v):
        return "-" if v is None else f"{v:.4f}"

    rows = [("task", "items", "acc", "acc_norm", "other metrics")]
    for task, row in table.items():
        other = ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k not in ("items", "acc", "acc_norm"))
        rows.append((task, str(row.get("items", "-")), number(row.get("acc")), number(row.get("acc_norm")), other))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(" | ".join(c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


# ----------------------------------------------------------------------------------------------------
# the command line
# ----------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="Depth: docs/evaluate.md (what a record checkpoint scores, how long it takes).")
    ap.add_argument("checkpoint", type=Path, help="records/logs/<run_id>/state_stepNNNNNN (train_gpt.py --save-checkpoint)")
    ap.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks, e.g. hellaswag,arc_easy")
    ap.add_argument("--limit", type=_positive("a positive number of items"), default=None,
                    help="score only the first N items of each task (a quick check: not comparable)")
    ap.add_argument("--data", type=Path, default=None, help="HellaSwag's jsonl (hellaswag_val.jsonl) read from disk "
                    "instead of downloading it")
    ap.add_argument("--sample", default=None, metavar="PROMPT", help="print PROMPT and the text the model continues it with")
    ap.add_argument("--tokens", type=_positive("a positive number of tokens"), default=64, help="--sample: new tokens at most (64)")
    ap.add_argument("--temperature", type=float, default=0.8, help="--sample: 0 is greedy (0.8)")
    ap.add_argument("--top-k", type=_positive("a positive number of tokens"), default=None,
                    help="--sample: draw among the K likeliest tokens only")
    ap.add_argument("--seed", type=int, default=0, help="--sample: seed of the draws (0)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    ap.add_argument("--runs", type=Path, default=None, help="where the scores line goes (default: the runs.jsonl "
                    "of the records folder holding the checkpoint)")
    args = ap.parse_args(argv)
    args.task_names = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks is not None else []
    if args.tasks is not None and not args.task_names:
        raise ConfigError("--tasks: no task named (e.g. --tasks hellaswag)")
    if not args.task_names and args.sample is None:
        raise ConfigError("nothing to do: pass --tasks hellaswag[,TASK...] and/or --sample PROMPT (see evaluate.py --help)")
    if args.data is not None and not args.task_names:
        raise ConfigError(f"--data {args.data} is a HellaSwag file: pass --tasks hellaswag with it")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must be >= 0 (0 is greedy)")
    return args


def _positive(what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value}: expected {what}")
        return value
    return parse


def build(cfg: RunConfig, folder: Path, device: str) -> tuple[Setup, Run]:
    """The run as the training builds it (runtime/training.py), the checkpoint loaded. No record node checks,
    no warmup: the forward runs eagerly, since every document length would be a compiled graph."""
    cfg = replace(cfg, device=device, requires_fast_path=False, warmup=False)
    setup = Setup(cfg)
    setup.init_process_group(cfg.collective_timeout_s)
    run = Run(cfg, setup)
    try:
        load_checkpoint(run, folder)
    except RuntimeError as e:  # load_state_dict: the weights do not fit the saved config's model
        raise ConfigError(f"checkpoint {folder}: its weights do not fit its own config's model "
                          f"({str(e).splitlines()[0]})") from None
    return setup, run


def main(argv=None) -> None:
    rank0 = os.environ.get("RANK", "0") in ("0", "")
    with exit_on_config_error("evaluate.py", is_master=rank0):
        args = parse_args(argv)
        cfg, step = read_checkpoint(args.checkpoint)
        manager = check_tasks(args.task_names, args.data) if args.task_names else None
        if not gpt2_bpe_available():  # tasks and prompts are text: GPT-2's BPE tokenizes them (training needs none)
            raise ConfigError("tiktoken cannot load GPT-2's BPE files (no cache, no network): evaluate.py tokenizes "
                              "tasks and prompts with them; set TIKTOKEN_CACHE_DIR to a folder holding them, or run "
                              "`python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` once online")
        # the execution path of the device the run lands on (the CPU's with --device cpu on a GPU
        # node), eager: no compile (every document length would be a graph), no CUDA graphs
        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        backend = replace(perf_backend.detect(device="cuda" if cuda else "cpu"), compile=False, cuda_graphs=False)
        try:
            with perf_backend.use_backend(**asdict(backend)):
                evaluate(args, cfg, step, manager)
        finally:  # after a failure too, so the other ranks are not left waiting on a collective
            if dist.is_initialized():
                dist.destroy_process_group()


def evaluate(args: argparse.Namespace, cfg: RunConfig, step: int, manager) -> None:
    started, t0 = now_iso(), time.perf_counter()
    setup, run = build(cfg, args.checkpoint, args.device)
    model = CheckpointModel(run, setup)
    say = print if setup.is_master else (lambda *a, **k: None)
    run_id = args.checkpoint.resolve().parent.name
    say(f"checkpoint {args.checkpoint}: run {run_id}, step {step}, config {cfg.name}; {setup.world_size} process(es), "
        f"device {setup.device}; loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if cfg.features.cplm:  # PR #379: the trained distribution is a mixture this scorer does not form
        say("features.cplm: scored and sampled by the LM softmax alone (the copy pointer's mixture is not applied; "
            "the validation loss of train_gpt.py --eval-checkpoint is the mixture's)", file=sys.stderr)
    try:
        if args.task_names:
            t1 = time.perf_counter()
            table = run_tasks(model, args.task_names, manager, args.data, args.limit)
            seconds = time.perf_counter() - t1
            if setup.is_master:
                print(format_table(table))
                print(f"scored in {seconds:.1f} s", file=sys.stderr)
                commit, dirty = git_state()
                append_run({"run_id": run_id, "kind": "evaluation", "started": started, "status": "finished",
                            "checkpoint": str(args.checkpoint), "step": step, "config": cfg.name,
                            "world_size": setup.world_size, "device": str(setup.device), "git_commit": commit,
                            "git_dirty": dirty, "limit": args.limit, "data": None if args.data is None else str(args.data),
                            "eval_time_s": round(seconds, 3), "tasks": table},
                           args.runs or runs_path_for(args.checkpoint))
        if args.sample is not None:
            say(args.sample, end="", flush=True)  # the prompt first, then the new text as it comes
            printed = [""]

            def stream(new_tokens):
                text = model.encoding.decode(new_tokens)
                if setup.is_master and not text.endswith("\ufffd"):  # a token may end inside a character
                    say(text[len(printed[0]):], end="", flush=True)
                    printed[0] = text

            (text,) = model.generate([args.sample], args.tokens, args.temperature, args.top_k, seed=args.seed,
                                     on_token=stream)
            say(text[len(printed[0]):])
    finally:
        run.close()


if __name__ == "__main__":
    main()
