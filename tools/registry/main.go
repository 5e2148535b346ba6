// Command registry is go-containerregistry's in-memory OCI registry (pkg/registry, the handler of
// its own cmd/registry) for Berth's tests (scripts/build-registry.sh, tests/test_kube_build.py):
// a real registry that speaks the distribution API over HTTP on a loopback port, so that the
// tests push images and ask for manifests as a cluster's registry would answer them.
//
// In front of it, optionally, the two ways registries ask for credentials, so that Berth's
// registry client is tested against both: -auth=basic (HTTP Basic on every request, as
// Distribution with htpasswd) and -auth=bearer (a 401 naming a token realm, then a bearer token
// from that realm for Basic credentials, as Docker Hub, GHCR, Harbor and Artifact Registry do).
// These checks are this file's, not go-containerregistry's; the registry itself is upstream's.
package main

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "host:port to listen on (port 0: any free port)")
	auth := flag.String("auth", "none", "none, basic or bearer")
	user := flag.String("user", "", "the one user name accepted (-auth basic or bearer)")
	password := flag.String("password", "", "its password")
	flag.Parse()
	if *auth != "none" && (*user == "" || *password == "") {
		log.Fatalf("-auth %s needs -user and -password", *auth)
	}

	listener, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	base := "http://" + listener.Addr().String()
	var handler http.Handler = registry.New(registry.Logger(log.New(os.Stderr, "registry ", log.LstdFlags)))
	switch *auth {
	case "none":
	case "basic":
		handler = basicAuth(handler, *user, *password)
	case "bearer":
		handler = bearerAuth(handler, base, *user, *password)
	default:
		log.Fatalf("-auth must be none, basic or bearer, got %q", *auth)
	}
	// The tests read this line to know the registry is up and where.
	fmt.Printf("serving on %s\n", base)
	server := &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}
	log.Fatal(server.Serve(listener))
}

func same(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

func goodBasic(req *http.Request, user, password string) bool {
	u, p, ok := req.BasicAuth()
	return ok && same(u, user) && same(p, password)
}

func unauthorized(resp http.ResponseWriter, challenge string) {
	resp.Header().Set("WWW-Authenticate", challenge)
	resp.Header().Set("Content-Type", "application/json")
	resp.WriteHeader(http.StatusUnauthorized)
	fmt.Fprint(resp, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`)
}

func basicAuth(next http.Handler, user, password string) http.Handler {
	return http.HandlerFunc(func(resp http.ResponseWriter, req *http.Request) {
		if !goodBasic(req, user, password) {
			unauthorized(resp, `Basic realm="berth-test-registry"`)
			return
		}
		next.ServeHTTP(resp, req)
	})
}

// bearerAuth serves tokens at /token for the Basic credentials and requires one on /v2/.
func bearerAuth(next http.Handler, base, user, password string) http.Handler {
	raw := make([]byte, 24)
	if _, err := rand.Read(raw); err != nil {
		log.Fatal(err)
	}
	token := hex.EncodeToString(raw)
	return http.HandlerFunc(func(resp http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/token" {
			if !goodBasic(req, user, password) {
				unauthorized(resp, `Basic realm="berth-test-registry-token"`)
				return
			}
			resp.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(resp).Encode(map[string]any{"token": token, "expires_in": 300})
			return
		}
		if !same(req.Header.Get("Authorization"), "Bearer "+token) {
			unauthorized(resp, fmt.Sprintf(`Bearer realm="%s/token",service="berth-test-registry"`, base))
			return
		}
		next.ServeHTTP(resp, req)
	})
}
