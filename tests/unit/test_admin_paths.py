"""Where the admin API makes a checkpoint it is asked for: inside the site's
checkpoints folder or an `admin.checkpoint_dirs` folder, whatever `..` or symbolic
links the request holds; never in the live data folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamq.broker.admin.http_errors import BadRequestError, ForbiddenPathError
from stratamq.broker.admin.paths import checkpoint_folder


def test_a_relative_folder_goes_in_the_checkpoints_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert checkpoint_folder("a/b", data, []) == (data / "checkpoints" / "a" / "b").resolve()
    assert checkpoint_folder("a/../c", data, [tmp_path]) == (
        data / "checkpoints" / "c").resolve()


@pytest.mark.parametrize("given", ["..", "../..", "a/../../x", ".", "../messages"])
def test_a_relative_folder_never_leaves_it(tmp_path: Path, given: str) -> None:
    with pytest.raises(ForbiddenPathError, match="outside"):
        checkpoint_folder(given, tmp_path / "data", [tmp_path])  # even with tmp allowed


def test_a_symbolic_link_out_is_followed_and_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "checkpoints").mkdir(parents=True)
    (data / "checkpoints" / "out").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ForbiddenPathError):
        checkpoint_folder("out/copy", data, [])


def test_an_absolute_folder_only_in_an_allowed_one(tmp_path: Path) -> None:
    data, shared = tmp_path / "data", tmp_path / "shared"
    assert checkpoint_folder(str(shared / "x"), data, [shared]) == (shared / "x").resolve()
    assert checkpoint_folder(str(data / "checkpoints" / "x"), data, []) == (
        data / "checkpoints" / "x").resolve()
    for refused in ("/etc/x", str(shared), str(shared / ".." / "x"), str(tmp_path / "x")):
        with pytest.raises(ForbiddenPathError):
            checkpoint_folder(refused, data, [shared])
    # the live data folder, even inside an allowed folder
    for refused in (str(data / "messages" / "x"), str(data / "y")):
        with pytest.raises(ForbiddenPathError):
            checkpoint_folder(refused, data, [tmp_path])


@pytest.mark.parametrize("given", [None, "", 3, "a\x00b"])
def test_not_a_folder_name(tmp_path: Path, given: object) -> None:
    with pytest.raises(BadRequestError):
        checkpoint_folder(given, tmp_path, [])
