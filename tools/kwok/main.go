//go:build tools

// Package tools pins KWOK (sigs.k8s.io/kwok, Kubernetes WithOut Kubelet) for Berth's scale
// benchmark and tests: scripts/build-kwok.sh builds its own command, sigs.k8s.io/kwok/cmd/kwok,
// at the version go.mod requires. This file only keeps that requirement in go.mod (the
// `tools` build tag: it is never compiled) and, with go.mod and go.sum, names the cache entry.
// The stages that move Berth's pods (Pending, Running, Succeeded, deleted) are the harness's
// own: tests/kwok.py.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
