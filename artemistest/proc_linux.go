package artemistest

import "syscall"

// sysProcAttr puts a child in its own process group, and has the kernel
// kill it if the test process dies first (a panic, go test -timeout,
// os.Exit), when no cleanup runs.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
