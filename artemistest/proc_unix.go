//go:build unix && !linux

package artemistest

import "syscall"

// sysProcAttr puts a child in its own process group. (Only Linux can also
// kill it when the test process dies first: stop brokers with Stop.)
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
