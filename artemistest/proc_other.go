//go:build !unix

package artemistest

import "syscall"

// sysProcAttr: mode Local is for Unix only (see runLocal).
func sysProcAttr() *syscall.SysProcAttr { return nil }
