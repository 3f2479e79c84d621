"""A real S3-compatible server (moto, in its own process) on 127.0.0.1, for tests.

moto runs as a separate process so that it does not share the GIL with the code under test.
Credentials are fake and given explicitly, so nothing is looked up elsewhere.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TestServerError

REGION = "us-east-1"
# The server enforces signatures (moto's IAM auth); these only bootstrap the IAM user whose
# generated key the tests then use (``S3Server.key_id``/``secret``).
_BOOT_ID, _BOOT_SECRET = "bootstrap", "bootstrap"
_ADMIN_POLICY = ('{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", '
                 '"Resource": "*"}]}')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A running moto server; ``options()`` gives obstore storage options for it."""

    endpoint: str
    process: subprocess.Popen
    key_id: str = ""
    secret: str = ""

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on: what a ``FaultProxy`` forwards to."""
        return "127.0.0.1", int(self.endpoint.rsplit(":", 1)[1])

    def options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "endpoint": endpoint or self.endpoint,
            "region": REGION,
            "access_key_id": self.key_id,
            "secret_access_key": self.secret,
            "client_options": {"allow_http": True, "timeout": "5s", "connect_timeout": "2s"},
        }
        opts.update(extra)
        return opts

    def boto3(self) -> Any:  # an S3 client
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.key_id, aws_secret_access_key=self.secret)

    def make_bucket(self, name: str) -> None:
        self.boto3().create_bucket(Bucket=name)

    def upload_dir(self, local: Path, bucket: str, prefix: str) -> None:
        """Copy a local zarr store into the bucket, key by key."""
        client = self.boto3()
        for path in sorted(local.rglob("*")):
            if path.is_file():
                key = f"{prefix}/{path.relative_to(local).as_posix()}"
                client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_moto(log_dir: Path) -> S3Server:
    port = free_port()
    log = open(log_dir / "moto.log", "wb")  # noqa: SIM115 - lives as long as the server
    # The first 4 requests (IAM bootstrap below) are let through; every later one must carry
    # a valid signature, so wrong credentials get a real 403.
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TestServerError(f"moto server exited with {proc.returncode}; see {log.name}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return _bootstrap(S3Server(f"http://127.0.0.1:{port}", proc))
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise TestServerError(f"moto server did not start within 30 s; see {log.name}")


@contextmanager
def serving(log_dir: Path, bucket: str, stores: Mapping[str, Path]) -> Iterator[S3Server]:
    """moto with each local store of ``stores`` at ``s3://bucket/<key>``, stopped on exit:
    what the S3 tests and the remote benchmarks all start from."""
    server = start_moto(log_dir)
    try:
        server.make_bucket(bucket)
        for key, local in stores.items():
            server.upload_dir(local, bucket, key)
        yield server
    finally:
        server.stop()


def _bootstrap(server: S3Server) -> S3Server:
    import boto3

    iam = boto3.client("iam", endpoint_url=server.endpoint, region_name=REGION,
                       aws_access_key_id=_BOOT_ID, aws_secret_access_key=_BOOT_SECRET)
    iam.create_user(UserName="tester")
    key = iam.create_access_key(UserName="tester")["AccessKey"]
    arn = iam.create_policy(PolicyName="all", PolicyDocument=_ADMIN_POLICY)["Policy"]["Arn"]
    iam.attach_user_policy(UserName="tester", PolicyArn=arn)
    server.key_id, server.secret = key["AccessKeyId"], key["SecretAccessKey"]
    return server
