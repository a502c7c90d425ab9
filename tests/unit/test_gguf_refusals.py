"""A GGUF conversion that cannot go on (eyrie/core/gguf_target.py), without the model: no file, no `gguf`
package, a failure halfway. The conversion itself: tests/e2e/test_real_target.py."""

import pytest

from eyrie.core import gguf_target
from eyrie.core.errors import EyrieError
from eyrie.core.gguf_target import convert_gguf


def test_missing_gguf_names_the_fix(tmp_path):
    with pytest.raises(EyrieError, match="no GGUF file") as err:
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert "--smollm2" in err.value.fix and not (tmp_path / "out").exists()


def test_missing_gguf_package_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_target.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EyrieError, match="`gguf` package") as err:
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert "requirements/dev.txt" in err.value.fix


def test_a_failed_conversion_leaves_no_directory(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")

    def crash(model, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_target, "_load", lambda gguf: (None, None))
    monkeypatch.setattr(gguf_target, "_write_model", crash)
    with pytest.raises(RuntimeError):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out" / "model")
    assert list((tmp_path / "out").iterdir()) == []
