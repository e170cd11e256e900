"""The master key every tenant's key is derived from: loaded from a file only the server's user may read, or from an
environment variable, and named everywhere by its key id, never by its bytes.

The format, one for the file and the variable alike: 64 hexadecimal digits
(32 random bytes, 256 bits), surrounding whitespace (a trailing newline)
ignored. Text rather than raw bytes so that the same key fits an environment
variable (which cannot hold a NUL byte) and a secret manager's text field, and
can be compared by eye. :data:`MAKE_KEY_COMMAND` makes one.

The file is refused, with one :class:`MasterKeyError` naming it and the fix,
when any group or other permission bit is set (whoever may read it may read
every tenant's offloaded KV), when it belongs to another user, when it is not
a regular file, or when it does not hold the format above. The checks are made
on the opened file (``fstat``), so the file checked is the file read.

The key id (:attr:`MasterKey.key_id`, 16 hex digits) is an HKDF output of the
key under a label of its own: it names the key in the start-up line and in
every sealed object, so that after a rotation an object sealed under the old
key is recognised as such (:attr:`~kvtriton.encryption.OpenFailure.RETIRED_KEY`)
rather than as damage. It reveals nothing of the key (HKDF is one-way) and no
tenant key can be computed from it.
"""

from __future__ import annotations

import os
import pwd
import re
import stat

from kvtriton.encryption._hkdf import hkdf

MASTER_KEY_BYTES = 32
"""256 bits: AES-256's key length, and HKDF-SHA256's block."""

KEY_ID_BYTES = 8
"""64 bits of key id: enough that two master keys of one deployment never share an id by chance."""

KEY_FORMAT = f"{2 * MASTER_KEY_BYTES} hexadecimal digits ({MASTER_KEY_BYTES} random bytes)"
"""The master key's format, as every refusal names it."""

MAKE_KEY_COMMAND = "(umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' > FILE)"
"""A command that makes a key file of the right format and mode (``FILE``: where the key goes)."""

_KEY_ID_SALT = b"kvtriton encryption: key id"
_KEY_ID_INFO = b"kvtriton master key id v1"
_HEX_KEY = re.compile(rf"[0-9a-fA-F]{{{2 * MASTER_KEY_BYTES}}}")
_KEY_ID = re.compile(rf"[0-9a-f]{{{2 * KEY_ID_BYTES}}}")
_MOST_FILE_BYTES = 4096
"""Read no more than this: a key file is 64 digits and a newline; a larger file is not a key file."""


class MasterKeyError(ValueError):
    """A master key that cannot be used: its file is missing, readable by others, another user's, or not a key."""


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def key_id_of(secret: bytes) -> str:
    """The key id of master key bytes ``secret``: 16 hex digits of HKDF-SHA256 output under a label of its own."""
    return hkdf(secret, salt=_KEY_ID_SALT, info=_KEY_ID_INFO, length=KEY_ID_BYTES).hex()


def check_key_id(value: object, *, where: str) -> str:
    """``value`` as a key id (16 lowercase hex digits: :attr:`MasterKey.key_id`); ``ValueError`` naming ``where``."""
    if not isinstance(value, str) or not _KEY_ID.fullmatch(value):
        raise ValueError(
            f"{where} must be a key id: {2 * KEY_ID_BYTES} lowercase hex digits, the key_id of the master key "
            f"rotated out, got {value!r}"
        )
    return value


def _parse(text: str, *, where: str, fix: str) -> bytes:
    """The key bytes of ``text`` in :data:`KEY_FORMAT`; :class:`MasterKeyError` naming ``where`` (never the text)."""
    digits = text.strip()
    if not _HEX_KEY.fullmatch(digits):
        shape = "characters" if len(digits) != 2 * MASTER_KEY_BYTES else "characters, not all of them hex digits"
        raise MasterKeyError(f"{where} must hold {KEY_FORMAT}, got {len(digits)} {shape}; {fix}")
    return bytes.fromhex(digits)


