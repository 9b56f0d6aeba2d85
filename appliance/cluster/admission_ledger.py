"""What every replica of the MIG-fallback webhook admitted, in one ConfigMap, so that replicas
answering reviews of one burst side by side do not admit the same free devices twice.

A replica's informer shows another replica's admissions only once their pods are created, after
the review has been answered; a burst split between two replicas used to over-admit inside that
window. So each decision reads this ledger, decides with every claim in it, and writes its own
claim back under the ConfigMap's `resourceVersion`: when another replica wrote in between, the
API server answers 409 Conflict and the decision is made again with that replica's claim in it.
The API server is the one arbiter; no clocks or leases are compared.

Each claim is the AdmissionReview's uid, the devices admitted and an expiry (wall clock: the
replicas share no monotonic clock). The webhook writes the uid on the pod too
(`webhook.ADMISSION_ANNOTATION`), so that once an informer shows the pod, the pod counts and the
claim no longer does (for that replica); a writer drops expired claims, and those whose pods
its cache has shown for a while.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client

log = logging.getLogger(__name__)

LEDGER_NAME = "nvshare-mig-admissions"
ATTEMPTS = 32  # decisions made again on conflicts before giving up (each a read and a write)
# A claim whose pod the writer's cache shows is dropped this long after its admission: every
# replica's cache shows the pod by then (milliseconds), and the ledger stays small in a burst.
SEEN_KEEP_S = 5.0

Devices = tuple[tuple[str, int], ...]  # (resource name, count), sorted


@dataclass(frozen=True, slots=True)
class SharedClaim:
    """One replica's admission, as every replica reads it."""

    admission: str  # the AdmissionReview's uid, also on the pod (ADMISSION_ANNOTATION)
    devices: Devices
    expires: float  # wall clock (time.time)
    admitted: float = 0.0  # wall clock; 0: not said (an older writer)


class LedgerUnavailable(RuntimeError):
    """The ledger could not be read or written (RBAC, the API server): decide alone."""


def _decode(data: Mapping[str, str]) -> list[SharedClaim]:
    claims = []
    for key, raw in data.items():
        try:
            doc = json.loads(raw)
            devices = tuple(sorted((str(r), int(n)) for r, n in doc["devices"].items()))
            admitted = float(doc.get("admitted", 0.0))
            claims.append(SharedClaim(key, devices, float(doc["expires"]), admitted))
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("MIG admission ledger: entry %r is not a claim; ignored", key)
    return claims


def _encode(claim: SharedClaim) -> str:
    return json.dumps(
        {
            "devices": dict(claim.devices),
            "expires": round(claim.expires, 3),
            "admitted": round(claim.admitted, 3),
        }
    )


class AdmissionLedger:
    """The ConfigMap `name` in `namespace`, read and written with optimistic concurrency."""

    def __init__(
        self,
        *,
        api_client: Any,
        namespace: str,
        name: str = LEDGER_NAME,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = client.CoreV1Api(api_client)
        self._namespace = namespace
        self._name = name
        self._clock = clock
        # What this replica last wrote (entries, resourceVersion): decided on without a read;
        # if another replica wrote since, the write is a 409 and the next try reads.
        self._last: tuple[dict[str, str], str | None] | None = None

    def now(self) -> float:
        return self._clock()

    def admit(
        self,
        decide: Callable[[list[SharedClaim]], SharedClaim | None],
        *,
        seen: Callable[[str], bool],
    ) -> SharedClaim | None:
        """`decide(claims)` with the claims of every replica whose pods this replica's informer
        does not show yet (`seen(uid)`: it does); its claim (None: nothing to hold) is written
        unless another replica wrote first, then it decides again. Returns the claim written.
        A claim stays until it expires, or until SEEN_KEEP_S after its admission once this
        replica's cache shows its pod: another replica's cache may show it a little later.
        LedgerUnavailable when the API server refuses or cannot be reached."""
        for _ in range(ATTEMPTS):
            data, version = self._last if self._last is not None else self._read()
            self._last = None
            now = self._clock()
            unexpired = [c for c in _decode(data) if c.expires > now]
            shown = {c.admission for c in unexpired if seen(c.admission)}
            claim = decide([c for c in unexpired if c.admission not in shown])
            kept = {
                c.admission: _encode(c)
                for c in unexpired
                if c.admission not in shown or now - c.admitted < SEEN_KEEP_S
            }
            if claim is not None:
                kept[claim.admission] = _encode(claim)
            if claim is None and kept.keys() == data.keys():
                self._last = (data, version)
                return None  # nothing to add, nothing to drop
            if (written := self._write(kept, version)) is not None:
                self._last = (kept, written)
                return claim
        raise LedgerUnavailable(f"{ATTEMPTS} writes lost to other replicas in a row")

    def _read(self) -> tuple[dict[str, str], str | None]:
        """The ledger's entries and resourceVersion (None: it does not exist yet)."""
        try:
            found = self._api.read_namespaced_config_map(self._name, self._namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return {}, None
            raise LedgerUnavailable(self._why(exc, "read")) from None
        except Exception as exc:  # unreachable, timed out
            raise LedgerUnavailable(f"cannot read {self._where}: {exc}") from None
        meta = found.metadata
        return dict(found.data or {}), meta.resource_version if meta is not None else None

    def _write(self, data: dict[str, str], version: str | None) -> str | None:
        """The new resourceVersion; None when another replica wrote first (409: read and
        decide again)."""
        body = client.V1ConfigMap(
            metadata=client.V1ObjectMeta(
                name=self._name,
                namespace=self._namespace,
                resource_version=version,
                labels={"app.kubernetes.io/name": "nvshare"},
            ),
            data=data,
        )
        try:
            if version is None:
                done = self._api.create_namespaced_config_map(self._namespace, body)
            else:
                done = self._api.replace_namespaced_config_map(self._name, self._namespace, body)
        except client.ApiException as exc:
            if exc.status == 409:
                return None
            raise LedgerUnavailable(self._why(exc, "write")) from None
        except Exception as exc:
            raise LedgerUnavailable(f"cannot write {self._where}: {exc}") from None
        return str(done.metadata.resource_version) if done.metadata is not None else None

    @property
    def _where(self) -> str:
        return f"ConfigMap {self._namespace}/{self._name}"

    def _why(self, exc: client.ApiException, verb: str) -> str:
        return f"cannot {verb} {self._where}: HTTP {exc.status} {exc.reason}"
