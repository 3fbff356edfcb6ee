package wire_test

import (
	"bytes"
	"encoding/binary"
	"net"
	"testing"
	"testing/synctest"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// goAMQPUint encodes v as go-amqp's writeUint32 does (uint0, smalluint or
// uint).
func goAMQPUint(v uint32) []byte {
	switch {
	case v == 0:
		return []byte{0x43}
	case v < 256:
		return []byte{0x52, byte(v)}
	}
	return binary.BigEndian.AppendUint32([]byte{0x70}, v)
}

// dispositionFrame is a disposition as go-amqp v1.7 writes it
// (MarshalComposite: descriptor, list32, trailing omitted fields dropped,
// omitted fields before the last set one written as null); last < 0 leaves
// last out, state is the outcome's encoding.
func dispositionFrame(ch uint16, role bool, first uint32, last int64, settled bool, state []byte, batchable bool) []byte {
	var fields [][]byte
	boolean := func(b bool) []byte {
		if b {
			return []byte{0x41}
		}
		return []byte{0x42}
	}
	fields = append(fields, boolean(role), goAMQPUint(first))
	if last >= 0 {
		fields = append(fields, goAMQPUint(uint32(last)))
	} else {
		fields = append(fields, []byte{0x40})
	}
	if settled {
		fields = append(fields, boolean(true))
	} else {
		fields = append(fields, []byte{0x40})
	}
	if state != nil {
		fields = append(fields, state)
	} else {
		fields = append(fields, []byte{0x40})
	}
	if batchable {
		fields = append(fields, boolean(true))
	}
	// Trim trailing nulls, as MarshalComposite does.
	for len(fields) > 0 && bytes.Equal(fields[len(fields)-1], []byte{0x40}) {
		fields = fields[:len(fields)-1]
	}
	var body []byte
	for _, f := range fields {
		body = append(body, f...)
	}
	list := []byte{0xd0}
	list = binary.BigEndian.AppendUint32(list, uint32(4+len(body)))
	list = binary.BigEndian.AppendUint32(list, uint32(len(fields)))
	list = append(list, body...)
	perf := append([]byte{0x00, 0x53, 0x15}, list...)
	f := binary.BigEndian.AppendUint32(nil, uint32(8+len(perf)))
	f = append(f, 2, 0)
	f = binary.BigEndian.AppendUint16(f, ch)
	return append(f, perf...)
}

var (
	stateAccepted = []byte{0x00, 0x53, 0x24, 0x45}
	stateRejected = []byte{0x00, 0x53, 0x25, 0x45}
	stateReleased = []byte{0x00, 0x53, 0x26, 0x45}
)

func accept(ch uint16, id uint32) []byte {
	return dispositionFrame(ch, true, id, -1, true, stateAccepted, false)
}

func TestParseAccepted(t *testing.T) {
	for _, id := range []uint32{0, 7, 255, 256, 70000, 1<<32 - 1} {
		ch, first, last, ok := wire.ParseAccepted(accept(3, id))
		if !ok || ch != 3 || first != id || last != id {
			t.Errorf("go-amqp's accept of %d: got ch %d, %d..%d, ok %v", id, ch, first, last, ok)
		}
	}
	if _, first, last, ok := wire.ParseAccepted(dispositionFrame(0, true, 5, 9, true, stateAccepted, false)); !ok || first != 5 || last != 9 {
		t.Errorf("a range 5..9: got %d..%d, ok %v", first, last, ok)
	}
	merged := wire.AppendAccepted(nil, 9, 100, 1<<20)
	if ch, first, last, ok := wire.ParseAccepted(merged); !ok || ch != 9 || first != 100 || last != 1<<20 {
		t.Errorf("our own merged frame does not read back: ch %d, %d..%d, ok %v", ch, first, last, ok)
	}
	if len(merged) != int(binary.BigEndian.Uint32(merged)) {
		t.Errorf("merged frame's size field %d, length %d", binary.BigEndian.Uint32(merged), len(merged))
	}

	withPayload := append(accept(0, 1), 0x40)
	binary.BigEndian.PutUint32(withPayload, uint32(len(withPayload)))
	sasl := accept(0, 1)
	sasl[5] = 1
	doff3 := accept(0, 1)
	doff3[4] = 3
	for name, f := range map[string][]byte{
		"unsettled (receiver-settle-mode second)": dispositionFrame(0, true, 1, -1, false, stateAccepted, false),
		"sender role":          dispositionFrame(0, false, 1, -1, true, stateAccepted, false),
		"rejected":             dispositionFrame(0, true, 1, -1, true, stateRejected, false),
		"released":             dispositionFrame(0, true, 1, -1, true, stateReleased, false),
		"no state":             dispositionFrame(0, true, 1, -1, true, nil, false),
		"batchable":            dispositionFrame(0, true, 1, -1, true, stateAccepted, true),
		"last before first":    dispositionFrame(0, true, 9, 5, true, stateAccepted, false),
		"bytes after the list": withPayload,
		"SASL frame type":      sasl,
		"data offset 3":        doff3,
		"truncated":            accept(0, 1)[:20],
		"empty frame":          {0, 0, 0, 8, 2, 0, 0, 0},
		"protocol header":      []byte("AMQP\x00\x01\x00\x00"),
	} {
		if _, _, _, ok := wire.ParseAccepted(f); ok {
			t.Errorf("%s: taken for a settled accept: % x", name, f)
		}
	}
}

func FuzzParseAccepted(f *testing.F) {
	f.Add(accept(0, 1))
	f.Add(dispositionFrame(2, true, 300, 900, true, stateAccepted, false))
	f.Add(wire.AppendAccepted(nil, 1, 2, 3))
	f.Fuzz(func(t *testing.T, p []byte) {
		ch, first, last, ok := wire.ParseAccepted(p)
		if !ok {
			return
		}
		if last < first {
			t.Fatalf("range %d..%d", first, last)
		}
		again := wire.AppendAccepted(nil, ch, first, last)
		if c2, f2, l2, ok := wire.ParseAccepted(again); !ok || c2 != ch || f2 != first || l2 != last {
			t.Fatalf("re-encoded %d/%d..%d reads as %d/%d..%d ok %v", ch, first, last, c2, f2, l2, ok)
		}
	})
}

// frames splits a byte stream into frames by their size fields.
func frames(t *testing.T, b []byte) [][]byte {
	t.Helper()
	var out [][]byte
	for len(b) > 0 {
		if len(b) < 8 {
			t.Fatalf("%d bytes left, not a frame", len(b))
		}
		n := int(binary.BigEndian.Uint32(b))
		if n < 8 || n > len(b) {
			t.Fatalf("frame size %d with %d bytes left", n, len(b))
		}
		out = append(out, b[:n])
		b = b[n:]
	}
	return out
}

func TestWriteMergesAcceptsStillQueued(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		c := wire.New(client, nil, wire.Options{})
		flow := []byte{0, 0, 0, 12, 2, 0, 0, 0, 0x00, 0x53, 0x13, 0x45}
		detach := []byte{0, 0, 0, 12, 2, 0, 0, 1, 0x00, 0x53, 0x16, 0x45}
		heartbeat := []byte{0, 0, 0, 8, 2, 0, 0, 0}
		rejected := dispositionFrame(1, true, 10, -1, true, stateRejected, false)

		c.Write(flow) // the flusher takes it and blocks: nobody reads the pipe yet
		synctest.Wait()
		for _, f := range [][]byte{
			accept(0, 1), accept(0, 2), accept(0, 3), // → 1..
			flow, heartbeat, // crossable
			accept(0, 4),                 // → 1..4
			accept(0, 6),                 // a gap: its own frame
			accept(0, 5),                 // → 1..6: 5 joins both, 6's frame is cut
			accept(1, 7),                 // another channel: its own
			accept(1, 9),                 // a gap: its own
			rejected,                     // not an accept: as written, and crossable
			accept(1, 12),                // its own
			accept(1, 8),                 // → 7..9: 8 joins 7 and 9, 9's frame is cut
			detach,                       // a barrier
			accept(1, 11), accept(1, 10), // not into 9 or 12: after the barrier; → 10..11
		} {
			if n, err := c.Write(f); n != len(f) || err != nil {
				t.Fatalf("Write = %d, %v", n, err)
			}
		}
		got := readAll(server)
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		server.Close()
		out := frames(t, <-got)
		type want struct {
			ch          uint16
			first, last uint32
		}
		wants := []any{flow, want{0, 1, 6}, flow, heartbeat, want{1, 7, 9},
			rejected, want{1, 12, 12}, detach, want{1, 10, 11}}
		if len(out) != len(wants) {
			for i, f := range out {
				ch, first, last, ok := wire.ParseAccepted(f)
				t.Logf("frame %d: % x (accept %v: ch %d %d..%d)", i, f, ok, ch, first, last)
			}
			t.Fatalf("%d frames on the wire, want %d", len(out), len(wants))
		}
		for i, w := range wants {
			switch w := w.(type) {
			case []byte:
				if !bytes.Equal(out[i], w) {
					t.Errorf("frame %d: % x, want it as written: % x", i, out[i], w)
				}
			case want:
				ch, first, last, ok := wire.ParseAccepted(out[i])
				if !ok || ch != w.ch || first != w.first || last != w.last {
					t.Errorf("frame %d: ch %d %d..%d ok %v, want ch %d %d..%d", i, ch, first, last, ok, w.ch, w.first, w.last)
				}
			}
		}
		if st := c.Stats(); st.Writes != 17 || st.Merged != 8 {
			t.Errorf("stats %+v, want 17 writes, 8 merged", st)
		}
	})
}

