"""Tokens at rest (contracts/tokens.py): the file keeps only salted hashes, a plain-text file is
rewritten hashed on its first read (no restart), `rollouts token add` prints the new token once,
and organizations carry their bucket grants."""

from __future__ import annotations

import json
import os
import stat

import pytest

from common.buckets import Grant
from common.settings import Settings
from contracts.errors import Unauthenticated
from contracts.tokens import TokenStore, add_token, grant_default_bucket, hash_token
from workers.cli import main as cli_main


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_the_file_keeps_only_hashes(tmp_path):
    path = tmp_path / "tokens.json"
    add_token(path, "rk-secret-one", "admin", "org-a", "a", buckets=["rollouts"])
    add_token(path, "rk-secret-two", "viewer", "org-a", "b")
    text = path.read_text()
    assert "rk-secret" not in text
    doc = json.loads(text)
    salts = [t["salt"] for t in doc["tokens"]]
    assert len(set(salts)) == 2  # a salt per token
    for t in doc["tokens"]:
        assert set(t) == {"sha256", "salt", "role", "organizationId", "name"}
    assert doc["tokens"][0]["sha256"] == hash_token("rk-secret-one", salts[0])
    assert doc["organizations"] == [{"id": "org-a", "hotLoadEnabled": True, "buckets": ["rollouts"]}]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    who = TokenStore(path).authenticate(bearer("rk-secret-one"))
    assert (who.role, who.organization_id, who.buckets) == ("admin", "org-a", (Grant("rollouts"),))
    assert TokenStore(path).authenticate(bearer("rk-secret-two")).role == "viewer"
    for wrong in ("rk-secret-on", "rk-secret-one-", doc["tokens"][0]["sha256"]):  # nor the hash itself
        with pytest.raises(Unauthenticated):
            TokenStore(path).authenticate(bearer(wrong))


def test_a_plain_text_file_is_migrated_on_first_read_without_a_restart(tmp_path):
    path = tmp_path / "tokens.json"
    store = TokenStore(path)
    with pytest.raises(Unauthenticated):
        store.authenticate(bearer("rk-old-admin"))  # no file yet
    old = {
        "organizations": [{"id": "org-local", "hotLoadEnabled": True}],
        "tokens": [
            {"token": "rk-old-admin", "role": "admin", "organizationId": "org-local", "name": "local-admin"},
            {"token": "rk-old-viewer", "role": "viewer", "organizationId": "org-local", "name": "local-viewer"},
        ],
    }
    path.write_text(json.dumps(old))
    who = store.authenticate(bearer("rk-old-admin"))  # the same store: no restart
    assert (who.role, who.organization_id, who.name) == ("admin", "org-local", "local-admin")
    text = path.read_text()
    assert "rk-old" not in text and '"token"' not in text
    doc = json.loads(text)
    assert [t["name"] for t in doc["tokens"]] == ["local-admin", "local-viewer"]
    assert doc["organizations"] == old["organizations"]  # no grant invented
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not list(tmp_path.glob("*.tmp"))
    assert TokenStore(path).authenticate(bearer("rk-old-viewer")).role == "viewer"


def test_the_stack_grants_its_bucket_to_an_old_file_only_when_it_has_no_grants(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"organizations": [{"id": "org-local", "hotLoadEnabled": True}], "tokens": []}))
    assert grant_default_bucket(path, "org-local", "rollouts")
    assert json.loads(path.read_text())["organizations"][0]["buckets"] == ["rollouts"]
    doc = json.loads(path.read_text())
    doc["organizations"][0]["buckets"] = []  # an operator revoked it: stays revoked
    path.write_text(json.dumps(doc))
    assert not grant_default_bucket(path, "org-local", "rollouts")
    assert json.loads(path.read_text())["organizations"][0]["buckets"] == []


def test_bad_input_to_add_token_changes_nothing(tmp_path):
    path = tmp_path / "tokens.json"
    add_token(path, "rk-a", "admin", "org-a", "a")
    before = path.read_text()
    with pytest.raises(ValueError, match="role"):
        add_token(path, "rk-b", "owner", "org-a", "b")
    with pytest.raises(ValueError, match="organization"):
        add_token(path, "rk-b", "admin", "org/a", "b")
    with pytest.raises(ValueError, match="bucket"):
        add_token(path, "rk-b", "admin", "org-a", "b", buckets=["../x"])
    assert path.read_text() == before


def test_cli_token_add_prints_the_token_once_and_stores_its_hash(tmp_path, capsys):
    settings = Settings.create(tmp_path / "home", 30000)
    settings.save()
    home = ["--home", settings.home]
    assert cli_main(["token", "add", *home, "--role", "admin", "--org", "team-b", "--bucket", "shared/team-b"]) == 0
    token = capsys.readouterr().out.strip()
    assert token.startswith("rk-admin-") and len(token) > 30
    text = settings.tokens_file.read_text()
    assert token not in text
    who = TokenStore(settings.tokens_file).authenticate(bearer(token))
    assert (who.organization_id, who.buckets) == ("team-b", (Grant("shared", "team-b"),))
    assert cli_main(["token", "add", *home, "--role", "viewer", "--org", "team-b", "--bucket", "s3://x"]) == 2
    assert "bucket" in capsys.readouterr().err
    assert settings.tokens_file.read_text() == text
