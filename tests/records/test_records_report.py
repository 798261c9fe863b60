"""The records report: statistics against hand-computed numbers, grouping, bad lines, the plot."""
import json
import math
import re
import statistics
import subprocess
import sys

import numpy as np
import pytest

from records import report
from records.run_log import REPO_ROOT, format_val_line

TARGET = 3.28


def _losses_with(mean, std, n, seed=0):
    z = np.random.default_rng(seed).standard_normal(n)
    z = (z - z.mean()) / z.std(ddof=1)  # exactly mean 0, sample std 1
    return list(mean + std * z)


def _write_runs(path, groups):
    with open(path, "w") as f:
        for config, (losses, times) in groups.items():
            for i, (loss, t) in enumerate(zip(losses, times)):
                f.write(json.dumps({"run_id": f"{config}-{i}", "config": config, "status": "finished",
                                    "val_loss": loss, "train_time_ms": t * 1000}) + "\n")


def test_record_360_pool_statistics(tmp_path, capsys):
    # PR #360's certification pool: 18 runs, mean 3.27731, sample std 0.00099 -> t = 11.53, p = 9.3e-10.
    losses = _losses_with(3.27731, 0.00099, 18)
    t_margin, df, p = report.target_test(losses)
    assert df == 17
    assert t_margin == pytest.approx((TARGET - 3.27731) / (0.00099 / math.sqrt(18)), rel=1e-9)
    assert t_margin == pytest.approx(11.53, abs=0.01)
    assert p == pytest.approx(9.3e-10, rel=0.05)

    runs = tmp_path / "runs.jsonl"
    _write_runs(runs, {"record": (losses, _losses_with(39.914, 0.120, 18, seed=1))})
    assert report.main(["--runs", str(runs)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| record"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:7] == ["record", "18", "39.914 ± 0.120", "3.27731 ± 0.00099", "11.53", "17", cells[6]]
    assert float(cells[6]) == pytest.approx(9.3e-10, rel=0.05)


def test_welch_against_baseline_matches_hand_formula(tmp_path, capsys):
    new_t, old_t = [39.8, 40.0, 39.9, 40.1], [73.8, 73.9, 74.0, 73.7, 73.95]
    new_l, old_l = [3.2771, 3.2775, 3.2779, 3.2770], [3.2780, 3.2785, 3.2779, 3.2790, 3.2776]
    runs = tmp_path / "runs.jsonl"
    _write_runs(runs, {"new": (new_l, new_t), "old": (old_l, old_t)})
    with open(runs, "a") as f:
        f.write("this line is broken\n")
        f.write(json.dumps({"run_id": "x", "config": "new", "status": "failed", "error": "nan"}) + "\n")
    assert report.main(["--runs", str(runs), "--baseline", "old"]) == 0
    captured = capsys.readouterr()
    assert f"{runs}:10: skipped malformed line" in captured.err
    assert "1 run(s) not finished" in captured.err
    row = next(line for line in captured.out.splitlines() if line.startswith("| new"))
    cells = [c.strip() for c in row.strip("|").split("|")]

    def welch(a, b):  # Welch's t and Welch-Satterthwaite df, then the t distribution via scipy
        from scipy import stats
        va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
        t = (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
        return 2 * stats.t.sf(abs(t), df)

    assert cells[1] == "4"
    assert float(cells[7]) == pytest.approx(statistics.fmean(new_t) - statistics.fmean(old_t), abs=1e-3)
    assert float(cells[8]) == pytest.approx(welch(new_t, old_t), rel=0.01)
    assert float(cells[10]) == pytest.approx(welch(new_l, old_l), rel=0.01)
    base_row = next(line for line in captured.out.splitlines() if line.startswith("| old (baseline)"))
    assert [c.strip() for c in base_row.strip("|").split("|")][7:11] == ["-"] * 4  # not compared with itself


def test_group_by_label_and_unknown_baseline(tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    with open(runs, "w") as f:
        for i, label in enumerate(["a", "a", "b"]):
            f.write(json.dumps({"run_id": str(i), "label": label, "status": "finished",
                                "val_loss": 3.27 + i * 1e-3, "train_time_ms": 40000}) + "\n")
    assert report.main(["--runs", str(runs), "--group-by", "label"]) == 0
    out = capsys.readouterr().out
    assert "| a | 2 |" in out and "| b | 1 |" in out
    assert report.main(["--runs", str(runs), "--group-by", "label", "--baseline", "zzz"]) == 2
    assert "groups: a, b" in capsys.readouterr().err


def test_tokens_per_second_and_mfu_are_means_of_the_runs_that_logged_them(tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    rows = [{"tokens_per_s": 8.0e6, "mfu": 0.30, "peak_fraction": 0.20}, {"tokens_per_s": 9.0e6, "mfu": 0.40},
            {"tokens_per_s": 1.0e6}, {}]  # a run without a peak fraction, a CPU run (no MFU) and an older line
    with open(runs, "w") as f:
        for i, (label, extra) in enumerate(zip(["gpu", "gpu", "cpu", "old"], rows)):
            f.write(json.dumps({"run_id": str(i), "label": label, "status": "finished", "val_loss": 3.27,
                                "train_time_ms": 40000, **extra}) + "\n")
    assert report.main(["--runs", str(runs), "--group-by", "label"]) == 0
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")][-3:]
             for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line}
    assert cells["label"] == ["tokens/s", "MFU (bf16 peak)", "peak fraction"]
    assert cells["gpu"] == ["8,500,000", "35.0%", "20.0%"] and cells["cpu"] == ["1,000,000", "-", "-"]
    assert cells["old"] == ["-", "-", "-"]


def test_plot_writes_png_with_loss_curves(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    log = tmp_path / "curve.txt"
    log.write_text("\n".join(format_val_line(s, 100, 6.0 - s / 40, s * 20.0) for s in (25, 50, 75, 100)))
    runs = tmp_path / "runs.jsonl"
    with open(runs, "w") as f:
        for i in range(3):
            f.write(json.dumps({"run_id": f"run{i}", "config": "smoke", "status": "finished",
                                "val_loss": 3.5 + i / 100, "train_time_ms": 1000 + i,
                                "log_path": str(log)}) + "\n")
    out_png = tmp_path / "plot.png"
    import matplotlib.pyplot as plt
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig) or close(fig))
    assert report.main(["--runs", str(runs), "--plot", str(out_png)]) == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for ax in figures[0].axes[:2]:  # per-run panels: the run axis has whole-number ticks only
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_cli_entry_point_runs_as_module(tmp_path):
    runs = tmp_path / "runs.jsonl"
    _write_runs(runs, {"smoke": ([3.5, 3.6], [1.0, 1.1])})
    proc = subprocess.run([sys.executable, "-m", "records.report", "--runs", str(runs)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| smoke | 2 |" in proc.stdout


def test_without_scipy_and_matplotlib_it_still_prints(tmp_path, capsys, monkeypatch):
    for name in ("scipy", "scipy.stats", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    runs = tmp_path / "runs.jsonl"
    _write_runs(runs, {"smoke": ([3.27, 3.271, 3.272], [1.0, 1.1, 1.2])})
    assert report.main(["--runs", str(runs), "--plot", str(tmp_path / "p.png")]) == 0
    captured = capsys.readouterr()
    assert "pip install scipy" in captured.err and "pip install matplotlib" in captured.err
    # t = (3.28 - 3.271) / (0.001 / sqrt(3)) = 15.59 by hand
    assert "| smoke | 3 | 1.100 ± 0.100 | 3.27100 ± 0.00100 | 15.59 | 2 | needs scipy |" in captured.out
    assert not (tmp_path / "p.png").exists()


def test_evaluation_lines_are_not_counted_as_runs(tmp_path, capsys):
    """evaluate.py appends a `kind: evaluation` line (a checkpoint's task scores) under the run's id."""
    runs = tmp_path / "runs.jsonl"
    _write_runs(runs, {"record": ([3.279, 3.277], [40.0, 41.0])})
    with open(runs, "a") as f:
        f.write(json.dumps({"run_id": "record-0", "kind": "evaluation", "status": "finished",
                            "tasks": {"hellaswag": {"items": 10042, "acc": 0.29, "acc_norm": 0.31}}}) + "\n")
    assert report.main(["--runs", str(runs)]) == 0
    out, err = capsys.readouterr()
    assert "not finished" not in err
    assert re.search(r"^\| record \| 2 \|", out, re.M), out


def _curve_runs(tmp_path):
    """runs.jsonl for --curves: label a (two runs with a training curve, one of them with a log of
    two validations), label b (one with a curve, one older line without the field), and a failed
    run with a curve, which the report leaves out."""
    log = tmp_path / "a0.txt"
    log.write_text("\n".join([format_val_line(0, 4, 10.8, 0.0), "step:2/4 train_loss:9.1000",
                              format_val_line(4, 4, 8.5, 4000.0)]))
    curve = lambda k: [[s, 1000.0 * s + k, 10.0 - s - k / 10] for s in (1, 2, 3, 4)]
    runs = [dict(run_id="a0", label="a", train_curve=curve(0), log_path=str(log)),
            dict(run_id="a1", label="a", train_curve=curve(1)),
            dict(run_id="b0", label="b", train_curve=curve(2)),
            dict(run_id="b-old", label="b"),
            dict(run_id="f", label="a", status="failed", train_curve=curve(3))]
    path = tmp_path / "runs.jsonl"
    with open(path, "w") as f:
        for r in runs:
            f.write(json.dumps({"config": "smoke", "status": "finished", "val_loss": 8.5, "train_time_ms": 4000.0,
                                **r}) + "\n")
    return path, curve


def test_curves_draw_one_training_line_per_run_and_val_where_a_run_validated_twice(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    runs, curve = _curve_runs(tmp_path)
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig) or close(fig))
    out = tmp_path / "curves.png"
    assert report.main(["--runs", str(runs), "--group-by", "label", "--curves", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "curves written to" in capsys.readouterr().out and sorted(p.name for p in tmp_path.iterdir()) == \
        ["a0.txt", "curves.png", "runs.jsonl"]  # the temp file was renamed into place
    (fig,) = figures
    by_step, by_time = fig.axes
    for ax, x_of in ((by_step, lambda p: p[0]), (by_time, lambda p: p[1] / 1000)):
        lines = {line.get_gid(): line for line in ax.get_lines()}
        assert sorted(lines) == ["target", "train a0", "train a1", "train b0", "val a0"]
        for k, run_id in enumerate(("a0", "a1", "b0")):  # each run's own points, from runs.jsonl
            line = lines[f"train {run_id}"]
            assert list(line.get_xdata()) == [x_of(p) for p in curve(k)]
            assert list(line.get_ydata()) == [p[2] for p in curve(k)]
        assert list(lines["val a0"].get_ydata()) == [10.8, 8.5]  # the log's val lines
        assert list(lines["target"].get_ydata()) == [3.28, 3.28]
        # one colour per group
        assert lines["train a0"].get_color() == lines["train a1"].get_color() == lines["val a0"].get_color()
        assert lines["train b0"].get_color() != lines["train a0"].get_color()
    assert list(by_time.get_lines()[3].get_xdata()) != list(by_step.get_lines()[3].get_xdata())


def test_curves_svg_by_suffix_a_bad_suffix_named_and_no_matplotlib_said(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    runs, _ = _curve_runs(tmp_path)
    drawn = report.plot_curves({"a": [json.loads(line) for line in runs.read_text().splitlines()[:2]]},
                               tmp_path / "c.svg")
    assert drawn == {"step": ["train a0", "val a0", "train a1"], "training time (s)": ["train a0", "val a0", "train a1"]}
    assert "<svg" in (tmp_path / "c.svg").read_text()
    assert report.main(["--runs", str(runs), "--curves", str(tmp_path / "c.jpg")]) == 2
    assert "--curves" in capsys.readouterr().err and not (tmp_path / "c.jpg").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert report.main(["--runs", str(runs), "--curves", str(tmp_path / "n.png")]) == 0
    assert "pip install matplotlib" in capsys.readouterr().err and not (tmp_path / "n.png").exists()
