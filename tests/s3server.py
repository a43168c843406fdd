"""A real S3-compatible object store for the tests: moto's standalone server (``moto_server``, pinned in the dev
extra) in a subprocess on 127.0.0.1, spoken to over HTTP by efftx (pyarrow's S3 filesystem), Ray Train and boto3.

Authentication is on: the server answers its first three actions without credentials (moto's
INITIAL_NO_AUTH_ACTION_COUNT), which create an IAM user, its access key and a policy allowing s3:*; from then on
every request must be signed with that key, so a wrong key is refused as a real store refuses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from netutil import free_port

REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    proc: subprocess.Popen
    log: Path

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client (efftx, boto3, a subprocess) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": REGION}

    def client(self, access_key: str | None = None, secret_key: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=access_key or self.access_key,
                            aws_secret_access_key=secret_key or self.secret_key)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` in ``bucket`` (empty "folder/" markers left out)."""
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(timeout: float = 60.0) -> S3Server:
    """Start moto_server on a free port of 127.0.0.1 and create the credentials (see the module docstring)."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="efftx-s3-")) / "moto_server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                break
        except OSError:
            if time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"moto_server did not answer on {endpoint} within {timeout:.0f}s:\n"
                                   f"{log.read_text()[-3000:]}") from None
            time.sleep(0.2)
    # the three unauthenticated actions: user, key, policy
    iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="bootstrap",
                       aws_secret_access_key="bootstrap")
    iam.create_user(UserName="efftx-tests")
    key = iam.create_access_key(UserName="efftx-tests")["AccessKey"]
    iam.put_user_policy(UserName="efftx-tests", PolicyName="s3-all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    return S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], proc, log)
