"""Test-only disk faults for an app under test (put this folder first on its PYTHONPATH).

``SPECVIZ_TEST_DISK_FAULT="full:<dir>"`` makes every file written under ``<dir>`` fail with ENOSPC, as a full
disk does; ``"read-only:<dir>"`` fails writes, folder creation and renames there with EROFS. Reads work.
"""

import builtins
import errno
import io
import os

_spec = os.environ.get("SPECVIZ_TEST_DISK_FAULT", "")
if _spec:
    _kind, _, _root = _spec.partition(":")
    _root = os.path.realpath(_root)
    _code = errno.ENOSPC if _kind == "full" else errno.EROFS

    def _under(path) -> bool:
        try:
            real = os.path.realpath(os.fspath(path))
        except TypeError:  # a file descriptor
            return False
        return real == _root or real.startswith(_root + os.sep)

    def _fail(path):
        raise OSError(_code, os.strerror(_code), os.fspath(path))

    _open = io.open

    def _faulty_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and _under(file):
            _fail(file)
        return _open(file, mode, *args, **kwargs)

    io.open = builtins.open = _faulty_open
    if _kind == "read-only":
        _mkdir, _replace, _rename = os.mkdir, os.replace, os.rename

        def _faulty_mkdir(path, *args, **kwargs):
            if _under(path):
                _fail(path)
            return _mkdir(path, *args, **kwargs)

        def _faulty_move(real):
            def move(src, dst, *args, **kwargs):
                if _under(src) or _under(dst):
                    _fail(dst)
                return real(src, dst, *args, **kwargs)
            return move

        os.mkdir, os.replace, os.rename = _faulty_mkdir, _faulty_move(_replace), _faulty_move(_rename)
