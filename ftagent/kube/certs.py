"""Serving certificates for the webhook, for clusters without cert-manager.

``self_signed(dns_names)`` makes a CA and a serving certificate signed by it (PEM bytes);
``ensure_shared`` keeps them in one Secret so that every webhook replica serves the same
certificate, and ``ca_bundle_patch`` is the JSON patch that writes the CA into the
MutatingWebhookConfiguration's ``caBundle`` (``ftagent webhook --self-signed`` applies both
through the Kubernetes API; the cert-manager overlay replaces all of it).
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Pems:
    ca: bytes
    cert: bytes
    key: bytes


def service_names(service: str, namespace: str) -> list[str]:
    """The names the API server may dial a webhook service by."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.cluster.local"]


def self_signed(dns_names: Sequence[str], days: int = 3650,
                ca_common_name: str = "ftagent-webhook-ca") -> Pems:
    """A CA and a certificate for ``dns_names`` signed by it (ECDSA P-256)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    until = now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_common_name)])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(until)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return Pems(
        ca=ca.public_bytes(pem), cert=cert.public_bytes(pem),
        key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def secret_data(p: Pems) -> dict[str, str]:
    """The Secret's ``data`` (kubernetes.io/tls keys plus ca.crt)."""
    return {k: base64.b64encode(v).decode() for k, v in
            (("ca.crt", p.ca), ("tls.crt", p.cert), ("tls.key", p.key))}


def from_secret_data(data: dict[str, Any]) -> Pems | None:
    try:
        return Pems(*(base64.b64decode(data[k]) for k in ("ca.crt", "tls.crt", "tls.key")))
    except (KeyError, ValueError, TypeError):
        return None


def ca_bundle_patch(config: dict[str, Any], ca: bytes) -> list[dict[str, Any]]:
    """JSONPatch setting ``caBundle`` on every webhook of a MutatingWebhookConfiguration
    (empty when they already carry it)."""
    bundle = base64.b64encode(ca).decode()
    return [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
            for i, w in enumerate(config.get("webhooks") or [])
            if (w.get("clientConfig") or {}).get("caBundle") != bundle]


def ensure_secret(api_client: Any, namespace: str, secret: str,
                  dns_names: Sequence[str]) -> tuple[Pems, bool]:
    """The arbiter's serving certificate from Secret ``namespace/secret`` (``tls.crt``,
    ``tls.key``, ``ca.crt``: cert-manager's layout), made (self-signed CA + a certificate
    for ``dns_names``) and created there when absent; (pems, created). Two replicas starting
    at once: the first create wins, the other reads it (409 -> read again)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(api_client)
    for _ in range(3):
        try:
            found = core.read_namespaced_secret(secret, namespace)
            pems = from_secret_data(found.data or {})
            if pems is None:
                raise ValueError(f"secret {namespace}/{secret} lacks tls.crt, tls.key or "
                                 "ca.crt (cert-manager's layout)")
            return pems, False
        except ApiException as e:
            if e.status != 404:
                raise
        made = self_signed(dns_names, ca_common_name="ftagent-arbiter-ca")
        body: Any = {"metadata": {"name": secret, "namespace": namespace,
                                  "labels": {"app.kubernetes.io/managed-by": "ftagent"}},
                     "type": "kubernetes.io/tls", "data": secret_data(made)}
        try:
            core.create_namespaced_secret(namespace, body)
            return made, True
        except ApiException as e:
            if e.status != 409:
                raise
    raise RuntimeError(f"secret {namespace}/{secret}: created and deleted under us")


def ensure_shared(namespace: str, secret: str, webhook_config: str,
                  dns_names: Sequence[str]) -> Pems:  # pragma: no cover - needs a cluster
    """Read the replicas' shared certificate from ``secret`` (or make and store it, the
    first replica wins a create race), then write its CA into ``webhook_config``."""
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    core, admission = client.CoreV1Api(), client.AdmissionregistrationV1Api()
    pems: Pems | None = None
    for _ in range(3):
        try:
            pems = from_secret_data(core.read_namespaced_secret(secret, namespace).data or {})
            if pems is not None:
                break
        except ApiException as e:
            if e.status != 404:
                raise
        made = self_signed(dns_names)
        body: Any = {"metadata": {"name": secret, "namespace": namespace},
                     "type": "kubernetes.io/tls", "data": secret_data(made)}
        try:
            core.create_namespaced_secret(namespace, body)
            pems = made
            break
        except ApiException as e:
            if e.status != 409:  # another replica created it first: read theirs
                raise
    if pems is None:
        raise RuntimeError(f"secret {namespace}/{secret} holds no usable certificate")
    current = admission.read_mutating_webhook_configuration(webhook_config).to_dict()
    ops = ca_bundle_patch({"webhooks": [{"clientConfig": {"caBundle": (w.get(
        "client_config") or {}).get("ca_bundle")}} for w in current.get("webhooks") or []]},
        pems.ca)
    if ops:
        admission.patch_mutating_webhook_configuration(webhook_config, ops)
    return pems
