"""The CLI's surface as one piece: each option two commands share is one declaration with one type, help
is plain text, and the app's description names every command.

The options are walked through typer's own records (each command's signature and the ``OptionInfo``
in its ``Annotated`` metadata), cross-checked against the click command typer builds from them.
"""

from __future__ import annotations

import collections
import inspect
import re
import typing
from typing import Annotated, Any

import pytest
import typer
from typer.main import get_command
from typer.models import OptionInfo
from typer.testing import CliRunner

from bert_cluster.cli import app

runner = CliRunner()


def commands(group: typer.Typer = app, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every command of ``group`` and its sub-apps, by its path of names, with its callback."""
    found = {}
    for command in group.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        found[(*path, name)] = command.callback
    for sub in group.registered_groups:
        found.update(commands(sub.typer_instance, (*path, sub.name)))
    return found


def declarations(group: typer.Typer) -> dict[str, list[tuple[str, OptionInfo, Any]]]:
    """Option name (long and short) -> (command, its OptionInfo, its type) for each command using it."""
    uses: dict[str, list[tuple[str, OptionInfo, Any]]] = collections.defaultdict(list)
    for path, callback in commands(group).items():
        for parameter in inspect.signature(callback, eval_str=True).parameters.values():
            annotation, default = parameter.annotation, parameter.default
            infos = [(default, tuple(default.param_decls))] if isinstance(default, OptionInfo) else []
            if typing.get_origin(annotation) is Annotated:
                # In Annotated, typer reads Option's first argument (its default) as the first name.
                infos += [
                    (item, (*([] if item.default is ... else [item.default]), *item.param_decls))
                    for item in annotation.__metadata__
                    if isinstance(item, OptionInfo)
                ]
                annotation = annotation.__origin__
            for info, declared in infos:
                declared = declared or (f"--{parameter.name.replace('_', '-')}",)
                for name in (part for declaration in declared for part in declaration.split("/")):
                    uses[name].append((" ".join(path), info, annotation))
    return uses


def problems(group: typer.Typer) -> list[str]:
    """Each option name that two commands share but declare apart, or with another type."""
    found = []
    for name, uses in sorted(declarations(group).items()):
        if len(uses) < 2:
            continue
        by_object = collections.defaultdict(list)
        for command, info, _ in uses:
            by_object[id(info)].append(command)
        if len(by_object) > 1:
            found.append(f"{name} declared {len(by_object)} times: {sorted(by_object.values())}")
        types = {repr(annotation) for _, _, annotation in uses}
        if len(types) > 1:
            found.append(f"{name} has {len(types)} types: {sorted(types)}")
    return found


def test_every_option_two_commands_share_is_one_declaration_of_one_type():
    assert problems(app) == []


def test_the_walk_sees_every_option_of_every_command():
    """The walk over signatures finds exactly the options click parses (none is declared another way)."""
    root = get_command(app)
    walked = collections.defaultdict(set)
    for name, uses in declarations(app).items():
        for command, _, _ in uses:
            walked[command].add(name)
    for path in commands(app):
        command = root
        for part in path:
            command = command.commands[part]
        parsed = {
            name
            for parameter in command.params
            if parameter.param_type_name == "option"
            for name in (*parameter.opts, *parameter.secondary_opts)
        }
        assert walked[" ".join(path)] == parsed, path


#: The toy's --seed: one object (annotations are read from this module's names).
TOY_SEED = typer.Option("--seed")


def test_the_check_catches_an_option_declared_twice_or_with_two_types():
    """The control: a toy app with --limit declared in two places and --seed of two types fails it."""
    toy = typer.Typer()

    @toy.command()
    def first(
        limit: Annotated[int, typer.Option("--limit", help="N.")] = 1,
        seed: Annotated[int, TOY_SEED] = 0,
    ) -> None:
        """First."""

    @toy.command()
    def second(
        limit: Annotated[int, typer.Option("--limit", help="N.")] = 1,
        seed: Annotated[str, TOY_SEED] = "0",
    ) -> None:
        """Second."""

    found = problems(toy)
    assert len(found) == 2, found
    assert found[0].startswith("--limit declared 2 times") and found[1].startswith("--seed has 2 types")


#: RST's inline literal (``x``), role (:func:`x`) and directive (.. note::); markdown's `x` too.
RST = re.compile(r"`|:[a-z]+:|\.\. [\w-]+::")


@pytest.mark.parametrize("path", [(), ("kernels",), *commands(app)], ids=lambda path: " ".join(path) or "app")
def test_help_is_plain_text(path):
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert RST.search(result.stdout) is None, RST.findall(result.stdout)


def test_the_description_names_every_command():
    root = get_command(app)
    description = root.help or ""
    missing = [
        name for name in root.commands if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", description)
    ]
    assert missing == [], f"the app's description does not name {missing}: {description!r}"
    shown = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout
    assert " ".join(description.split()[:6]) in " ".join(shown.split())
