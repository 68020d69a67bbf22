"""The admin API token generated on first start is a secret: it is kept in the 0600
file `data/admin-token` only. The broker log (collected by log shippers, readable by
whoever reads the pod's logs) says that a token was generated and where it is, never
the token itself.

Note: tests/integration/test_admin_api.py::test_token_is_generated_once_stored_0600_and_reused
asserts the opposite today (the token in a WARNING line); the fix changes that line."""

from __future__ import annotations

import stat
from pathlib import Path

from harness.processes import BrokerProcess


def test_generated_admin_token_is_not_written_to_the_log(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path, {"admin": {"token": None}}).start()
    try:
        token_file = tmp_path / "data" / "admin-token"
        token = token_file.read_text().strip()
        assert len(token) >= 32
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        log = broker.log()
        assert token not in log, "the admin API token is in the broker log"
        # the log still tells the operator where to find it
        assert str(token_file) in log or "data/admin-token" in log
        # a restart reuses the stored token and does not log it either
        assert broker.stop() == 0
        broker.start()
        assert token_file.read_text().strip() == token
        assert token not in broker.log()
    finally:
        broker.kill()
