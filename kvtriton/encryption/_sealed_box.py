"""The sealed box: one object's bytes encrypted and authenticated with AES-256-GCM under its tenant's key.

A box is a fixed header, the ciphertext, and the 16-byte GCM tag::

    offset bytes  field
    0      4      magic b"KVTe"
    4      1      format version (FORMAT_VERSION)
    5      1      algorithm (1: AES-256-GCM)
    6      2      reserved, zero
    8      8      key id of the master key the tenant key came from
    16     12     nonce
    28     n      ciphertext (as long as the plaintext)
    28+n   16     tag

The header is authenticated too (it is prefixed to the associated data), so a
changed byte anywhere in a box fails its tag. The ciphertext and tag are
contiguous, so a box opens straight into the caller's memory
(:meth:`SealedBox.open_into`: a host slab row) without a copy.

**Nonces.** 96 random bits from ``os.urandom`` per box. A counter would need
one sequence per key across every process and host that seals for a tenant
(any server of the fleet may), which nothing coordinates; random nonces need
nothing. Their limit is the birthday bound: NIST SP 800-38D keeps random-nonce
GCM to 2^32 boxes per key (a nonce collision then has a chance below 2^-32).
A tenant key is per (master key, tenant, model), and a box is a chunk of
64 KiB to 16 MiB, so that is 2^32 chunks (256 TiB of KV at 64 KiB a chunk) per
tenant and model before the master key must be rotated: far beyond what a
fleet offloads between rotations.

**Failures are values.** :meth:`SealedBox.open` returns an :class:`OpenFailure`
(the metric's reason label), never raises, for anything a tier can hand back:
a box cut short, another format, a box sealed under a retired or another master
key, a failed tag. It raises only for a caller's mistake (a wrong ``out``
buffer), as any function does.

**Why AES-256-GCM from ``cryptography``.** Measured by ``python -m bench.aead``
(docs/security.md, "Encryption per tenant: the primitives"): OpenSSL's
AES-GCM runs several GB/s per core on AES-NI/VAES, its calls release the GIL
from ``cryptography`` 50 on (so sealing on the seal thread never stalls the
scheduler), and the package is the Python Cryptographic Authority's. It is
imported when the first box is built, so ``import kvtriton`` and a server that
does not encrypt never need it.
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Collection
from typing import TYPE_CHECKING

from kvtriton.encryption._master_key import KEY_ID_BYTES, check_key_id
from kvtriton.encryption._tenant_keys import TenantKey

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

FORMAT_VERSION = 1
"""The version of the box's layout; a box of another version opens as :attr:`OpenFailure.UNKNOWN_FORMAT`."""

ALGORITHM_AES_256_GCM = 1
NONCE_BYTES = 12
TAG_BYTES = 16
_MAGIC = b"KVTe"
_HEADER = struct.Struct("<4sBBH8s12s")
HEADER_BYTES = _HEADER.size
"""28: magic, version, algorithm, reserved, key id, nonce."""
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
"""What a box adds to its plaintext: 44 bytes."""

assert HEADER_BYTES == 28 and KEY_ID_BYTES == 8

CRYPTOGRAPHY_REQUIREMENT = "cryptography>=50"
"""The oldest release whose AEAD calls release the GIL (measured in bench/aead.py; its changelog: pull request 15361)."""

MISSING_CRYPTOGRAPHY = (
    "kvtriton encrypts offloaded KV with AES-256-GCM from the 'cryptography' package, which this environment lacks; "
    f"install it: pip install '{CRYPTOGRAPHY_REQUIREMENT}' (or, from kvtriton's clone, pip install './kvtriton[encryption]')"
)
"""What building a :class:`SealedBox` says when ``cryptography`` is not installed."""

Buffer = bytes | bytearray | memoryview
"""What a box reads and writes: any contiguous buffer (a NumPy array or a CPU tensor through ``memoryview``)."""


