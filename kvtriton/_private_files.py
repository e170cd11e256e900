"""Who may read what kvtriton puts on disk: the server's user only, unless the operator names a group.

The KV a server offloads reveals its prompts, so the files holding it are
the server's user's alone: directories ``0700`` (nobody else may enter, so
nothing beneath them can be read, whatever the files' own modes) and files
``0600``. An operator who shares a tier's directory between servers running
as different users names a group (``kvtriton_shared_group``): directories
are then ``2770`` and owned by that group (the setgid bit hands the group on
to everything made inside), never readable by other users.

kvtriton's own region in /dev/shm is :data:`PRIVATE_FILE_MODE` regardless
(:mod:`kvtriton.worker._region_file`): one engine's processes share it, never
two servers. vLLM's ``fs`` tier writes its chunk files itself, with the
process umask (``0644`` files, ``0755`` directories under the usual ``022``);
kvtriton makes the tier's ``root_dir`` before the tier starts
(:func:`prepare_tier_root`), so those files sit under a directory only the
server's user (or the group) may enter. A ``root_dir`` that already exists
is never changed: one that others may enter is refused, naming the fix.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PRIVATE_DIRECTORY_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
"""Every file kvtriton itself creates: the shared host region (never shared beyond one engine's processes)."""
GROUP_DIRECTORY_MODE = 0o2770
"""rwx for the user and the group, setgid: what is made inside takes the group."""


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


@dataclass(frozen=True, slots=True)
class FileSharing:
    """Who besides the server's user may read kvtriton's files: nobody (``group_id`` None) or one group."""

    group_id: int | None = None
    group_name: str | None = None

    @classmethod
    def from_setting(cls, value: object, *, where: str) -> FileSharing:
        """``kvtriton_shared_group``'s value (a group name or id; None: private); ``ValueError`` naming ``where``.

        The group must exist and this process must be able to hand its
        directories to it (a member of it, or root).
        """
        if value is None:
            return cls()
        try:
            if isinstance(value, int) and not isinstance(value, bool):
                found = grp.getgrgid(value)
            elif isinstance(value, str) and value:
                found = grp.getgrnam(value)
            else:
                raise ValueError(f"{where} must be a group name or a group id, got {value!r}")
        except KeyError:
            raise ValueError(f"{where}={value!r}: no such group on this host") from None
        if os.geteuid() != 0 and found.gr_gid != os.getegid() and found.gr_gid not in os.getgroups():
            raise ValueError(
                f"{where}={value!r}: this server's user ({_user_name(os.geteuid())}) is not a member of group "
                f"{found.gr_name!r}, so it cannot hand its directories to it; add the user to the group"
            )
        return cls(found.gr_gid, found.gr_name)

    @property
    def directory_mode(self) -> int:
        return PRIVATE_DIRECTORY_MODE if self.group_id is None else GROUP_DIRECTORY_MODE

    def describe(self) -> str:
        """The start-up line's words, e.g. ``private to user alice (tier roots made 0700, the host region 0600)``."""
        modes = f"tier roots made {self.directory_mode:04o}, the host region {PRIVATE_FILE_MODE:04o}"
        if self.group_id is None:
            return f"private to user {_user_name(os.geteuid())} ({modes})"
        return f"shared with group {self.group_name} ({modes})"

    def too_open(self, found: os.stat_result) -> str | None:
        """Why an existing directory lets in more than this allows, or None."""
        mode = stat.S_IMODE(found.st_mode)
        if found.st_uid != os.geteuid():
            return f"belongs to {_user_name(found.st_uid)}, not to this server's user {_user_name(os.geteuid())}"
        if mode & 0o007:
            return f"has mode {mode:04o}: every user on the host may enter it"
        if mode & 0o070 and self.group_id is None:
            return f"has mode {mode:04o}: its group may enter it, and no kvtriton_shared_group is set"
        if mode & 0o070 and found.st_gid != self.group_id:
            return f"has mode {mode:04o} for group id {found.st_gid}, not the shared group {self.group_name}"
        return None

    def make_directory(self, path: str) -> list[str]:
        """Create ``path`` and its missing parents with :attr:`directory_mode` (the umask aside); those made."""
        parent = os.path.dirname(os.path.abspath(path))
        made = [] if os.path.isdir(parent) else self.make_directory(parent)
        try:
            os.mkdir(path, self.directory_mode)
        except FileExistsError:
            return made
        if self.group_id is not None:
            os.chown(path, -1, self.group_id)
        os.chmod(path, self.directory_mode)  # exactly: mkdir applied the umask (and ignores the setgid bit)
        return [*made, path]


PRIVATE = FileSharing()
"""No group: the server's user only."""


def _builtin_fs_root(tier_config: Mapping[str, object]) -> str | None:
    """The ``root_dir`` of vLLM's built-in ``fs`` tier; None for another tier (or a root that is no string)."""
    root = tier_config.get("root_dir")
    if tier_config.get("type") != "fs" or tier_config.get("module_path") is not None or not isinstance(root, str):
        return None
    return root


_PLACEHOLDER = re.compile(r"<[^<>]*>")
"""A value in angle brackets: a placeholder of ``kvtriton simulate``'s printed configuration, never a real path."""


def tier_root_problem(tier_config: Mapping[str, object]) -> str | None:
    """Why a built-in ``fs`` tier's ``root_dir`` cannot be a root at all, naming the key and value; None when it can.

    Refused: a placeholder in angle brackets (``kvtriton simulate --tier fs``
    prints ``"<a directory on local NVMe>"`` for the operator to replace),
    ``""`` (vLLM's fs tier would file its chunks under ``/``) and a relative
    path (it would depend on each process's working directory).
    """
    root = _builtin_fs_root(tier_config)
    if root is None:
        return None
    if _PLACEHOLDER.search(root):
        return (
            f"key 'root_dir'={root!r} is a placeholder (as `kvtriton simulate` prints it): replace it with the "
            "absolute path of a directory on local disk (NVMe) for the tier's files"
        )
    if not root.strip():
        return (
            f"key 'root_dir'={root!r} is empty: vLLM's fs tier would write its files under '/'; give the absolute "
            "path of a directory on local disk (NVMe)"
        )
    if not os.path.isabs(root):
        return (
            f"key 'root_dir'={root!r} is a relative path, which each process would resolve against its own working "
            f"directory; give an absolute path (e.g. {os.path.abspath(root)!r})"
        )
    return None


def prepare_tier_root(label: str, tier_config: Mapping[str, object], sharing: FileSharing) -> None:
    """Make a built-in ``fs`` tier's ``root_dir`` (``sharing``'s mode) before the tier writes, or refuse it.

    A ``root_dir`` :func:`tier_root_problem` refuses is refused here too
    (``ValueError``). One that exists stays as it is, but one that lets in more
    than ``sharing`` allows is refused with ``ValueError`` naming ``label``,
    the directory, its mode or owner, and the fix. Other tiers (no
    ``root_dir``, or an out-of-tree ``module_path``) write no files of
    kvtriton's making and are left alone.
    """
    root = _builtin_fs_root(tier_config)
    if root is None:
        return
    unusable = tier_root_problem(tier_config)
    if unusable is not None:
        raise ValueError(unusable)
    if not os.path.isdir(root):
        made = sharing.make_directory(root)
        logger.info("%s root_dir %r: created %s, %s", label, root, ", ".join(made) or root, sharing.describe())
        return
    problem = sharing.too_open(os.stat(root))
    if problem is not None:
        raise ValueError(
            f"key 'root_dir'={root!r} {problem}, so other users could read the KV files vLLM's fs tier writes "
            f"beneath it; point root_dir at a directory that does not exist yet (kvtriton creates it "
            f"{sharing.directory_mode:04o}), make this one {sharing.directory_mode:04o} and the server's user's, or "
            "set kvtriton_shared_group to the group that shares it"
        )
    logger.info("%s root_dir %r: kept, %s", label, root, sharing.describe())
