"""What a non-editable install of jaxkv carries besides its modules: every file under
jaxkv/data, the trained tiny checkpoint among them, which the README's Engine example
loads through `jaxkv.models.TINY_CHECKPOINT`."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import jaxkv
from jaxkv.models import TINY_CHECKPOINT, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(jaxkv.__file__).resolve().parent


def test_package_data_globs_cover_every_data_file():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["jaxkv"]
    files = [p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "data").rglob("*")]
    files = [f for f in files if (PACKAGE / f).is_file()]
    assert "data/tiny/params.msgpack" in files
    # setuptools' "*" does not cross a "/": each folder needs a glob of its own.
    left_out = [f for f in files if not any(fnmatch.fnmatch(f, g) and
                f.count("/") == g.count("/") for g in globs)]  # fmt: skip
    assert left_out == []


def test_tiny_checkpoint_is_inside_the_package_and_loads():
    assert TINY_CHECKPOINT.is_relative_to(PACKAGE)
    model = load_checkpoint(TINY_CHECKPOINT)
    assert model.config.vocab_size == 259
