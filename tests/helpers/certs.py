"""A throwaway certificate authority for the TLS tests: a CA, certificates it signs (for a server
at an IP address, or a client by name), all made with the system's ``openssl`` command."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _run(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


class Authority:
    """``Authority(dir, "ca")``: ``ca.crt``; ``issue(name, ip=...)`` gives (cert, key) paths."""

    def __init__(self, where: Path, name: str):
        if OPENSSL is None:
            pytest.skip("openssl is not installed")
        self.where, self.name = where, name
        where.mkdir(parents=True, exist_ok=True)
        _run("req", "-x509", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN={name}", cwd=where)
        self.cert = where / f"{name}.crt"

    def issue(self, name: str, ip: str | None = None, days: int = 2) -> tuple[Path, Path]:
        """``days`` 0: a certificate that has expired by the time it is used."""
        _run("req", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=self.where)
        ext = self.where / f"{name}.ext"
        ext.write_text((f"subjectAltName=IP:{ip}\n" if ip else "") + "extendedKeyUsage=serverAuth,clientAuth\n")
        _run("x509", "-req", "-in", f"{name}.csr", "-CA", self.cert.name, "-CAkey", f"{self.name}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", str(days), "-extfile", ext.name, cwd=self.where)
        return self.where / f"{name}.crt", self.where / f"{name}.key"
