"""The chart's `helm test` (operator/helm_test.py): where its credentials come from.
Against a real storage: tests/kube/test_chart_uninstall.py."""

from __future__ import annotations

import pytest

from stratamq.operator.helm_test import (
    PASSWORD_ENV,
    USERNAME_ENV,
    Credentials,
    HelmTestError,
    credentials_from,
)


def test_credentials_come_from_both_variables_or_none() -> None:
    assert credentials_from({}) is None
    assert credentials_from({USERNAME_ENV: "helm-test", PASSWORD_ENV: ""}) == Credentials(
        "helm-test", "")
    # one without the other is a mistake of the Secret, not a reason to go anonymous
    for half in ({USERNAME_ENV: "helm-test"}, {PASSWORD_ENV: "s3cret"},
                 {USERNAME_ENV: "", PASSWORD_ENV: "s3cret"}):
        with pytest.raises(HelmTestError, match="go together"):
            credentials_from(half)
