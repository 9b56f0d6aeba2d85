"""A small, honest Kubernetes API server for tests that have no cluster.

The pod watcher, the events sink and the webhook are tested against the real `kubernetes`
Python client and the real `kubectl`, so the server they talk to must behave like an API
server where it matters to them, including where it says no:

* one global, monotonically increasing resourceVersion; list then watch from a
  resourceVersion with replay; bookmarks; a watch cache that keeps `watch_window_s` of
  history, after which older versions are 410 Gone (`compact()` forgets it at once);
* field selectors limited to the fields Kubernetes supports for each resource (400 otherwise)
  and label selectors;
* `limit`/`continue` paging over a consistent snapshot (a token older than the history is a
  410), except for `resourceVersion=0` lists, which come whole from the watch cache as in 1.32;
* RBAC for service accounts from the roles and bindings given (`load_rbac`, say the rendered
  deploy/ manifests; `token_for` makes a bearer token): anything not granted is a 403, an
  unknown token a 401. A request without credentials is the cluster admin;
* mutating admission for registered MutatingWebhookConfigurations (`admission.register`): the
  webhook is called over HTTPS with the configuration's caBundle, timeout, selectors, CEL
  matchConditions and failurePolicy, its patch applied and its warnings passed on;
* merge, strategic-merge and JSON patches; optimistic concurrency on PUT and PATCH; the
  discovery endpoints kubectl reads;
* server-side field validation, as kubectl's default `--validate=strict` asks for it: the
  OpenAPI v3 documents (`/openapi/v3`, one per group version) list each kind's PATCH with
  the `fieldValidation` parameter, which is all kubectl reads of them, and a create, update or
  patch with `fieldValidation=Strict` is checked against Kubernetes' own schema for that kind
  (kubernetes-validate's, strict: an unknown field is a 400, as a real server says it).

Defaulting is what the tests need of it: resource quantities are stored as strings, and a new
pod's requests default to its limits and its phase to Pending.

What it does not do (and says so here rather than pretending): no validation of object schemas
unless a request asks for it (`fieldValidation=Strict`), and then only of what Kubernetes' JSON
schema says (no semantic checks such as DNS names); no validating admission, strategic-merge
patches replace lists instead of merging them by key, deleting a pod is immediate (no graceful
phase), deleting a namespace keeps its contents. Resources: pods (with pods/status), nodes (with
nodes/status), events, configmaps, namespaces (core/v1); deployments and replicasets (apps/v1)
and jobs (batch/v1), stored and watched like the others, with no controller inside:
`mig_cluster.Controllers` is one.

Use it in-process (`FakeApiServer().start()`, or the `fake_api` fixture in conftest.py), or
standalone: `python tests/kube/fakeapi.py --port 8080 [--seed-node n1 --seed-pods 100]`.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import copy
import datetime as _dt
import http.client
import json
import signal
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Obj = dict[str, Any]
Key = tuple[str, str, str]  # (plural, namespace or "", name)

# plural -> (kind, namespaced, short names)
RESOURCES: dict[str, tuple[str, bool, list[str]]] = {
    "pods": ("Pod", True, ["po"]),
    "nodes": ("Node", False, ["no"]),
    "events": ("Event", True, ["ev"]),
    "configmaps": ("ConfigMap", True, ["cm"]),
    "namespaces": ("Namespace", False, ["ns"]),
    "deployments": ("Deployment", True, ["deploy"]),
    "replicasets": ("ReplicaSet", True, ["rs"]),
    "jobs": ("Job", True, []),
}
# The API group and version each resource is served under ("v1": the core group).
GROUP_VERSIONS: dict[str, str] = {
    "deployments": "apps/v1",
    "replicasets": "apps/v1",
    "jobs": "batch/v1",
}


def api_version(plural: str) -> str:
    return GROUP_VERSIONS.get(plural, "v1")


SUBRESOURCES = {
    ("pods", "status"),
    ("nodes", "status"),
    ("deployments", "status"),
    ("replicasets", "status"),
    ("jobs", "status"),
}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
ADMIN = "kubernetes-admin"  # who a request without credentials is
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


class ApiError(Exception):
    """An error answered as a core/v1 Status object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- patches


def merge_patch(target: Any, patch: Any, *, strategic: bool = False) -> Any:
    """RFC 7386 JSON merge patch; strategic mode also drops `$directive` keys."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if strategic and k.startswith("$"):
            continue
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v, strategic=strategic)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    cur = doc
    for p in parts[:-1]:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        elif isinstance(cur, list) and p.isdigit() and int(p) < len(cur):
            cur = cur[int(p)]
        else:
            raise ApiError(422, "Invalid", f"JSON patch path {path!r}: {p!r} does not exist")
    return cur


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise ApiError(422, "Invalid", f"JSON patch path {path!r} does not exist")


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    parent = _parent(doc, parts, path)
    last = parts[-1] if parts else ""
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise ApiError(422, "Invalid", f"JSON patch remove: {path!r} does not exist")


def _add(doc: Any, path: str, value: Any, *, replace: bool) -> Any:
    parts = _pointer(path)
    if not parts:
        return copy.deepcopy(value)
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise ApiError(422, "Invalid", f"JSON patch replace: {path!r} does not exist")
        parent[last] = copy.deepcopy(value)
    elif isinstance(parent, list):
        if last == "-" and not replace:
            parent.append(copy.deepcopy(value))
        elif last.isdigit() and int(last) <= len(parent) - (1 if replace else 0):
            if replace:
                parent[int(last)] = copy.deepcopy(value)
            else:
                parent.insert(int(last), copy.deepcopy(value))
        else:
            raise ApiError(422, "Invalid", f"JSON patch: index in {path!r} is out of range")
    else:
        raise ApiError(422, "Invalid", f"JSON patch: parent of {path!r} is not a container")
    return doc


def json_patch(doc: Obj, ops: Any) -> Obj:
    """RFC 6902 JSON patch: add, remove, replace, test, move, copy."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")
    out: Any = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiError(422, "Invalid", f"JSON patch operation {op!r} needs op and path")
        kind, path = op["op"], op["path"]
        if kind == "add":
            out = _add(out, path, op.get("value"), replace=False)
        elif kind == "replace":
            out = _add(out, path, op.get("value"), replace=True)
        elif kind == "remove":
            _remove(out, path)
        elif kind == "test":
            if _get(out, path) != op.get("value"):
                raise ApiError(422, "Invalid", f"JSON patch test failed at {path!r}")
        elif kind in ("move", "copy"):
            src = op.get("from", "")
            value = _remove(out, src) if kind == "move" else copy.deepcopy(_get(out, src))
            out = _add(out, path, value, replace=False)
        else:
            raise ApiError(422, "Invalid", f"JSON patch operation {kind!r} is not supported")
    if not isinstance(out, dict):
        raise ApiError(422, "Invalid", "JSON patch replaced the object with a non-object")
    return out


