"""The master key: its one format, every refusal of its file or variable (each naming the fix), and its key id."""

from __future__ import annotations

import os
import pickle
import secrets
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtriton.encryption import KEY_FORMAT, MasterKey, MasterKeyError, check_key_id
from kvtriton.encryption._master_key import key_id_of

KEY = bytes(range(32))
KEY_HEX = KEY.hex()


def key_file(folder: Path, content: str | bytes = KEY_HEX + "\n", mode: int = 0o600) -> Path:
    path = folder / "master.key"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)
    return path


def test_a_key_file_of_the_server_s_user_with_mode_600_loads(tmp_path: Path) -> None:
    path = key_file(tmp_path)
    master = MasterKey.from_file(str(path))
    assert master.secret == KEY
    assert master.key_id == key_id_of(KEY)
    assert master.source == f"file {str(path)!r}"
    assert MasterKey.from_file(str(key_file(tmp_path, f"  {KEY_HEX.upper()}  ", mode=0o400))).secret == KEY


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o610, 0o601])
def test_a_key_file_its_group_or_others_may_touch_is_refused_naming_file_mode_and_chmod(
    tmp_path: Path, mode: int
) -> None:
    path = key_file(tmp_path, mode=mode)
    with pytest.raises(MasterKeyError) as refused:
        MasterKey.from_file(str(path))
    message = str(refused.value)
    assert f"master key file {str(path)!r} has mode {mode:04o}" in message
    assert message.endswith(f"chmod 600 {path}")
    assert KEY_HEX not in message


def test_a_key_file_of_another_user_is_refused_naming_both_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = key_file(tmp_path)
    owner = os.stat(path).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # the server runs as someone else than the file's owner
    with pytest.raises(MasterKeyError, match=rf"master key file '{path}' belongs to \S+, not to this server's user"):
        MasterKey.from_file(str(path))


def test_a_missing_key_file_is_refused_with_the_command_that_makes_one(tmp_path: Path) -> None:
    path = tmp_path / "absent.key"
    with pytest.raises(MasterKeyError) as refused:
        MasterKey.from_file(str(path))
    assert str(refused.value) == (
        f"master key file {str(path)!r} does not exist; make a key with: "
        f"(umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' > {path})"
    )


def test_a_directory_is_no_key_file(tmp_path: Path) -> None:
    folder = tmp_path / "dir"
    folder.mkdir(mode=0o700)
    with pytest.raises(MasterKeyError, match="is not a regular file"):
        MasterKey.from_file(str(folder))


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (KEY_HEX[:-2], "got 62 characters;"),
        (KEY_HEX + "00", "got 66 characters;"),
        ("z" * 64, "got 64 characters, not all of them hex digits;"),
        ("", "got 0 characters;"),
        (bytes(range(200, 232)), "holds binary bytes (raw random bytes are not accepted)"),
        ("0" * 5000, "but it is larger"),
    ],
    ids=["short", "long", "not-hex", "empty", "raw-bytes", "huge"],
)
def test_a_key_file_not_in_the_format_is_refused_naming_the_format(
    tmp_path: Path, content: str | bytes, said: str
) -> None:
    path = key_file(tmp_path, content)
    with pytest.raises(MasterKeyError) as refused:
        MasterKey.from_file(str(path))
    message = str(refused.value)
    assert message.startswith(f"master key file {str(path)!r} must hold {KEY_FORMAT}")
    assert said in message and "secrets.token_hex(32)" in message
    assert KEY_HEX[:-2] not in message  # the file's content is never echoed


def test_the_key_from_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRITON_TEST_MASTER_KEY", KEY_HEX + "\n")
    master = MasterKey.from_environment("KVTRITON_TEST_MASTER_KEY")
    assert master.secret == KEY and master.source == "environment variable KVTRITON_TEST_MASTER_KEY"


def test_a_missing_or_malformed_environment_variable_is_refused_naming_it_and_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVTRITON_TEST_MASTER_KEY", raising=False)
    with pytest.raises(MasterKeyError) as refused:
        MasterKey.from_environment("KVTRITON_TEST_MASTER_KEY", where="kvtriton_encryption['key_env']")
    assert str(refused.value).startswith(
        "environment variable KVTRITON_TEST_MASTER_KEY (named by kvtriton_encryption['key_env']) is not set in this "
        f"server's environment; set it to the master key, {KEY_FORMAT}"
    )
    monkeypatch.setenv("KVTRITON_TEST_MASTER_KEY", "secret-passphrase")
    with pytest.raises(MasterKeyError) as refused:
        MasterKey.from_environment("KVTRITON_TEST_MASTER_KEY")
    message = str(refused.value)
    assert message.startswith(
        f"environment variable KVTRITON_TEST_MASTER_KEY (named by the encryption setting) must hold {KEY_FORMAT}, "
        "got 17 characters;"
    )
    assert "secret-passphrase" not in message


def test_the_key_id_is_stable_short_and_reveals_nothing_of_the_key() -> None:
    master = MasterKey(KEY, source="test")
    assert master.key_id == MasterKey(KEY, source="elsewhere").key_id == key_id_of(KEY)
    assert master.key_id == "29a20dd5f4049d9c"  # fixed by the derivation: a change would orphan every sealed object
    independent = HKDF(hashes.SHA256(), 8, b"kvtriton encryption: key id", b"kvtriton master key id v1")
    assert master.key_id == independent.derive(KEY).hex()  # the same HKDF as another implementation computes it
    assert len(master.key_id) == 16 and master.key_id not in KEY_HEX
    assert MasterKey(secrets.token_bytes(32), source="test").key_id != master.key_id
    assert check_key_id(master.key_id, where="x") == master.key_id


@pytest.mark.parametrize("bad", ["FD4E5BD0FC5BEE6B", "fd4e5bd0", 12, None, "fd4e5bd0fc5bee6bzz"])
def test_a_malformed_key_id_is_refused_naming_where_it_was(bad: object) -> None:
    with pytest.raises(ValueError, match=r"retired_key_ids\[0\] must be a key id: 16 lowercase hex digits"):
        check_key_id(bad, where="retired_key_ids[0]")


def test_the_key_never_shows_in_repr_str_or_a_pickle() -> None:
    master = MasterKey(KEY, source="file '/etc/kvtriton/master.key'")
    for shown in (repr(master), str(master), f"{master}"):
        assert shown == f"MasterKey(key_id={master.key_id!r}, source=\"file '/etc/kvtriton/master.key'\")"
        assert KEY_HEX not in shown and repr(KEY) not in shown
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(master)


def test_a_key_of_the_wrong_length_is_refused_without_showing_it() -> None:
    with pytest.raises(MasterKeyError, match=r"a master key must be 32 bytes, got 16 \(test\)") as refused:
        MasterKey(KEY[:16], source="test")
    assert KEY[:16].hex() not in str(refused.value)
