"""tests/affected.py against a hand-made repository whose right answers are written out below.

Its package is `net`, not `model`: strings naming this repository's modules would make this file
selected for their changes (affected.py reads module names in strings, as tests launch them).
"""
import subprocess

import pytest

from tests.affected import changed_files, main, select

FILES = {  # a miniature of the project's layout (net/ for model/): path -> source
    "net/__init__.py": "",
    "net/loss.py": "X = 1\n",
    "net/mlp.py": "Y = 2\n",
    "net/gpt.py": "from net.loss import X\nfrom net import mlp\n",
    "perf/__init__.py": "",
    "perf/kernels/__init__.py": "",
    "perf/kernels/ce.py": "from net.loss import X\n",
    "train.py": "from net.gpt import X\n",
    "tests/conftest.py": "",
    "tests/helpers.py": "def run(script): pass\n",
    "tests/net/test_net_loss.py": "from net.loss import X\n",
    "tests/net/test_net_loss_sampled.py": "import math\n",  # mirrors net/loss.py by name
    "tests/net/test_net_lossy.py": "import math\n",  # does not: another name
    "tests/net/test_net_gpt.py": "from net.gpt import X\n",
    "tests/kernels/test_kernels_ce.py": "from perf.kernels.ce import X\n",
    "tests/optim/test_optim_dist.py": 'from tests.helpers import run\nWORKER = """\n    from net import loss\n"""\n',
    "tests/run/test_run_train.py": 'import subprocess, sys\nsubprocess.run([sys.executable, "train.py"])\n',
    "tests/run/test_run_cli.py": 'ARGS = ["-m", "net.mlp"]\n',
    "tests/data/test_data_words.py": 'KEY = "config"\nTEXT = "net.mlp is the MLP."\n',  # words, not modules
    "tests/records/test_records_old.py": "from net.old import Z\n",  # net/old.py was deleted
    "venv/lib/old.py": "print 'python 2'\n",  # not a package of the project: never read
}


@pytest.fixture
def repo(tmp_path):
    for path, source in FILES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    return tmp_path


@pytest.mark.parametrize("changed, expected", [
    (["net/loss.py"], {"tests/net/test_net_loss.py": "mirrors net/loss.py",
                       "tests/net/test_net_loss_sampled.py": "mirrors net/loss.py",
                       "tests/optim/test_optim_dist.py": "imports net.loss"}),  # in its worker script
    (["perf/kernels/ce.py"], {"tests/kernels/test_kernels_ce.py": "mirrors perf/kernels/ce.py"}),
    (["train.py"], {"tests/run/test_run_cli.py": "mirrors train.py",
                    "tests/run/test_run_train.py": "mirrors train.py"}),
    (["net/mlp.py"], {"tests/run/test_run_cli.py": "imports net.mlp"}),  # launched with -m
    (["tests/helpers.py"], {"tests/optim/test_optim_dist.py": "imports tests.helpers"}),
    (["net/old.py"], {"tests/records/test_records_old.py": "imports net.old"}),
    (["tests/net/test_net_gpt.py", "README.md"], {"tests/net/test_net_gpt.py": "changed"}),
    (["README.md", "net/notes.txt"], {}),
    (["net/__init__.py"], {  # every test importing anything under net/ runs it
        **{f"tests/net/test_net_{n}.py": "mirrors net/__init__.py" for n in ("gpt", "loss", "loss_sampled", "lossy")},
        "tests/optim/test_optim_dist.py": "imports net", "tests/records/test_records_old.py": "imports net",
        "tests/run/test_run_cli.py": "imports net"}),
])
def test_direct_selection(repo, changed, expected):
    assert {test: why for test, (why, _) in select(changed, repo).items()} == expected


@pytest.mark.parametrize("changed, expected", [
    (["net/mlp.py"], {"tests/run/test_run_cli.py": "imports net.mlp",  # net.gpt: `from net import mlp`
                      "tests/net/test_net_gpt.py": "runs net.gpt, which imports net/mlp.py"}),
    (["perf/kernels/ce.py"], {"tests/kernels/test_kernels_ce.py": "mirrors perf/kernels/ce.py"}),  # not in net.gpt
    (["net/gpt.py"], {"tests/net/test_net_gpt.py": "mirrors net/gpt.py"}),  # once
])
def test_the_end_to_end_test_runs_for_what_its_module_imports(repo, changed, expected):
    got = select(changed, repo, end_to_end={"tests/net/test_net_gpt.py": "net.gpt"})
    assert {test: why for test, (why, _) in got.items()} == expected


def test_a_file_that_does_not_parse_is_named(repo):
    (repo / "net/gpt.py").write_text("def broken(:\n")
    with pytest.raises(SystemExit, match=r"net/gpt.py: line 1: .*fix it"):
        select(["net/loss.py"], repo)


@pytest.mark.parametrize("changed", [["tests/conftest.py"], ["net/loss.py", "pyproject.toml"]])
def test_a_set_up_change_selects_the_whole_suite(repo, changed):
    assert select(changed, repo) is None


def test_changed_files_are_the_diff_and_untracked_files(repo):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                       capture_output=True)
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    assert changed_files("HEAD", repo) == []
    (repo / "net/loss.py").write_text("X = 2\n")
    (repo / "net/new.py").write_text("")  # untracked
    git("mv", "net/mlp.py", "net/mlps.py")  # a rename lists both names
    assert changed_files("HEAD", repo) == ["net/loss.py", "net/mlp.py", "net/mlps.py", "net/new.py"]
    git("commit", "-q", "-am", "two")
    assert changed_files("HEAD~1", repo) == ["net/loss.py", "net/mlp.py", "net/mlps.py", "net/new.py"]
    with pytest.raises(SystemExit, match="git diff .*no-such-rev"):
        changed_files("no-such-rev", repo)


def test_command_line_on_this_repository(capsys):
    assert main(["--files", "README.md"]) == 0  # nothing selected: no pytest run (it would run everything)
    out = capsys.readouterr().out
    assert "0 test file(s)" in out and "pytest" not in out
    assert main(["--files", "tests/affected.py"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("-m pytest tests/test_affected.py")