// Sixteen ranges are tracked; a seventeenth makes the oldest one final.
func TestMergeTracksTheNewestRanges(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		c := wire.New(client, nil, wire.Options{})
		c.Write([]byte{0, 0, 0, 8, 2, 0, 0, 0})
		synctest.Wait()
		for i := range uint32(17) {
			c.Write(accept(0, 10*i)) // 17 ranges with gaps: 0, 10, …, 160
		}
		c.Write(accept(0, 1))   // continues 0, which is no longer tracked
		c.Write(accept(0, 161)) // continues 160
		got := readAll(server)
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		server.Close()
		out := frames(t, <-got)
		if len(out) != 1+17+1 {
			t.Fatalf("%d frames, want 19", len(out))
		}
		if _, first, last, _ := wire.ParseAccepted(out[17]); first != 160 || last != 161 {
			t.Errorf("the newest range is %d..%d, want 160..161", first, last)
		}
		if _, first, last, _ := wire.ParseAccepted(out[18]); first != 1 || last != 1 {
			t.Errorf("the last frame is %d..%d, want 1 on its own", first, last)
		}
	})
}

func TestNoMergeWritesEveryAcceptAsWritten(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		c := wire.New(client, nil, wire.Options{NoMerge: true})
		var all []byte
		for id := range uint32(5) {
			f := accept(0, id)
			all = append(all, f...)
			c.Write(f)
		}
		got := readAll(server)
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		server.Close()
		if b := <-got; !bytes.Equal(b, all) {
			t.Errorf("NoMerge changed the bytes:\n% x\nwant\n% x", b, all)
		}
		if st := c.Stats(); st.Merged != 0 {
			t.Errorf("Merged %d with NoMerge", st.Merged)
		}
	})
}

