// Builds go-containerregistry's in-memory registry for Berth's tests (scripts/build-registry.sh).
module berth.local/tools/registry

go 1.25.0

require github.com/google/go-containerregistry v0.22.1
