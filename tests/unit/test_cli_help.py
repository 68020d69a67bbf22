"""`--help` works on every command and subcommand (a user's first try), and says the
command's own usage; arguments parse the same wherever the options come."""

from __future__ import annotations

import argparse

import pytest

from stratamq.broker import cli
from stratamq.broker.admin import ctl
from stratamq.spark import cli as spark_cli


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    code = exit_.value.code
    return (code if isinstance(code, int) else 2), capsys.readouterr().out


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands a parser offers (its subparsers), by name, in order."""
    return {name: sub for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def every_command() -> list[list[str]]:
    """Every `stratamq` command and subcommand, found in the parsers themselves, so a
    command added later is walked too. `ctl`'s commands are the choices of its first
    argument; `cluster controller` is the one subcommand no parser lists."""
    top = cli.build_parser()
    commands = subcommands(top)
    found: list[list[str]] = [[], *([name] for name in commands)]
    ctl_command = next(action for action in commands["ctl"]._actions
                       if action.dest == "ctl_command")
    found += [["ctl", name] for name in ctl_command.choices or ()]
    found += [["ctl", "ds", action] for action in subcommands(ctl._parser("ds"))]
    found += [["cluster", "controller"]]
    found += [["spark", job] for job in subcommands(spark_cli._parser())]
    found += [["spark", "launch", job] for job in spark_cli.JOBS]
    return found


def test_the_walk_finds_the_commands_users_run() -> None:
    walked = {" ".join(argv) for argv in every_command()}
    assert {"ctl passwd", "ctl ds checkpoint", "cluster controller", "spark gc",
            "spark launch", "spark submit", "spark launch export"} <= walked, walked


@pytest.mark.parametrize("argv", every_command(), ids=" ".join)
@pytest.mark.parametrize("option", ["-h", "--help"])
def test_help_works_on_every_command(argv: list[str], option: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A user's first try: `-h` and `--help` answer with the command's own usage and
    exit 0 (a launch job's help is launch's: the job is one of its arguments)."""
    code, out = run_main([*argv, option], capsys)
    assert code == 0, out
    command = argv[:2] if argv[:2] == ["spark", "launch"] else argv
    assert out.startswith(" ".join(["usage: stratamq", *command])), out


@pytest.mark.parametrize("action", list(ctl.DS_ACTIONS))
def test_each_ds_action_has_its_own_help(action: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.ctl_main("ds", [action, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: stratamq ctl ds {action}"), out
    assert ctl.DS_ACTIONS[action][1].split()[0] in out


def test_ds_checkpoint_help_says_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.ctl_main("ds", ["checkpoint", "-h"]) == 0
    assert "checkpoint [-h]" in capsys.readouterr().out
    # a wrong count is a usage error (exit 2) naming what is missing
    assert ctl.ctl_main("ds", ["checkpoint", "messages"]) == 2
    assert "the following arguments are required: DIR" in capsys.readouterr().err


def test_ds_options_before_or_after_the_action() -> None:
    parser = ctl._parser("ds")
    before = parser.parse_args(["--url", "http://a:1", "--json", "set-replicas", "messages",
                                "S1", "S2"])
    after = parser.parse_args(["set-replicas", "messages", "S1", "S2", "--url", "http://a:1",
                               "--json"])
    for parsed in (before, after):
        assert (parsed.url, parsed.json, parsed.action) == ("http://a:1", True, "set-replicas")
        assert ctl._positionals(parsed) == ["messages", "S1", "S2"]
    assert ctl._positionals(parser.parse_args(["info"])) == []
    verify = parser.parse_args(["verify", "--wait", "3", "messages"])
    assert (verify.wait, ctl._positionals(verify)) == (3.0, ["messages"])
    # an option not given keeps its default, before the action or not
    assert parser.parse_args(["checkpoint", "messages", "dir"]).url is None
