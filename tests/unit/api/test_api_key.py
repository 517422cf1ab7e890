"""Where the API key comes from (api/api_key.py): --api-key, --api-key-file or M3SERVE_API_KEY,
so that it need not be visible in `ps`; the app built from either requires it."""

from __future__ import annotations

from pathlib import Path

import pytest

from m3serve.api.api_key import ENV_VAR, read_api_key
from m3serve.runtime.config import ApiArgs, ConfigInvalid, ServerArgs

from .test_http_errors import MESSAGES, hello

KEY = "sk-from-elsewhere-42"


def test_the_flag_wins_then_the_file_then_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(f"{KEY}\n")  # a trailing newline, as `echo key > file` writes
    env = {ENV_VAR: "sk-env"}
    assert read_api_key(ApiArgs(api_key="sk-flag"), env) == "sk-flag"
    assert read_api_key(ApiArgs(api_key_file=str(path)), env) == KEY
    assert read_api_key(ApiArgs(), env) == "sk-env"
    assert read_api_key(ApiArgs(), {}) is None
    assert read_api_key(ApiArgs(), {ENV_VAR: ""}) is None


def test_a_missing_or_empty_key_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid, match="--api-key-file"):
        read_api_key(ApiArgs(api_key_file=str(tmp_path / "absent")), {})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigInvalid, match="is empty"):
        read_api_key(ApiArgs(api_key_file=str(empty)), {})


def test_the_key_and_a_key_file_together_are_refused() -> None:
    with pytest.raises(ConfigInvalid, match="one of --api-key and --api-key-file"):
        ServerArgs.from_kwargs(api_key="a", api_key_file="b")


async def test_a_key_from_the_environment_guards_the_app(serve, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, KEY)
    async with serve(hello, ApiArgs()) as s:
        without = await s.post("/v1/chat/completions", {"messages": MESSAGES})
        auth = {"Authorization": f"Bearer {KEY}"}
        with_key = await s.post("/v1/chat/completions", {"messages": MESSAGES}, headers=auth)
        schema = (await s.client.get("/openapi.json", headers=auth)).json()
    assert without.status_code == 401
    assert with_key.status_code == 200
    assert schema["security"] == [{"bearer": []}]


async def test_a_key_from_a_file_guards_the_app(serve, tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(KEY)
    async with serve(hello, ApiArgs(api_key_file=str(path))) as s:
        without = await s.post("/v1/chat/completions", {"messages": MESSAGES})
        auth = {"Authorization": f"Bearer {KEY}"}
        with_key = await s.post("/v1/chat/completions", {"messages": MESSAGES}, headers=auth)
    assert (without.status_code, with_key.status_code) == (401, 200)
