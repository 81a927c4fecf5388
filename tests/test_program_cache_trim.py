"""The on-disk program cache stays within MESH_CACHE_MAX_MB: least recently used files go first, the file just
written stays, a read counts as a use."""
import os

from engine.program_cache import read_blob, trim, write_blob


def _aged(path, t):
    os.utime(path, (t, t))


def test_the_least_recently_used_files_go_first_and_a_read_counts_as_a_use(tmp_path, monkeypatch):
    monkeypatch.setenv("MESH_CACHE_MAX_MB", "1")  # 1 MiB
    blob = b"x" * 300_000
    files = [tmp_path / f"{i}.bin" for i in range(3)]
    for i, f in enumerate(files):
        assert write_blob(f, blob)
        _aged(f, 1_000_000 + i)                   # 0 is the oldest, 2 the newest
    assert read_blob(files[0]) == blob            # 0 is used now: 1 becomes the least recently used
    assert write_blob(tmp_path / "new.bin", blob)  # 4 x ~300 KB > 1 MiB: one must go
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["0.bin", "2.bin", "new.bin"]


def test_the_file_just_written_stays_even_alone_over_the_limit(tmp_path):
    old, new = tmp_path / "old.bin", tmp_path / "new.bin"
    old.write_bytes(b"o" * 10)
    new.write_bytes(b"n" * 100)
    trim(tmp_path, keep=new, limit=50)
    assert [p.name for p in tmp_path.iterdir()] == ["new.bin"]


def test_a_missing_folder_is_no_error(tmp_path):
    trim(tmp_path / "absent", limit=0)
