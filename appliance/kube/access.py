"""What RBAC refuses this program, as the API server's 403s show it, for the readiness probe.

A 403 means the service account's role lacks a verb. The part that got it carries on as well as
it can: an informer retries, the node status is written again later, an Event is dropped. But
without a record of the refusal the program would stay Ready while it ignores annotations or
cannot report on pods. So every part reports what it was refused (`refused`) and what worked
(`granted`), and `/readyz` fails while `missing()` is not empty, naming each missing verb.

A refusal that nobody retries (an Event is only sent when there is something to report) would
keep the program unready after the role was fixed, so while anything is refused the API server
is asked every `recheck_s` whether it still is (a SelfSubjectAccessReview, which every
authenticated user may create).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from kubernetes import client

log = logging.getLogger(__name__)

RBAC_MANIFEST = "deploy/rbac.yaml"


@dataclass(frozen=True, slots=True, order=True)
class Permission:
    """A verb on a resource (core API group), cluster-wide or in one namespace."""

    verb: str
    resource: str
    namespace: str = ""

    def __str__(self) -> str:
        where = f" in namespace {self.namespace}" if self.namespace else ""
        return f"{self.verb} {self.resource}{where}"


def is_forbidden(exc: BaseException) -> bool:
    return isinstance(exc, client.ApiException) and exc.status == 403


def _server_message(exc: client.ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


class Permissions:
    """The permissions the API server refused and no later request or review has granted."""

    def __init__(self, api_client: Any = None, *, recheck_s: float = 30.0) -> None:
        self._api = client.AuthorizationV1Api(api_client) if api_client is not None else None
        self._recheck_s = recheck_s
        self._refused: dict[Permission, str] = {}  # -> who was refused
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def refused(self, permission: Permission, exc: client.ApiException, *, who: str) -> None:
        """`who` was refused `permission` (a 403): said once, until it is granted."""
        with self._lock:
            new = permission not in self._refused
            self._refused[permission] = who
            if new and self._api is not None and self._thread is None:
                self._thread = threading.Thread(
                    target=self._recheck, name="rbac-recheck", daemon=True
                )
                self._thread.start()
        if new:
            log.error(
                "%s: RBAC forbids %s (the API server said: %s); not ready until this service "
                "account's ClusterRole grants verb %r on resource %r (%s)",
                who,
                permission,
                _server_message(exc),
                permission.verb,
                permission.resource,
                RBAC_MANIFEST,
            )

    def granted(self, permission: Permission) -> None:
        """A request needing `permission` succeeded (or a review says it would)."""
        with self._lock:
            if permission not in self._refused:
                return
            who = self._refused.pop(permission)
        log.info("%s: RBAC allows %s now", who, permission)

    def missing(self) -> list[Permission]:
        with self._lock:
            return sorted(self._refused)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _recheck(self) -> None:
        while not self._stopping.wait(self._recheck_s):
            for permission in self.missing():
                if self._review(permission):
                    self.granted(permission)

    def _review(self, permission: Permission) -> bool:
        assert self._api is not None
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=client.V1ResourceAttributes(
                    verb=permission.verb,
                    resource=permission.resource,
                    namespace=permission.namespace or None,
                    group="",
                )
            )
        )
        try:
            answer = self._api.create_self_subject_access_review(review, _request_timeout=10.0)
        except Exception as exc:  # the next recheck tries again
            log.debug("access review of %s failed: %s", permission, exc)
            return False
        return bool(answer.status and answer.status.allowed)