# ---------------------------------------------------------------- selectors


def _field(obj: Obj, dotted: str) -> str:
    cur: Any = obj
    for part in dotted.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


# What the API server lets each resource be selected by (besides metadata.name and
# metadata.namespace, which every resource has); anything else is a 400, as on a real one.
FIELD_LABELS: dict[str, dict[str, str]] = {
    "pods": {
        f: f
        for f in (
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        )
    },
    "nodes": {"spec.unschedulable": "spec.unschedulable"},
    "events": {
        **{
            f: f
            for f in (
                "involvedObject.kind",
                "involvedObject.namespace",
                "involvedObject.name",
                "involvedObject.uid",
                "involvedObject.apiVersion",
                "involvedObject.resourceVersion",
                "involvedObject.fieldPath",
                "reason",
                "reportingComponent",
                "type",
            )
        },
        "source": "source.component",
    },
    "namespaces": {"status.phase": "status.phase"},
    "configmaps": {},
    "deployments": {},
    "replicasets": {"status.replicas": "status.replicas"},
    "jobs": {"status.successful": "status.succeeded"},
}


def field_matcher(selector: str | None, plural: str) -> Callable[[Obj], bool]:
    """`spec.nodeName=n1,status.phase!=Failed`: `=`, `==` and `!=` over supported labels."""
    labels = {"metadata.name": "metadata.name", "metadata.namespace": "metadata.namespace"}
    labels |= FIELD_LABELS[plural]
    terms: list[tuple[str, bool, str]] = []
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            eq = False
        elif "=" in term:
            k, v = term.replace("==", "=", 1).split("=", 1)
            eq = True
        else:
            raise ApiError(400, "BadRequest", f"invalid field selector term {term!r}")
        if k.strip() not in labels:
            raise ApiError(400, "BadRequest", f"field label not supported: {k.strip()}")
        terms.append((labels[k.strip()], eq, v.strip()))
    return lambda obj: all((_field(obj, k) == v) == eq for k, eq, v in terms)


def _split_outside_parens(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_matcher(selector: str | None) -> Callable[[Obj], bool]:
    """`a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x,y)`."""
    preds: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_outside_parens(selector or ""):
        words = term.split(None, 1)
        if len(words) == 2 and words[1].startswith(("in ", "in(", "notin ", "notin(")):
            op, rest = words[1].split("(", 1) if "(" in words[1] else (words[1], "")
            values = {v.strip() for v in rest.rstrip(")").split(",") if v.strip()}
            k, negate = words[0], op.strip() == "notin"
            preds.append(lambda ls, k=k, vs=values, n=negate: (ls.get(k) in vs) != n)
        elif "!=" in term:
            k, v = (x.strip() for x in term.split("!=", 1))
            preds.append(lambda ls, k=k, v=v: ls.get(k) != v)
        elif "=" in term:
            k, v = (x.strip() for x in term.replace("==", "=", 1).split("=", 1))
            preds.append(lambda ls, k=k, v=v: ls.get(k) == v)
        elif term.startswith("!"):
            absent = term[1:].strip()
            preds.append(lambda ls, k=absent: k not in ls)
        else:
            preds.append(lambda ls, k=term: k in ls)
    return lambda obj: all(p(obj.get("metadata", {}).get("labels") or {}) for p in preds)


# ---------------------------------------------------------------- RBAC


@dataclass(frozen=True, slots=True)
class Rule:
    groups: frozenset[str]
    resources: frozenset[str]  # "pods", "pods/status", "*"
    verbs: frozenset[str]

    def allows(self, verb: str, group: str, resource: str) -> bool:
        return (
            (group in self.groups or "*" in self.groups)
            and (resource in self.resources or "*" in self.resources)
            and (verb in self.verbs or "*" in self.verbs)
        )


class Rbac:
    """ClusterRoles, Roles and their bindings, as given (the rendered deploy/ manifests).

    Service-account users only (`system:serviceaccount:NS:NAME`): what the manifests bind to
    them is all they may do. A request without a token is the cluster admin, as a test's
    kubeconfig would be.
    """

    def __init__(self) -> None:
        self._roles: dict[tuple[str, str], list[Rule]] = {}  # (namespace or "", name)
        self._bindings: list[tuple[str, tuple[str, str], set[str]]] = []  # ns, role, users

    def load(self, objects: list[Obj]) -> None:
        for obj in objects:
            kind, meta = obj.get("kind"), obj.get("metadata") or {}
            if kind in ("ClusterRole", "Role"):
                scope = meta.get("namespace", "") if kind == "Role" else ""
                self._roles[(scope, meta["name"])] = [
                    Rule(
                        frozenset(r.get("apiGroups") or []),
                        frozenset(r.get("resources") or []),
                        frozenset(r.get("verbs") or []),
                    )
                    for r in obj.get("rules") or []
                ]
            elif kind in ("ClusterRoleBinding", "RoleBinding"):
                scope = meta.get("namespace", "") if kind == "RoleBinding" else ""
                ref = obj["roleRef"]
                role = (scope if ref["kind"] == "Role" else "", ref["name"])
                users = {
                    f"system:serviceaccount:{s.get('namespace', scope)}:{s['name']}"
                    for s in obj.get("subjects") or []
                    if s.get("kind") == "ServiceAccount"
                }
                self._bindings.append((scope, role, users))

    def allows(self, user: str, verb: str, group: str, resource: str, namespace: str) -> bool:
        for scope, role, users in self._bindings:
            if user not in users or (scope and scope != namespace):
                continue
            if any(r.allows(verb, group, resource) for r in self._roles.get(role, [])):
                return True
        return False


def _verb(method: str, name: str, query: dict[str, str]) -> str:
    if method == "GET":
        return "watch" if _is_true(query.get("watch")) else ("get" if name else "list")
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]


def _forbidden(user: str, verb: str, resource: str, namespace: str) -> ApiError:
    where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    return ApiError(
        403,
        "Forbidden",
        f'{resource.split("/")[0]} is forbidden: User "{user}" cannot {verb} resource '
        f'"{resource}" in API group "" {where}',
    )


# ---------------------------------------------------------------- admission


