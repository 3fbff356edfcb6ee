package wire

// SniffCap is how many inbound bytes the sniffer looks at.
const SniffCap = sniffCap

// SetWaitHook makes every Write of c call f when it is about to wait for
// room. Set it before the first Write.
func SetWaitHook(c *Conn, f func()) { c.waitHook = f }

// ParseAccepted exposes parseAccepted: channel, first, last, ok.
func ParseAccepted(p []byte) (uint16, uint32, uint32, bool) {
	a, ok := parseAccepted(p)
	return a.ch, a.first, a.last, ok
}

// AppendAccepted exposes appendAccepted.
func AppendAccepted(b []byte, ch uint16, first, last uint32) []byte {
	return appendAccepted(b, accepted{ch: ch, first: first, last: last})
}
