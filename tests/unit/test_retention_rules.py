"""Per-topic retention rules: the most specific matching filter wins."""

from __future__ import annotations

import pytest

from stratamq.broker.config import Config
from stratamq.broker.ds.generation import GenerationInfo, RetentionPlan, plan_retention
from stratamq.broker.ds.retention import RetentionRules, is_expired
from stratamq.broker.errors import InvalidTopicFilterError
from stratamq.broker.site import messages_db_options

DAY = 86_400.0
RULES = RetentionRules(DAY, {"sensors/#": 7 * DAY, "sensors/+": 2 * DAY,
                             "sensors/temp": 3 * DAY, "alerts/#": 90 * DAY,
                             "a/+/#": 4 * DAY, "a/#": 5 * DAY, "a/+": 6 * DAY})


@pytest.mark.parametrize(("topic", "rule"), [
    ("sensors/temp", "sensors/temp"),       # literal beats + and #
    ("sensors/speed", "sensors/+"),         # + beats #
    ("sensors/x/y", "sensors/#"),
    ("sensors", "sensors/#"),               # `#` matches the parent level too
    ("alerts/fire/1", "alerts/#"),
    ("a/b/c", "a/+/#"),                     # + beats # at the second level
    ("a/b", "a/+"),                         # equal matches: fewer levels
    ("other/topic", None),
    ("$SYS/sensors", None),                 # wildcards never take `$` topics
])
def test_most_specific_rule_wins(topic: str, rule: str | None) -> None:
    assert RULES.rule_of(topic) == rule
    assert RULES.retention_of(topic) == (DAY if rule is None else RULES.rules[rule])


def test_expiry_and_longest() -> None:
    now = 1_000 * 86_400 * 1_000_000
    week_us = int(7 * DAY * 1_000_000)
    assert is_expired(RULES, "sensors/x/y", now - week_us - 1, now)
    assert not is_expired(RULES, "sensors/x/y", now - week_us, now)
    assert is_expired(RULES, "other", now - week_us, now)
    assert RULES.longest == 90 * DAY
    assert RetentionRules.from_json(RULES.to_json()) == RULES


def test_bad_rules_are_refused() -> None:
    with pytest.raises(InvalidTopicFilterError):
        RetentionRules(DAY, {"a/#/b": DAY})
    with pytest.raises(ValueError, match="above 0"):
        RetentionRules(DAY, {"a/#": 0})


def test_generations_are_dropped_whole_only_after_the_longest_rule() -> None:
    closed = GenerationInfo(1, "wildcard_optimized_v2", since=0, until=100)
    current = GenerationInfo(2, "wildcard_optimized_v2", since=100)
    # retention 50: rolled over at 150, and without rules dropped at 150
    assert plan_retention([closed, current], 150, 50) == RetentionPlan(True, (1,))
    # with a rule keeping some topics 500, the generation stays until 600
    assert plan_retention([closed, current], 599, 50, 500) == RetentionPlan(True, ())
    assert plan_retention([closed, current], 600, 50, 500) == RetentionPlan(True, (1,))


def test_a_generation_period_apart_from_retention() -> None:
    """Generations roll over every `period` whatever the retention; closed ones still
    go by the retention."""
    closed = GenerationInfo(1, "wildcard_optimized_v2", since=0, until=100)
    current = GenerationInfo(2, "wildcard_optimized_v2", since=100)
    # retention 500, period 20: rolled over at 120, not at 600; dropped at 600
    assert plan_retention([closed, current], 119, 500, None, 20) == RetentionPlan(False, ())
    assert plan_retention([closed, current], 120, 500, None, 20) == RetentionPlan(True, ())
    assert plan_retention([closed, current], 600, 500, None, 20) == RetentionPlan(True, (1,))
    # a period longer than the retention: generations outlive it
    assert plan_retention([closed, current], 600, 50, None, 1000) == RetentionPlan(False, (1,))


def test_the_generation_period_goes_from_the_config_to_the_storage() -> None:
    config = Config.model_validate({"durable_storage": {"messages": {
        "generation_period": "1h"}}, "durable_sessions": {"message_retention_period": "7d"}})
    messages = config.durable_storage.messages
    options = messages_db_options(messages, config.durable_sessions.message_retention_period)
    assert (options.generation_period, options.message_retention_period) == (
        3600.0, 7 * 86_400.0)
    # unset: the retention period, as before
    assert messages_db_options(Config().durable_storage.messages, 60.0).generation_period \
        is None
    with pytest.raises(ValueError, match="generation_period"):
        Config.model_validate({"durable_storage": {"messages": {"generation_period": "0s"}}})
