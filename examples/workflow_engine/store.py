"""The example workflow engine's records: one catalogue of definitions, events per tenant.

Definitions (object types, triggers) form one catalogue shared by all tenants,
as modules declare them once; events are kept per tenant, deduplicated by
idempotency key.

Small on purpose: every change rewrites the file atomically (write, fsync,
rename), so a crash never leaves half a file. Without a path it keeps
everything in memory.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class Conflict(Exception):
    """A registration the store cannot accept; the message says why."""


def _object_type_conflict(name: str, old: dict[str, Any], new: dict[str, Any]) -> str | None:
    if old["source"] != new["source"]:
        return f"object type {name!r} belongs to module {old['source']!r}, not {new['source']!r}"
    if old["id_field"] != new["id_field"]:
        return (f"object type {name!r} id_field cannot change from {old['id_field']!r} "
                f"to {new['id_field']!r}")
    return None


def _trigger_conflict(name: str, old: dict[str, Any], new: dict[str, Any]) -> str | None:
    if old["source"] != new["source"]:
        return f"trigger {name!r} belongs to module {old['source']!r}, not {new['source']!r}"
    if old["object_type"] != new["object_type"]:
        return (f"trigger {name!r} fires on object type {old['object_type']!r}, "
                f"not {new['object_type']!r}")
    new_fields = {f["name"]: f for f in new["fields"]}
    for field in old["fields"]:
        kept = new_fields.get(field["name"])
        if kept is None:
            return f"trigger {name!r} cannot drop field {field['name']!r}: workflows may use it"
        if field["required"] and not kept["required"]:
            return f"trigger {name!r} cannot make field {field['name']!r} optional"
    return None


class WorkflowStore:
    """Definitions and received events, per tenant."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {"object_types": {}, "triggers": {}, "tenants": {}}
        if self.path is not None and self.path.exists():
            self._data = json.loads(self.path.read_text("utf-8"))

    def _tenant(self, tenant: str) -> dict[str, Any]:
        tenants: dict[str, Any] = self._data["tenants"]
        records: dict[str, Any] = tenants.setdefault(
            tenant, {"events": [], "keys": {}, "duplicates": 0})
        return records

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(self._data, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)

    def register(self, kind: str, name: str, definition: dict[str, Any]) -> str:
        """Store one definition; returns created, updated or unchanged; raises Conflict."""
        check = _object_type_conflict if kind == "object_types" else _trigger_conflict
        with self._lock:
            table = self._data[kind]
            old = table.get(name)
            if old is not None:
                reason = check(name, old, definition)
                if reason:
                    raise Conflict(reason)
                if old == definition:
                    return "unchanged"
            if kind == "triggers" and definition["object_type"] not in self._data["object_types"]:
                raise Conflict(f"trigger {name!r} names unregistered object type "
                               f"{definition['object_type']!r}")
            table[name] = definition
            self._save()
            return "created" if old is None else "updated"

    def record_event(self, tenant: str, key: str, event: dict[str, Any]) -> tuple[bool, int]:
        """Record one event unless its idempotency key was seen; (is_new, record id)."""
        with self._lock:
            records = self._tenant(tenant)
            if key in records["keys"]:
                records["duplicates"] += 1
                self._save()
                return False, int(records["keys"][key])
            record_id = len(records["events"]) + 1
            records["events"].append({"id": record_id, "idempotency_key": key,
                                      "received_at": time.time(), **event})
            records["keys"][key] = record_id
            self._save()
            return True, record_id

    def trigger(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._data["triggers"].get(name)
            return copy.deepcopy(found) if found is not None else None

    def definitions(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy({"object_types": self._data["object_types"],
                                  "triggers": self._data["triggers"]})

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(self._data["tenants"])

    def events(self, tenant: str) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(self._tenant(tenant)["events"])

    def duplicates(self, tenant: str) -> int:
        with self._lock:
            return int(self._tenant(tenant)["duplicates"])
