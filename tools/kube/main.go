// Command kube-apiserver is the upstream Kubernetes API server, built from the published Go
// modules at the version pinned in go.mod, so that Berth's tests can run a real API server
// (with etcd, without a kubelet) on a machine that can reach only the Go module proxy.
//
// It mirrors k8s.io/kubernetes/cmd/kube-apiserver/apiserver.go, which lives in package main
// there and so cannot be imported.
package main

import (
	"os"
	_ "time/tzdata" // for time zone support in CronJob, as upstream

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // the JSON log format, as upstream
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as upstream
	_ "k8s.io/component-base/metrics/prometheus/version"  // the version metric, as upstream
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	os.Exit(cli.Run(app.NewAPIServerCommand()))
}
