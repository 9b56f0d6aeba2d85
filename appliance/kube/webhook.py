"""The MIG-fallback mutating admission webhook.

A pod that asks for a MIG profile no node can give (say `nvidia.com/mig-3g.40gb`) pends until
one frees up. When the policy lists that profile in a `migFallback.chains` chain, this webhook
rewrites the pod at CREATE to the next profile in the chain that some node has free, and
annotates the pod with what it did (`nvshare.com/mig-fallback: "3g.40gb->2g.20gb"`), so the
user can see why their pod got a smaller slice.

It must never be the reason a pod is refused: every error of ours (API server unreachable,
malformed pod, a bug) answers "allowed, unchanged" with a warning, and the configuration
uses `failurePolicy: Ignore` for the case where the webhook is down altogether.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.kube.informer import NodesAndBoundPods
from appliance.kube.resources import pod_request
from appliance.kube.resources import resource_count as _count
from appliance.kube.serving import CacheBackedServer, ProbedHandler

log = logging.getLogger(__name__)

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
FALLBACK_ANNOTATION = "nvshare.com/mig-fallback"
# A pod labelled `nvshare.com/mig-fallback: disabled` keeps the profile it asked for. The
# configuration's objectSelector keeps such pods away from the webhook; the webhook checks too.
OPT_OUT_LABEL = "nvshare.com/mig-fallback"
OPT_OUT_VALUE = "disabled"
WARNING_MAX_CHARS = 250
_TERMINATED_PHASES = frozenset({"Succeeded", "Failed"})
MAX_REVIEW_BYTES = 3 << 20  # the API server's own request limit; a pod is far smaller

Chains = Sequence[Sequence[str]]
Availability = Callable[[str, int], bool]  # (resource name, count) -> some node has it free


@dataclass(frozen=True, slots=True)
class Fallback:
    """One rewrite: every request and limit of `requested` becomes `granted`."""

    requested: str  # resource names, "nvidia.com/mig-3g.40gb"
    granted: str

    @property
    def summary(self) -> str:
        return f"{profile_of(self.requested)}->{profile_of(self.granted)}"


def profile_of(name: str) -> str:
    """`nvidia.com/mig-3g.40gb` or `3g.40gb` -> `3g.40gb`."""
    return name.removeprefix(MIG_RESOURCE_PREFIX)


def resource_of(profile: str) -> str:
    """`3g.40gb` (as policy chains spell it) or a full resource name -> the resource name."""
    return profile if profile.startswith(MIG_RESOURCE_PREFIX) else MIG_RESOURCE_PREFIX + profile


def requested_mig_resources(pod: Mapping[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    names: dict[str, None] = {}
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        for section in ("limits", "requests"):
            for name in resources.get(section) or {}:
                if name.startswith(MIG_RESOURCE_PREFIX):
                    names[name] = None
    return list(names)


def choose_fallbacks(
    pod: Mapping[str, Any], *, chains: Chains, available: Availability
) -> tuple[list[Fallback], list[str]]:
    """The rewrites this pod needs, and warnings for profiles that have no way out."""
    fallbacks: list[Fallback] = []
    warnings: list[str] = []
    for resource in requested_mig_resources(pod):
        count = pod_request(pod, resource)
        chain = next(
            (
                [resource_of(p) for p in c]
                for c in chains
                if resource in [resource_of(p) for p in c]
            ),
            None,
        )
        if chain is None or count == 0 or available(resource, count):
            continue
        later = chain[chain.index(resource) + 1 :]
        granted = next((r for r in later if available(r, count)), None)
        if granted is None:
            warnings.append(
                f"{resource} x{count} is not free on any node, nor is any fallback "
                f"({', '.join(profile_of(r) for r in later) or 'none after it'}); "
                "the pod is left unchanged and will wait"
            )
            continue
        fallbacks.append(Fallback(requested=resource, granted=granted))
    return fallbacks, warnings


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def fallback_patch(pod: Mapping[str, Any], fallbacks: Sequence[Fallback]) -> list[dict[str, Any]]:
    """RFC 6902 operations that move every request/limit and add the annotation."""
    ops: list[dict[str, Any]] = []
    spec = pod.get("spec") or {}
    for kind in ("containers", "initContainers"):
        for index, container in enumerate(spec.get(kind) or []):
            resources = container.get("resources") or {}
            for section in ("limits", "requests"):
                values = resources.get(section) or {}
                base = f"/spec/{kind}/{index}/resources/{section}"
                for fallback in fallbacks:
                    if fallback.requested not in values:
                        continue
                    amount = _count(values[fallback.requested])
                    amount += _count(values.get(fallback.granted, 0))
                    ops.append({"op": "remove", "path": f"{base}/{_escape(fallback.requested)}"})
                    ops.append(
                        {
                            "op": "add",
                            "path": f"{base}/{_escape(fallback.granted)}",
                            "value": str(amount),
                        }
                    )
    summary = ",".join(f.summary for f in fallbacks)
    if (pod.get("metadata") or {}).get("annotations") is None:
        ops.append(
            {"op": "add", "path": "/metadata/annotations", "value": {FALLBACK_ANNOTATION: summary}}
        )
    else:
        ops.append(
            {
                "op": "add",
                "path": f"/metadata/annotations/{_escape(FALLBACK_ANNOTATION)}",
                "value": summary,
            }
        )
    return ops


class MigFallbackWebhook:
    """AdmissionReview in, AdmissionReview out; no I/O except through `available`."""

    def __init__(self, *, chains: Callable[[], Chains], available: Availability) -> None:
        self._chains = chains
        self._available = available

    def review(self, body: Mapping[str, Any]) -> dict[str, Any]:
        request = body.get("request") or {}
        response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
        try:
            self._mutate(request, response)
        except NotSynced as exc:
            log.warning("MIG fallback skipped for %s: %s", _pod_name(request), exc)
            response["warnings"] = [warning_text(f"nvshare MIG fallback skipped ({exc})")]
        except Exception as exc:  # fail open: our error must not block anyone's pod
            log.exception("MIG fallback failed for %s; admitting unchanged", _pod_name(request))
            response.pop("patch", None)
            response.pop("patchType", None)
            response["warnings"] = [
                warning_text(f"nvshare MIG fallback skipped ({exc}); pod admitted unchanged")
            ]
        return {
            "apiVersion": body.get("apiVersion", "admission.k8s.io/v1"),
            "kind": "AdmissionReview",
            "response": response,
        }

    def _mutate(self, request: Mapping[str, Any], response: dict[str, Any]) -> None:
        pod = request.get("object") or {}
        if request.get("operation") != "CREATE" or pod.get("kind", "Pod") != "Pod":
            return
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(OPT_OUT_LABEL) == OPT_OUT_VALUE:
            return
        if not requested_mig_resources(pod):
            return
        fallbacks, warnings = choose_fallbacks(
            pod, chains=self._chains(), available=self._available
        )
        if warnings:
            response["warnings"] = [warning_text(w) for w in warnings]
            for warning in warnings:
                log.warning("pod %s: %s", _pod_name(request), warning)
        if fallbacks:
            patch = fallback_patch(pod, fallbacks)
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
            log.info(
                "pod %s: MIG fallback %s",
                _pod_name(request),
                ",".join(f.summary for f in fallbacks),
            )


def warning_text(text: str) -> str:
    """A warning the API server passes on: printable characters only, and short.

    It becomes an HTTP `Warning` header and a line on the user's terminal, so an exception's
    newlines, escapes or a pod name full of control characters must not reach it.
    """
    clean = "".join(c if c.isprintable() else " " for c in text)
    clean = " ".join(clean.split())
    if len(clean) > WARNING_MAX_CHARS:
        clean = clean[: WARNING_MAX_CHARS - 3] + "..."
    return clean


def _pod_name(request: Mapping[str, Any]) -> str:
    pod = request.get("object") or {}
    metadata = pod.get("metadata") or {}
    name = metadata.get("name") or metadata.get("generateName") or "<unnamed>"
    return f"{request.get('namespace') or metadata.get('namespace') or 'default'}/{name}"


@dataclass(frozen=True, slots=True)
class MigPod:
    """What the webhook keeps of a bound, unfinished pod that holds MIG devices."""

    node: str
    devices: tuple[tuple[str, int], ...]  # (resource name, count)


def mig_pod(pod: Mapping[str, Any]) -> MigPod | None:
    """The pod's MIG holdings, or None for a pod that holds none (most pods)."""
    node = (pod.get("spec") or {}).get("nodeName") or ""
    if not node or (pod.get("status") or {}).get("phase") in _TERMINATED_PHASES:
        return None
    devices = tuple((r, pod_request(pod, r)) for r in requested_mig_resources(pod))
    return MigPod(node=node, devices=devices) if devices else None


