"""--model-path resolution: directories as they are, Hub ids from the local cache only."""

from __future__ import annotations

from pathlib import Path

import pytest

from m3serve.model.locate import ModelNotFound, resolve_model_path

COMMIT = "ce7f4df87d2e05262f5775f373dac4772f134041"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--MiniMaxAI--MiniMax-M3.1-Flash"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return repo


def test_a_directory_is_used_as_it_is(tmp_path: Path) -> None:
    assert resolve_model_path(tmp_path) == tmp_path


def test_a_hub_id_resolves_to_the_cached_snapshot_of_main(hub: Path) -> None:
    assert resolve_model_path("MiniMaxAI/MiniMax-M3.1-Flash") == hub / "snapshots" / COMMIT


@pytest.mark.parametrize("revision", [COMMIT, COMMIT[:12], "main"])
def test_a_revision_picks_its_snapshot(hub: Path, revision: str) -> None:
    found = resolve_model_path("MiniMaxAI/MiniMax-M3.1-Flash", revision)
    assert found == hub / "snapshots" / COMMIT


def test_an_uncached_model_says_how_to_fetch_it(hub: Path) -> None:
    with pytest.raises(ModelNotFound, match="hf download MiniMaxAI/Other --revision abc"):
        resolve_model_path("MiniMaxAI/Other", "abc")
