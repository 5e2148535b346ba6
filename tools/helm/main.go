//go:build tools

// Package tools pins Helm (helm.sh/helm/v3) for Berth's chart (docker/chart): scripts/build-helm.sh
// builds Helm's own command, helm.sh/helm/v3/cmd/helm, at the version go.mod requires, and the
// tests render and lint the chart with it (tests/helm.py). This file only keeps that requirement
// in go.mod (the `tools` build tag: it is never compiled) and, with go.mod and go.sum, names the
// cache entry.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
