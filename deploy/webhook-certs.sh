#!/bin/sh
# Makes a self-signed certificate for the MIG-fallback webhook, stores it as the Secret
# nvshare-webhook-tls and puts its CA into the MutatingWebhookConfiguration. Run it once after
# `kubectl apply -k deploy/` (and again before the certificate expires, after DAYS days).
# Clusters with cert-manager do not need this: see docs/kubernetes.md.
set -eu
NAMESPACE=${NAMESPACE:-nvshare-system}
SERVICE=${SERVICE:-nvshare-webhook}
DAYS=${DAYS:-825}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

openssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" \
  -keyout "$work/tls.key" -out "$work/tls.crt" \
  -subj "/CN=$SERVICE.$NAMESPACE.svc" \
  -addext "subjectAltName=DNS:$SERVICE.$NAMESPACE.svc,DNS:$SERVICE.$NAMESPACE.svc.cluster.local" \
  2>/dev/null

kubectl -n "$NAMESPACE" create secret tls nvshare-webhook-tls \
  --cert="$work/tls.crt" --key="$work/tls.key" --dry-run=client -o yaml | kubectl apply -f -
ca=$(base64 < "$work/tls.crt" | tr -d '\n')
kubectl patch mutatingwebhookconfiguration nvshare-mig-fallback --type=json \
  -p "[{\"op\": \"add\", \"path\": \"/webhooks/0/clientConfig/caBundle\", \"value\": \"$ca\"}]"
kubectl -n "$NAMESPACE" rollout restart deployment/nvshare-webhook
echo "webhook certificate installed (valid $DAYS days)"
