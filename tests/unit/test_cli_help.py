"""`--help` works on every command and subcommand (a user's first try), and says the
command's own usage; arguments parse the same wherever the options come."""

from __future__ import annotations

import pytest

from stratamq.broker import cli
from stratamq.broker.admin import ctl


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    code = exit_.value.code
    return (code if isinstance(code, int) else 2), capsys.readouterr().out


@pytest.mark.parametrize("argv", [["-h"], ["broker", "-h"], ["ctl", "-h"], ["cluster", "-h"],
                                  ["spark", "-h"], ["spark", "--help"], ["spark", "gc", "-h"]])
def test_help_of_every_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_main(argv, capsys)
    assert code == 0, out
    assert out.startswith("usage: "), out


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
