"""Tests for broker/auth/acl.py: rule semantics, subscribe coverage, loading errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamq.broker.auth.acl import Acl, filter_covers, load_acl_file, parse_rules
from stratamq.broker.errors import ConfigError


def acl_from(tmp_path: Path, text: str, no_match: str = "deny") -> Acl:
    path = tmp_path / "acl.yaml"
    path.write_text(text, encoding="utf-8")
    assert no_match in ("allow", "deny")
    return load_acl_file(path, "allow" if no_match == "allow" else "deny")


def acl_error(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "acl.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_acl_file(path)
    return [line.strip().removeprefix(f"{path}: ") for line in info.value.message.splitlines()]


def pub(acl: Acl, topic: str, username: str | None = "alice", client_id: str = "c1") -> bool:
    return acl.allows("publish", client_id, username, topic)


def sub(acl: Acl, topic_filter: str, username: str | None = "alice",
        client_id: str = "c1") -> bool:
    return acl.allows("subscribe", client_id, username, topic_filter)


def delivered(acl: Acl, topic: str, username: str | None = "alice",
              client_id: str = "c1") -> bool:
    return acl.allows_delivery(client_id, username, topic)


# --- coverage --------------------------------------------------------------------------

@pytest.mark.parametrize(("rule", "subscription", "covered"), [
    ("sensors/#", "sensors/+/temp", True),
    ("sensors/#", "sensors/#", True),
    ("sensors/#", "sensors", True),  # `a/#` matches `a`
    ("sensors/#", "sensors/a/b/c", True),
    ("sensors/+/temp", "sensors/#", False),
    ("sensors/+/temp", "sensors/+/temp", True),
    ("sensors/+/temp", "sensors/x/temp", True),
    ("sensors/+/temp", "sensors/x/+", False),
    ("sensors/x/temp", "sensors/+/temp", False),
    ("sensors/+", "sensors/+/temp", False),
    ("sensors/+/temp", "sensors/+", False),
    ("sensors/+/#", "sensors/x", True),
    ("sensors/+/#", "sensors", False),
    ("#", "#", True),
    ("#", "a/+/b", True),
    ("+", "#", False),
    ("+/#", "#", False),
    ("#", "$SYS/broker", False),  # the `$` rule
    ("+/broker", "$SYS/broker", False),
    ("$SYS/#", "$SYS/broker/+", True),
    ("#", "+/x", True),
])
def test_filter_covers(rule: str, subscription: str, covered: bool) -> None:
    assert filter_covers(rule.split("/"), subscription.split("/")) is covered


# --- semantics -------------------------------------------------------------------------

def test_publish_matches_topic_names(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, '- {permission: allow, action: publish, topics: ["a/+/c", "d/#"]}')
    assert pub(acl, "a/b/c") and pub(acl, "d") and pub(acl, "d/e/f")
    assert not pub(acl, "a/b") and not pub(acl, "x")
    assert not sub(acl, "a/b/c")  # the rule is for publish only


def test_subscribe_needs_coverage(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, '- {permission: allow, action: subscribe, topics: ["sensors/#"]}\n'
                             '- {permission: allow, action: subscribe, topics: ["x/+/t"]}\n')
    assert sub(acl, "sensors/+/temp") and sub(acl, "sensors/#") and sub(acl, "x/y/t")
    assert not sub(acl, "#") and not sub(acl, "x/#") and not sub(acl, "+/+/t")
    assert not pub(acl, "sensors/a")


def test_first_match_wins(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, (
        '- {permission: deny, action: all, topics: ["secret/#"]}\n'
        '- {permission: allow, action: all, topics: ["#"]}\n'
        '- {permission: deny, action: all, topics: ["public/#"]}\n'), no_match="deny")
    assert not pub(acl, "secret/x") and not sub(acl, "secret/+")
    assert pub(acl, "public/x") and sub(acl, "public/#")
    # `#` covers `+/x`, yet `+/x` can also receive secret/x: the deny rule does not
    # cover `+/x`, so the allow rule decides the SUBSCRIBE; the deny rule then keeps
    # secret/x from being delivered through it.
    assert sub(acl, "+/x")
    assert not delivered(acl, "secret/x") and delivered(acl, "other/x")


def test_delivery_is_judged_by_the_topic(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, (
        '- {permission: deny, action: subscribe, username: bob, topics: ["secret/#"]}\n'
        '- {permission: deny, action: publish, topics: ["pub-only/#"]}\n'
        '- {permission: deny, action: subscribe, topics: ["eq exact/x", "%u/private"]}\n'
        '- {permission: allow, action: subscribe, topics: ["eq #"]}\n'), no_match="deny")
    assert not delivered(acl, "secret/x", "bob") and delivered(acl, "secret/x", "alice")
    assert delivered(acl, "pub-only/x", "bob")  # publish rules do not judge delivery
    assert not delivered(acl, "alice/private", "alice")
    assert delivered(acl, "alice/private", "bob")
    # `eq` names a subscription filter, not a topic: it takes no part, and when no
    # rule matches the topic the subscription's own grant stands (here `eq #`)
    assert delivered(acl, "exact/x") and delivered(acl, "anything/else")
    assert sub(acl, "#") and not sub(acl, "anything/else")
    # the `$` rule: a `#` rule does not match `$SYS/...` topics
    acl = acl_from(tmp_path, '- {permission: deny, action: subscribe, topics: ["#"]}')
    assert not delivered(acl, "a/b") and delivered(acl, "$SYS/x")


def test_no_match(tmp_path: Path) -> None:
    text = '- {permission: deny, action: publish, topics: ["a"]}'
    assert pub(acl_from(tmp_path, text, "allow"), "b")
    assert not pub(acl_from(tmp_path, text, "deny"), "b")
    assert sub(acl_from(tmp_path, "", "allow"), "#")
    assert not sub(acl_from(tmp_path, "# nothing\n", "deny"), "#")
    assert not Acl([], "deny").allows("publish", "c", None, "x")


def test_username_and_client_id_selectors(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, (
        '- {permission: allow, action: publish, username: alice, topics: ["a"]}\n'
        '- {permission: allow, action: publish, client_id: dev-1, topics: ["b"]}\n'
        '- {permission: allow, action: publish, username: bob, client_id: dev-2, topics: [c]}\n'
        '- {permission: allow, action: publish, username: "%any", client_id: "%any", '
        'topics: ["d"]}\n'))
    assert pub(acl, "a", "alice") and not pub(acl, "a", "bob") and not pub(acl, "a", None)
    assert pub(acl, "b", None, "dev-1") and not pub(acl, "b", "alice", "dev-2")
    assert pub(acl, "c", "bob", "dev-2")
    assert not pub(acl, "c", "bob", "dev-1") and not pub(acl, "c", "alice", "dev-2")
    assert pub(acl, "d", None, "anything") and pub(acl, "d", "x", "y")


def test_placeholders(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, (
        '- {permission: allow, action: all, topics: ["sensors/%u/#", "cmd/%c/+", '
        '"both/%u-%c"]}\n'))
    assert pub(acl, "sensors/alice/t", "alice") and sub(acl, "sensors/alice/#", "alice")
    assert not pub(acl, "sensors/bob/t", "alice") and not sub(acl, "sensors/#", "alice")
    assert not sub(acl, "sensors/+/t", "alice")
    assert pub(acl, "cmd/c1/reboot", None, "c1") and not pub(acl, "cmd/c2/reboot", None, "c1")
    assert pub(acl, "both/alice-c1", "alice", "c1")
    # No user name: a %u filter never matches (the %c one still can).
    assert not pub(acl, "sensors/%u/t", None) and not pub(acl, "sensors//t", None)
    # Values that would widen the filter, or leave an empty level, never fill a placeholder.
    for bad in ["+", "#", "a/b", ""]:
        assert not pub(acl, "sensors/x/t", bad)
        assert not sub(acl, "sensors/+/t", bad)
        assert not sub(acl, "sensors/#", bad)
        assert not pub(acl, "cmd/x/y", "alice", bad)
    assert not pub(acl, "sensors/a/b/t", "a/b")


def test_eq(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, (
        '- {permission: deny, action: subscribe, topics: ["eq #", "eq sensors/+/temp"]}\n'
        '- {permission: allow, action: all, topics: ["#", "eq lit/%u"]}\n'))
    assert not sub(acl, "#")
    assert not sub(acl, "sensors/+/temp")
    assert sub(acl, "sensors/#") and sub(acl, "sensors/x/temp") and sub(acl, "a/#")
    assert pub(acl, "anything")
    # eq is literal: no placeholder is filled in.
    acl = acl_from(tmp_path, '- {permission: allow, action: all, topics: ["eq lit/%u"]}')
    assert sub(acl, "lit/%u", "alice") and not sub(acl, "lit/alice", "alice")
    assert pub(acl, "lit/%u", "alice") and not pub(acl, "lit/alice", "alice")


def test_dollar_topics_need_explicit_rules(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, (
        '- {permission: allow, action: subscribe, topics: ["$SYS/broker/#"]}\n'
        '- {permission: allow, action: all, topics: ["#"]}\n'))
    assert not pub(acl, "$SYS/x") and not sub(acl, "$SYS/#")
    assert sub(acl, "$SYS/broker/+")


def test_shared_subscriptions_are_checked_by_their_filter(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, (
        '- {permission: deny, action: subscribe, topics: ["secret/#"]}\n'
        '- {permission: allow, action: subscribe, topics: ["#"]}\n'))
    assert not sub(acl, "$share/g/secret/x")
    assert sub(acl, "$share/g/public/#")
    assert not sub(acl, "$share/g") and not sub(acl, "$share//x")


def test_invalid_topics_are_denied(tmp_path: Path) -> None:
    acl = acl_from(tmp_path, '- {permission: allow, action: all, topics: ["#"]}', "allow")
    assert not pub(acl, "a/+") and not pub(acl, "") and not pub(acl, "a/#")
    assert not sub(acl, "a/#/b") and not sub(acl, "a+") and not sub(acl, "")


# --- validation ------------------------------------------------------------------------

def test_validation_names_rule_index_and_key(tmp_path: Path) -> None:
    lines = acl_error(tmp_path, (
        '- {permission: allow, action: publish, topics: ["ok"]}\n'
        '- {permission: maybe, action: publish, topics: ["a"]}\n'
        '- {permission: allow, action: read, topics: ["a"]}\n'
        '- {permission: allow, action: all, topic: ["a"]}\n'
        '- {permission: allow, action: all, topics: ["a/#/b", "x+", 5, "eq "]}\n'
        '- {permission: allow, action: all, topics: []}\n'
        '- {permission: allow, action: all, topics: "a/b"}\n'
        '- {permission: deny, action: all, username: 42, client_id: "", topics: ["a"]}\n'
        '- just a string\n'
        '- {}\n'))
    assert lines == [
        "invalid ACL:",
        "rule[1].permission: must be one of allow, deny (got 'maybe')",
        "rule[2].action: must be one of publish, subscribe, all (got 'read')",
        "rule[3].topic: unknown key (expected one of permission, action, username, "
        "client_id, topics)",
        "rule[3].topics: missing",
        "rule[4].topics[0]: '#' must be the last level of a topic filter: 'a/#/b'",
        "rule[4].topics[1]: a wildcard must occupy a whole level: 'x+'",
        "rule[4].topics[2]: must be a string (got 5)",
        "rule[4].topics[3]: topic filter must not be empty",
        "rule[5].topics: must be a non-empty list of topic filters (got [])",
        "rule[6].topics: must be a non-empty list of topic filters (got 'a/b')",
        "rule[7].username: must be a non-empty string or '%any' (got 42)",
        "rule[7].client_id: must be a non-empty string or '%any' (got '')",
        "rule[8]: a rule must be a mapping of keys, got str",
        "rule[9].permission: missing",
        "rule[9].action: missing",
        "rule[9].topics: missing",
    ]


def test_file_level_errors(tmp_path: Path) -> None:
    assert acl_error(tmp_path, "permission: allow\n") == [
        "the ACL must be a list of rules, got dict"]
    assert acl_error(tmp_path, "- [\n")[0].startswith("invalid YAML")
    duplicate = acl_error(tmp_path, "- permission: allow\n  permission: deny\n")
    assert duplicate[0].startswith("invalid YAML: duplicate key 'permission'")
    with pytest.raises(ConfigError, match="ACL file not found"):
        load_acl_file(tmp_path / "missing.yaml")


def test_parse_rules_from_data() -> None:
    rules = parse_rules([{"permission": "deny", "action": "all", "username": "%any",
                          "topics": ["eq #"]}])
    assert len(rules) == 1
    assert rules[0].username is None and rules[0].topics[0].exact
    assert parse_rules(None) == []
