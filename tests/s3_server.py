"""A local S3 endpoint for the tests: moto's server on 127.0.0.1 and a free port, in this process, with a bucket.

`with S3Server() as s3:` -> s3.url, s3.bucket, s3.env (the standard AWS variables a process needs to reach it:
`AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, credentials, region), s3.keys(prefix). Stopped at the end of the block.
"""

from typing import Optional

from ray_head import free_ports


class S3Server:
    def __init__(self, bucket: str = "ampflow-test", port: Optional[int] = None):
        self.bucket, self.port = bucket, port or free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL_S3": self.url, "AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
        self.server = None

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def __enter__(self) -> "S3Server":
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def keys(self, prefix: str = "") -> list[str]:
        """Every key in the bucket under `prefix`."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]
