"""Where each setting comes from, in one order expressed in pydantic-settings
(``Settings.settings_customise_sources``): flags > environment (``MMCACHE_*``, read
case-insensitively, as pydantic-settings reads it) > the --config file (the Go plugin's
YAML) > defaults. A test per pair of sources; the capacity's two keys are one choice, taken
whole from the highest source that names either."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream.cli import _parser, _settings
from stream.config import Resolved

MB_YAML = "cacheSizeInMBPerServer: 512\n"  # 256 entries


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.upper().startswith("MMCACHE_"):
            monkeypatch.delenv(name)


def _resolved(*flags: str) -> Resolved:
    return _settings(_parser().parse_args(["serve", *flags]))


def _config(tmp_path: Path, text: str = MB_YAML) -> str:
    path = tmp_path / "plugin.yaml"
    path.write_text(text)
    return str(path)


def test_a_flag_beats_the_environment(monkeypatch):
    monkeypatch.setenv("MMCACHE_PORT", "9001")
    monkeypatch.setenv("MMCACHE_CACHE_SIZE_MB_PER_SERVER", "100")
    resolved = _resolved("--port", "9002", "--cache-size-mb-per-server", "64")
    assert resolved.settings.port == 9002
    assert resolved.settings.cache_size_mb_per_server == 64
    assert resolved.capacity_source == "flag --cache-size-mb-per-server"


def test_a_flag_beats_the_config_file(tmp_path):
    resolved = _resolved("--config", _config(tmp_path), "--cache-size-mb-per-server", "64")
    assert resolved.settings.cache_size_mb_per_server == 64
    assert resolved.capacity_source == "flag --cache-size-mb-per-server"


def test_a_flag_beats_the_default():
    assert _resolved("--port", "9002").settings.port == 9002
    assert _resolved().settings.port == 8080


@pytest.mark.parametrize("name", ["MMCACHE_CACHE_SIZE_MB_PER_SERVER", "mmcache_cache_size_mb_per_server"])
def test_the_environment_beats_the_config_file_whatever_the_variables_case(tmp_path, monkeypatch, name):
    monkeypatch.setenv(name, "100")
    resolved = _resolved("--config", _config(tmp_path))
    assert resolved.settings.cache_size_mb_per_server == 100
    assert resolved.capacity_source == f"environment {name}"


def test_the_environment_beats_the_default(monkeypatch):
    monkeypatch.setenv("mmcache_port", "9003")  # read as pydantic-settings reads it
    assert _resolved().settings.port == 9003


def test_the_config_file_beats_the_default(tmp_path):
    resolved = _resolved("--config", _config(tmp_path))
    assert resolved.settings.cache_size_mb_per_server == 512
    assert resolved.capacity_source.startswith("--config ")
    assert _resolved().capacity_source == "default"


def test_the_config_file_may_come_from_the_environment_in_any_case(tmp_path, monkeypatch):
    monkeypatch.setenv("mmcache_config", _config(tmp_path))
    assert _resolved().settings.cache_size_mb_per_server == 512


def test_the_capacity_is_one_choice_taken_whole_from_the_highest_source(tmp_path, monkeypatch):
    # the other mode below a source that names one is no conflict: it is not read
    monkeypatch.setenv("MMCACHE_CACHE_SIZE_EMBEDDINGS_PER_SERVER", "5000")
    resolved = _resolved("--config", _config(tmp_path), "--cache-size-mb-per-server", "64")
    assert (resolved.settings.cache_size_mb_per_server,
            resolved.settings.cache_size_embeddings_per_server) == (64, None)
    resolved = _resolved("--config", _config(tmp_path))
    assert (resolved.settings.cache_size_mb_per_server,
            resolved.settings.cache_size_embeddings_per_server) == (None, 5000)
    assert resolved.capacity_source == "environment MMCACHE_CACHE_SIZE_EMBEDDINGS_PER_SERVER"


def test_both_modes_in_one_source_are_refused(monkeypatch):
    monkeypatch.setenv("MMCACHE_CACHE_SIZE_EMBEDDINGS_PER_SERVER", "5000")
    monkeypatch.setenv("MMCACHE_CACHE_SIZE_MB_PER_SERVER", "64")
    with pytest.raises(SystemExit, match="configuration error"):
        _resolved()
