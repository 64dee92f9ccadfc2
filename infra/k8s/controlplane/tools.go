//go:build tools

// Package tools names the commands build.sh compiles, so `go mod tidy` keeps
// their dependencies in go.sum.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "sigs.k8s.io/kwok/cmd/kwok"
)