def selector_matches(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels, matchExpressions); empty or absent matches all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _rule_matches(rule: Obj, operation: str, plural: str) -> bool:
    def has(field: str, value: str) -> bool:
        return value in rule.get(field, []) or "*" in rule.get(field, [])

    return (
        has("operations", operation)
        and has("apiGroups", "")
        and has("apiVersions", "v1")
        and (has("resources", plural) or "*/*" in rule.get("resources", []))
    )


class _ServiceConnection(http.client.HTTPSConnection):
    """HTTPS to a Service's address, verifying the certificate for the Service's DNS name."""

    def __init__(
        self, address: tuple[str, int], server_name: str, tls: ssl.SSLContext, timeout: float
    ) -> None:
        super().__init__(server_name, address[1], context=tls, timeout=timeout)
        self._address = address
        self._tls = tls

    def connect(self) -> None:
        sock = socket.create_connection(self._address, self.timeout)
        self.sock = self._tls.wrap_socket(sock, server_hostname=self.host)


@dataclass
class _Webhook:
    spec: Obj  # one entry of a MutatingWebhookConfiguration's `webhooks`
    addresses: list[tuple[str, int]]  # the Service's endpoints, one per replica
    server_name: str
    tls: ssl.SSLContext
    conditions: list[tuple[str, Any]]  # (name, compiled CEL program)
    idle: list[_ServiceConnection]
    opened: int = 0  # connections opened: the next goes to endpoint `opened % len(addresses)`


class MutatingAdmission:
    """The API server's mutating admission step, for registered MutatingWebhookConfigurations.

    For a CREATE it does what kube-apiserver does with each webhook: match `rules`,
    `namespaceSelector`, `objectSelector` and `matchConditions` (CEL, evaluated by cel-python),
    then POST an AdmissionReview over HTTPS, trusting only the `caBundle`, with the
    certificate checked for `<service>.<namespace>.svc`, within `timeoutSeconds`; apply the
    returned JSON patch, pass warnings on, and apply `failurePolicy` to any failure (a call
    that cannot be made, times out or answers nonsense; a condition that fails to evaluate).
    Connections are kept alive and reused, as the API server's are.
    """

    def __init__(self) -> None:
        self._webhooks: list[_Webhook] = []
        self._lock = threading.Lock()
        self.calls = 0  # AdmissionReviews sent
        self.connections = 0  # TCP connections opened for them
        self.failures: list[str] = []  # calls that failed under failurePolicy Ignore

    def register(
        self,
        config: Obj,
        *,
        address: tuple[str, int],
        replicas: Sequence[tuple[str, int]] = (),
    ) -> None:
        """`config`: a MutatingWebhookConfiguration; its Service answers at `address` (and at
        the `replicas`' addresses: each new connection goes to the next, as kube-proxy spreads
        connections over a Service's endpoints)."""
        import celpy  # type: ignore[import-untyped]

        env = celpy.Environment()
        for spec in config["webhooks"]:
            service = spec["clientConfig"]["service"]
            tls = ssl.create_default_context(
                cadata=base64.b64decode(spec["clientConfig"]["caBundle"]).decode()
            )
            conditions = [
                (c["name"], env.program(env.compile(c["expression"])))
                for c in spec.get("matchConditions") or []
            ]
            self._webhooks.append(
                _Webhook(
                    spec=spec,
                    addresses=[address, *replicas],
                    server_name=f"{service['name']}.{service['namespace']}.svc",
                    tls=tls,
                    conditions=conditions,
                    idle=[],
                )
            )

    def close(self) -> None:
        """Close the connections kept alive to webhooks."""
        with self._lock:
            idle = [c for hook in self._webhooks for c in hook.idle]
            for hook in self._webhooks:
                hook.idle.clear()
        for conn in idle:
            conn.close()

    def admit(
        self, *, plural: str, obj: Obj, namespace_labels: dict[str, str], user: str
    ) -> tuple[Obj, list[str]]:
        """The object after every matching webhook, and the warnings they gave."""
        warnings: list[str] = []
        for hook in self._webhooks:
            if not self._selected(hook, plural, obj, namespace_labels, user):
                continue
            try:
                response = self._call(hook, plural, obj, user)
            except Exception as e:
                why = f'failed calling webhook "{hook.spec["name"]}": {type(e).__name__}: {e}'
                if hook.spec.get("failurePolicy", "Fail") == "Fail":
                    raise ApiError(
                        500, "InternalError", f"Internal error occurred: {why}"
                    ) from None
                self.failures.append(why)
                continue
            warnings.extend(response.get("warnings") or [])
            if not response.get("allowed"):
                status = response.get("status") or {}
                raise ApiError(
                    int(status.get("code") or 400),
                    str(status.get("reason") or "BadRequest"),
                    f'admission webhook "{hook.spec["name"]}" denied the request: '
                    f"{status.get('message', '')}",
                )
            if response.get("patch"):
                ops = json.loads(base64.b64decode(response["patch"]))
                obj = json_patch(obj, ops)
        return obj, warnings

    def _selected(
        self, hook: _Webhook, plural: str, obj: Obj, namespace_labels: dict[str, str], user: str
    ) -> bool:
        spec = hook.spec
        if not any(_rule_matches(r, "CREATE", plural) for r in spec.get("rules") or []):
            return False
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if not selector_matches(spec.get("namespaceSelector"), namespace_labels):
            return False
        if not selector_matches(spec.get("objectSelector"), labels):
            return False
        import celpy

        activation = {
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(None),
            "request": celpy.json_to_cel({"operation": "CREATE", "userInfo": {"username": user}}),
        }
        for name, program in hook.conditions:
            result = program.evaluate(activation)
            if isinstance(result, celpy.CELEvalError):
                if spec.get("failurePolicy", "Fail") == "Fail":
                    raise ApiError(
                        500, "InternalError", f"matchCondition {name!r} failed: {result}"
                    )
                return False
            if not result:
                return False
        return True

    def _call(self, hook: _Webhook, plural: str, obj: Obj, user: str) -> Obj:
        uid = str(uuid.uuid4())
        meta = obj.get("metadata") or {}
        kind = RESOURCES[plural][0]
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "", "version": "v1", "kind": kind},
                "resource": {"group": "", "version": "v1", "resource": plural},
                "requestKind": {"group": "", "version": "v1", "kind": kind},
                "requestResource": {"group": "", "version": "v1", "resource": plural},
                "name": meta.get("name", ""),
                "namespace": meta.get("namespace", ""),
                "operation": "CREATE",
                "userInfo": {"username": user},
                "object": obj,
                "oldObject": None,
                "dryRun": False,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
            },
        }
        service = hook.spec["clientConfig"]["service"]
        path = service.get("path", "/")
        timeout = float(hook.spec.get("timeoutSeconds", 10))
        with self._lock:
            self.calls += 1
            conn = hook.idle.pop() if hook.idle else None
            if conn is None:
                address = hook.addresses[hook.opened % len(hook.addresses)]
                hook.opened += 1
                self.connections += 1
        if conn is None:
            conn = _ServiceConnection(address, hook.server_name, hook.tls, timeout)
        try:
            conn.request("POST", path, json.dumps(review), {"Content-Type": "application/json"})
            answer = conn.getresponse()
            payload = answer.read()
        except BaseException:
            conn.close()
            raise
        if answer.will_close:
            conn.close()
        else:
            with self._lock:
                hook.idle.append(conn)
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status}: {payload[:200]!r}")
        response = json.loads(payload).get("response") or {}
        if response.get("uid") != uid:
            raise RuntimeError(f"the response's uid {response.get('uid')!r} is not {uid!r}")
        return dict(response)


