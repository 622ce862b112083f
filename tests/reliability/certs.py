"""Test certificates, made with the ``openssl`` command line (never committed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HAVE_OPENSSL = shutil.which("openssl") is not None


def _run(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)


def make_ca(d: Path, name: str) -> None:
    _run(
        d,
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
    )


def make_cert(d: Path, ca: str, name: str, ips: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, str]:
    """A worker certificate signed by ``ca`` naming ``ips`` (and localhost)."""
    sans = ",".join([*(f"IP:{ip}" for ip in ips), "DNS:localhost"])
    (d / f"{name}.cnf").write_text(f"subjectAltName={sans}\n")
    _run(
        d,
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
    )
    _run(
        d,
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        f"{name}.cnf",
        "-out",
        f"{name}.pem",
    )
    return {
        "tls_cert_file": str(d / f"{name}.pem"),
        "tls_key_file": str(d / f"{name}.key"),
        "tls_ca_file": str(d / f"{ca}.pem"),
    }
