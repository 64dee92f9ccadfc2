//go:build tools

// Package tools names the commands build.sh compiles, so `go mod tidy` keeps
// their dependencies in go.sum.
package tools

import (
	_ "go.temporal.io/server/cmd/server"
	_ "go.temporal.io/server/cmd/tools/sql"
)
