"""docs/runbook.md against the alerts of charts/stratamq/rules/stratamq.rules.yaml: the
`runbook_url` the chart gives each alert (`<base>#<alert name in lower case>`,
templates/prometheusrule.yaml) must land on that alert's section, and the commands
the runbook tells an operator to type must exist."""

from __future__ import annotations

import re

import yaml

from harness.processes import REPO
from stratamq.broker.admin import ctl

RUNBOOK = REPO / "docs" / "runbook.md"
RULES = REPO / "charts" / "stratamq" / "rules" / "stratamq.rules.yaml"


def anchor(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading: lower case,
    punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_anchor_is_githubs() -> None:
    assert anchor("StratamqDiskFull") == "stratamqdiskfull"
    assert anchor("What to do: a site's disk") == "what-to-do-a-sites-disk"


def test_every_alert_has_its_section_at_its_runbook_anchor() -> None:
    alerts = [rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"]
              for rule in group["rules"]]
    headings = [line[3:] for line in RUNBOOK.read_text().splitlines()
                if line.startswith("## ")]
    assert len(alerts) == 18
    # one section per alert, in the rules file's order, and nothing else
    assert headings == alerts
    assert [anchor(heading) for heading in headings] == [alert.lower() for alert in alerts]


def test_the_ctl_commands_of_the_runbook_exist() -> None:
    """Each `ctl ds ACTION` and `ctl clients ...` the runbook names parses as
    `stratamq ctl` parses it (so no command is made up)."""
    text = RUNBOOK.read_text()
    named = re.findall(r"\bctl\s+(ds|clients|passwd)\b((?:\s+[a-z][a-z-]*|\s+[A-Z_]+)*)",
                       text)
    assert {command for command, _ in named} == {"ds", "clients"}
    for command, rest in named:
        words = rest.split()
        if command == "ds":
            assert words and words[0] in ctl.DS_ACTIONS, f"ctl ds {rest}"
        args = [word for word in words if word != "CLIENT_ID"] + (
            ["some-client"] if "CLIENT_ID" in words else [])
        ctl._parser(command).parse_args(args)  # exits (a test failure) when unknown