def node_mig_allocatable(node: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return tuple(
        sorted(
            (name, _count(value))
            for name, value in allocatable.items()
            if name.startswith(MIG_RESOURCE_PREFIX)
        )
    )


class NotSynced(RuntimeError):
    """The caches have not finished their first list; admission cannot judge yet."""


class MigInventory(NodesAndBoundPods[tuple[tuple[str, int], ...], MigPod]):
    """Free MIG devices per node, from two informers, so admission decides from memory.

    Nodes: every node's allocatable MIG resources. Pods: only bound, unfinished pods, and of
    those only the ones holding MIG devices are kept. A resource counts as available when one
    node has `count` free (a pod cannot straddle nodes). Node selectors, affinities and taints
    are not considered: a fallback may still pend, as the original request would have.
    """

    def __init__(self, *, api_client: Any, page_size: int = 500, **informer_options: Any) -> None:
        self._lock = threading.Lock()
        self._allocatable: dict[str, dict[str, int]] = {}
        self._used: dict[str, dict[str, int]] = {}  # node -> resource -> held by pods
        self._held: dict[str, MigPod] = {}  # pod uid -> what it holds
        super().__init__(
            api_client=api_client, name="webhook", page_size=page_size, **informer_options
        )

    def convert_node(self, node: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
        return node_mig_allocatable(node)

    def convert_pod(self, pod: Mapping[str, Any]) -> MigPod | None:
        return mig_pod(pod)

    def __call__(self, resource: str, count: int) -> bool:
        if not self.synced:
            raise NotSynced("the node and pod caches are still being listed")
        with self._lock:
            return any(
                allocatable.get(resource, 0) - self._used.get(node, {}).get(resource, 0) >= count
                for node, allocatable in self._allocatable.items()
            )

    def free_per_node(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                node: {r: n - self._used.get(node, {}).get(r, 0) for r, n in allocatable.items()}
                for node, allocatable in self._allocatable.items()
            }

    def node_set(self, name: str, allocatable: tuple[tuple[str, int], ...]) -> None:
        with self._lock:
            if allocatable:
                self._allocatable[name] = dict(allocatable)
            else:
                self._allocatable.pop(name, None)

    def node_gone(self, name: str, allocatable: tuple[tuple[str, int], ...]) -> None:
        self.node_set(name, ())

    def pod_set(self, uid: str, pod: MigPod) -> None:
        with self._lock:
            old = self._held.get(uid)
            if old is not None:
                self._hold(old, -1)
            self._held[uid] = pod
            self._hold(pod, +1)

    def pod_gone(self, uid: str, pod: MigPod) -> None:
        with self._lock:
            if self._held.pop(uid, None) is not None:
                self._hold(pod, -1)

    def _hold(self, pod: MigPod, sign: int) -> None:
        used = self._used.setdefault(pod.node, {})
        for resource, count in pod.devices:
            used[resource] = used.get(resource, 0) + sign * count
            if used[resource] == 0:
                del used[resource]
        if not used:
            del self._used[pod.node]


class CertificateFiles:
    """The serving certificate, loaded again when its files change (cert-manager rotation).

    A mounted Secret changes by kubelet swapping a symlink, so the files are compared by
    (inode, mtime, size) through the links at each new connection: two `stat` calls. A pair
    that does not load (a key that does not match, a half-written file) keeps the previous
    context and is reported once.
    """

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self._lock = threading.Lock()
        self._seen = self._signature()
        self._context = self._load()
        self.loads = 1

    def _signature(self) -> tuple[tuple[int, int, int], ...]:
        stats = (os.stat(self.cert_file), os.stat(self.key_file))
        return tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in stats)

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(certfile=str(self.cert_file), keyfile=str(self.key_file))
        return context

    def context(self) -> ssl.SSLContext:
        with self._lock:
            try:
                signature = self._signature()
            except OSError as exc:  # mid-swap: the old files are gone, the new not yet there
                log.debug("webhook certificate files unreadable for now: %s", exc)
                return self._context
            if signature != self._seen:
                self._seen = signature
                try:
                    self._context = self._load()
                    self.loads += 1
                    log.info("webhook certificate reloaded from %s", self.cert_file)
                except (OSError, ssl.SSLError) as exc:
                    log.error(
                        "webhook certificate %s / %s changed but does not load (%s); "
                        "still serving the previous one",
                        self.cert_file,
                        self.key_file,
                        exc,
                    )
            return self._context


class _ReviewHandler(ProbedHandler):
    server: WebhookServer
    log_as = "webhook"
    log = log

    def do_GET(self) -> None:  # noqa: N802
        if not self.answer_probe():
            self.send(404, b"not found\n")

    def do_POST(self) -> None:  # noqa: N802
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 <= length <= MAX_REVIEW_BYTES:
                raise ValueError(f"a body of {length} bytes (at most {MAX_REVIEW_BYTES})")
            body = json.loads(self.rfile.read(length))
            if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
                raise ValueError("the body is not an AdmissionReview with a request")
        except RecursionError:
            self._bad_request("a body nested too deeply to be an AdmissionReview")
            return
        except (ValueError, UnicodeDecodeError) as exc:
            self._bad_request(str(exc))
            return
        answer = self.server.webhook.review(body)
        self.send(200, json.dumps(answer).encode(), "application/json")

    def _bad_request(self, why: str) -> None:
        log.warning("webhook: bad request from %s: %s", self.client_address[0], why)
        self.close_connection = True  # an unread body must not be taken for the next request
        self.send(400, f"expected an AdmissionReview: {why}\n".encode())


class WebhookServer(CacheBackedServer):
    """HTTPS server answering AdmissionReviews on any POST path, /healthz and /readyz on GET."""

    def __init__(
        self,
        *,
        webhook: MigFallbackWebhook,
        cert_file: Path,
        key_file: Path,
        host: str = "0.0.0.0",
        port: int = 8443,
        ready: Callable[[], bool] = lambda: True,
        sources: Sequence[Any] = (),
    ) -> None:
        self.certificate = CertificateFiles(Path(cert_file), Path(key_file))
        super().__init__((host, port), _ReviewHandler, ready=ready, sources=sources)
        self.webhook = webhook

    def get_request(self) -> tuple[Any, Any]:
        # Each connection gets the current certificate. The handshake runs in the request's
        # thread (on its first read), so one slow client cannot stall accept().
        sock, address = self.socket.accept()
        tls = self.certificate.context().wrap_socket(
            sock, server_side=True, do_handshake_on_connect=False
        )
        return tls, address


class PolicyChains:
    """The policy's `migFallback.chains`, re-read every `ttl_s`; a bad policy keeps the old."""

    def __init__(
        self,
        *,
        policy_dir: Path,
        load: Callable[[Path], Chains],
        ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy_dir = policy_dir
        self._load = load
        self._ttl_s = ttl_s
        self._clock = clock
        self._chains: Chains = ()
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def __call__(self) -> Chains:
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= self._ttl_s:
                self._read_at = now
                try:
                    self._chains = self._load(self._policy_dir)
                except Exception as exc:
                    log.error(
                        "reading MIG fallback chains from %s failed (%s); keeping %d chain(s)",
                        self._policy_dir,
                        exc,
                        len(self._chains),
                    )
            return self._chains


def policy_chains(policy_dir: Path) -> Chains:
    """The merged policy's `migFallback.chains` (the loader validates and reports errors)."""
    from appliance.policy.load import load_policy_dir

    return load_policy_dir(policy_dir).mig_fallback.chains


def build_webhook_server(
    *,
    policy_dir: Path,
    cert_file: Path,
    key_file: Path,
    port: int,
    api_client: Any,
    host: str = "0.0.0.0",
) -> WebhookServer:
    """The production webhook, bound but not yet serving (port 0 picks a free port).

    Its node and pod caches start listing at once; /readyz answers 503 until both have.
    """
    inventory = MigInventory(api_client=api_client)
    webhook = MigFallbackWebhook(
        chains=PolicyChains(policy_dir=Path(policy_dir), load=policy_chains),
        available=inventory,
    )
    server = WebhookServer(
        webhook=webhook,
        cert_file=Path(cert_file),
        key_file=Path(key_file),
        host=host,
        port=port,
        ready=lambda: inventory.synced,
        sources=[inventory],
    )
    inventory.start()
    return server


def serve_webhook(server: WebhookServer) -> None:
    """Run a built webhook server until interrupted."""
    host, port = server.server_address[:2]
    log.info("MIG fallback webhook listening on https://%s:%d", host, port)
    try:
        server.serve_forever()
    finally:
        server.server_close()
