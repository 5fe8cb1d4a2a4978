"""moto's server (what ``ThreadedMotoServer`` and ``moto_server`` run: its
``DomainDispatcherApplication`` under werkzeug's threaded server) as a process of its own,
counting what it handled; and the workload, driven by boto3: an S3 bucket with objects put,
read and deleted, a multipart upload of 15 MiB, and an SQS queue sent to, received from (a
long-poll receive) and emptied.

    python3 -m tests.motoapp --port 5000
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import subprocess
import sys
import time
from typing import Any

from tests.difftools import wait_http
from tests.threeways import Tally
from tests.wsgicount import COUNT_PATH, Counting, read_count

PART_BYTES = 5 * 1024 * 1024  # S3's smallest part (all but the last)
PARTS = 3  # 15 MiB in all
SMALL = {f"doc-{i}.txt": f"document {i}\n".encode() * (i + 1) for i in range(5)}
MESSAGES = [f"message {i}" for i in range(8)]


def request_key(environ: dict[str, Any]) -> str:
    """The operation: SQS's JSON protocol names it in ``X-Amz-Target``; S3 by method and by
    the multipart query parameters."""
    target = environ.get("HTTP_X_AMZ_TARGET")
    if target:
        return str(target)
    query = str(environ.get("QUERY_STRING", ""))
    marks = [m for m in ("uploads", "uploadId", "partNumber", "list-type") if m in query]
    return f"S3 {environ.get('REQUEST_METHOD')} {','.join(marks)}".rstrip()


def serve(port: int) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    # werkzeug logs every request at INFO to stderr, a pipe the test reads only on failure.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    app = Counting(DomainDispatcherApplication(create_backend_app), request_key)
    make_server("127.0.0.1", port, app, threaded=True).serve_forever()


def start(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.motoapp", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_http(port, COUNT_PATH, proc, "moto server")
    return proc


def big_object() -> bytes:
    return random.Random(15).randbytes(PART_BYTES * PARTS)


def clients(base: str) -> tuple[Any, Any]:
    """boto3's S3 and SQS clients for ``base``, each call one HTTP request: boto3's own
    retries are off, so a count of requests means the same every way."""
    import boto3
    from botocore.config import Config

    cfg = Config(
        retries={"total_max_attempts": 1},
        s3={"addressing_style": "path"},
        connect_timeout=10,
        read_timeout=30,
    )
    session = boto3.session.Session(
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    return (
        session.client("s3", endpoint_url=base, config=cfg),
        session.client("sqs", endpoint_url=base, config=cfg),
    )


class Ops:
    """Calls the workload's operations one by one; counts those answered and those that
    failed (a refusal or an error of any kind), and keeps what each returned."""

    def __init__(self) -> None:
        self.answered = 0
        self.failed: list[str] = []

    def __call__(self, name: str, fn: Any, **kwargs: Any) -> Any:
        try:
            out = fn(**kwargs)
        except Exception as exc:
            self.failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
            return None
        self.answered += 1
        return out


def s3_workload(s3: Any, op: Ops) -> dict[str, object]:
    seen: dict[str, object] = {}
    op("create_bucket", s3.create_bucket, Bucket="apps")
    for key, body in SMALL.items():
        op("put_object", s3.put_object, Bucket="apps", Key=key, Body=body)
    got = {}
    for key in SMALL:
        r = op("get_object", s3.get_object, Bucket="apps", Key=key)
        got[key] = r["Body"].read() if r else None
    seen["small objects read back"] = got == SMALL
    big = big_object()
    up = op("create_multipart_upload", s3.create_multipart_upload, Bucket="apps", Key="big.bin")
    upload_id = up["UploadId"] if up else ""
    parts = []
    for n in range(1, PARTS + 1):
        piece = big[(n - 1) * PART_BYTES : n * PART_BYTES]
        r = op(
            "upload_part",
            s3.upload_part,
            Bucket="apps",
            Key="big.bin",
            UploadId=upload_id,
            PartNumber=n,
            Body=piece,
        )
        parts.append({"PartNumber": n, "ETag": r["ETag"] if r else ""})
    op(
        "complete_multipart_upload",
        s3.complete_multipart_upload,
        Bucket="apps",
        Key="big.bin",
        UploadId=upload_id,
        MultipartUpload={"Parts": parts},
    )
    r = op("get_object", s3.get_object, Bucket="apps", Key="big.bin")
    data = r["Body"].read() if r else b""
    seen["multipart object intact"] = hashlib.sha256(data).digest() == hashlib.sha256(big).digest()
    listed = op("list_objects_v2", s3.list_objects_v2, Bucket="apps")
    seen["listed"] = sorted(o["Key"] for o in (listed or {}).get("Contents", []))
    for key in [*SMALL, "big.bin"]:
        op("delete_object", s3.delete_object, Bucket="apps", Key=key)
    listed = op("list_objects_v2", s3.list_objects_v2, Bucket="apps")
    seen["listed after delete"] = sorted(o["Key"] for o in (listed or {}).get("Contents", []))
    op("delete_bucket", s3.delete_bucket, Bucket="apps")
    return seen


def sqs_workload(sqs: Any, op: Ops) -> dict[str, object]:
    seen: dict[str, object] = {}
    q = op("create_queue", sqs.create_queue, QueueName="apps")
    url = q["QueueUrl"] if q else ""
    for body in MESSAGES:
        op("send_message", sqs.send_message, QueueUrl=url, MessageBody=body)
    received: list[str] = []
    for _ in range(len(MESSAGES)):  # bounded: at most one receive per message
        if len(received) == len(MESSAGES):
            break
        r = op(
            "receive_message",
            sqs.receive_message,
            QueueUrl=url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,
        )
        for m in (r or {}).get("Messages", []):
            received.append(m["Body"])
            op("delete_message", sqs.delete_message, QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    seen["messages received"] = sorted(received)
    # A long-poll receive of an empty queue: answered empty after its wait, as direct.
    r = op("receive_message", sqs.receive_message, QueueUrl=url, WaitTimeSeconds=1)
    seen["empty queue receive"] = (r or {}).get("Messages", []) if r is not None else None
    op("delete_queue", sqs.delete_queue, QueueUrl=url)
    return seen


def run(base: str, app_port: int) -> Tally:
    s3, sqs = clients(base)
    op = Ops()
    t0 = time.monotonic()
    outcome = {**s3_workload(s3, op), **sqs_workload(sqs, op)}
    seconds = time.monotonic() - t0
    outcome["failed operations"] = op.failed
    count = read_count(app_port)
    outcome["app statuses"] = count["statuses"]
    return Tally(
        outcome=outcome,
        answered=op.answered,
        refused=len(op.failed),
        handled=count["handled"],
        seconds=seconds,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    serve(args.port)


if __name__ == "__main__":
    main()