# ---------------------------------------------------------------- the store


@dataclass(frozen=True, slots=True)
class Change:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    key: Key
    obj: Obj
    prev: Obj | None
    at: float  # time.monotonic() when it happened


class Store:
    """Objects plus the history of changes that watches replay, under one condition."""

    def __init__(self, *, watch_window_s: float) -> None:
        self.cond = threading.Condition()
        self.rv = 0
        self.compacted_rv = 0
        self.watch_window_s = watch_window_s
        self.objects: dict[Key, Obj] = {}
        self.history: list[Change] = []
        self.history_rvs: list[int] = []
        self.bookmark_generation = 0
        for ns in ("default", "kube-system"):
            self.create("namespaces", "", {"metadata": {"name": ns}})

    def _record(self, kind: str, key: Key, obj: Obj, prev: Obj | None) -> None:
        now = time.monotonic()
        self.history.append(Change(self.rv, kind, key, obj, prev, now))
        self.history_rvs.append(self.rv)
        self._expire(now)
        self.cond.notify_all()

    def _expire(self, now: float) -> None:
        """The watch cache keeps `watch_window_s` of history; older versions become 410s."""
        keep = 0
        while keep < len(self.history) and now - self.history[keep].at > self.watch_window_s:
            keep += 1
        if keep:
            self.compacted_rv = max(self.compacted_rv, self.history[keep - 1].rv)
            del self.history[:keep], self.history_rvs[:keep]

    def snapshot(self, rv: int) -> dict[Key, Obj]:
        """The objects as they were at `rv` (current ones undone by the history after it)."""
        if rv < self.compacted_rv:
            raise ApiError(
                410,
                "Expired",
                "The provided continue parameter is too old to display a consistent list "
                "result. You can start a new list without the continue parameter.",
            )
        state = dict(self.objects)
        for change in reversed(self.changes_after(rv)):
            if change.prev is None:
                state.pop(change.key, None)
            else:
                state[change.key] = change.prev
        return state

    def get(self, key: Key) -> Obj:
        with self.cond:
            if key not in self.objects:
                raise ApiError(404, "NotFound", f'{key[0]} "{key[2]}" not found')
            return copy.deepcopy(self.objects[key])

    def list(self, plural: str, namespace: str) -> tuple[list[Obj], int]:
        with self.cond:
            items = [
                copy.deepcopy(o)
                for (p, ns, _), o in sorted(self.objects.items())
                if p == plural and (not namespace or ns == namespace)
            ]
            return items, self.rv

    def create(self, plural: str, namespace: str, body: Obj) -> Obj:
        kind, namespaced, _ = RESOURCES[plural]
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        with self.cond:
            if namespaced:
                if ("namespaces", "", namespace) not in self.objects:
                    raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            name = meta.get("name")
            if not name:
                raise ApiError(422, "Invalid", f"{kind}: metadata.name is required")
            key = (plural, namespace if namespaced else "", name)
            if key in self.objects:
                raise ApiError(409, "AlreadyExists", f'{plural} "{name}" already exists')
            self.rv += 1
            obj["kind"], obj["apiVersion"] = kind, api_version(plural)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            meta["resourceVersion"] = str(self.rv)
            if plural == "namespaces":
                obj.setdefault("status", {"phase": "Active"})
                meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = name
            self.objects[key] = obj
            self._record("ADDED", key, copy.deepcopy(obj), None)
            return copy.deepcopy(obj)

    def update(self, key: Key, new: Obj, *, check_rv: bool = True) -> Obj:
        """Replace an object; a stale metadata.resourceVersion is a 409 Conflict."""
        with self.cond:
            old = self.objects.get(key)
            if old is None:
                raise ApiError(404, "NotFound", f'{key[0]} "{key[2]}" not found')
            obj = copy.deepcopy(new)
            meta = obj.setdefault("metadata", {})
            given = meta.get("resourceVersion")
            if check_rv and given and given != old["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {key[0]} "{key[2]}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                )
            for immutable in ("uid", "creationTimestamp", "name", "namespace"):
                if immutable in old["metadata"]:
                    meta[immutable] = old["metadata"][immutable]
            obj["kind"], obj["apiVersion"] = old["kind"], old["apiVersion"]
            meta["resourceVersion"] = old["metadata"]["resourceVersion"]
            if obj == old:  # a no-op write neither bumps the version nor wakes watchers
                return copy.deepcopy(old)
            self.rv += 1
            meta["resourceVersion"] = str(self.rv)
            self.objects[key] = obj
            self._record("MODIFIED", key, copy.deepcopy(obj), old)
            return copy.deepcopy(obj)

    def mutate(self, key: Key, fn: Callable[[Obj], Obj]) -> Obj:
        with self.cond:
            return self.update(key, fn(self.get(key)))

    def delete(self, key: Key) -> Obj:
        with self.cond:
            old = self.objects.pop(key, None)
            if old is None:
                raise ApiError(404, "NotFound", f'{key[0]} "{key[2]}" not found')
            self.rv += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self.rv)
            self._record("DELETED", key, gone, old)
            return copy.deepcopy(gone)

    def changes_after(self, rv: int) -> list[Change]:
        return self.history[bisect.bisect_right(self.history_rvs, rv) :]


