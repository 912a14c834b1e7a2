"""Declaring object types and triggers, and registering them with the example engine on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from examples.mail_module import registry as mail_registry

from conveyor.consumers.engine_client import AsyncEngineClient
from conveyor.errors import ConfigError, InvalidInputError
from conveyor.workflow import (
    Field,
    HttpWorkflowAdapter,
    RegistrationReport,
    WorkflowConflictError,
    WorkflowError,
    WorkflowRegistry,
)

from .conftest import JWT_SECRET, ROOT, EngineHandle

MAIL_LABELS = ["object_type:message", "object_type:thread", "trigger:mail.received",
               "trigger:mail.delivery_failed", "trigger:mail.deadline_reached"]


def _mail(description: str = "A message arrived in a mailbox") -> WorkflowRegistry:
    registry = WorkflowRegistry(source="mail")
    registry.object_type("message", id_field="message_id")
    registry.trigger("mail.received", object_type="message", description=description,
                     fields=["thread_id", "mailbox"])
    return registry


async def _register(client: AsyncEngineClient, registry: WorkflowRegistry) -> RegistrationReport:
    return await registry.register_all(HttpWorkflowAdapter(client))


# ------------------------------------------------------------ declaring


def test_trigger_gets_its_object_ids_field_and_a_publish_method() -> None:
    registry = WorkflowRegistry(source="mail")
    registry.object_type("thread")
    trigger = registry.trigger("mail.deadline_reached", object_type="thread", fields=["deadline"])
    assert trigger.field_names == ("thread_id", "deadline")
    assert trigger.method == "publish_deadline_reached"
    assert registry.trigger_for_method("publish_deadline_reached") is trigger


def test_trigger_on_an_undeclared_object_type_is_refused() -> None:
    registry = WorkflowRegistry(source="mail")
    with pytest.raises(ConfigError, match="undeclared object type 'message'"):
        registry.trigger("mail.received", object_type="message")


def test_duplicate_declarations_are_refused() -> None:
    registry = _mail()
    with pytest.raises(ConfigError, match="object type 'message' is already declared"):
        registry.object_type("message")
    with pytest.raises(ConfigError, match=r"trigger 'mail\.received' is already declared"):
        registry.trigger("mail.received", object_type="message")


def test_two_triggers_publishing_under_one_method_name_are_refused() -> None:
    registry = _mail()
    with pytest.raises(ConfigError, match="would both publish as 'publish_received'"):
        registry.trigger("sms.received", object_type="message")
    registry.trigger("sms.received", object_type="message", method="publish_sms_received")


@pytest.mark.parametrize("bad", ["Mail.Received", "received", "mail..received", "mail.re ceived"])
def test_malformed_trigger_names_are_refused(bad: str) -> None:
    registry = _mail()
    with pytest.raises(ConfigError, match="invalid trigger name"):
        registry.trigger(bad, object_type="message")


def test_field_names_of_the_publish_keywords_are_reserved() -> None:
    with pytest.raises(ConfigError, match="field name 'tenant' is reserved"):
        Field(name="tenant")


def test_unknown_trigger_lookup_names_it_and_the_known_ones() -> None:
    with pytest.raises(InvalidInputError, match="'mail.sent' is not registered in 'mail'"
                                                r".*mail\.received"):
        mail_registry.get_trigger("mail.sent")


# ---------------------------------------------------------- registering


async def test_first_registration_creates_every_definition(
        running_engine: EngineHandle, engine_client: AsyncEngineClient) -> None:
    report = await _register(engine_client, mail_registry)
    assert report.created == MAIL_LABELS
    assert (report.updated, report.unchanged, report.conflicts) == ([], [], [])
    catalogue = running_engine.engine.store.definitions()
    assert sorted(catalogue["triggers"]) == sorted(t.name for t in mail_registry.triggers)
    assert catalogue["triggers"]["mail.received"]["fields"][0]["name"] == "message_id"


async def test_second_registration_changes_nothing(
        running_engine: EngineHandle, engine_client: AsyncEngineClient) -> None:
    await _register(engine_client, mail_registry)
    before = running_engine.engine.store.definitions()
    report = await _register(engine_client, mail_registry)
    assert report.unchanged == MAIL_LABELS
    assert not report.changed and report.summary() == "created 0, updated 0, unchanged 5"
    assert running_engine.engine.store.definitions() == before


async def test_a_new_description_is_reported_as_updated(
        running_engine: EngineHandle, engine_client: AsyncEngineClient) -> None:
    await _register(engine_client, _mail())
    report = await _register(engine_client, _mail(description="New wording"))
    assert report.updated == ["trigger:mail.received"]
    assert report.unchanged == ["object_type:message"]


async def test_a_definition_owned_by_another_module_is_a_conflict(
        running_engine: EngineHandle, engine_client: AsyncEngineClient) -> None:
    await _register(engine_client, mail_registry)
    crm = WorkflowRegistry(source="crm")
    crm.object_type("message", id_field="message_id")
    crm.object_type("contact")
    with pytest.raises(WorkflowConflictError) as caught:
        await _register(engine_client, crm)
    error = caught.value
    assert "object_type:message: object type 'message' belongs to module 'mail', not 'crm'" \
        in str(error)
    assert error.report is not None and error.report.created == ["object_type:contact"]
    assert len(error.conflicts) == 1


async def test_dropping_a_field_or_moving_a_trigger_is_a_conflict(
        running_engine: EngineHandle, engine_client: AsyncEngineClient) -> None:
    await _register(engine_client, mail_registry)
    changed = WorkflowRegistry(source="mail")
    changed.object_type("message", description="One e-mail message in a mailbox",
                        id_field="message_id")
    changed.object_type("thread", description="A conversation of messages", id_field="thread_id")
    changed.trigger("mail.received", object_type="message", fields=["thread_id"])
    changed.trigger("mail.deadline_reached", object_type="message", fields=["deadline"])
    with pytest.raises(WorkflowConflictError) as caught:
        await _register(engine_client, changed)
    assert len(caught.value.conflicts) == 2
    message = str(caught.value)
    assert "cannot drop field 'mailbox'" in message
    assert "fires on object type 'thread', not 'message'" in message


async def test_a_wrong_secret_is_refused_by_the_engine(running_engine: EngineHandle) -> None:
    config = running_engine.config(jwt_secret="another-secret-of-at-least-32-bytes!!")
    async with AsyncEngineClient(config) as client:
        with pytest.raises(WorkflowError, match="answered 401: invalid token"):
            await _register(client, mail_registry)


def _cli(args: list[str], engine_url: str, secret: str = JWT_SECRET) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CONVEYOR_WORKFLOW_ENGINE_URL=engine_url,
               CONVEYOR_WORKFLOW_JWT_SECRET=secret)
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", "workflow", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_cli_register_creates_then_changes_nothing(running_engine: EngineHandle) -> None:
    args = ["register", "--app", "examples.mail_module:registry"]
    first = _cli(args, running_engine.url)
    assert first.returncode == 0, first.stderr
    assert "created   trigger:mail.received" in first.stdout
    assert first.stdout.strip().endswith("created 5, updated 0, unchanged 0")
    second = _cli([*args, "--json"], running_engine.url)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["unchanged"] == MAIL_LABELS


def test_cli_register_reports_a_conflict_and_exits_1(running_engine: EngineHandle) -> None:
    running_engine.engine.store.register(
        "object_types", "message", {"source": "crm", "description": "", "id_field": "message_id"})
    result = _cli(["register", "--app", "examples.mail_module:registry"], running_engine.url)
    assert result.returncode == 1
    assert result.stderr.startswith("conveyor: error: 1 workflow definition(s) of 'mail' conflict"), \
        result.stderr
    assert "belongs to module 'crm'" in result.stderr


def test_cli_register_refuses_what_is_not_a_registry(running_engine: EngineHandle) -> None:
    result = _cli(["register", "--app", "examples.mail_module:publisher"], running_engine.url)
    assert result.returncode == 1
    assert "is a WorkflowPublisher, not a WorkflowRegistry" in result.stderr


def test_cli_mirrors_the_workflow_defaults_it_does_not_import() -> None:
    # cli/multi.py keeps copies so a worker never imports httpx and PyJWT.
    from conveyor.cli import workflow_command
    from conveyor.workflow.adapters import REGISTRATION_TENANT_DEFAULT
    from conveyor.workflow.publisher import TOPIC_PREFIX_DEFAULT

    assert workflow_command.REGISTRATION_TENANT_DEFAULT == REGISTRATION_TENANT_DEFAULT
    assert workflow_command.TOPIC_PREFIX_DEFAULT == TOPIC_PREFIX_DEFAULT
