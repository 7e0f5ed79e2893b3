"""Files compressed by their name: ``.xz`` is xz on disk, any other name is the bytes as given."""

import lzma

import pytest

from specviz.core import xzfile

DATA = b"specviz " * 4096


def test_xz_name_is_compressed_on_disk_and_reads_back(tmp_path):
    path = tmp_path / "ids.bin.xz"
    xzfile.write_bytes(path, DATA)
    on_disk = path.read_bytes()
    assert len(on_disk) < len(DATA) // 10 and lzma.decompress(on_disk) == DATA
    assert xzfile.read_bytes(path) == DATA


def test_other_names_are_stored_as_given(tmp_path):
    path = tmp_path / "ids.bin"
    xzfile.write_bytes(path, DATA)
    assert path.read_bytes() == DATA and xzfile.read_bytes(path) == DATA
    assert xzfile.compress_for(path, DATA) is DATA


def test_truncated_xz_file_is_an_error_not_short_data(tmp_path):
    path = tmp_path / "ids.bin.xz"
    xzfile.write_bytes(path, DATA)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises((lzma.LZMAError, EOFError)):
        xzfile.read_bytes(path)