// A merged frame never crosses a flush: what the flusher took is not
// rewritten, so bytes already handed to the syscall stay as they were.
func TestMergeNeverTouchesAFlushInProgress(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		c := wire.New(client, nil, wire.Options{})
		c.Write(accept(0, 1)) // taken by the flusher at once
		synctest.Wait()
		c.Write(accept(0, 2)) // queued: must not extend 1, which is being written
		c.Write(accept(0, 3)) // extends 2
		got := readAll(server)
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		server.Close()
		out := frames(t, <-got)
		if len(out) != 2 {
			t.Fatalf("%d frames, want 2 (1, then 2..3)", len(out))
		}
		for i, w := range [][2]uint32{{1, 1}, {2, 3}} {
			if _, first, last, ok := wire.ParseAccepted(out[i]); !ok || first != w[0] || last != w[1] {
				t.Errorf("frame %d: %d..%d ok %v, want %d..%d", i, first, last, ok, w[0], w[1])
			}
		}
	})
}

// An accepted disposition is queued in its merged form, which can be a
// byte longer than go-amqp's: MaxQueued makes room for that form, not for
// the bytes Write was given.
func TestMaxQueuedCountsTheMergedForm(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		flow := []byte{0, 0, 0, 12, 2, 0, 0, 0, 0x00, 0x53, 0x13, 0x45}
		acc := accept(0, 1) // 29 bytes as go-amqp writes it; 30 merged
		if len(acc) != 29 {
			t.Fatalf("go-amqp's accept of 1 is %d bytes here, the test wants 29", len(acc))
		}
		c := wire.New(client, nil, wire.Options{MaxQueued: len(flow) + len(acc)})
		waited := make(chan struct{}, 1)
		wire.SetWaitHook(c, func() { waited <- struct{}{} })
		c.Write(flow) // the flusher takes it and blocks: nobody reads the pipe yet
		synctest.Wait()
		done := make(chan struct{})
		go func() {
			defer close(done)
			c.Write(acc)
		}()
		synctest.Wait()
		select {
		case <-waited:
		default:
			t.Fatal("12 + 30 bytes exceed MaxQueued 41, yet the accept was queued without waiting")
		}
		got := readAll(server)
		<-done
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		server.Close()
		out := frames(t, <-got)
		if len(out) != 2 {
			t.Fatalf("%d frames, want the flow and the accept", len(out))
		}
		if _, first, last, ok := wire.ParseAccepted(out[1]); !ok || first != 1 || last != 1 {
			t.Errorf("second frame %d..%d ok %v, want the accept of 1", first, last, ok)
		}
	})
}
