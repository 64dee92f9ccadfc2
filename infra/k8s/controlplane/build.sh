#!/usr/bin/env bash
# Builds the tests' Go components from the modules pinned in a go.mod/go.sum into a cache
# directory outside the repository, and prints the directory on stdout. Nothing prebuilt is
# downloaded: only module sources through the Go module proxy. A second run with the same
# pins reuses the binaries; a rebuild reuses Go's module and build caches.
#   build.sh               the control plane: etcd, kube-apiserver, kube-scheduler, kwok and
#                          kubectl (this directory's go.mod)
#   build.sh karpenter     Karpenter's kwok provider, as `karpenter-kwok`, and its CRDs
#                          under crds/ (infra/k8s/karpenter/kwok/go.mod: its own pins)
#   build.sh temporal      the Temporal server and temporal-sql-tool, with its PostgreSQL
#                          schema under schema/ (infra/temporal/go.mod; the scale benchmark's
#                          production-shaped server, bench/temporal_server.py; not in CI)
#   SPOTRAIN_K8S_CACHE  cache root (default ~/.cache/spotrain/k8s; temporal: its
#                       SPOTRAIN_TEMPORAL_CACHE, default ~/.cache/spotrain/temporal)
#   SPOTRAIN_GO_P       parallel build jobs for `go build -p` (default: number of CPUs)
#   SPOTRAIN_K8S_CHECK_ONLY=1  only print the directory if built, else fail (tests use this)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command -v go >/dev/null || { echo "build.sh: Go toolchain not found (need go >= 1.26)" >&2; exit 1; }

component=${1:-controlplane}
case "$component" in
  controlplane)
    cd "$here"
    version="$(awk '$1 == "k8s.io/kubernetes" {print $2}' go.mod)"
    major="${version#v}"; major="${major%%.*}"
    minor="${version#v*.}"; minor="${minor%%.*}"
    ver=k8s.io/component-base/version
    ldflags="-s -w -X $ver.gitVersion=$version -X $ver.gitMajor=$major -X $ver.gitMinor=$minor"
    tools=(etcd kube-apiserver kube-scheduler kwok kubectl)
    packages=(
      go.etcd.io/etcd/server/v3
      k8s.io/kubernetes/cmd/kube-apiserver
      k8s.io/kubernetes/cmd/kube-scheduler
      k8s.io/kubernetes/cmd/kubectl
      sigs.k8s.io/kwok/cmd/kwok
    )
    what="control plane"; prefix=""
    ;;
  karpenter)
    cd "$here/../karpenter/kwok"
    version="$(awk '$1 == "require" && $2 == "sigs.k8s.io/karpenter" {print $3}' go.mod)"
    ldflags="-s -w"
    tools=(karpenter-kwok crds)
    packages=(sigs.k8s.io/karpenter/kwok)
    what="Karpenter (kwok provider)"; prefix="karpenter-"
    ;;
  temporal)
    cd "$here/../../temporal"
    version="$(awk '$1 == "require" && $2 == "go.temporal.io/server" {print $3}' go.mod)"
    ldflags="-s -w"
    tools=(temporal-server temporal-sql-tool schema)
    packages=(go.temporal.io/server/cmd/server go.temporal.io/server/cmd/tools/sql)
    what="Temporal server"; prefix=""
    cache="${SPOTRAIN_TEMPORAL_CACHE:-$HOME/.cache/spotrain/temporal}"
    ;;
  *) echo "build.sh: unknown component $component (controlplane | karpenter | temporal)" >&2; exit 2 ;;
esac
# The binaries depend on the pins, the toolchain and the flags: a change to any builds anew.
key="$( (cat go.mod go.sum; go env GOVERSION GOOS GOARCH; echo "$ldflags ${tools[*]}") | sha256sum | cut -c1-12)"
out="${cache:-${SPOTRAIN_K8S_CACHE:-$HOME/.cache/spotrain/k8s}}/$prefix$version-$key/bin"

have=1
for t in "${tools[@]}"; do [[ -e "$out/$t" ]] || have=0; done
if [[ $have == 1 ]]; then
  echo "build.sh: $what $version already built in $out" >&2
  echo "$out"
  exit 0
fi

if [[ -n "${SPOTRAIN_K8S_CHECK_ONLY:-}" ]]; then
  echo "build.sh: $what $version not built yet: run $0 $component" >&2
  exit 1
fi

start=$SECONDS
mkdir -p "$(dirname "$out")"
tmp="$(mktemp -d "$(dirname "$out")/bin.tmp.XXXXXX")"
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT
# Two steps, each announced, so that a progress line tells downloads from the silent compile.
echo "build.sh: fetching the modules of ${tools[*]} ($what $version)" >&2
go list -deps "${packages[@]}" >/dev/null
echo "build.sh: compiling ${tools[*]} into $out (modules fetched in $((SECONDS - start)) s)" >&2
go build -p "${SPOTRAIN_GO_P:-$(nproc)}" -ldflags "$ldflags" -o "$tmp/" "${packages[@]}" >&2
case "$component" in
  controlplane) mv "$tmp/server" "$tmp/etcd" ;;  # go names a .../v3 main after its parent
  karpenter)
    mv "$tmp/kwok" "$tmp/karpenter-kwok"  # not to be taken for the kwok above
    src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/karpenter)/kwok"  # NodeClaim, NodePool, KWOKNodeClass
    mkdir "$tmp/crds" && cp "$src"/charts/crds/*.yaml "$src"/apis/crds/*.yaml "$tmp/crds/"
    ;;
  temporal)
    mv "$tmp/server" "$tmp/temporal-server" && mv "$tmp/sql" "$tmp/temporal-sql-tool"
    src="$(go list -m -f '{{.Dir}}' go.temporal.io/server)/schema/postgresql"  # the sql tool's input
    mkdir "$tmp/schema" && cp -r "$src" "$tmp/schema/" && chmod -R u+w "$tmp/schema"
    ;;
esac
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "build.sh: built in $((SECONDS - start)) s" >&2
echo "$out"
