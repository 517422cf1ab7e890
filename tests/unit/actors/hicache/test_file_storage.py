"""The local-file L3 backend: round trip, atomic writes, and a store shared between replicas."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from m3serve.actors.hicache.file_storage import STALE_TMP_S, FileStorage
from m3serve.actors.hicache.storage import open_storage
from m3serve.core.hicache.keys import page_keys, root_key
from m3serve.runtime.config import STORAGE_BACKENDS, HiCacheArgs

PAGE_BYTES = 4096
KEYS = page_keys(root_key("m", 2, "float32"), list(range(16)), 2)


def page(seed: int) -> memoryview:
    return memoryview(bytes((seed * 7 + i) % 256 for i in range(PAGE_BYTES)))


def read(store: FileStorage, key: str, nbytes: int = PAGE_BYTES) -> bytes | None:
    out = bytearray(nbytes)
    return bytes(out) if store.get(key, memoryview(out)) else None


def test_a_page_round_trips(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    assert not store.exists(KEYS[0]) and read(store, KEYS[0]) is None
    assert store.put(KEYS[0], page(1))
    assert store.exists(KEYS[0])
    assert read(store, KEYS[0]) == bytes(page(1))
    assert store.path(KEYS[0]) == tmp_path / KEYS[0][:2] / KEYS[0]


def test_a_second_put_of_a_key_keeps_the_first_page(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    assert store.put(KEYS[0], page(1))
    assert not store.put(KEYS[0], page(2))
    assert read(store, KEYS[0]) == bytes(page(1))


def test_a_replica_on_the_same_directory_sees_the_pages(tmp_path: Path) -> None:
    first = FileStorage(tmp_path)
    for i, key in enumerate(KEYS[:3]):
        first.put(key, page(i))
    replica = FileStorage(tmp_path)
    assert [read(replica, key) for key in KEYS[:3]] == [bytes(page(i)) for i in range(3)]
    assert not replica.exists(KEYS[3])


def test_a_leftover_temporary_file_is_never_read_as_a_page(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    key = KEYS[0]
    # What a writer killed mid-write leaves: a partial page under a temporary name.
    tmp = store.path(key).with_name(f".{key}.999.abcd.tmp")
    tmp.parent.mkdir()
    tmp.write_bytes(bytes(page(1))[:100])
    assert not store.exists(key) and read(store, key) is None
    assert store.put(key, page(1))  # the page is written as if the leftover were not there
    assert read(store, key) == bytes(page(1))
    assert tmp.exists()  # young: it may belong to a live writer
    old = time.time() - STALE_TMP_S - 1
    os.utime(tmp, (old, old))
    FileStorage(tmp_path)  # a stale one is removed when a backend opens the store
    assert not tmp.exists()


def test_writes_go_through_a_temporary_name_and_a_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStorage(tmp_path)
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        # At the moment of the rename the whole page is in the temporary file, and the final
        # name does not exist yet: a reader sees no page or all of it.
        assert Path(src).read_bytes() == bytes(page(1))
        assert not store.exists(KEYS[0])
        renames.append((Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    store.put(KEYS[0], page(1))
    ((src, dst),) = renames
    assert src.startswith(f".{KEYS[0]}.") and src.endswith(".tmp") and dst == KEYS[0]


def test_a_failed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStorage(tmp_path)

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        store.put(KEYS[0], page(1))
    assert list(store.path(KEYS[0]).parent.iterdir()) == []


def test_a_page_of_another_size_counts_as_absent(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    store.put(KEYS[0], page(1))
    assert read(store, KEYS[0], PAGE_BYTES // 2) is None
    store.path(KEYS[1]).parent.mkdir(exist_ok=True)
    store.path(KEYS[1]).write_bytes(b"")  # a page whose data never reached the disk
    assert read(store, KEYS[1]) is None


@pytest.mark.parametrize("key", ["../../etc/passwd", "ab", "ABCDEF0123456789", ""])
def test_anything_but_a_hex_key_is_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="not a page key"):
        FileStorage(tmp_path).exists(key)


def test_open_storage_builds_what_the_flags_name(tmp_path: Path) -> None:
    assert STORAGE_BACKENDS == ("file",)
    assert open_storage(HiCacheArgs()) is None
    args = HiCacheArgs(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "l3"),
    )
    store = open_storage(args)
    assert isinstance(store, FileStorage) and store.root == tmp_path / "l3"


def test_the_default_directory_is_under_the_m3serve_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    store = open_storage(
        HiCacheArgs(enable_hierarchical_cache=True, hicache_storage_backend="file")
    )
    assert isinstance(store, FileStorage) and store.root == tmp_path / "m3serve" / "hicache"
