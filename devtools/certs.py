"""``python -m infermesh certs DIR``: a development CA, one certificate per mesh role and one
per worker named (``--worker NAME``).

Each certificate names its role as a SAN URI ``spiffe://infermesh/<role>`` (what the services'
per-RPC checks read, ``infermesh.authz``) and the hosts it may be reached at as DNS and IP
SANs: loopback, the role's service name (``router``, ``worker``, ...) and any hosts given.
Files keep fixed names (``ca.crt``, ``<role>.crt``, ``<role>.key``; the CA's key ``ca.key``
stays beside them to issue more); keys are written owner-only. A set that is still valid and
names the hosts asked for is kept, so running the command again changes nothing; ``renew``
issues new role certificates from the same CA (a rotation: services pick them up without a
restart)."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from infermesh.authz import ROLES, role_uri
from infermesh.tls import TlsSection

_CA_DAYS = 3650
_LEAF_DAYS = 365
# a certificate this close to its end is issued again rather than kept
_RENEW_BEFORE = datetime.timedelta(days=7)
_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def role_tls(directory: Path, role: str) -> TlsSection:
    """The ``[tls]`` section of a service (or caller) in ``role``, from ``directory``'s set."""
    return TlsSection(
        cert_file=str(directory / f"{role}.crt"),
        key_file=str(directory / f"{role}.key"),
        ca_file=str(directory / "ca.crt"),
    )


def role_hosts(role: str, extra: Iterable[str] = ()) -> list[str]:
    """The hosts a role's certificate names: loopback, the role's service name, ``extra``."""
    return list(dict.fromkeys([*_LOOPBACK_HOSTS, role, *extra]))


def write_certs(
    directory: Path,
    extra_hosts: Mapping[str, Iterable[str]] | None = None,
    *,
    client_name: str = "",
    workers: Mapping[str, Iterable[str]] | None = None,
    renew: bool = False,
) -> list[str]:
    """Writes the CA and every role's certificate and key into ``directory``; returns the
    file names written (empty: the existing set was kept). ``extra_hosts`` maps a role to more
    hosts it is reached at; ``client_name`` names the client (``spiffe://infermesh/client/NAME``);
    ``workers`` maps a worker's name to its hosts: each gets its own identity,
    ``spiffe://infermesh/worker/NAME``, in ``worker-NAME.crt`` naming loopback and those hosts
    (the router gives a worker id to the identity that registered it, so workers that share a
    certificate could take over each other's ids); ``renew`` issues every role certificate
    again from the existing CA."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    ca_key, ca_cert = _load_ca(directory)
    if ca_key is None or ca_cert is None:
        ca_key, ca_cert = _new_ca()
        _write_key(directory / "ca.key", ca_key)
        _write_public(directory / "ca.crt", ca_cert)
        written += ["ca.crt", "ca.key"]
        renew = True  # certificates of another CA are no use
    leaves = [
        (role, role_uri(role, client_name if role == "client" else ""), role_hosts(role, extra))
        for role in ROLES
        for extra in [(extra_hosts or {}).get(role, ())]
    ] + [
        (f"worker-{name}", role_uri("worker", name), [*_LOOPBACK_HOSTS, *hosts])
        for name, hosts in (workers or {}).items()
    ]
    for stem, uri, hosts in leaves:
        if not renew and _leaf_valid(directory, stem, ca_cert, uri, hosts):
            continue
        key = ec.generate_private_key(ec.SECP256R1())
        _write_key(directory / f"{stem}.key", key)
        _write_public(directory / f"{stem}.crt", _leaf(ca_key, ca_cert, key, stem, uri, hosts))
        written += [f"{stem}.crt", f"{stem}.key"]
    return written


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "infermesh development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _new_ca() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("infermesh development CA")
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _san(uri: str, hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    role: str,
    uri: str,
    hosts: list[str],
) -> x509.Certificate:
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(_name(f"infermesh {role}"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(uri, hosts), critical=False)
        # every service is a server to its callers and a client of the next hop
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )


def _load_ca(
    directory: Path,
) -> tuple[ec.EllipticCurvePrivateKey | None, x509.Certificate | None]:
    """The directory's CA, if its key and certificate are there, match and are in date."""
    try:
        key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
        cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    except (OSError, ValueError):
        return None, None
    if (
        not isinstance(key, ec.EllipticCurvePrivateKey)
        or key.public_key() != cert.public_key()
        or cert.not_valid_after_utc - _RENEW_BEFORE < _now()
    ):
        return None, None
    return key, cert


def _leaf_valid(
    directory: Path, stem: str, ca_cert: x509.Certificate, uri: str, hosts: list[str]
) -> bool:
    """The certificate ``stem``.crt and key are there, match, come from the CA, are in date and
    name ``uri`` and every host of ``hosts``."""
    try:
        cert = x509.load_pem_x509_certificate((directory / f"{stem}.crt").read_bytes())
        key = serialization.load_pem_private_key((directory / f"{stem}.key").read_bytes(), None)
        cert.verify_directly_issued_by(ca_cert)
    except (OSError, ValueError, TypeError, InvalidSignature):
        return False
    try:
        named = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return False
    return (
        key.public_key() == cert.public_key()
        and cert.not_valid_after_utc - _RENEW_BEFORE > _now()
        and set(_san(uri, hosts)) <= named
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_atomically(path, pem, 0o600)


def _write_public(path: Path, cert: x509.Certificate) -> None:
    _write_atomically(path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Writes through a temporary file renamed into place, so that a service re-reading the
    files (a rotation) never sees half of one; the file is created with ``mode``."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    certs = commands.add_parser(
        "certs", help="write a development CA and a certificate + key per mesh role"
    )
    certs.add_argument("directory", type=Path, help="where ca.crt, <role>.crt, <role>.key go")
    for role in ROLES:
        certs.add_argument(
            f"--{role}-host",
            action="append",
            default=[],
            metavar="HOST",
            help=f"another DNS name or IP the {role} is reached at (repeatable)",
        )
    certs.add_argument(
        "--client-name", default="", help="names the client: spiffe://infermesh/client/NAME"
    )
    certs.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="NAME[=HOST,...]",
        help="a worker certificate of its own, worker-NAME.crt (spiffe://infermesh/worker/NAME), "
        "naming loopback and the hosts given (repeatable)",
    )
    certs.add_argument(
        "--renew", action="store_true", help="issue every role certificate again (same CA)"
    )


def run(args: argparse.Namespace) -> int:
    extra = {role: getattr(args, f"{role}_host") for role in ROLES}
    workers = {
        name: [host for host in hosts.split(",") if host]
        for name, _, hosts in (worker.partition("=") for worker in args.worker)
    }
    written = write_certs(
        args.directory, extra, client_name=args.client_name, workers=workers, renew=args.renew
    )
    if written:
        print(f"{args.directory}: wrote {', '.join(written)}")
    else:
        print(f"{args.directory}: certificates valid, kept")
    return 0