class OpenFailure(str, enum.Enum):
    """Why a box did not open; each one is a miss, and the value is the metric's ``reason`` label."""

    TAG_MISMATCH = "tag_mismatch"
    """The tag fails: a byte changed, or the box is read as another object, model, layout, tier or tenant."""
    RETIRED_KEY = "retired_key"
    """Sealed under a master key the operator retired (listed in ``retired_key_ids``): expected after a rotation."""
    OTHER_KEY = "other_key"
    """Sealed under a master key that is neither the current one nor a retired one: another deployment's, or a
    server started with the wrong key."""
    TRUNCATED = "truncated"
    """Shorter than a header and a tag, or than the plaintext length the caller expects: cut short."""
    WRONG_LENGTH = "wrong_length"
    """Longer than the plaintext length the caller expects: another chunk geometry."""
    UNKNOWN_FORMAT = "unknown_format"
    """No box of this format: another magic, format version or algorithm (not sealed by this kvtriton, or not
    encrypted at all)."""


def sealed_length(plaintext_length: int) -> int:
    """Bytes of the box of a ``plaintext_length``-byte plaintext."""
    if plaintext_length < 0:
        raise ValueError(f"plaintext_length must be >= 0, got {plaintext_length}")
    return plaintext_length + OVERHEAD_BYTES


def _aesgcm_class() -> type[AESGCM]:
    """``cryptography``'s AESGCM, imported now; ``ModuleNotFoundError`` (:data:`MISSING_CRYPTOGRAPHY`) or
    ``ImportError`` (a release that holds the GIL) otherwise."""
    try:
        import cryptography
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as error:
        raise ModuleNotFoundError(MISSING_CRYPTOGRAPHY, name="cryptography") from error
    major = cryptography.__version__.split(".", 1)[0]
    if not major.isdigit() or int(major) < 50:
        raise ImportError(
            f"cryptography {cryptography.__version__} is installed, but kvtriton needs {CRYPTOGRAPHY_REQUIREMENT}: "
            f"older releases hold Python's GIL for the whole of each AES-GCM call, which would stall the scheduler "
            f"while a chunk is sealed; install it: pip install '{CRYPTOGRAPHY_REQUIREMENT}'",
            name="cryptography",
        )
    return AESGCM


def require_cryptography() -> None:
    """Raise what building a :class:`SealedBox` would raise without a usable ``cryptography``: for a start-up check
    that refuses before the first seal, mid-serve."""
    _aesgcm_class()


