"""Files compressed by their name: ``.xz`` is xz on disk, any other name is the bytes as given."""

import lzma

import pytest

from specviz.core import files

DATA = b"specviz " * 4096


def test_xz_name_is_compressed_on_disk_and_reads_back(tmp_path):
    path = tmp_path / "ids.bin.xz"
    files.write_bytes(path, DATA)
    on_disk = path.read_bytes()
    assert len(on_disk) < len(DATA) // 10 and lzma.decompress(on_disk) == DATA
    assert files.read_bytes(path) == DATA


def test_other_names_are_stored_as_given(tmp_path):
    path = tmp_path / "ids.bin"
    files.write_bytes(path, DATA)
    assert path.read_bytes() == DATA and files.read_bytes(path) == DATA
    assert files.compress_for(path, DATA) is DATA


def test_truncated_xz_file_is_an_error_not_short_data(tmp_path):
    path = tmp_path / "ids.bin.xz"
    files.write_bytes(path, DATA)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises((lzma.LZMAError, EOFError)):
        files.read_bytes(path)


def test_atomic_write_leaves_no_partial_and_replaces_whole(tmp_path):
    path = tmp_path / "sub" / "results.json"
    files.atomic_write(path, "first")
    files.atomic_write(path, b"second")
    assert path.read_text() == "second"
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]


def test_content_key_ignores_dict_order_and_tells_values_apart():
    assert files.content_key({"a": 1, "b": [2, 3]}) == files.content_key({"b": [2, 3], "a": 1})
    assert files.content_key({"a": 1}) != files.content_key({"a": 2})
    assert len(files.content_key("x")) == 12 and len(files.content_key("x", 8)) == 8
    assert files.content_key(b"raw") == files.content_key(b"raw")
