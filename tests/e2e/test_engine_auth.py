"""The example engine over real HTTP (uvicorn on loopback): JWT verification, tenants, RBAC,
idempotent writes, and the outbox event committed in the create's own transaction."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from conveyor.consumers.engine_client import EngineClient, EngineConfig, mint_service_token

from .conftest import DOMAIN, SECRET, Api, EngineProcess, query, token

SERVICE = "conveyor-service"
# HS384/HS512 tokens are minted on purpose with a key shorter than those algorithms like.
pytestmark = pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")


@pytest.fixture(scope="module")
def api(module_engine: EngineProcess) -> Iterator[Api]:
    client = Api(module_engine.url)
    yield client
    client.close()


@pytest.fixture
def db(module_db: str) -> str:
    return module_db


def new_job(api: Api, tenant: str = "acme", name: str = "in.xlsx") -> int:
    return int(api.create(tenant, "filejobs", name)["id"])


def events_for(db: str, topic: str, tenant: str, row_id: int) -> list[tuple[Any, ...]]:
    return query(db, "SELECT id, state, payload, xmin::text FROM conveyor.events "
                     "WHERE topic = %s AND tenant = %s AND payload->>'id' = %s",
                 (topic, tenant, str(row_id)))


def b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


# ------------------------------------------------------------------ the token itself


def test_valid_user_token_creates(api: Api) -> None:
    reply = api.call("POST", "/api/filejobs", json={"file": "a.xlsx"})
    assert reply.status_code == 201, reply.text
    body = reply.json()
    assert body["tenant"] == "acme" and body["file"] == "a.xlsx" and body["status"] == "pending"
    got = api.call("GET", f"/api/filejobs/{body['id']}")
    assert got.status_code == 200 and got.json()["id"] == body["id"]


@pytest.mark.parametrize("algorithm", ["HS512", "HS384", "none"])
def test_other_algorithm_refused(api: Api, algorithm: str) -> None:
    reply = api.call("POST", "/api/filejobs", json={"file": "a.xlsx"},
                     bearer=token(algorithm=algorithm))
    assert reply.status_code == 401, reply.text


def test_unsigned_token_forged_by_hand_refused(api: Api) -> None:
    now = int(time.time())
    claims = {"iss": "engine", "aud": "engine", "sub": "x", "iat": now, "exp": now + 60,
              "tenant": "acme", "role": "admin"}
    for alg in ("none", "None", "NONE"):
        forged = f"{b64({'alg': alg, 'typ': 'JWT'})}.{b64(claims)}."
        reply = api.call("POST", "/api/filejobs", json={"file": "a.xlsx"}, bearer=forged)
        assert reply.status_code == 401, (alg, reply.text)


def test_expired_beyond_leeway_refused_within_leeway_accepted(api: Api) -> None:
    now = int(time.time())
    expired = token(iat=now - 120, exp=now - 30)
    assert api.call("POST", "/api/filejobs", json={"file": "a.xlsx"},
                    bearer=expired).status_code == 401
    just_expired = token(iat=now - 120, exp=now - 2)  # leeway is 5 s
    reply = api.call("POST", "/api/filejobs", json={"file": "a.xlsx"}, bearer=just_expired)
    assert reply.status_code == 201, reply.text


def test_token_from_the_future_refused(api: Api) -> None:
    now = int(time.time())
    assert api.call("GET", "/api/filejobs/1",
                    bearer=token(iat=now + 600, exp=now + 900)).status_code == 401
    assert api.call("GET", "/api/filejobs/1",
                    bearer=token(nbf=now + 600)).status_code == 401


@pytest.mark.parametrize("claim", ["exp", "iat", "iss", "aud", "sub"])
def test_missing_required_claim_refused(api: Api, claim: str) -> None:
    reply = api.call("POST", "/api/filejobs", json={"file": "a.xlsx"}, bearer=token(drop=(claim,)))
    assert reply.status_code == 401, reply.text


@pytest.mark.parametrize(("claim", "value"), [
    ("aud", "other-api"), ("aud", ["other-api"]), ("iss", "evil"), ("iss", ""),
])
def test_wrong_audience_or_issuer_refused(api: Api, claim: str, value: Any) -> None:
    reply = api.call("POST", "/api/filejobs", json={"file": "a.xlsx"},
                     bearer=token(**{claim: value}))
    assert reply.status_code == 401, reply.text


def test_wrong_secret_refused(api: Api) -> None:
    for secret in (SECRET[:-1] + "X", "another-secret-of-enough-length-0123456789"):
        reply = api.call("POST", "/api/filejobs", json={"file": "a.xlsx"},
                         bearer=token(secret=secret))
        assert reply.status_code == 401, reply.text


def test_tampered_claims_refused(api: Api) -> None:
    header, _, signature = token(role="user").split(".")
    now = int(time.time())
    forged = b64({"iss": "engine", "aud": "engine", "sub": "x", "iat": now, "exp": now + 60,
                  "tenant": "acme", "role": "admin"})
    assert api.call("POST", "/api/filejobs", json={"file": "a.xlsx"},
                    bearer=f"{header}.{forged}.{signature}").status_code == 401


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Basic dXNlcjpwdw==",
                                           "Bearer not.a.jwt", "bearer x"])
def test_missing_or_malformed_authorization_refused(api: Api, authorization: str | None) -> None:
    headers = {"Host": f"acme.{DOMAIN}"}
    if authorization is not None:
        headers["Authorization"] = authorization
    reply = api.http.post("/api/filejobs", json={"file": "a.xlsx"}, headers=headers)
    assert reply.status_code == 401, reply.text


# ------------------------------------------------------------------ tenants


def test_token_for_another_tenant_forbidden(api: Api, db: str) -> None:
    job = new_job(api, "acme")
    other = token("globex")
    assert api.call("GET", f"/api/filejobs/{job}", bearer=other).status_code == 403
    assert api.call("POST", "/api/filejobs", json={"file": "a.xlsx"},
                    bearer=other).status_code == 403
    assert api.call("GET", f"/api/filejobs/{job}",
                    bearer=token(drop=("tenant",))).status_code == 403
    # And the other tenant's own Host cannot see acme's row either.
    assert api.call("GET", f"/api/filejobs/{job}", tenant="globex").status_code == 404


@pytest.mark.parametrize("host", ["initech.app.test", "app.test", "acme.other.test", "acme",
                                  ".app.test", "-acme.app.test", "a_b.app.test",
                                  "x.acme.app.test"])
def test_unknown_tenant_host_not_found(api: Api, host: str) -> None:
    tenant = host.split(".")[0] or "acme"
    reply = api.call("POST", "/api/filejobs", host=host, json={"file": "a.xlsx"},
                     bearer=token(tenant))
    assert reply.status_code == 404, reply.text


def test_host_with_port_and_case_resolves(api: Api) -> None:
    reply = api.call("POST", "/api/filejobs", host=f"ACME.{DOMAIN}:8443", json={"file": "a.xlsx"})
    assert reply.status_code == 201, reply.text


# ------------------------------------------------------------------ RBAC


def test_service_role_reads_and_updates_filejobs_only(api: Api) -> None:
    job = new_job(api)
    svc = token(role=SERVICE, sub="service:conveyor", iss="conveyor")
    got = api.call("GET", f"/api/filejobs/{job}", bearer=svc)
    assert got.status_code == 200, got.text
    patched = api.call("PATCH", f"/api/filejobs/{job}", bearer=svc,
                       json={"status": "done", "result": {"rows": 1}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["status"] == "done" and patched.json()["result"] == {"rows": 1}
    create = api.call("POST", "/api/filejobs", bearer=svc, json={"file": "a.xlsx"})
    assert create.status_code == 403, create.text
    mail = api.call("POST", "/api/emails", bearer=svc,
                    json={"to": "a@example.com", "template": "welcome", "data": {}})
    assert mail.status_code == 403, mail.text


@pytest.mark.parametrize("role", ["user", "viewer", "", "ADMIN", None])
def test_user_and_unknown_roles_may_not_patch(api: Api, role: str | None) -> None:
    job = new_job(api)
    bearer = token(role=role) if role is not None else token(drop=("role",))
    reply = api.call("PATCH", f"/api/filejobs/{job}", bearer=bearer, json={"status": "done"})
    assert reply.status_code == 403, reply.text
    assert api.call("GET", f"/api/filejobs/{job}").json()["status"] == "pending"


def test_unknown_role_may_do_nothing(api: Api) -> None:
    bearer = token(role="viewer")
    assert api.call("POST", "/api/filejobs", bearer=bearer,
                    json={"file": "a.xlsx"}).status_code == 403
    assert api.call("GET", "/api/filejobs/1", bearer=bearer).status_code == 403


def test_minted_service_tokens_accepted(api: Api, module_engine: EngineProcess) -> None:
    job = new_job(api, "globex")
    config = EngineConfig(base_url=module_engine.url, tenant_domain=DOMAIN, jwt_secret=SECRET)
    minted = mint_service_token(config, "globex")
    assert api.call("GET", f"/api/filejobs/{job}", tenant="globex",
                    bearer=minted).status_code == 200
    # The library's own client, as the worker uses it: reads and writes pass.
    with EngineClient(config) as client:
        assert client.request("globex", "GET", f"/api/filejobs/{job}").status == 200
        reply = client.request("globex", "PATCH", f"/api/filejobs/{job}",
                               json={"status": "failed", "error": "nope"})
        assert reply.status == 200 and reply.body["status"] == "failed", reply
        assert reply.body["error"] == "nope"
        # ...and what the role may not do is refused to it too.
        assert client.request("globex", "POST", "/api/filejobs",
                              json={"file": "x.xlsx"}).status == 403
        assert client.request("globex", "POST", "/api/emails",
                              json={"to": "a@example.com", "template": "welcome"}).status == 403
        # A token minted for globex does not open acme.
        assert client.request("acme", "GET", f"/api/filejobs/{job}").status == 404
    # A minted token whose TTL ran out (beyond the leeway) is refused.
    stale = mint_service_token(config, "globex", now=time.time() - 120)
    assert api.call("GET", f"/api/filejobs/{job}", tenant="globex",
                    bearer=stale).status_code == 401


def test_tasks_follow_the_same_rules(api: Api) -> None:
    task = api.create("acme", "tasks", "write the report")
    assert task["title"] == "write the report"
    svc = token(role=SERVICE)
    assert api.call("PATCH", f"/api/tasks/{task['id']}", bearer=svc,
                    json={"status": "done"}).status_code == 200
    assert api.call("POST", "/api/tasks", bearer=svc, json={"title": "t"}).status_code == 403
    assert api.call("PATCH", f"/api/tasks/{task['id']}",
                    json={"status": "done"}).status_code == 403
    assert api.call("POST", "/api/nothing", json={"title": "t"}).status_code == 404


# ------------------------------------------------------------------ idempotent writes


def test_patch_replayed_with_same_key_returns_first_answer(api: Api) -> None:
    job = new_job(api)
    svc = token(role=SERVICE)
    key = {"Idempotency-Key": f"e2e-replay-{job}"}
    first = api.call("PATCH", f"/api/filejobs/{job}", bearer=svc, headers=key,
                     json={"status": "done", "result": {"rows": 3}})
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers
    again = api.call("PATCH", f"/api/filejobs/{job}", bearer=svc, headers=key,
                     json={"status": "failed", "error": "second try"})
    assert again.status_code == 200
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.json() == first.json()
    row = api.call("GET", f"/api/filejobs/{job}").json()
    assert row["status"] == "done" and row["result"] == {"rows": 3} and row["error"] is None
    # Keys are per tenant: the same key on globex is a new write.
    other = new_job(api, "globex")
    fresh = api.call("PATCH", f"/api/filejobs/{other}", tenant="globex",
                     bearer=token("globex", SERVICE), headers=key, json={"status": "failed"})
    assert fresh.status_code == 200 and "idempotent-replayed" not in fresh.headers
    assert fresh.json()["status"] == "failed"


def test_concurrent_patches_with_one_key_all_get_the_first_answer(api: Api) -> None:
    """A redelivered event racing its first delivery: one write, every caller the same answer."""
    racers = 8
    clients = [Api(str(api.http.base_url)) for _ in range(racers)]
    try:
        for client in clients:  # warm connections, so the PATCHes leave together
            client.call("GET", "/api/filejobs/0")
        failures = []
        for round_ in range(5):
            job = new_job(api)
            key = {"Idempotency-Key": f"e2e-race-{job}"}
            barrier = threading.Barrier(racers)

            def patch(i: int, job: int = job, key: dict[str, str] = key,
                      barrier: threading.Barrier = barrier) -> tuple[int, Any]:
                bearer = token(role=SERVICE)
                barrier.wait(timeout=10)
                reply = clients[i].call("PATCH", f"/api/filejobs/{job}", bearer=bearer,
                                        headers=key, json={"status": "done", "result": {"i": i}})
                return reply.status_code, reply.json() if reply.status_code == 200 else reply.text

            with ThreadPoolExecutor(racers) as pool:
                answers = list(pool.map(patch, range(racers)))
            statuses = [status for status, _ in answers]
            bodies = {json.dumps(body, sort_keys=True) for _, body in answers}
            if statuses != [200] * racers or len(bodies) != 1:
                failures.append((round_, statuses, len(bodies)))
        assert not failures, failures
    finally:
        for client in clients:
            client.close()


# ------------------------------------------------------------------ the outbox


def test_create_commits_exactly_one_event_in_the_same_transaction(api: Api, db: str) -> None:
    for resource, tenant in (("filejobs", "acme"), ("tasks", "globex")):
        value = "jobs/q3.xlsx" if resource == "filejobs" else "call back"
        row = api.create(tenant, resource, value)
        events = events_for(db, f"{resource}.created", tenant, row["id"])
        assert len(events) == 1, events
        _, state, payload, event_xmin = events[0]
        assert state == "pending" and payload == {"id": row["id"]}
        table = "engine.filejobs" if resource == "filejobs" else "engine.tasks"
        (row_xmin,), = query(db, f"SELECT xmin::text FROM {table} WHERE id = %s", (row["id"],))
        # Same inserting transaction id: the row and its event were committed together.
        assert row_xmin == event_xmin


def test_email_request_enqueues_one_event(api: Api, db: str) -> None:
    event_id = api.email("globex", "ann@example.com", "welcome", {"name": "Ann"})
    rows = query(db, "SELECT topic, tenant, payload FROM conveyor.events WHERE id = %s",
                 (event_id,))
    assert rows == [("email.send", "globex",
                     {"to": "ann@example.com", "template": "welcome", "data": {"name": "Ann"}})]


def event_count(db: str) -> int:
    return int(query(db, "SELECT count(*) FROM conveyor.events")[0][0])


def row_counts(db: str) -> tuple[int, int]:
    (jobs,), = query(db, "SELECT count(*) FROM engine.filejobs")
    (tasks,), = query(db, "SELECT count(*) FROM engine.tasks")
    return int(jobs), int(tasks)


@pytest.mark.parametrize(("path", "body", "status", "raw"), [
    ("/api/filejobs", {}, 422, None),
    ("/api/filejobs", {"file": ""}, 422, None),
    ("/api/filejobs", {"file": 7}, 422, None),
    ("/api/filejobs", {"file": "x" * 2000}, 422, None),
    ("/api/tasks", {"file": "wrong field"}, 422, None),
    ("/api/filejobs", None, 400, b"{not json"),
    ("/api/filejobs", None, 400, b"[1, 2]"),
    ("/api/emails", {"to": "a@example.com", "template": "welcome", "data": "x" * 2_000_000},
     422, None),
])
def test_failed_create_leaves_no_event(api: Api, db: str, path: str, body: Any, status: int,
                                       raw: bytes | None) -> None:
    before = (event_count(db), row_counts(db))
    headers = {"Host": f"acme.{DOMAIN}", "Authorization": f"Bearer {token()}",
               "Content-Type": "application/json"}
    if raw is not None:
        reply = api.http.post(path, content=raw, headers=headers)
    else:
        reply = api.http.post(path, json=body, headers=headers)
    assert reply.status_code == status, reply.text
    assert (event_count(db), row_counts(db)) == before


def test_refused_create_leaves_no_row_and_no_event(api: Api, db: str) -> None:
    before = (event_count(db), row_counts(db))
    assert api.call("POST", "/api/filejobs", json={"file": "a"},
                    bearer=token(algorithm="HS512")).status_code == 401
    assert api.call("POST", "/api/filejobs", json={"file": "a"},
                    bearer=token("globex")).status_code == 403
    assert api.call("POST", "/api/filejobs", json={"file": "a"},
                    host="initech.app.test").status_code == 404
    assert (event_count(db), row_counts(db)) == before


def test_create_failing_inside_the_transaction_leaves_neither(api: Api, db: str) -> None:
    """A value PostgreSQL refuses (NUL) fails inside the transaction: no row, no event, no 500."""
    before = (event_count(db), row_counts(db))
    reply = api.call("POST", "/api/tasks", json={"title": "a\u0000b"})
    assert reply.status_code in (400, 422), (reply.status_code, reply.text)
    assert (event_count(db), row_counts(db)) == before


@pytest.mark.parametrize("body", [{"status": "failed", "error": "bad\u0000reason"},
                                  {"status": "done", "result": {"k": "v\u0000"}},
                                  {"status": "finished"}, {"result": {}}])
def test_patch_with_a_refused_value_changes_nothing(api: Api, body: dict[str, Any]) -> None:
    job = new_job(api)
    key = {"Idempotency-Key": f"e2e-bad-{job}"}
    reply = api.call("PATCH", f"/api/filejobs/{job}", bearer=token(role=SERVICE), headers=key,
                     json=body)
    assert reply.status_code == 422, (reply.status_code, reply.text)
    assert api.call("GET", f"/api/filejobs/{job}").json()["status"] == "pending"
    # The refusal was not recorded as the key's answer: a valid retry applies.
    retry = api.call("PATCH", f"/api/filejobs/{job}", bearer=token(role=SERVICE), headers=key,
                     json={"status": "done"})
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    assert retry.json()["status"] == "done"


def test_idempotency_key_reused_on_another_row_is_refused(api: Api) -> None:
    first, second = new_job(api), new_job(api)
    svc = token(role=SERVICE)
    key = {"Idempotency-Key": f"e2e-reuse-{first}"}
    assert api.call("PATCH", f"/api/filejobs/{first}", bearer=svc, headers=key,
                    json={"status": "done"}).status_code == 200
    reused = api.call("PATCH", f"/api/filejobs/{second}", bearer=svc, headers=key,
                      json={"status": "done"})
    assert reused.status_code == 422, reused.text
    assert api.call("GET", f"/api/filejobs/{second}").json()["status"] == "pending"
    assert api.call("PATCH", f"/api/tasks/{first}", bearer=svc, headers=key,
                    json={"status": "done"}).status_code == 422


@pytest.mark.parametrize("name", ["../globex/q3.xlsx", "/srv/uploads/globex/q3.xlsx", "a/../b.xlsx",
                                  "./a.xlsx", "a//b.xlsx", "..\\globex\\q3.xlsx", "a\nb.xlsx",
                                  "a\x1bb.xlsx", "a/"])
def test_file_names_that_could_leave_the_tenants_uploads_are_refused(
        api: Api, db: str, name: str) -> None:
    """The worker reads only the tenant's own directory anyway; the engine says so at once."""
    before = (event_count(db), row_counts(db))
    reply = api.call("POST", "/api/filejobs", json={"file": name})
    assert reply.status_code == 422, (reply.status_code, reply.text)
    assert "relative name inside the tenant's uploads" in reply.json()["error"]
    assert (event_count(db), row_counts(db)) == before


def test_plain_and_nested_file_names_are_accepted(api: Api) -> None:
    for name in ("q3.xlsx", "2026/q3 final.xlsx", "informes/año/q3.xlsx", "globex/q3.xlsx"):
        assert api.call("POST", "/api/filejobs", json={"file": name}).status_code == 201, name
