"""Fixtures shared by several test modules (pytest finds them here, no import needed)."""

from s3server import aws, s3  # noqa: F401 (moto's S3 server over real HTTP, per module)
