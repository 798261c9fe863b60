"""Run.train_step reads top to bottom (runtime/training.py): batch inputs, the forward/backward
regions, one optimizer call, the prefetch, each named once, in about 60 lines."""
import ast
import inspect
import textwrap

from runtime import training

MAX_STEP_LINES = 60  # issue 46: upstream's train_step is one function of about 50 lines


def _function(name: str) -> ast.FunctionDef:
    source = textwrap.dedent(inspect.getsource(getattr(training.Run, name)))
    return ast.parse(source).body[0]


def _calls_on(fn: ast.FunctionDef, owners: set[str]) -> list[str]:
    """`self.<owner>.<method>(...)` calls in fn, as 'owner.method', sorted."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self" \
                    and owner.attr in owners:
                found.append(f"{owner.attr}.{node.func.attr}")
    return sorted(found)


def test_the_optimizers_work_in_a_training_step_is_one_call():
    step = _function("_train_step")
    assert _calls_on(step, {"manager", "ngram_opt"}) == ["manager.step"]
    for helper in ("step_inputs", "forward_backward"):  # what the step's body hands off reaches no optimizer
        assert _calls_on(_function(helper), {"manager", "ngram_opt"}) == []


def test_a_training_step_reads_in_about_60_lines():
    lengths = {name: _function(name).end_lineno - _function(name).lineno + 1 for name in ("train_step", "_train_step")}
    assert sum(lengths.values()) <= MAX_STEP_LINES, lengths


def test_the_checks_see_a_broken_step():
    """The two checks above fail on a step that drives the optimizer's pieces itself."""
    broken = ast.parse(textwrap.dedent('''
        def _train_step(self, step):
            self.manager.load_scalars(step)
            self.run_region("optimizer", self.manager.phase(step), lambda: self.manager.update(step))
            self.ngram_opt.step(step)
    ''')).body[0]
    assert _calls_on(broken, {"manager", "ngram_opt"}) == [
        "manager.load_scalars", "manager.phase", "manager.update", "ngram_opt.step"]
