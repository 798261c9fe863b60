"""The command-line plumbing every entry point shares: an argparse whose usage errors are one
line, exit 2 on a refused configuration, the integer argument types, --set SECTION.FIELD=VALUE
(`apply_overrides`: any config field) and the measuring tools' --config/--world-size/--set line.

It imports only `config` (and the standard library), so any module's command line can use it
without an import circle: the up-front check of a run (runtime/config_check.py) builds a schedule and reads
a checkpoint, and the schedule's own command line (`python -m optim.schedule`) uses this module.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

from config import ConfigError, RunConfig

EXIT_CONFIG_ERROR = 2  # argparse's status for a usage error; ours for every refused configuration


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise ConfigError (one line, exit 2 under exit_on_config_error)
    instead of printing the usage block; --help is unchanged."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see {self.prog} --help)")


def _int_at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer ({what})") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: must be {what}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")


@contextlib.contextmanager
def exit_on_config_error(prog: str, is_master: bool = True):
    """Print a ConfigError as one `prog: error: ...` line per problem on stderr (only on rank 0:
    every rank refuses the same configuration) and exit with status 2."""
    try:
        yield
    except ConfigError as e:
        if is_master:
            for problem in e.problems:
                print(f"{prog}: error: {problem}", file=sys.stderr)
        sys.stderr.flush()
        raise SystemExit(EXIT_CONFIG_ERROR) from None


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """--set SECTION.FIELD=VALUE (repeatable), as train_gpt.py takes it (`apply_overrides`)."""
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", dest="assignments",
                        help="set a field of the preset's run config, as train_gpt.py --set does "
                             "(e.g. --set features.ngram=false; repeatable)")


def add_proposal_argument(parser: argparse.ArgumentParser) -> None:
    """--proposal NAME: an open PR past the record as it ran (config.PROPOSALS), as train_gpt.py takes it."""
    from config import PROPOSALS

    parser.add_argument("--proposal", default=None, choices=sorted(PROPOSALS),
                        help="an open upstream PR past the record, as it ran: its features on and its base steps on "
                             "the record's schedule (config.PROPOSALS; --set still wins)")


def preset_run_config(name: str, assignments: list[str], proposal: str | None = None) -> RunConfig:
    """RUN_PRESETS[name], with a proposal's features and schedule (config.PROPOSALS) and then the --set
    assignments applied (ConfigError naming each bad one), as train_gpt.py builds its config."""
    from dataclasses import replace

    from config import PROPOSALS, RUN_PRESETS

    cfg = RUN_PRESETS[name]
    if proposal:
        cfg = PROPOSALS[proposal].apply(cfg)
    return replace(apply_overrides(cfg, assignments), overrides=tuple(assignments)) if assignments else cfg


def parse_preset_args(prog: str, description: str, argv, presets, world_size_help: str,
                      world_size_default: int | None = None, ranks_of=None) -> argparse.Namespace:
    """The measuring tools' command line (model.summary, tools.memory, tools.cost): --config PRESET,
    --world-size W and --set SECTION.FIELD=VALUE (repeatable; `args.run_config` is the preset's
    RunConfig with them applied), bad input refused in one line with exit 2. ranks_of: preset name
    -> the ranks W must divide (the process count of a run); None: any positive W."""
    with exit_on_config_error(prog):
        parser = ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--config", default="record", choices=sorted(presets))
        parser.add_argument("--world-size", type=positive_int, default=world_size_default, help=world_size_help)
        add_set_argument(parser)
        add_proposal_argument(parser)
        args = parser.parse_args(argv)
        if ranks_of is not None and args.world_size is not None and ranks_of(args.config) % args.world_size:
            raise ConfigError(f"--world-size {args.world_size}: must divide --config {args.config}'s "
                              f"{ranks_of(args.config)} ranks")
        args.run_config = preset_run_config(args.config, args.assignments, args.proposal)
    return args


def check_preset(name: str, presets, flag: str = "--config") -> None:
    """For entry points that take a preset name as free text: refuse a typo, suggesting the nearest."""
    if name not in presets:
        import difflib

        close = difflib.get_close_matches(name, list(presets), n=1)
        raise ConfigError(f"{flag} {name}: unknown preset; choose from {', '.join(sorted(presets))}"
                          + (f" (did you mean {close[0]}?)" if close else ""))


# ----------------------------------------------------------------------------------------------------
# --set section.field=value: any config field from the command line
# ----------------------------------------------------------------------------------------------------


def apply_overrides(cfg, assignments: list[str]):
    """`cfg` with each `path=value` of `assignments` applied (`--set`, repeatable): a path names a
    field of the RunConfig (`val_every`), of a section (`model.mlp_hidden_dim`, `optim.anvil_lr`,
    `schedule.base_steps`) or of a stage (`schedule.stages.2.lr_mul`). The value is parsed by the
    field's declared type: int, float, bool (true/false/1/0), str, None where the type allows it
    (`none`), a tuple as comma-separated items (`schedule.stages.0.mtp_start=1,0.5`, empty for ()).
    Every bad assignment is named at once (the path, the valid names at that level, or the type)."""
    problems = []
    for text in assignments:
        path, sep, value = text.partition("=")
        if not sep or not path:
            problems.append(f"--set {text}: expected SECTION.FIELD=VALUE (e.g. --set optim.anvil_lr=0.02)")
            continue
        try:
            cfg = _set_path(cfg, path.strip().split("."), value.strip(), path.strip())
        except ConfigError as e:
            problems += [f"--set {text}: {p}" for p in e.problems]
    if problems:
        raise ConfigError(problems)
    return cfg


def _set_path(obj, keys: list[str], value: str, path: str):
    import dataclasses

    key, rest = keys[0], keys[1:]
    if isinstance(obj, tuple):  # a tuple of dataclasses (the stages): by index
        if not key.isdigit() or int(key) >= len(obj):
            raise ConfigError(f"{key!r} is not an index of this tuple: 0..{len(obj) - 1}")
        if not rest:
            raise ConfigError("name a field of the item (e.g. schedule.stages.2.lr_mul)")
        items = list(obj)
        items[int(key)] = _set_path(items[int(key)], rest, value, path)
        return tuple(items)
    names = [f.name for f in dataclasses.fields(obj) if f.name not in _NOT_SETTABLE]
    if key in _NOT_SETTABLE and key not in names:
        raise ConfigError(f"{key} cannot be set: it names the preset (use --config) or records the --set flags")
    if key not in names:
        import difflib

        close = difflib.get_close_matches(key, names, n=1)
        raise ConfigError(f"{type(obj).__name__} has no field {key!r}"
                          + (f" (did you mean {close[0]}?)" if close else "") + f"; its fields: {', '.join(names)}")
    current = getattr(obj, key)
    if rest:
        if not (dataclasses.is_dataclass(current) or isinstance(current, tuple) and current
                and dataclasses.is_dataclass(current[0])):
            raise ConfigError(f"{key} is a value, not a section: use {path.rsplit('.', len(rest))[0]}=VALUE")
        new = _set_path(current, rest, value, path)
    else:
        if dataclasses.is_dataclass(current) or isinstance(current, tuple) and current and dataclasses.is_dataclass(current[0]):
            raise ConfigError(f"{key} is a section: name one of its fields ({path}.FIELD=VALUE)")
        new = _parse_value(value, _field_type(type(obj), key))
    try:
        return dataclasses.replace(obj, **{key: new})
    except (ValueError, TypeError) as e:  # the dataclass's own checks (ModelConfig.__post_init__, ...)
        raise ConfigError(str(e)) from None


_NOT_SETTABLE = ("name", "overrides", "proposal")  # the preset's name (use --config), the record of the --set flags, --proposal


def _field_type(cls, name: str):
    import typing

    return typing.get_type_hints(cls)[name]


def _parse_value(text: str, annotation):
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() == "none":
            return None
        (annotation,) = [a for a in args if a is not type(None)]
        return _parse_value(text, annotation)
    if origin is tuple:
        item = args[0] if args else str
        return tuple(_parse_value(t.strip(), item) for t in text.split(",") if t.strip())
    if annotation is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{text!r} is not a bool (true/false/1/0)")
    if annotation in (int, float):
        try:
            return annotation(text.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{text!r} is not {'an integer' if annotation is int else 'a number'}") from None
    return text
