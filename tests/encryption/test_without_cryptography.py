"""kvtriton without the ``cryptography`` package: everything imports, and only building a sealed box asks for it.

A server that does not encrypt, and the GPU check's machine, lack it. Each
case runs in a fresh interpreter where ``import cryptography`` fails, as it
fails there.
"""

from __future__ import annotations

import pytest
from packaging_fixtures import missing_package_errors, run_python_without

import kvtriton.encryption._sealed_box as sealed_box_module
from kvtriton.encryption import MasterKey, SealedBox, TenantKeys, require_cryptography


def test_kvtriton_and_its_encryption_package_import_without_loading_a_cipher_library() -> None:
    code = (
        "import sys\n"
        "del sys.modules['cryptography']\n"  # importable here: prove that nothing imports it
        "import kvtriton, kvtriton.encryption\n"
        "from kvtriton.encryption import MasterKey, TenantKeys, associated_data\n"
        "TenantKeys(MasterKey(bytes(32), source='test')).key_for('a', b'model')\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('cryptography', 'pyaegis')))\n"
    )
    run = run_python_without("cryptography", code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"


def test_building_a_sealed_box_without_cryptography_names_the_package_and_the_extra() -> None:
    setup = (
        "from kvtriton.encryption import MasterKey, SealedBox, TenantKeys, require_cryptography\n"
        "key = TenantKeys(MasterKey(bytes(32), source='test')).key_for(None, b'model')"
    )
    lines = missing_package_errors("cryptography", setup, ("require_cryptography()", "SealedBox(key)"))
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("cryptography | kvtriton encrypts offloaded KV with AES-256-GCM")
        assert "pip install 'cryptography>=50'" in line and "pip install './kvtriton[encryption]'" in line


def test_a_cryptography_that_holds_the_gil_is_refused_naming_the_release_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cryptography

    monkeypatch.setattr(cryptography, "__version__", "49.0.0")
    key = TenantKeys(MasterKey(bytes(32), source="test")).key_for(None, b"model")
    for attempt in (require_cryptography, lambda: SealedBox(key)):
        with pytest.raises(ImportError) as refused:
            attempt()
        assert str(refused.value).startswith(
            "cryptography 49.0.0 is installed, but kvtriton needs cryptography>=50: older releases hold Python's GIL"
        )
    assert sealed_box_module.CRYPTOGRAPHY_REQUIREMENT == "cryptography>=50"
