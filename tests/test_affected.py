"""tests/affected.py against a hand-made repository whose right answers are written out below.

Its package is `net`, not `model`: strings naming this repository's modules would make this file
selected for their changes (affected.py reads module names in strings, as tests launch them).
"""
import subprocess

import pytest

from tests.affected import changed_files, main, select
from tests.file_tree import write_tree

FILES = {  # a miniature of the project's layout (net/ for model/): path -> source
    "net/__init__.py": "",
    "net/loss.py": "X = 1\n",
    "net/mlp.py": "Y = 2\n",
    "net/gpt.py": "from net.loss import X\nfrom net import mlp\n",
    "ops/__init__.py": "",
    "ops/ce.py": "from net.loss import X\n",
    "train.py": "from net.gpt import X\n",
    "tests/conftest.py": "",
    "tests/helpers.py": "def run(script): pass\n",
    "tests/net/test_net_loss.py": "from net.loss import X\n",
    "tests/net/test_net_loss_sampled.py": "import math\n",  # mirrors net/loss.py by name
    "tests/net/test_net_lossy.py": "import math\n",  # does not: another name
    "tests/net/test_net_gpt.py": "from net.gpt import X\n",
    "tests/ops/test_ops_ce.py": "from ops.ce import X\n",
    "tests/optim/test_optim_dist.py": 'from tests.helpers import run\nWORKER = """\n    from net import loss\n"""\n',
    "tests/run/test_run_launch.py": 'import subprocess, sys\nsubprocess.run([sys.executable, "train.py"])\n',
    "tests/run/test_run_cli.py": 'ARGS = ["-m", "net.mlp"]\n',
    "tests/data/test_data_words.py": 'KEY = "config"\nTEXT = "net.mlp is the MLP."\n',  # words, not modules
    "tests/records/test_records_old.py": "from net.old import Z\n",  # net/old.py was deleted
    "venv/lib/old.py": "print 'python 2'\n",  # not a package of the project: never read
}


@pytest.fixture
def repo(tmp_path):
    return write_tree(tmp_path, FILES)


@pytest.mark.parametrize("changed, expected", [
    (["net/loss.py"], {"tests/net/test_net_loss.py": "mirrors net/loss.py",
                       "tests/net/test_net_loss_sampled.py": "mirrors net/loss.py",
                       "tests/optim/test_optim_dist.py": "imports net.loss",  # in its worker script
                       "tests/ops/test_ops_ce.py": "imports ops.ce → net.loss",
                       "tests/net/test_net_gpt.py": "imports net.gpt → net.loss",
                       "tests/run/test_run_launch.py": "imports train → net.gpt → net.loss"}),  # it launches train.py
    (["ops/ce.py"], {"tests/ops/test_ops_ce.py": "mirrors ops/ce.py"}),
    (["train.py"], {"tests/run/test_run_cli.py": "mirrors train.py",
                    "tests/run/test_run_launch.py": "mirrors train.py"}),
    (["net/mlp.py"], {"tests/run/test_run_cli.py": "imports net.mlp",  # launched with -m
                      "tests/net/test_net_gpt.py": "imports net.gpt → net.mlp",  # `from net import mlp`
                      "tests/run/test_run_launch.py": "imports train → net.gpt → net.mlp"}),
    (["tests/helpers.py"], {"tests/optim/test_optim_dist.py": "imports tests.helpers"}),
    (["net/old.py"], {"tests/records/test_records_old.py": "imports net.old"}),
    (["tests/net/test_net_gpt.py", "README.md"], {"tests/net/test_net_gpt.py": "changed"}),
    (["README.md", "net/notes.txt"], {}),
    (["net/__init__.py"], {  # every test importing anything under net/ runs it
        **{f"tests/net/test_net_{n}.py": "mirrors net/__init__.py" for n in ("gpt", "loss", "loss_sampled", "lossy")},
        "tests/optim/test_optim_dist.py": "imports net", "tests/records/test_records_old.py": "imports net",
        "tests/run/test_run_cli.py": "imports net", "tests/ops/test_ops_ce.py": "imports ops.ce → net",
        "tests/run/test_run_launch.py": "imports train → net"}),
])
def test_selection(repo, changed, expected):
    assert {test: why for test, (why, _) in select(changed, repo).items()} == expected


CHAIN = {  # a hand-built chain: the test imports a, a imports b inside a function, b's worker script imports c
    "chain/__init__.py": "",
    "chain/a.py": "import os\n",
    "chain/b.py": "def f():\n    from chain import a\n",
    "chain/c.py": 'SCRIPT = """\nfrom chain.b import f\n"""\n',
    "chain/d.py": "from chain import c\n",
    "tests/chain/test_chain_d.py": "from chain.d import x\n",
    "tests/other/test_other_b.py": "import chain.b\n",
}


@pytest.mark.parametrize("changed, expected", [
    (["chain/a.py"], {"tests/chain/test_chain_d.py": "imports chain.d → chain.c → chain.b → chain.a",
                      "tests/other/test_other_b.py": "imports chain.b → chain.a"}),
    (["chain/c.py"], {"tests/chain/test_chain_d.py": "imports chain.d → chain.c"}),  # nothing below c reaches it
    (["chain/d.py"], {"tests/chain/test_chain_d.py": "mirrors chain/d.py"}),  # once, its first reason
    (["ops/ce.py"], {"tests/ops/test_ops_ce.py": "mirrors ops/ce.py"}),  # net.gpt does not import it
])
def test_a_test_reaching_a_changed_module_through_any_chain_is_selected(repo, changed, expected):
    for path, source in CHAIN.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(source)
    assert {test: why for test, (why, _) in select(changed, repo).items()} == expected


def test_a_test_reading_the_tree_runs_for_what_it_reads(repo):
    readers = {"tests/net/test_net_lossy.py": ("*.md",), "tests/net/test_net_gpt.py": ("net/*",)}
    got = select(["README.md", "net/notes.txt"], repo, readers=readers)
    assert {test: why for test, (why, _) in got.items()} == {"tests/net/test_net_lossy.py": "reads README.md",
                                                               "tests/net/test_net_gpt.py": "reads net/notes.txt"}


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
    assert main(["--files", "records/plot.png"]) == 0  # nothing selected: no pytest run (it would run everything)
    out = capsys.readouterr().out
    assert "0 test file(s)" in out and "pytest" not in out
    assert main(["--files", "tests/affected.py"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "-m pytest tests/test_affected.py tests/test_citations.py tests/test_imports.py")  # the last two: READERS
    assert main(["--files", "README.md"]) == 0  # the tests that read it as text
    assert capsys.readouterr().out.splitlines()[-1].endswith("-m pytest tests/test_citations.py tests/test_readme.py")


def test_optim_anvil_reaches_the_optimizer_and_run_tests():
    """optim/anvil.py is imported by optim/manager.py, which the distributed and wiring tests and
    every run test (through runtime/training.py) import: each is selected, not only the anvil tests. (Paths
    are built, not written out: a literal path would make this file reach those modules.)"""
    def test(area, name):
        return "/".join(("tests", area, f"test_{area}_{name}.py"))

    got = select(["/".join(("optim", "anvil.py"))])
    assert {test("optim", "distributed"), test("optim", "model_wiring"), test("optim", "anvil")} <= got.keys()
    assert {test("run", "train"), test("run", "features"), test("run", "checkpoints")} <= got.keys()
    assert got[test("optim", "distributed")][0] == "imports optim.manager → optim.anvil"
