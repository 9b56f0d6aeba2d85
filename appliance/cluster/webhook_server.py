"""The MIG-fallback webhook as an HTTPS server: certificates that rotate, reviews over kept-alive
connections, probes, and the policy's chains from the same `PolicyWatcher` as the node daemon.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
from pathlib import Path
from typing import Any

from appliance.cluster.admission_ledger import AdmissionLedger
from appliance.cluster.mig_inventory import MigInventory
from appliance.cluster.serving import (
    BadBody,
    CacheBackedServer,
    ProbedHandler,
    Refused,
    run_until_stopped,
)
from appliance.cluster.webhook import FALLBACK_ANNOTATION, Chains, MigFallbackWebhook
from appliance.policy.watch import PolicyWatcher
from appliance.web.listen import EVERY_ADDRESS, bind

log = logging.getLogger("appliance.cluster.webhook")

MAX_REVIEW_BYTES = 3 << 20  # the API server's own request limit; a pod is far smaller


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
            with self.server.in_flight():
                body = self.read_json(MAX_REVIEW_BYTES)
                if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
                    raise BadBody(400, "the body is not an AdmissionReview with a request")
                answer = self.server.webhook.review(body)
        except BadBody as refusal:
            self.refuse_body(refusal, "an AdmissionReview")
            return
        self.send(200, json.dumps(answer).encode(), "application/json")


class WebhookServer(CacheBackedServer):
    """HTTPS server answering AdmissionReviews on any POST path, /healthz and /readyz on GET."""

    SCHEME = "https"

    def __init__(
        self,
        *,
        webhook: MigFallbackWebhook,
        cert_file: Path,
        key_file: Path,
        host: str = EVERY_ADDRESS,
        port: int = 8443,
        **serving: Any,  # CacheBackedServer's: not_ready, unhealthy, sources
    ) -> None:
        self.certificate = CertificateFiles(Path(cert_file), Path(key_file))
        super().__init__((host, port), _ReviewHandler, **serving)
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
    """The policy's `migFallback.chains`, as the node daemon gets its policy: a `PolicyWatcher`
    (inotify, a bad edit keeps the last good policy and says so). While the policy has never
    been valid there are no chains, and every pod is admitted unchanged."""

    def __init__(self, policy_dir: Path) -> None:
        self.watcher = PolicyWatcher(
            Path(policy_dir),
            on_policy=lambda policy: None,  # read through `last_good`, the newest valid policy
            on_error=lambda errors: None,  # the watcher logs them
        )

    def start(self) -> None:
        self.watcher.watch()

    def stop(self) -> None:
        self.watcher.stop()

    def __call__(self) -> Chains:
        good = self.watcher.last_good
        return good.mig_fallback.chains if good is not None else ()

    def annotation(self) -> str:
        good = self.watcher.last_good
        return good.mig_fallback.annotation if good is not None else FALLBACK_ANNOTATION

    def not_ready(self) -> list[str]:
        if self.watcher.last_good is None:
            return [f"no valid policy in {self.watcher.directory} yet (see the log)"]
        return []


def build_webhook_server(
    *,
    policy_dir: Path,
    cert_file: Path,
    key_file: Path,
    port: int,
    api_client: Any,
    host: str = EVERY_ADDRESS,
    namespace: str = "nvshare-system",
) -> WebhookServer:
    """The production webhook, bound but not yet serving (port 0 picks a free port).

    Its node and pod caches start listing at once (/readyz answers 503 until both have and
    the policy loaded), and the policy directory is watched from then on. Its admissions are
    shared with the other replicas through a ConfigMap in `namespace`.
    """
    ledger = AdmissionLedger(api_client=api_client, namespace=namespace)
    inventory = MigInventory(api_client=api_client, ledger=ledger)
    chains = PolicyChains(policy_dir)
    server = bind(
        lambda at: WebhookServer(
            webhook=MigFallbackWebhook(
                chains=chains, capacity=inventory, annotation=chains.annotation
            ),
            cert_file=Path(cert_file),
            key_file=Path(key_file),
            host=at[0],
            port=at[1],
            not_ready=lambda: chains.not_ready() + inventory.not_ready(),
            unhealthy=inventory.unhealthy,
            sources=[inventory, chains],
        ),
        host,
        port,
        what="webhook",
    )
    inventory.start()
    chains.start()
    return server


def run_webhook(
    *,
    policy_dir: Path,
    cert_file: Path,
    key_file: Path,
    port: int,
    host: str,
    kube_api: str | None,
    namespace: str = "nvshare-system",
) -> int:
    """`nvshare-scheduler webhook`: 0 when stopped by a signal, 1 when it cannot start."""
    log = logging.getLogger("nvshare.webhook")

    def build() -> WebhookServer:
        from appliance.kube.api import KubeConfigError, api_client_from_env

        try:
            server = build_webhook_server(
                policy_dir=policy_dir,
                cert_file=cert_file,
                key_file=key_file,
                port=port,
                host=host,
                api_client=api_client_from_env(kube_api),
                namespace=namespace,
            )
        except KubeConfigError as exc:
            raise Refused(str(exc)) from None
        except ssl.SSLError as exc:
            raise Refused(
                f"cannot use {cert_file} with {key_file} for TLS: {exc.reason or exc}"
            ) from None
        except OSError as exc:
            raise Refused(f"cannot serve on port {port}: {exc.strerror or exc}") from None
        log.info("MIG fallback chains from %s", policy_dir)
        return server

    return run_until_stopped(build, "MIG fallback webhook on https", log)