class MasterKey:
    """The master key's bytes and its :attr:`key_id`; ``repr`` and ``str`` show the id and where it came from, never the
    bytes."""

    __slots__ = ("_secret", "key_id", "source")

    def __init__(self, secret: bytes, *, source: str) -> None:
        if len(secret) != MASTER_KEY_BYTES:
            raise MasterKeyError(f"a master key must be {MASTER_KEY_BYTES} bytes, got {len(secret)} ({source})")
        self._secret = bytes(secret)
        self.key_id: str = key_id_of(self._secret)
        """16 hex digits that name the key in logs and in every sealed object."""
        self.source: str = source
        """Where the key came from: ``file '/etc/...'`` or ``environment variable NAME``."""

    @property
    def secret(self) -> bytes:
        """The key's bytes: only for the key derivation (:mod:`kvtriton.encryption._tenant_keys`)."""
        return self._secret

    def __repr__(self) -> str:
        return f"MasterKey(key_id={self.key_id!r}, source={self.source!r})"

    __str__ = __repr__

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("a MasterKey is never pickled: each process loads the key from its file or variable itself")

    @classmethod
    def from_file(cls, path: str) -> MasterKey:
        """The key in file ``path`` (:data:`KEY_FORMAT`), refused with :class:`MasterKeyError` unless the file is the
        server's user's alone."""
        make = MAKE_KEY_COMMAND.replace("FILE", path)
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise MasterKeyError(f"master key file {path!r} does not exist; make a key with: {make}") from None
        except PermissionError:
            raise MasterKeyError(
                f"master key file {path!r} cannot be read by this server's user ({_user_name(os.geteuid())}): "
                f"it must be that user's file, mode 600: chown it to that user and chmod 600 {path}"
            ) from None
        except OSError as error:
            raise MasterKeyError(f"master key file {path!r} cannot be opened: {error.strerror}") from None
        try:
            found = os.fstat(descriptor)
            if not stat.S_ISREG(found.st_mode):
                raise MasterKeyError(f"master key file {path!r} is not a regular file; make a key with: {make}")
            if found.st_uid != os.geteuid():
                raise MasterKeyError(
                    f"master key file {path!r} belongs to {_user_name(found.st_uid)}, not to this server's user "
                    f"{_user_name(os.geteuid())}: the key must be that user's alone; copy it to a file the server's "
                    f"user owns and chmod 600 it"
                )
            mode = stat.S_IMODE(found.st_mode)
            if mode & 0o077:
                raise MasterKeyError(
                    f"master key file {path!r} has mode {mode:04o}: its group or other users may read or change it, "
                    f"and whoever reads it reads every tenant's offloaded KV; make it the server's user's alone: "
                    f"chmod 600 {path}"
                )
            content = os.read(descriptor, _MOST_FILE_BYTES + 1)
        finally:
            os.close(descriptor)
        if len(content) > _MOST_FILE_BYTES:
            raise MasterKeyError(f"master key file {path!r} must hold {KEY_FORMAT}, but it is larger; {make}")
        try:
            text = content.decode("ascii")
        except UnicodeDecodeError:
            raise MasterKeyError(
                f"master key file {path!r} must hold {KEY_FORMAT} as text, but it holds binary bytes "
                f"(raw random bytes are not accepted); make a key with: {make}"
            ) from None
        return cls(
            _parse(text, where=f"master key file {path!r}", fix=f"make a key with: {make}"), source=f"file {path!r}"
        )

    @classmethod
    def from_environment(cls, name: str, *, where: str = "the encryption setting") -> MasterKey:
        """The key in environment variable ``name`` (:data:`KEY_FORMAT`), which ``where`` names; :class:`MasterKeyError`
        when it is unset or not a key."""
        value = os.environ.get(name)
        make = "python3 -c 'import secrets; print(secrets.token_hex(32))'"
        if value is None:
            raise MasterKeyError(
                f"environment variable {name} (named by {where}) is not set in this server's environment; set it to "
                f"the master key, {KEY_FORMAT} (make one with: {make})"
            )
        secret = _parse(value, where=f"environment variable {name} (named by {where})", fix=f"make a key with: {make}")
        return cls(secret, source=f"environment variable {name}")
