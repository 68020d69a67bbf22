"""Topic access rules (ACL), after EMQX's file-based authorization.

The ACL file is a YAML list of rules, checked in order; the first rule that matches the
client, the action and the topic decides. When none matches, `no_match` decides.

```yaml
- {permission: allow, action: publish, username: "%any", topics: ["sensors/%u/#"]}
- {permission: deny, action: subscribe, topics: ["$SYS/#", "eq #"]}
- {permission: allow, action: all, client_id: gateway-1, topics: ["cmd/%c/+"]}
```

Keys: `permission` (allow|deny), `action` (publish|subscribe|all) and `topics` (a
non-empty list) are required; `username` and `client_id` (a name, or `%any`) are
optional and default to `%any`.

Topics:

* A topic filter; `%u` and `%c` in it stand for the client's user name and client id.
  A client without a user name never matches a `%u` filter, and neither does a client
  whose user name or client id is empty or contains `/`, `+` or `#` (it would widen
  the filter, as in mosquitto).
* `eq <filter>`: the topic (publish) or the subscription filter (subscribe) must equal
  `<filter>` exactly, as text; no wildcard or placeholder is interpreted (EMQX's `eq`).
  `eq #` is how to refuse subscribing to everything while allowing narrower filters.

Publish: the rule matches when one of its filters matches the topic name.
Subscribe: the rule matches when one of its filters *covers* the subscription filter,
i.e. every topic the subscription can receive matches the rule's filter: rule
`sensors/#` covers `sensors/+/temp`, but rule `sensors/+/temp` does not cover
`sensors/#`. Wildcards follow the `$` rule (a filter starting with `+` or `#` matches
no topic starting with `$`), so a `#` rule does not cover `$SYS/...`. A shared
subscription `$share/<group>/<filter>` is checked as `<filter>`, so the prefix cannot
be used to get around a rule.

Delivery: subscribe rules also hold for every message delivered, so a wide filter
(`#`, `+/x`) cannot reach a topic a narrower deny names. A message on a topic may be
delivered through a subscription when the subscription's filter is (still) allowed
and the first subscribe rule whose filter matches the topic name allows it; `eq`
entries name subscription filters, not topics, and take no part. When no rule matches
the topic, the subscription's own grant stands.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from ..errors import ConfigError, InvalidTopicError, InvalidTopicFilterError
from ..topic import SHARE_PREFIX, levels_match, validate_filter, validate_topic
from ..yamlfile import load_yaml_file

Permission = Literal["allow", "deny"]
Action = Literal["publish", "subscribe"]
RuleAction = Literal["publish", "subscribe", "all"]

ANY = "%any"
USERNAME_PLACEHOLDER = "%u"
CLIENT_ID_PLACEHOLDER = "%c"
EQ_PREFIX = "eq "
_RULE_KEYS = ("permission", "action", "username", "client_id", "topics")
# Characters that must not reach a filter through a placeholder.
_UNSAFE_IN_PLACEHOLDER = ("/", "+", "#")


@dataclass(frozen=True)
class TopicPattern:
    """One entry of a rule's `topics`: a filter (maybe with `%u`/`%c`), or with
    `exact` set, the text an `eq` entry must equal."""

    text: str
    exact: bool = False

    @property
    def uses_username(self) -> bool:
        return not self.exact and USERNAME_PLACEHOLDER in self.text

    @property
    def uses_client_id(self) -> bool:
        return not self.exact and CLIENT_ID_PLACEHOLDER in self.text

    def levels_for(self, client_id: str, username: str | None) -> list[str] | None:
        """The filter's levels with the placeholders filled in; None when this client
        cannot fill them (no or unsafe user name / client id)."""
        text = self.text
        if self.uses_username:
            if username is None or not _fills_placeholder(username):
                return None
            text = text.replace(USERNAME_PLACEHOLDER, username)
        if self.uses_client_id:
            if not _fills_placeholder(client_id):
                return None
            text = text.replace(CLIENT_ID_PLACEHOLDER, client_id)
        return text.split("/")


def _fills_placeholder(value: str) -> bool:
    return value != "" and not any(ch in value for ch in _UNSAFE_IN_PLACEHOLDER)


@dataclass(frozen=True)
class AclRule:
    permission: Permission
    action: RuleAction
    topics: tuple[TopicPattern, ...]
    username: str | None = None  # None: any user (`%any`), anonymous clients included
    client_id: str | None = None  # None: any client

    def applies_to(self, action: Action, client_id: str, username: str | None) -> bool:
        return ((self.action == "all" or self.action == action)
                and (self.username is None or self.username == username)
                and (self.client_id is None or self.client_id == client_id))

    def matches_topic(self, action: Action, client_id: str, username: str | None,
                      topic: str, topic_levels: list[str]) -> bool:
        for pattern in self.topics:
            if pattern.exact:
                if topic == pattern.text:
                    return True
                continue
            levels = pattern.levels_for(client_id, username)
            if levels is None:
                continue
            if action == "publish":
                if levels_match(levels, topic_levels):
                    return True
            elif filter_covers(levels, topic_levels):
                return True
        return False

    def matches_delivered_topic(self, client_id: str, username: str | None,
                                topic_levels: list[str]) -> bool:
        for pattern in self.topics:
            if pattern.exact:
                continue  # `eq` names a subscription filter, never a topic
            levels = pattern.levels_for(client_id, username)
            if levels is not None and levels_match(levels, topic_levels):
                return True
        return False


def filter_covers(rule_levels: list[str], filter_levels: list[str]) -> bool:
    """Whether every topic matching the filter `filter_levels` also matches the filter
    `rule_levels` (both already split on `/` and valid)."""
    if (filter_levels[0].startswith("$") and rule_levels[0] in ("+", "#")):
        return False  # the `$` rule: the rule cannot match any of the filter's topics
    for position, want in enumerate(filter_levels):
        if position >= len(rule_levels):
            return False
        rule = rule_levels[position]
        if rule == "#":
            return True
        if want == "#":
            return False  # only a `#` in the rule covers a `#`
        if rule != "+" and rule != want:
            return False  # a `+` in the filter is covered only by `+` (or `#`)
    # The filter is used up; `a/#` also matches `a`, so a trailing `#` still covers.
    return len(rule_levels) == len(filter_levels) or (
        len(rule_levels) == len(filter_levels) + 1 and rule_levels[-1] == "#")


class Acl:
    """An ordered list of rules and the decision when none matches."""

    def __init__(self, rules: Sequence[AclRule], no_match: Permission = "allow") -> None:
        self.rules = tuple(rules)
        self.no_match: Permission = no_match

    def decide(self, action: Action, client_id: str, username: str | None,
               topic: str, levels: list[str] | None = None) -> Permission:
        """allow or deny `action` on `topic` (a topic name to publish to, or a filter to
        subscribe to). An invalid topic or filter is denied. A shared subscription
        `$share/<group>/<filter>` is checked as `<filter>`. `levels`: those of a topic
        the caller has validated already (it is not validated again)."""
        if action == "subscribe" and topic.startswith(SHARE_PREFIX):
            parts = topic.split("/", 2)
            if len(parts) != 3 or not parts[1] or not parts[2]:
                return "deny"
            topic = parts[2]
        if levels is None:
            try:
                levels = validate_topic(topic) if action == "publish" \
                    else validate_filter(topic)
            except (InvalidTopicError, InvalidTopicFilterError):
                return "deny"
        for rule in self.rules:
            if rule.applies_to(action, client_id, username) and rule.matches_topic(
                    action, client_id, username, topic, levels):
                return rule.permission
        return self.no_match

    def allows(self, action: Action, client_id: str, username: str | None,
               topic: str, levels: list[str] | None = None) -> bool:
        return self.decide(action, client_id, username, topic, levels) == "allow"

    def allows_delivery(self, client_id: str, username: str | None, topic: str) -> bool:
        """Whether a message on the topic name may be delivered to the client through
        a subscription it is allowed to hold (see the module's "Delivery")."""
        levels = topic.split("/")
        for rule in self.rules:
            if rule.applies_to("subscribe", client_id, username) and \
                    rule.matches_delivered_topic(client_id, username, levels):
                return rule.permission == "allow"
        return True


# --- loading ---------------------------------------------------------------------------

def _parse_topic(text: str) -> TopicPattern:
    """Raise InvalidTopicFilterError when the entry is not a filter or `eq <filter>`."""
    exact = text.startswith(EQ_PREFIX)
    body = text[len(EQ_PREFIX):].strip() if exact else text
    validate_filter(body)
    return TopicPattern(body, exact)


def _parse_rule(data: Any) -> AclRule | list[tuple[str, str]]:
    """One rule from its YAML mapping, or its problems as (key path, why); the key path
    is "" when the rule as a whole is wrong."""
    if not isinstance(data, dict):
        return [("", f"a rule must be a mapping of keys, got {type(data).__name__}")]
    problems: list[tuple[str, str]] = []
    for key in data:
        if key not in _RULE_KEYS:
            problems.append((str(key), f"unknown key (expected one of {', '.join(_RULE_KEYS)})"))
    for key in ("permission", "action", "topics"):
        if key not in data:
            problems.append((key, "missing"))
    choices: dict[str, tuple[str, ...]] = {
        "permission": get_args(Permission), "action": get_args(RuleAction)}
    for key, allowed in choices.items():
        if key in data and data[key] not in allowed:
            problems.append((key, f"must be one of {', '.join(allowed)} (got {data[key]!r})"))
    for key in ("username", "client_id"):
        if key in data and (not isinstance(data[key], str) or not data[key]):
            problems.append((key, f"must be a non-empty string or {ANY!r} (got {data[key]!r})"))
    topics: list[TopicPattern] = []
    raw_topics = data.get("topics")
    if "topics" in data and (not isinstance(raw_topics, list) or not raw_topics):
        problems.append(("topics", f"must be a non-empty list of topic filters "
                                   f"(got {raw_topics!r})"))
    elif isinstance(raw_topics, list):
        for index, entry in enumerate(raw_topics):
            if not isinstance(entry, str):
                problems.append((f"topics[{index}]", f"must be a string (got {entry!r})"))
                continue
            try:
                topics.append(_parse_topic(entry))
            except InvalidTopicFilterError as exc:
                problems.append((f"topics[{index}]", exc.message))
    if problems:
        return problems
    username, client_id = data.get("username", ANY), data.get("client_id", ANY)
    return AclRule(permission=data["permission"], action=data["action"], topics=tuple(topics),
                   username=None if username == ANY else username,
                   client_id=None if client_id == ANY else client_id)


def parse_rules(data: Any, source: str = "ACL") -> list[AclRule]:
    """Rules from a parsed YAML document (a list; None for an empty file). Raises one
    ConfigError listing every problem as `source: rule[i].key: why` (i from 0)."""
    if data is None:
        return []
    if not isinstance(data, list):
        raise ConfigError(
            f"{source}: the ACL must be a list of rules, got {type(data).__name__}")
    rules: list[AclRule] = []
    errors: list[str] = []
    for index, item in enumerate(data):
        parsed = _parse_rule(item)
        if isinstance(parsed, AclRule):
            rules.append(parsed)
        else:
            errors.extend(f"{source}: rule[{index}]{'.' if key else ''}{key}: {why}"
                          for key, why in parsed)
    if errors:
        raise ConfigError("invalid ACL:\n" + "\n".join(f"  {line}" for line in errors))
    return rules


def load_acl_file(path: str | os.PathLike[str], no_match: Permission = "allow") -> Acl:
    """Read and validate an ACL file. Raises ConfigError naming the rule index and key."""
    file = Path(path)
    return Acl(parse_rules(load_yaml_file(file, "ACL file"), str(file)), no_match)
