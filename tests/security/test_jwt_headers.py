"""S5 additions to tests/e2e/test_engine_auth.py: key material in the JWT header
(kid, jku, jwk, x5u) is ignored, and asymmetric algorithms (RS256, ES256, PS256,
EdDSA), including the RS256-with-the-secret confusion, are refused by the
example engine over real HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import RSAAlgorithm

from server_support import MakeDb

e2e = pytest.importorskip("e2e.conftest", reason="needs tests/e2e on the path")

pytestmark = pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")

ATTACKER_SECRET = "attacker-controlled-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def engine_api(make_db: MakeDb, template_db: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with make_db(prefix="conveyor_jwt_", template=template_db) as url:
        engine = e2e.EngineProcess(url, Path(tmp_path_factory.mktemp("engine")) / "engine.log")
        try:
            engine.start()
            api = e2e.Api(engine.url)
            yield api
            api.close()
        finally:
            engine.stop()


def _claims(tenant: str = "acme") -> dict[str, Any]:
    now = int(time.time())
    return {"iss": "engine", "aud": "engine", "sub": f"user:{tenant}:1", "iat": now,
            "exp": now + 300, "tenant": tenant, "role": "user"}


def _create(api: Any, bearer: str) -> int:
    return int(api.call("POST", "/api/filejobs", json={"file": "h.xlsx"}, bearer=bearer).status_code)


def test_control_a_plain_hs256_token_is_accepted(engine_api: Any) -> None:
    assert _create(engine_api, jwt.encode(_claims(), e2e.SECRET, algorithm="HS256")) == 201


@pytest.mark.parametrize("header", [
    {"kid": "attacker"},
    {"kid": "../../../../dev/null"},
    {"kid": "' UNION SELECT 'x"},
    {"jku": "http://127.0.0.1:1/jwks.json"},
    {"x5u": "http://127.0.0.1:1/cert.pem"},
    {"jwk": {"kty": "oct", "k": "YXR0YWNrZXItY29udHJvbGxlZC1zZWNyZXQtMDEyMzQ1Njc4OWFiY2RlZg"}},
], ids=["kid", "kid-path", "kid-sql", "jku", "x5u", "jwk-oct"])
def test_header_key_material_is_ignored(engine_api: Any, header: dict[str, Any]) -> None:
    # Signed with the attacker's key, which the header points to: refused.
    forged = jwt.encode(_claims(), ATTACKER_SECRET, algorithm="HS256", headers=header)
    assert _create(engine_api, forged) == 401
    # The same header on a token signed with the real secret changes nothing either way.
    genuine = jwt.encode(_claims(), e2e.SECRET, algorithm="HS256", headers=header)
    assert _create(engine_api, genuine) == 201


def test_embedded_rsa_jwk_is_ignored(engine_api: Any) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
    forged = jwt.encode(_claims(), key, algorithm="RS256", headers={"jwk": jwk})
    assert _create(engine_api, forged) == 401


@pytest.mark.parametrize("alg", ["RS256", "PS256", "ES256", "EdDSA"])
def test_asymmetric_algorithms_are_refused(engine_api: Any, alg: str) -> None:
    key: Any
    if alg in ("RS256", "PS256"):
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    elif alg == "ES256":
        key = ec.generate_private_key(ec.SECP256R1())
    else:
        key = ed25519.Ed25519PrivateKey.generate()
    assert _create(engine_api, jwt.encode(_claims(), key, algorithm=alg)) == 401


def test_alg_confusion_hs256_header_over_an_rs256_shape_is_refused(engine_api: Any) -> None:
    # The classic confusion: alg switched in the header, signature made with
    # something the attacker knows. Only the shared secret verifies.
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rs = jwt.encode(_claims(), key, algorithm="RS256")
    header, payload, sig = rs.split(".")
    hs_header = jwt.utils.base64url_encode(b'{"alg":"HS256","typ":"JWT"}').decode()
    assert _create(engine_api, f"{hs_header}.{payload}.{sig}") == 401
    assert _create(engine_api, f"{header}.{payload}.") == 401