def _byte_view(buffer: Buffer, argument: str) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError(f"{argument} must be a contiguous buffer, got a {view.format!r} view of shape {view.shape}")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class SealedBox:
    """Seals and opens boxes with one tenant's key (:class:`~kvtriton.encryption.TenantKey`); thread-safe.

    ``retired_key_ids``: key ids of master keys rotated out; a box sealed under
    one of them opens as :attr:`OpenFailure.RETIRED_KEY`, one under any other
    key as :attr:`OpenFailure.OTHER_KEY`. Building a box imports
    ``cryptography`` (:data:`MISSING_CRYPTOGRAPHY` without it).
    """

    __slots__ = ("_cipher", "_invalid_tag", "_key_id_bytes", "_retired", "key_id")

    def __init__(self, key: TenantKey, *, retired_key_ids: Collection[str] = ()) -> None:
        aesgcm = _aesgcm_class()
        from cryptography.exceptions import InvalidTag

        retired = frozenset(
            check_key_id(key_id, where=f"retired_key_ids[{index}]") for index, key_id in enumerate(retired_key_ids)
        )
        if key.key_id in retired:
            raise ValueError(
                f"retired_key_ids lists {key.key_id}, the id of the current master key: a key cannot be current and "
                "retired at once; list only the ids of keys rotated out"
            )
        self._cipher = aesgcm(key.secret)
        self._invalid_tag = InvalidTag
        self._key_id_bytes = bytes.fromhex(key.key_id)
        self._retired = retired
        self.key_id: str = key.key_id
        """The id every box sealed here carries."""

    def __repr__(self) -> str:
        return f"SealedBox(key_id={self.key_id!r}, retired_key_ids={sorted(self._retired)!r})"

    __str__ = __repr__

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("a SealedBox is never pickled: build it from a TenantKey in the process that uses it")

    def _header(self) -> bytes:
        return _HEADER.pack(
            _MAGIC, FORMAT_VERSION, ALGORITHM_AES_256_GCM, 0, self._key_id_bytes, os.urandom(NONCE_BYTES)
        )

    def seal_into(self, plaintext: Buffer, associated_data: bytes, out: Buffer) -> None:
        """Seal ``plaintext`` into the writable ``out`` of exactly :func:`sealed_length` bytes (no allocation: for an
        egress area)."""
        source = _byte_view(plaintext, "plaintext")
        target = _byte_view(out, "out")
        if target.readonly:
            raise ValueError("out must be writable, got a read-only buffer")
        if len(target) != sealed_length(len(source)):
            raise ValueError(
                f"out must be sealed_length({len(source)}) = {sealed_length(len(source))} bytes, got {len(target)}"
            )
        header = self._header()
        target[:HEADER_BYTES] = header
        self._cipher.encrypt_into(header[-NONCE_BYTES:], source, header + associated_data, target[HEADER_BYTES:])

    def seal(self, plaintext: Buffer, associated_data: bytes) -> bytes:
        """The box of ``plaintext`` bound to ``associated_data`` (:func:`kvtriton.encryption.associated_data`)."""
        out = bytearray(sealed_length(len(_byte_view(plaintext, "plaintext"))))
        self.seal_into(plaintext, associated_data, out)
        return bytes(out)

    def _check(self, view: memoryview, plaintext_length: int | None) -> OpenFailure | bytes:
        """The box's header bytes, or why it cannot open under this key."""
        if len(view) < HEADER_BYTES:
            return OpenFailure.TRUNCATED
        magic, version, algorithm, reserved, key_id, _nonce = _HEADER.unpack_from(view)
        if magic != _MAGIC or version != FORMAT_VERSION or algorithm != ALGORITHM_AES_256_GCM or reserved != 0:
            return OpenFailure.UNKNOWN_FORMAT
        if key_id != self._key_id_bytes:
            return OpenFailure.RETIRED_KEY if key_id.hex() in self._retired else OpenFailure.OTHER_KEY
        if len(view) < OVERHEAD_BYTES:
            return OpenFailure.TRUNCATED
        if plaintext_length is not None and len(view) != sealed_length(plaintext_length):
            return OpenFailure.TRUNCATED if len(view) < sealed_length(plaintext_length) else OpenFailure.WRONG_LENGTH
        return bytes(view[:HEADER_BYTES])

    def open_into(self, box: Buffer, associated_data: bytes, out: Buffer) -> OpenFailure | None:
        """Open ``box`` into the writable ``out`` (its plaintext's length exactly); None when it opened.

        On a failed tag ``out`` is zeroed (it held unauthenticated bytes for a
        moment); after any failure its contents must not be used.
        """
        target = _byte_view(out, "out")
        if target.readonly:
            raise ValueError("out must be writable, got a read-only buffer")
        view = _byte_view(box, "box")
        checked = self._check(view, len(target))
        if isinstance(checked, OpenFailure):
            return checked
        try:
            self._cipher.decrypt_into(checked[-NONCE_BYTES:], view[HEADER_BYTES:], checked + associated_data, target)
        except self._invalid_tag:
            target[:] = bytes(len(target))
            return OpenFailure.TAG_MISMATCH
        return None

    def open(self, box: Buffer, associated_data: bytes, *, plaintext_length: int | None = None) -> bytes | OpenFailure:
        """The plaintext of ``box``, or why it did not open; ``plaintext_length``: the length expected, when known."""
        view = _byte_view(box, "box")
        checked = self._check(view, plaintext_length)
        if isinstance(checked, OpenFailure):
            return checked
        out = bytearray(len(view) - OVERHEAD_BYTES)
        failure = self.open_into(view, associated_data, out)
        return bytes(out) if failure is None else failure
