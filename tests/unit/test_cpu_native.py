"""Building the native CPU kernels: a built library is reused, concurrent builders publish whole files, a read-only
cache falls back to a private directory, and no compiler means a logged fallback to torch's forms."""
from __future__ import annotations

import logging
import os
import shutil

import pytest

from decode_worker_kernels import cpu_native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on PATH: the kernels cannot be built here")


def test_a_built_library_is_reused_and_a_missing_compiler_falls_back(tmp_path, monkeypatch, caplog):
    first = cpu_native._build(tmp_path / "ok")
    stamp = first.stat().st_mtime_ns
    assert cpu_native._build(tmp_path / "ok") == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "ok").iterdir()] == [first.name]  # no partial file left behind

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.load(tmp_path / "none") is None
    assert "native CPU kernels unavailable" in caplog.text and "no-such-cc" in caplog.text


def test_only_a_folder_that_no_one_else_could_have_filled_is_built_in(tmp_path):
    mine = tmp_path / "a" / "kernels"
    assert cpu_native._private(mine) and mine.stat().st_mode & 0o777 == 0o700
    mine.chmod(0o775)
    assert not cpu_native._private(mine)  # writable by the group
    mine.chmod(0o700)
    (tmp_path / "a").chmod(0o777)
    assert not cpu_native._private(mine)  # a folder above it others could swap it in
    (tmp_path / "a").chmod(0o755)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert not cpu_native._private(tmp_path / "link" / "kernels")
    if os.getuid() == 0:
        os.chown(tmp_path / "a", 65534, 65534)
        assert not cpu_native._private(mine)  # another user's folder above it


def test_a_library_file_others_may_write_is_not_loaded(tmp_path):
    library = tmp_path / "lib.so"
    library.write_bytes(b"")
    library.chmod(0o755)
    cpu_native._safe_to_load(library)
    library.chmod(0o775)
    with pytest.raises(RuntimeError, match="not loaded"):
        cpu_native._safe_to_load(library)


def test_a_read_only_cache_builds_into_a_private_temp_dir(tmp_path, monkeypatch):
    """As in a pod with a read-only root: the library lands in a 0700 directory of this user under the temp dir,
    and a directory others could write to is refused."""
    monkeypatch.setattr(cpu_native, "_private", lambda directory: False)
    monkeypatch.setattr(cpu_native.tempfile, "gettempdir", lambda: str(tmp_path))
    assert cpu_native.load(tmp_path / "read-only") is not None
    private = tmp_path / f"decode-worker-kernels-{os.getuid()}"
    assert private.stat().st_mode & 0o777 == 0o700 and any(private.glob("cpu_native-*.so"))
    private.chmod(0o777)  # another user could now have planted a library
    with pytest.raises(RuntimeError, match="not a private directory"):
        cpu_native._private_temp_dir()
