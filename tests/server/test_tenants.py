"""The tenants file (server.tenants): who a caller is, which salts are whose, and what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdock.errors import ConfigError
from kvdock.server.tenants import load_tenants
from kvdock.transport import curve

TOKEN_A, TOKEN_B = "a" * 20, "b" * 20


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def two(tmp_path: Path, key_line: str = "") -> Path:
    return write(
        tmp_path,
        f"""
[tenants.acme]
tokens = ["{TOKEN_A}"]
models = ["tiny"]
salts = ["acme", "acme/*"]
l1 = "1MiB"
l2 = 4096
{key_line}

[tenants.beta]
tokens = ["{TOKEN_B}"]
models = ["*"]
salts = ["beta"]
""",
    )


def test_callers_are_found_by_token_and_key_and_salts_by_owner(tmp_path: Path) -> None:
    public, _ = curve.keygen(tmp_path / "keys", "acme")
    tenants = load_tenants(two(tmp_path, 'keys = ["keys/acme.key"]'))
    acme, beta = tenants.all["acme"], tenants.all["beta"]
    key = curve.load_public(public)
    assert tenants.keys == {key}
    assert tenants.by_token(TOKEN_A) is acme and tenants.by_token(TOKEN_B) is beta
    assert tenants.by_token("a" * 19) is None and tenants.by_token("") is None
    assert tenants.identify(key, "") is acme and tenants.identify(key, TOKEN_A) is acme
    assert tenants.identify(key, TOKEN_B) is None  # a key and a token of two tenants: neither
    assert tenants.identify(b"", "") is None
    assert [tenants.owner(s) for s in ("acme", "acme/x", "acme/", "acmex", "beta", "betax", "")] == [
        acme,
        acme,
        acme,
        None,
        beta,
        None,
        None,
    ]
    assert acme.allows_model("tiny") and not acme.allows_model("other") and beta.allows_model("anything")
    assert (acme.quota("l1"), acme.quota("l2"), acme.quota("l3"), beta.quota("l1")) == (2**20, 4096, 0, 0)
    assert TOKEN_A not in repr(acme)


@pytest.mark.parametrize(
    "acme_salts, beta_salts",
    [('"x"', '"x"'), ('"x*"', '"xy"'), ('"xy"', '"x*"'), ('"x*"', '"xy*"'), ('"xy*"', '"x*"')],
)
def test_overlapping_salts_are_refused(tmp_path: Path, acme_salts: str, beta_salts: str) -> None:
    path = write(
        tmp_path,
        f"""
[tenants.acme]
tokens = ["{TOKEN_A}"]
models = ["*"]
salts = [{acme_salts}]
[tenants.beta]
tokens = ["{TOKEN_B}"]
models = ["*"]
salts = [{beta_salts}]
""",
    )
    with pytest.raises(ConfigError, match="both claim cache_salt"):
        load_tenants(path)


@pytest.mark.parametrize(
    "body, message",
    [
        ('tokens = ["short"]\nmodels = ["*"]\nsalts = ["a"]', "16 to 1024 characters"),
        ('models = ["*"]\nsalts = ["a"]', "neither keys nor tokens"),
        (f'tokens = ["{TOKEN_A}"]\nsalts = ["a"]', "no models"),
        (f'tokens = ["{TOKEN_A}"]\nmodels = ["*"]', "no salts"),
        (f'tokens = ["{TOKEN_A}"]\nmodels = ["*"]\nsalts = ["*"]', "lone"),
        (f'tokens = ["{TOKEN_A}"]\nmodels = ["*"]\nsalts = ["a*b"]', "only ends a prefix"),
        (f'tokens = ["{TOKEN_A}"]\nmodels = ["*"]\nsalts = ["a"]\nl9 = 1', "unknown keys"),
        (f'tokens = ["{TOKEN_A}"]\nmodels = ["*"]\nsalts = ["a"]\nl1 = true', "must be a size"),
        (f'tokens = ["{TOKEN_A}"]\nmodels = ["*"]\nsalts = ["a"]\nkeys = ["nope.key"]', "cannot read"),
    ],
)
def test_bad_tenants_are_refused_naming_the_problem(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_tenants(write(tmp_path, f"[tenants.acme]\n{body}\n"))


def test_a_credential_belongs_to_one_tenant(tmp_path: Path) -> None:
    text = two(tmp_path).read_text().replace(TOKEN_B, TOKEN_A)
    with pytest.raises(ConfigError, match="token is given to two tenants"):
        load_tenants(write(tmp_path, text))
    with pytest.raises(ConfigError, match="expected one or more"):
        load_tenants(write(tmp_path, "x = 1\n"))
    with pytest.raises(ConfigError, match="a tenant name"):
        load_tenants(write(tmp_path, f'[tenants."a b"]\ntokens = ["{TOKEN_A}"]\nmodels = ["*"]\nsalts = ["a"]\n'))
