package wire

// SniffCap is how many inbound bytes the sniffer looks at.
const SniffCap = sniffCap

// SetWaitHook makes every Write of c call f when it is about to wait for
// room. Set it before the first Write.
func SetWaitHook(c *Conn, f func()) { c.waitHook = f }