# ---------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _HttpServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests read `FakeApiServer.requests` instead

    def setup(self) -> None:
        super().setup()
        self.server.fake._track(self.connection, True)

    def finish(self) -> None:
        self.server.fake._track(self.connection, False)
        try:
            super().finish()
        except OSError:
            pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ApiError(400, "BadRequest", f"request body is not JSON: {e}") from None

    def _send(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        for warning in getattr(self, "warnings", []):
            self.send_header("Warning", f'299 - "{warning}"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        fake = self.server.fake
        fake.requests.append((method, url.path, query))
        self.warnings: list[str] = []
        try:
            self.user = fake._authenticate(self.headers.get("Authorization", ""))
            if method == "GET" and url.path in fake.discovery:
                self._body()
                self._send(200, fake.discovery[url.path]())
                return
            if method == "POST" and url.path == ACCESS_REVIEWS:
                self._send(201, fake._review_access(self.user, self._body()))
                return
            if method == "POST" and url.path == "/_fake/compact":
                self._send(200, {"compactedResourceVersion": str(fake.compact())})
                return
            body = self._body()  # always read it, or a DELETE body would poison keep-alive
            result = fake._serve(self, method, url.path, query, body)
            if result is not None:
                code, obj = result
                self._send(code, obj)
        except ApiError as e:
            self._send(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug in the fake must show as a 500, not a dropped connection
            self._send(500, ApiError(500, "InternalError", f"{type(e).__name__}: {e}").status())

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # a burst of clients connecting at once, as controllers do
    fake: FakeApiServer


def _gv_path(group_version: str) -> str:
    return "api/v1" if group_version == "v1" else f"apis/{group_version}"


def _openapi_root() -> Obj:
    """/openapi/v3: where each group version's document is."""
    gvs = sorted({api_version(plural) for plural in RESOURCES})
    return {
        "paths": {
            _gv_path(gv): {"serverRelativeURL": f"/openapi/v3/{_gv_path(gv)}?hash=nvshare-fake"}
            for gv in gvs
        }
    }


def _openapi_group_version(group_version: str) -> Obj:
    """A group version's OpenAPI v3 document as far as kubectl reads it: each kind's PATCH and
    whether it takes `fieldValidation` (it does). No schemas: the server checks, not kubectl."""
    group, _, version = group_version.rpartition("/")
    paths: Obj = {}
    for plural, (kind, namespaced, _) in RESOURCES.items():
        if api_version(plural) != group_version:
            continue
        scope = "/namespaces/{namespace}" if namespaced else ""
        paths[f"/{_gv_path(group_version)}{scope}/{plural}/{{name}}"] = {
            "patch": {
                "operationId": f"patch{kind}",
                "x-kubernetes-action": "patch",
                "x-kubernetes-group-version-kind": {
                    "group": group,
                    "version": version,
                    "kind": kind,
                },
                "parameters": [
                    {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}
                ],
                "responses": {"200": {"description": "OK"}},
            }
        }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (nvshare fake)", "version": "v1.32.0"},
        "paths": paths,
        "components": {"schemas": {}},
    }


_SCHEMA_VERSION = "1.32.0"  # the version the discovery endpoints claim


def _check_fields(plural: str, obj: Obj, query: dict[str, str]) -> Obj:
    """`fieldValidation=Strict`: a 400 for a field Kubernetes' schema of the kind lacks."""
    if query.get("fieldValidation") != "Strict" or not isinstance(obj, dict):
        return obj
    import kubernetes_validate  # type: ignore[import-untyped]

    kind = RESOURCES[plural][0]
    typed = {"apiVersion": api_version(plural), "kind": kind, **obj}
    try:
        kubernetes_validate.validate(typed, _SCHEMA_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "(the object)"
        raise ApiError(
            400,
            "BadRequest",
            f'{kind} in version "{api_version(plural)}" cannot be handled as a {kind}: '
            f"strict decoding error: {where}: {e.message}",
        ) from None
    return obj


def _route(path: str) -> tuple[str, str, str, str]:
    """/api/v1[/namespaces/NS]/PLURAL[/NAME[/SUB]] (or /apis/GROUP/VERSION/... for the
    resources of GROUP_VERSIONS) -> (plural, namespace, name, subresource)."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"] and len(parts) >= 3:
        served, rest = "v1", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        served, rest = "/".join(parts[1:3]), parts[3:]
    else:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    plural = rest[0]
    if plural not in RESOURCES or api_version(plural) != served:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
    name = rest[1] if len(rest) > 1 else ""
    sub = rest[2] if len(rest) > 2 else ""
    if (sub and (plural, sub) not in SUBRESOURCES) or len(rest) > 3:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
    if RESOURCES[plural][1] is False:
        namespace = ""
    return plural, namespace, name, sub


class FakeApiServer:
    """The fake API server: `start()`, `.url`, seeding helpers, `compact()`, `stop()`.

    `stop()` then `start()` restarts it on the same port with the same objects and
    resourceVersions, as a real API server backed by etcd would come back.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        bookmark_interval_s: float = 60.0,
        watch_window_s: float = 120.0,
    ) -> None:
        self.host, self.port = host, port
        self.bookmark_interval_s = bookmark_interval_s
        # A too-old watch gets a 200 stream with an ERROR event (the watch cache's answer);
        # True answers with an HTTP 410 Status instead, as a read through to etcd does.
        self.expired_as_status = False
        self.store = Store(watch_window_s=watch_window_s)
        self.rbac = Rbac()
        self.admission = MutatingAdmission()
        self._tokens: dict[str, str] = {}  # bearer token -> user
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._httpd: _HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stalled: set[socket.socket] = set()
        self._stopping = False
        self._lists_open = threading.Event()  # hold_lists clears it: lists wait (a slow server)
        self._lists_open.set()
        self.discovery: dict[str, Callable[[], Obj]] = {
            "/api": self._api_versions,
            "/api/v1": self._api_v1,
            "/apis": self._api_groups,
            **{
                f"/apis/{gv}": lambda gv=gv: self._api_resources(gv)
                for gv in {"apps/v1", "batch/v1"}
            },
            **{f"/apis/{g}": lambda g=g: self._api_group(g) for g in ("apps", "batch")},
            "/openapi/v3": _openapi_root,
            **{
                f"/openapi/v3/{_gv_path(gv)}": lambda gv=gv: _openapi_group_version(gv)
                for gv in {api_version(plural) for plural in RESOURCES}
            },
            "/version": lambda: {
                "major": "1",
                "minor": "32",
                "gitVersion": "v1.32.0-nvshare-fake",
                "platform": "linux/amd64",
            },
        }

    # ---- lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FakeApiServer:
        self._stopping = False
        self._httpd = _HttpServer((self.host, self.port), _Handler)
        self._httpd.fake = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection (watches end abruptly)."""
        if self._httpd is None:
            return
        self._stopping = True
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self.store.cond:
            self.store.cond.notify_all()
        self.admission.close()
        self._httpd = None

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._conns_lock:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)
                self._stalled.discard(conn)

    # ---- controls for tests

    @property
    def resource_version(self) -> int:
        with self.store.cond:
            return self.store.rv

    def compact(self) -> int:
        """Forget history up to now: watches from an older resourceVersion get 410 Gone."""
        with self.store.cond:
            self.store.compacted_rv = self.store.rv
            return self.store.rv

    def bookmark_now(self) -> None:
        """Make every open watch that asked for bookmarks send one now."""
        with self.store.cond:
            self.store.bookmark_generation += 1
            self.store.cond.notify_all()

    def stall_open_watches(self) -> int:
        """Open watches go silent (connection kept open, nothing sent), like a dead peer."""
        with self._conns_lock:
            self._stalled |= self._conns
            return len(self._stalled)

    def hold_lists(self) -> None:
        """Every list request waits (a slow API server after a restart) until release_lists."""
        self._lists_open.clear()

    def release_lists(self) -> None:
        self._lists_open.set()

    def token_for(self, namespace: str, service_account: str) -> str:
        """A bearer token for a service account; its rights come from `rbac` (see load_rbac)."""
        token = uuid.uuid4().hex
        self._tokens[token] = f"system:serviceaccount:{namespace}:{service_account}"
        return token

    def write_kubeconfig(self, path: Any, *, namespace: str, service_account: str) -> str:
        """A kubeconfig at `path` for a new token of that service account; returns the path.

        What a process started by a test (the daemon, the extender, kubectl) reads as a pod's
        credentials, under the RBAC given to `load_rbac`.
        """
        token = self.token_for(namespace, service_account)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": service_account, "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": service_account}}],
            "current-context": "fake",
        }
        with open(path, "w", encoding="utf-8") as out:
            json.dump(config, out)
        return str(path)

    def load_rbac(self, objects: list[Obj]) -> None:
        """Roles and bindings among `objects` (say, the rendered deploy/) take effect."""
        self.rbac.load(objects)

    def watch_count(self) -> int:
        return sum(1 for m, _, q in self.requests if m == "GET" and _is_true(q.get("watch")))

    # ---- seeding and direct edits (no HTTP involved)

    def add_namespace(self, name: str) -> Obj:
        return self.store.create("namespaces", "", {"metadata": {"name": name}})

    def add_node(
        self, name: str, *, labels: dict[str, str] | None = None, status: Obj | None = None
    ) -> Obj:
        body: Obj = {"metadata": {"name": name, "labels": dict(labels or {})}}
        body["status"] = status or {"conditions": [{"type": "Ready", "status": "True"}]}
        return self.store.create("nodes", "", body)

    def add_pod(
        self,
        name: str,
        *,
        namespace: str = "default",
        node: str | None = None,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        spec: Obj | None = None,
    ) -> Obj:
        """Create a pod directly; its namespace is created when missing."""
        with self.store.cond:
            if ("namespaces", "", namespace) not in self.store.objects:
                self.add_namespace(namespace)
        pod_spec: Obj = dict(spec or {"containers": [{"name": "main", "image": "cuda:latest"}]})
        if node:
            pod_spec["nodeName"] = node
        body: Obj = {
            "metadata": {
                "name": name,
                "labels": dict(labels or {}),
                "annotations": dict(annotations or {}),
            },
            "spec": pod_spec,
            "status": {"phase": "Running" if node else "Pending"},
        }
        return self.store.create("pods", namespace, body)

    def get(self, plural: str, name: str, *, namespace: str = "") -> Obj:
        return self.store.get((plural, namespace if RESOURCES[plural][1] else "", name))

    def update(
        self, plural: str, name: str, fn: Callable[[Obj], Obj], *, namespace: str = ""
    ) -> Obj:
        """Read-modify-write one object; `fn` gets a copy and returns the new object."""
        return self.store.mutate((plural, namespace if RESOURCES[plural][1] else "", name), fn)

    def set_pod_annotations(
        self, name: str, changes: dict[str, str | None], *, namespace: str = "default"
    ) -> Obj:
        """Merge annotations into a pod; a None value removes the key."""
        patch = {"metadata": {"annotations": changes}}
        return self.update("pods", name, lambda o: merge_patch(o, patch), namespace=namespace)

    def delete(self, plural: str, name: str, *, namespace: str = "") -> Obj:
        return self.store.delete((plural, namespace if RESOURCES[plural][1] else "", name))

    # ---- discovery

    def _api_versions(self) -> Obj:
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.host}:{self.port}"}
            ],
        }

    def _api_group(self, group: str) -> Obj:
        version = {"groupVersion": f"{group}/v1", "version": "v1"}
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": group,
            "versions": [version],
            "preferredVersion": version,
        }

    def _api_groups(self) -> Obj:
        groups = [self._api_group(g) for g in ("apps", "batch")]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def _api_v1(self) -> Obj:
        return self._api_resources("v1")

    def _api_resources(self, group_version: str) -> Obj:
        resources: list[Obj] = []
        for plural, (kind, namespaced, short) in RESOURCES.items():
            if api_version(plural) != group_version:
                continue
            resources.append(
                {
                    "name": plural,
                    "singularName": kind.lower(),
                    "namespaced": namespaced,
                    "kind": kind,
                    "verbs": VERBS,
                    "shortNames": short,
                }
            )
            if (plural, "status") in SUBRESOURCES:
                resources.append(
                    {
                        "name": f"{plural}/status",
                        "singularName": "",
                        "namespaced": namespaced,
                        "kind": kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {"kind": "APIResourceList", "groupVersion": group_version, "resources": resources}

    # ---- REST

    def _serve(
        self, h: _Handler, method: str, path: str, query: dict[str, str], body: Any
    ) -> tuple[int, Any] | None:
        plural, namespace, name, sub = _route(path)
        key: Key = (plural, namespace, name)
        self._authorize(h.user, _verb(method, name, query), plural, sub, namespace)
        if not name:
            if method == "GET" and _is_true(query.get("watch")):
                self._watch(h, plural, namespace, query)
                return None
            if method == "GET":
                return 200, self._list(h, plural, namespace, query)
            if method == "POST":
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "POST needs a JSON object body")
                if RESOURCES[plural][1] and not namespace:
                    namespace = body.get("metadata", {}).get("namespace") or ""
                    if not namespace:
                        raise ApiError(400, "BadRequest", "a namespace is required")
                _check_fields(plural, body, query)
            return 201, self._create(h, plural, namespace, body)
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
        if RESOURCES[plural][1] and not namespace:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource {path}"
            )
        if method == "GET":
            return 200, self.store.get(key)
        if method == "PUT":
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "PUT needs a JSON object body")
            _check_fields(plural, body, query)
            return 200, self._write(key, sub, lambda cur: body)
        if method == "PATCH":
            ctype = h.headers.get("Content-Type", "")

            def patched(cur: Obj) -> Obj:
                return _check_fields(plural, _apply_patch(cur, ctype, body), query)

            return 200, self._write(key, sub, patched)
        if method == "DELETE" and not sub:
            return 200, self.store.delete(key)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed")

    def _authenticate(self, authorization: str) -> str:
        """The user a request is from; no credentials at all is the admin (a test's kubectl)."""
        if not authorization:
            return ADMIN
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or token not in self._tokens:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return self._tokens[token]

    def _review_access(self, user: str, body: Any) -> Obj:
        """A SelfSubjectAccessReview: may `user` do what `spec.resourceAttributes` says? Any
        authenticated user may ask (system:basic-user grants it in a real cluster)."""
        attrs = (body or {}).get("spec", {}).get("resourceAttributes") or {}
        resource = attrs.get("resource", "")
        if attrs.get("subresource"):
            resource = f"{resource}/{attrs['subresource']}"
        allowed = user == ADMIN or self.rbac.allows(
            user,
            attrs.get("verb", ""),
            attrs.get("group", ""),
            resource,
            attrs.get("namespace", ""),
        )
        return {**body, "status": {"allowed": allowed}}

    def _authorize(self, user: str, verb: str, plural: str, sub: str, namespace: str) -> None:
        resource = f"{plural}/{sub}" if sub else plural
        if user != ADMIN and not self.rbac.allows(user, verb, "", resource, namespace):
            raise _forbidden(user, verb, resource, namespace)

    def _create(self, h: _Handler, plural: str, namespace: str, body: Obj) -> Obj:
        """Defaulting, mutating admission, then the write, as kube-apiserver orders them."""
        obj = copy.deepcopy(body)
        _quantities_as_written(obj)
        if plural == "pods":
            _default_pod(obj)
        meta = obj.setdefault("metadata", {})
        if RESOURCES[plural][1]:
            meta["namespace"] = namespace
        labels: dict[str, str] = {}
        if RESOURCES[plural][1]:
            with self.store.cond:
                ns = self.store.objects.get(("namespaces", "", namespace))
            if ns is None:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
            labels = ns["metadata"].get("labels") or {}
        obj, warnings = self.admission.admit(
            plural=plural, obj=obj, namespace_labels=labels, user=h.user
        )
        h.warnings.extend(warnings)
        return self.store.create(plural, namespace, obj)

    def _write(self, key: Key, sub: str, make: Callable[[Obj], Obj]) -> Obj:
        """PUT or PATCH: status changes only through /status, and /status changes only status."""
        with self.store.cond:
            cur = self.store.get(key)
            new = make(copy.deepcopy(cur))
            if key[0] in ("pods", "nodes"):
                if sub == "status":
                    meta = dict(cur["metadata"])
                    if "resourceVersion" in new.get("metadata", {}):
                        meta["resourceVersion"] = new["metadata"]["resourceVersion"]
                    new = {**cur, "metadata": meta, "status": new.get("status") or {}}
                elif "status" in cur:
                    new["status"] = cur["status"]
                else:
                    new.pop("status", None)
            return self.store.update(key, new)  # a stale resourceVersion given: 409

    def _list(self, h: _Handler, plural: str, namespace: str, query: dict[str, str]) -> Obj:
        """A list; with `limit`, one page of a consistent snapshot and a `continue` token.

        As in Kubernetes 1.32, `resourceVersion=0` is answered from the watch cache, which does
        not page: `limit` is ignored there.
        """
        self._lists_open.wait(timeout=120)
        fmatch = field_matcher(query.get("fieldSelector"), plural)
        lmatch = label_matcher(query.get("labelSelector"))
        limit = int(query.get("limit") or 0)
        if query.get("resourceVersion") == "0":
            limit = 0
        token = query.get("continue") or ""
        with self.store.cond:
            if token:
                rv, after = _decode_continue(token)
                state = self.store.snapshot(rv)
            else:
                rv, after, state = self.store.rv, None, self.store.objects
            keys = sorted(
                k
                for k, o in state.items()
                if k[0] == plural
                and (not namespace or k[1] == namespace)
                and (after is None or k > after)
                and fmatch(o)
                and lmatch(o)
            )
            shown = keys[:limit] if limit else keys
            items = [copy.deepcopy(state[k]) for k in shown]
        metadata: Obj = {"resourceVersion": str(rv)}
        if len(shown) < len(keys):
            metadata["continue"] = _encode_continue(rv, shown[-1])
            metadata["remainingItemCount"] = len(keys) - len(shown)
        if "as=Table" in h.headers.get("Accept", ""):
            return _table(items, metadata)
        for o in items:  # list items carry no kind/apiVersion, as from a real server
            o.pop("kind", None)
            o.pop("apiVersion", None)
        kind = RESOURCES[plural][0]
        return {
            "kind": f"{kind}List",
            "apiVersion": api_version(plural),
            "metadata": metadata,
            "items": items,
        }

    def _watch(self, h: _Handler, plural: str, namespace: str, query: dict[str, str]) -> None:
        fmatch = field_matcher(query.get("fieldSelector"), plural)
        lmatch = label_matcher(query.get("labelSelector"))
        bookmarks = _is_true(query.get("allowWatchBookmarks"))
        timeout = float(query.get("timeoutSeconds") or 1800)
        kind = RESOURCES[plural][0]
        rv_param = query.get("resourceVersion", "")
        store = self.store

        def matches(o: Obj | None, key: Key) -> bool:
            if o is None or key[0] != plural or (namespace and key[1] != namespace):
                return False
            return fmatch(o) and lmatch(o)

        with store.cond:
            if rv_param not in ("", "0"):
                try:
                    cursor = int(rv_param)
                except ValueError:
                    raise ApiError(
                        400, "BadRequest", f"invalid resourceVersion {rv_param!r}"
                    ) from None
                initial: list[Obj] = []
                if cursor < store.compacted_rv:
                    expired = ApiError(
                        410,
                        "Expired",
                        f"too old resource version: {cursor} ({store.compacted_rv})",
                    )
                    if self.expired_as_status:
                        raise expired
                    initial = [{"type": "ERROR", "object": expired.status()}]
            else:  # "start at most recent": synthetic ADDED for what exists now
                cursor = store.rv
                initial = [
                    {"type": "ADDED", "object": copy.deepcopy(o)}
                    for k, o in sorted(store.objects.items())
                    if matches(o, k)
                ]
            generation = store.bookmark_generation

        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        conn = h.connection
        deadline = time.monotonic() + timeout
        next_bookmark = time.monotonic() + self.bookmark_interval_s
        try:
            for ev in initial:
                h.write_chunk(json.dumps(ev).encode() + b"\n")
            if initial and initial[0]["type"] == "ERROR":
                h.write_chunk(b"")  # the stream ends cleanly after the error, as on a real server
                return
            for batch in self._watch_batches(cursor, generation, deadline, next_bookmark, conn):
                out = []
                for ev in batch:
                    if ev["type"] == "BOOKMARK":
                        if bookmarks:
                            meta = {"resourceVersion": ev["rv"]}
                            out.append(
                                {
                                    "type": "BOOKMARK",
                                    "object": {
                                        "kind": kind,
                                        "apiVersion": api_version(plural),
                                        "metadata": meta,
                                    },
                                }
                            )
                        continue
                    change: Change = ev["change"]
                    was, now = matches(change.prev, change.key), matches(change.obj, change.key)
                    if change.type == "DELETED":
                        kind_out = "DELETED" if was else None
                    elif was and now:
                        kind_out = "MODIFIED"
                    elif now:
                        kind_out = "ADDED"
                    elif was:  # left the selection: watchers see it go away
                        kind_out = "DELETED"
                    else:
                        kind_out = None
                    if kind_out:
                        out.append({"type": kind_out, "object": change.obj})
                if out:
                    h.write_chunk(b"".join(json.dumps(e).encode() + b"\n" for e in out))
            h.write_chunk(b"")
        except OSError:
            h.close_connection = True

    def _watch_batches(
        self,
        cursor: int,
        generation: int,
        deadline: float,
        next_bookmark: float,
        conn: socket.socket,
    ) -> Iterator[list[dict[str, Any]]]:
        store = self.store
        while True:
            with store.cond:
                while True:
                    if self._stopping:
                        return
                    now = time.monotonic()
                    stalled = conn in self._stalled
                    pending = not stalled and bool(store.changes_after(cursor))
                    wanted = not stalled and (
                        store.bookmark_generation != generation or now >= next_bookmark
                    )
                    if pending or wanted:
                        break
                    if now >= deadline:
                        return
                    store.cond.wait(
                        min(deadline, next_bookmark) - now if not stalled else deadline - now
                    )
                changes = store.changes_after(cursor)
                cursor = store.rv
                batch: list[dict[str, Any]] = [{"type": "EVENT", "change": c} for c in changes]
                if wanted:
                    generation = store.bookmark_generation
                    next_bookmark = now + self.bookmark_interval_s
                    batch.append({"type": "BOOKMARK", "rv": str(cursor)})
            yield batch


def _quantities_as_written(obj: Any) -> None:
    """Resource quantities as the API server stores and returns them: strings (`1` -> "1"),
    in a pod's containers and in the pod templates of workloads alike."""
    if isinstance(obj, dict):
        resources = obj.get("resources")
        if isinstance(resources, dict):
            for section in ("limits", "requests"):
                values = resources.get(section)
                if isinstance(values, dict):
                    for name, value in values.items():
                        if isinstance(value, (int, float)) and not isinstance(value, bool):
                            values[name] = str(value)
        for value in obj.values():
            _quantities_as_written(value)
    elif isinstance(obj, list):
        for value in obj:
            _quantities_as_written(value)


def _default_pod(pod: Obj) -> None:
    """What the API server's defaulting does to a new pod that matters here: a container's
    requests default to its limits (for extended resources a pod may give only limits), and a
    pod starts Pending."""
    spec = pod.get("spec") or {}
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        if limits:
            requests = resources.setdefault("requests", {})
            for name, value in limits.items():
                requests.setdefault(name, value)
    status = pod.setdefault("status", {})
    status.setdefault("phase", "Pending")


def _apply_patch(cur: Obj, content_type: str, body: Any) -> Obj:
    ctype = content_type.split(";")[0].strip()
    if ctype == "application/json-patch+json":
        return json_patch(cur, body)
    if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
        raise ApiError(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format: {ctype}",
        )
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequest", f"a {ctype} body must be a JSON object")
    patched = merge_patch(cur, body, strategic=ctype.startswith("application/strategic"))
    assert isinstance(patched, dict)
    return patched


def _encode_continue(rv: int, last: Key) -> str:
    return base64.urlsafe_b64encode(json.dumps([rv, list(last)]).encode()).decode()


def _decode_continue(token: str) -> tuple[int, Key]:
    try:
        rv, last = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(rv), (str(last[0]), str(last[1]), str(last[2]))
    except (ValueError, TypeError, IndexError):
        raise ApiError(400, "BadRequest", f"invalid continue token {token!r}") from None


def _is_true(v: str | None) -> bool:
    return (v or "").lower() in ("1", "true")


def _table(items: list[Obj], metadata: Obj) -> Obj:
    """The meta.k8s.io/v1 Table that `kubectl get` asks for, with Name and Age columns."""
    rows = []
    for o in items:
        meta = o.get("metadata", {})
        created = meta.get("creationTimestamp") or _now()
        born = _dt.datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc)
        age = int((_dt.datetime.now(_dt.timezone.utc) - born).total_seconds())
        partial = {
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": meta,
        }
        rows.append({"cells": [meta.get("name", ""), f"{age}s"], "object": partial})
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": [
            {"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0},
            {"name": "Age", "type": "string", "format": "", "description": "", "priority": 0},
        ],
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--bookmark-interval", type=float, default=60.0, metavar="SECONDS")
    ap.add_argument("--seed-node", help="create this node and put --seed-pods pods on it")
    ap.add_argument("--seed-pods", type=int, default=0)
    args = ap.parse_args()
    fake = FakeApiServer(host=args.host, port=args.port, bookmark_interval_s=args.bookmark_interval)
    if args.seed_node:
        fake.add_node(args.seed_node)
        for i in range(args.seed_pods):
            fake.add_pod(f"pod-{i}", node=args.seed_node)
    fake.start()
    print(f"fake API server listening on {fake.url}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    fake.stop()


if __name__ == "__main__":
    main()
