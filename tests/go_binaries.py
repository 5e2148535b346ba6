"""Where scripts/build-kube.sh, build-registry.sh and build-kwok.sh cache the Go binaries the
tests run, by the rule of scripts/lib/go-cache.sh (kept in step with it):
`<cache>/<version>-<hash>/<binary>`, where the version is the module's in `tools/<name>/go.mod`
and the hash the first 12 hex digits of the sha256 of that folder's go.mod, go.sum and main.go.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def required_version(go_mod: Path, module: str) -> str:
    """The version of `module` that `go_mod` requires (a replace or a comment is not one)."""
    for line in go_mod.read_text().splitlines():
        words = line.split()
        if words and not words[0].startswith("//") and "=>" not in words and module in words[:-1]:
            return words[words.index(module) + 1]
    raise ValueError(f"{go_mod} requires no {module} version")


def cached_binary(tools: Path, module: str, cache_env: str, cache_name: str, binary: str) -> Path:
    """Where the build script of `tools` puts `binary` (the cache from $`cache_env`, else
    ~/.cache/berth/`cache_name`)."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((tools / name).read_bytes())
    cache = Path(os.environ.get(cache_env) or Path.home() / ".cache/berth" / cache_name)
    version = required_version(tools / "go.mod", module)
    return cache / f"{version}-{digest.hexdigest()[:12]}" / binary
