//go:build tools

// Package tools pins Karpenter's kwok provider (the `kwok` command of sigs.k8s.io/karpenter)
// for the tests' real Karpenter controller; infra/k8s/controlplane/build.sh builds it.
package tools

import _ "sigs.k8s.io/karpenter/kwok"
