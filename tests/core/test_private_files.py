"""The modes of what kvtriton puts on disk: the server's user only, or the group the operator names."""

from __future__ import annotations

import grp
import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtriton._private_files import PRIVATE, FileSharing, prepare_tier_root, tier_root_problem

LABEL = "secondary_tiers[0] (type 'fs')"


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that hides nothing: the modes below are kvtriton's, not the umask's."""
    previous = os.umask(0)
    yield
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def own_group() -> FileSharing:
    """This user's own primary group, which it may always hand its directories to."""
    return FileSharing.from_setting(grp.getgrgid(os.getegid()).gr_name, where="['kvtriton_shared_group']")


def test_a_missing_root_is_made_0700_with_its_missing_parents_whatever_the_umask(
    tmp_path: Path, open_umask: None, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "made" / "kv"
    caplog.set_level(logging.INFO, logger="kvtriton._private_files")
    prepare_tier_root(LABEL, {"type": "fs", "root_dir": str(root)}, PRIVATE)
    assert mode(root) == mode(root.parent) == 0o700
    assert f"{LABEL} root_dir {str(root)!r}: created {root.parent}, {root}, private to user" in caplog.text


def test_an_existing_root_others_may_enter_is_refused_naming_its_mode_and_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    for too_open, why in [(0o755, "every user on the host may enter it"), (0o750, "its group may enter it")]:
        root.mkdir(mode=too_open, exist_ok=True)
        root.chmod(too_open)
        with pytest.raises(
            ValueError, match=rf"key 'root_dir'='{root}' has mode {too_open:04o}: {why}.*kvtriton creates it 0700"
        ):
            prepare_tier_root(LABEL, {"type": "fs", "root_dir": str(root)}, PRIVATE)
        assert mode(root) == too_open  # refused, never changed
    root.chmod(0o700)
    prepare_tier_root(LABEL, {"type": "fs", "root_dir": str(root)}, PRIVATE)  # private: kept as it is


def test_an_existing_root_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, -1)
    else:
        theirs = Path("/")
    with pytest.raises(ValueError, match=r"belongs to .*, not to this server's user"):
        prepare_tier_root(LABEL, {"type": "fs", "root_dir": str(theirs)}, PRIVATE)


def test_a_shared_group_makes_the_root_2770_owned_by_the_group_and_accepts_its_group_bits(
    tmp_path: Path, open_umask: None
) -> None:
    sharing = own_group()
    root = tmp_path / "shared"
    prepare_tier_root(LABEL, {"type": "fs", "root_dir": str(root)}, sharing)
    assert mode(root) == 0o2770 and root.stat().st_gid == sharing.group_id
    prepare_tier_root(LABEL, {"type": "fs", "root_dir": str(root)}, sharing)  # exists, the group's: kept
    assert "shared with group" in sharing.describe() and "tier roots made 2770" in sharing.describe()


def test_tiers_that_write_no_files_of_kvtritons_making_are_left_alone(tmp_path: Path) -> None:
    for config in (
        {"type": "obj", "root_dir": str(tmp_path / "obj")},
        {"type": "fs", "module_path": "my.tiers", "root_dir": str(tmp_path / "mine")},
        {"type": "fs", "root_dir": 7},
    ):
        prepare_tier_root(LABEL, config, PRIVATE)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_shared_group_is_refused_naming_the_key_and_the_value() -> None:
    where = "kv_connector_extra_config['kvtriton_shared_group']"
    with pytest.raises(ValueError, match=r"\['kvtriton_shared_group'\]='no-such-group-kvtriton': no such group"):
        FileSharing.from_setting("no-such-group-kvtriton", where=where)
    for bad in ("", True, 1.5, ["kv"]):
        with pytest.raises(ValueError, match=r"must be a group name or a group id, got"):
            FileSharing.from_setting(bad, where=where)
    assert FileSharing.from_setting(None, where=where) == PRIVATE
    assert FileSharing.from_setting(os.getegid(), where=where).group_id == os.getegid()
    assert (
        "private to user" in PRIVATE.describe() and "tier roots made 0700, the host region 0600" in PRIVATE.describe()
    )


@pytest.mark.parametrize("root", ["<a directory on local NVMe>", "", "  ", "kv", "./kv", "/mnt/<nvme>/kv"])
def test_a_root_that_is_a_placeholder_empty_or_relative_is_refused_and_nothing_is_made(
    root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tier = {"type": "fs", "root_dir": root}
    problem = tier_root_problem(tier)
    assert problem is not None and problem.startswith(f"key 'root_dir'={root!r} is ")
    with pytest.raises(ValueError, match="^" + re.escape(problem) + "$"):
        prepare_tier_root(LABEL, tier, PRIVATE)
    assert list(tmp_path.iterdir()) == []
    assert tier_root_problem({"type": "fs", "root_dir": str(tmp_path / "kv")}) is None
    assert tier_root_problem({"type": "MyTier", "module_path": "my.tiers", "root_dir": "relative"}) is None
