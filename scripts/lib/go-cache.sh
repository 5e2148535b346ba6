# Sourced by scripts/build-kube.sh, build-registry.sh, build-kwok.sh and build-helm.sh: a Go
# binary built from a pinned module in tools/<name>/ and cached under
# <cache>/<version>-<hash>/, where the hash covers the module's go.mod, go.sum and main.go, so
# a changed pin builds anew, never a stale binary. The tests compute the same path
# (tests/go_binaries.py: keep them in step).

export PATH="/usr/local/go/bin:$PATH"
# The go directive in go.mod is met by the installed Go; never let Go fetch a toolchain.
export GOTOOLCHAIN=local

# go_cache_locate TAG SRC MODULE CACHE NAME: sets `version` (MODULE's in SRC/go.mod, inside or
# outside a require block), `dir` and `bin` (where the binary NAME belongs).
go_cache_locate() {
  local tag=$1 src=$2 module=$3 cache=$4 name=$5 hash
  version=$(awk -v module="$module" '$0 !~ /=>|^[[:space:]]*\/\// {
    for (i = 1; i < NF; i++) if ($i == module) { print $(i + 1); exit }
  }' "$src/go.mod")
  if [[ -z "$version" ]]; then
    echo "$tag: no requirement of $module in $src/go.mod" >&2
    exit 1
  fi
  hash=$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-12)
  dir="$cache/$version-$hash"
  bin="$dir/$name"
}

# go_cache_lock TAG: one build at a time per cache entry (a second caller waits, then finds the
# binary); then fails unless the binary is cached or Go is there to build it. Returns 0 when
# the binary must be built, 1 when it is cached.
go_cache_lock() {
  local tag=$1
  mkdir -p "$dir"
  exec 9>"$dir/.lock"
  flock 9
  if [[ -x "$bin" ]]; then
    return 1
  fi
  if ! command -v go >/dev/null; then
    echo "$tag: Go not found (expected /usr/local/go/bin/go)" >&2
    exit 1
  fi
  return 0
}

# go_cache_build TAG SRC PACKAGE LDFLAGS: the binary `bin` (go_cache_locate's), reused when
# cached, else built from PACKAGE (`.`: SRC's own main package) in the module SRC, at low
# priority (shared 2-core machines) and into place only once whole.
go_cache_build() {
  local tag=$1 src=$2 package=$3 ldflags=$4 name start
  name=$(basename "$bin")
  if ! go_cache_lock "$tag"; then
    echo "$tag: reusing cached $name $version" >&2
    return 0
  fi
  echo "$tag: building $name $version (cold build: minutes)..." >&2
  start=$(date +%s)
  (cd "$src" && nice -n 15 go build -trimpath -ldflags "$ldflags" -o "$bin.tmp" "$package")
  mv "$bin.tmp" "$bin"
  echo "$tag: built in $(( $(date +%s) - start )) s, $(du -h "$bin" | cut -f1)" >&2
}
