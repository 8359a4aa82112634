"""What the S3 client sends: SigV4 presigned URLs equal to botocore's, and the URLs of objects and
listings (virtual-hosted or path-style) as botocore would address them."""

from __future__ import annotations

import datetime
from typing import Any
from unittest import mock
from urllib.parse import parse_qsl, urlsplit

import pytest

from streamer import ConfigError, S3Config
from streamer.backends.s3.client import S3Client
from streamer.backends.s3.sigv4 import Credentials, presign
from streamer.backends.s3.uri import S3Uri

botocore_auth = pytest.importorskip("botocore.auth")
NOW = datetime.datetime(2026, 11, 27, 19, 44, 48, tzinfo=datetime.timezone.utc)
KEY, SECRET, TOKEN = "AKIDSIGNTEST", "sign/secret+key", "session//token=="


def botocore_presigned(url: str, token: str | None, region: str) -> str:
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCredentials

    request = AWSRequest(method="GET", url=url)
    signer = botocore_auth.S3SigV4QueryAuth(BotoCredentials(KEY, SECRET, token), "s3", region, expires=3600)
    with mock.patch("botocore.auth.get_current_datetime", return_value=NOW.replace(tzinfo=None)):
        signer.add_auth(request)
    return str(request.url)


@pytest.mark.parametrize(
    "url",
    [
        "https://bucket.s3.amazonaws.com/model.safetensors",
        "https://s3.eu-west-1.amazonaws.com/my.bucket/dir%20with%20space/a%2Bb~c.safetensors",
        "http://127.0.0.1:9000/models/%C3%BCnicode/%E2%9C%93.safetensors",
        "http://localhost:9000/models?list-type=2&prefix=a%20b%2F&delimiter=%2F&encoding-type=url",
        "https://bucket.s3.amazonaws.com/?list-type=2&prefix=&delimiter=%2F&continuation-token=1%2Fab%3D%3D",
    ],
)
@pytest.mark.parametrize("token", [None, TOKEN])
def test_presigned_urls_are_botocores(url: str, token: str | None) -> None:
    region = "eu-west-1" if "eu-west-1" in url else "us-east-1"
    ours = (
        f"{url}{'&' if '?' in url else '?'}{presign(url, Credentials(KEY, SECRET, token), region, NOW, 3600)}"
    )
    theirs = botocore_presigned(url, token, region)
    assert urlsplit(ours).path == urlsplit(theirs).path
    assert dict(parse_qsl(urlsplit(ours).query)) == dict(parse_qsl(urlsplit(theirs).query))


def test_the_secret_never_appears_in_a_presigned_url() -> None:
    query = presign("https://b.s3.amazonaws.com/k", Credentials(KEY, SECRET, TOKEN), "us-east-1", NOW, 60)
    assert SECRET not in query and "sign%2Fsecret" not in query
    assert "secret" not in repr(Credentials(KEY, SECRET, TOKEN)) and "session" not in repr(
        Credentials(KEY, SECRET, TOKEN)
    )


def urls(monkeypatch: pytest.MonkeyPatch, bucket: str, **settings: Any) -> tuple[str, str]:
    """The object URL of ``bucket/dir/m.safetensors`` and the listing URL of ``bucket/dir/``."""
    for name in (
        "AWS_PROFILE",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
    ):
        monkeypatch.delenv(name, raising=False)
    with S3Client(S3Config(anonymous=True, **settings)) as client:
        obj = client.object_url(S3Uri(bucket, "dir/m.safetensors"), None)
        listing = client.list_page_url(bucket, "dir/", None)
    return obj, listing.partition("?")[0]


@pytest.mark.parametrize(
    ("bucket", "settings", "expected"),
    [
        ("models", {}, "https://models.s3.amazonaws.com/"),
        ("models", {"region": "eu-west-2"}, "https://models.s3.eu-west-2.amazonaws.com/"),
        ("models", {"region": "cn-north-1"}, "https://models.s3.cn-north-1.amazonaws.com.cn/"),
        ("my.models", {"region": "eu-west-2"}, "https://s3.eu-west-2.amazonaws.com/my.models"),
        ("Models_Upper", {}, "https://s3.amazonaws.com/Models_Upper"),
        ("models", {"addressing_style": "path"}, "https://s3.amazonaws.com/models"),
        ("models", {"endpoint_url": "http://localhost:9000"}, "http://localhost:9000/models"),
        ("models", {"endpoint_url": "http://localhost:9000/", "addressing_style": "virtual"}, "http://models.localhost:9000/"),
        ("models", {"endpoint_url": "http://127.0.0.1:9000", "addressing_style": "virtual"}, "http://127.0.0.1:9000/models"),
        ("models", {"endpoint_url": "https://gw.example/s3"}, "https://gw.example/s3/models"),
    ],
)  # fmt: skip
def test_addressing_follows_botocores_rule(
    monkeypatch: pytest.MonkeyPatch, bucket: str, settings: dict[str, Any], expected: str
) -> None:
    obj, listing = urls(monkeypatch, bucket, **settings)
    assert listing == expected
    assert obj == expected.rstrip("/") + "/dir/m.safetensors"


def test_a_malformed_endpoint_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Invalid IPv6 URL") as caught:
        S3Client(S3Config(anonymous=True, endpoint_url="http://[::1"))
    assert caught.value.__context__ is None and caught.value.__cause__ is None


def test_listing_pages_are_read_as_s3_writes_them() -> None:
    with S3Client(S3Config(anonymous=True, endpoint_url="http://127.0.0.1:1")) as client:
        page = (
            b'<?xml version="1.0" encoding="UTF-8"?>'
            b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name>'
            b"<Prefix>d%2F</Prefix><EncodingType>url</EncodingType><IsTruncated>true</IsTruncated>"
            b"<Contents><Key>d/a+b%2Bc.safetensors</Key><Size>1</Size></Contents>"
            b"<Contents><Key>d/%C3%BC.safetensors</Key></Contents>"
            b"<NextContinuationToken>tok/en==</NextContinuationToken></ListBucketResult>"
        )
        assert client.parse_page(page) == (["d/a b+c.safetensors", "d/ü.safetensors"], "tok/en==")
        plain = page.replace(b"<EncodingType>url</EncodingType>", b"").replace(b"true", b"false")
        assert client.parse_page(plain) == (["d/a+b%2Bc.safetensors", "d/%C3%BC.safetensors"], None)
